"""The server's face of one replica on a stage host: a :class:`~runtime.worker.Worker`.

A work call is pickled on the loop (handles and small inputs only) and queued to the
connection's I/O thread; the reply is decoded there, the client payloads it names are pulled
from the host's pool, the chunks the call consumed are released, and only then is the
outcome handed to the loop (one ``call_soon_threadsafe``). A lost host turns every call in
flight into :class:`~runtime.worker.WorkerDied` naming the stage and the host; ``restart``
says hello again (the host then finishes what this server had started there).
"""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import time
from collections.abc import Callable
from typing import Any

from runtime.connectors import Handle
from runtime.remote.auth import CurveKeys
from runtime.remote.connector import MooncakeConnector
from runtime.remote.control import ControlClient
from runtime.remote.histogram import Histogram
from runtime.remote.host import HostInfo, encode_call
from runtime.worker import CallResult, Done, Outcome, WorkCall, Worker, WorkerDied

HELLO_TIMEOUT_S = 5.0
UNAVAILABLE = "stage_unavailable"  # session.internal_errors: the client sees the text from here on


class RemoteWorker(Worker):
    def __init__(
        self,
        pipeline: str,
        stage: str,
        endpoint: str,
        index: int,
        keys: CurveKeys | None,
        connector: MooncakeConnector,
        *,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
    ) -> None:
        self.pipeline = pipeline
        self.stage = stage
        self.endpoint = endpoint
        self.index = index
        self.hello_timeout_s = hello_timeout_s
        self.connector = connector
        self.client = ControlClient(endpoint, keys, name=f"{stage}@{endpoint}/{index}", on_lost=self._lost)
        self.info: HostInfo | None = None
        self.in_flight = 0
        self.calls = 0
        self.failures = 0
        self.call_seconds = Histogram()  # work call round trips (queue, host, pulls)
        self.bytes_pulled = 0  # client payloads pulled from the host's pool
        # session key -> (handle, nbytes) of KV a draining replica handed on (RemoteStage's)
        self.kv_moves: dict[str, tuple[Handle, int]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_death: Callable[[str], None] | None = None

    @property
    def name(self) -> str:
        return f"{self.endpoint}/{self.index}"

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self._hello(reset=False)

    async def restart(self) -> None:
        await self._hello(reset=True)

    def watch(self, on_death: Callable[[str], None]) -> None:
        self._on_death = on_death

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)

    def report_lost(self, reason: str) -> None:
        """Fail this replica's requests as if the host had died (it left the registry)."""
        if self._on_death is not None:
            self._on_death(self.unavailable(reason))

    def unavailable(self, why: str) -> str:
        """A lost host, as the runtime's error text: details for the log, then the client's part."""
        return f"stage {self.stage} ({why}): {UNAVAILABLE}: stage {self.stage} lost its host mid-request"

    def submit(self, call: WorkCall, done: Done) -> None:
        loop = asyncio.get_running_loop()
        imports = self._imports(call)
        body = encode_call(self.index, call, imports)
        started = time.perf_counter()
        self.in_flight += 1

        def on_reply(status: str, reply: bytes) -> None:  # on the connection's I/O thread
            outcome = self._outcome(call, status, reply)
            for _key, handle, _nbytes in imports:  # taken in (or lost): the old owner frees it
                self.connector.release(handle)
            elapsed = time.perf_counter() - started
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(self._finish, done, outcome, elapsed)

        self.client.request("call", body, on_reply)

    def _imports(self, call: WorkCall) -> list[tuple[str, Handle, int]]:
        """The moved KV of the sessions whose requests this call starts (taken from the map)."""
        own = self.info.session if self.info is not None else ""
        imports = []
        for request in call.starts:
            key = request.session_key
            if key is not None and key in self.kv_moves and self.kv_moves[key][0].ref.owner != own:
                handle, nbytes = self.kv_moves.pop(key)
                imports.append((key, handle, nbytes))
        return imports

    async def ask(self, kind: str, timeout_s: float = 10.0) -> Any:
        """A small request to this replica's host (``kv_export``, ``stats``): its decoded reply."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[tuple[str, bytes]] = loop.create_future()

        def on_reply(status: str, body: bytes) -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, (status, body))

        self.client.request(kind, pickle.dumps(self.index), on_reply)
        async with asyncio.timeout(timeout_s):  # not wait_for: see _hello
            status, body = await future
        if status != "ok":
            raise WorkerDied(
                f"stage {self.stage}: host {self.endpoint}: {kind}: {body.decode(errors='replace')}"
            )
        return pickle.loads(body)

    # -- on the loop --------------------------------------------------------------------------

    def _finish(self, done: Done, outcome: Outcome, elapsed: float) -> None:
        self.in_flight -= 1
        self.calls += 1
        if isinstance(outcome, BaseException):
            self.failures += 1
        self.call_seconds.observe(elapsed)
        done(outcome)

    async def _hello(self, *, reset: bool) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.hello_timeout_s
        last = "no answer"
        while loop.time() < deadline:
            if self.client.refused:
                raise WorkerDied(
                    f"stage {self.stage}: host {self.endpoint} refused the control handshake "
                    "(another stage key?)"
                )
            future: asyncio.Future[tuple[str, bytes]] = loop.create_future()

            def on_reply(
                status: str, body: bytes, future: asyncio.Future[tuple[str, bytes]] = future
            ) -> None:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(_settle, future, (status, body))

            self.client.request("hello", pickle.dumps((self.index, reset)), on_reply)
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands
            # after the answer is in but before this task took it, and a replica closed then (its
            # host left the registry) would go on saying hello for ever, its close waiting on it.
            try:
                async with asyncio.timeout(max(0.05, deadline - loop.time())):
                    status, body = await future
            except TimeoutError:
                break
            if status == "ok":
                self._accept(pickle.loads(body))
                return
            last = body.decode(errors="replace")
            if status == "error":
                break
            await asyncio.sleep(0.1)  # not connected yet: ZeroMQ is still connecting
        refused = " (handshake refused: another stage key?)" if self.client.refused else ""
        raise WorkerDied(f"stage {self.stage}: host {self.endpoint} did not answer{refused}: {last}")

    def _accept(self, info: Any) -> None:
        if not isinstance(info, HostInfo):
            raise WorkerDied(f"stage {self.stage}: host {self.endpoint} sent a malformed hello")
        if (info.pipeline, info.stage) != (self.pipeline, self.stage):
            raise WorkerDied(
                f"stage {self.stage}: host {self.endpoint} serves {info.pipeline}/{info.stage}, "
                f"not {self.pipeline}/{self.stage}"
            )
        self.info = info

    def _lost(self, reason: str) -> None:  # on the I/O thread
        loop, on_death = self._loop, self._on_death
        if loop is not None and on_death is not None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_death, self.unavailable(reason))

    # -- on the I/O thread --------------------------------------------------------------------

    def _outcome(self, call: WorkCall, status: str, reply: bytes) -> Outcome:
        try:
            if status == "lost":
                return WorkerDied(self.unavailable(reply.decode(errors="replace")))
            if status != "ok":
                return RuntimeError(
                    f"stage {self.stage} on host {self.endpoint}: {reply.decode(errors='replace')}"
                )
            result: CallResult = pickle.loads(reply)
            for item in result.items:
                if item.client:
                    payloads = []
                    for handle in item.client:
                        payloads.append(self.connector.get(handle))
                        self.connector.release(handle)
                        self.bytes_pulled += handle.ref.nbytes if handle.ref.inline is None else 0
                    item.client = payloads
            return result
        except Exception as exc:  # a payload the host named is gone: the requests fail
            return RuntimeError(f"stage {self.stage} on host {self.endpoint}: {type(exc).__name__}: {exc}")
        finally:
            for handle in call.releases():
                self.connector.release(handle)


def _settle(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)
