"""Where engine code runs: never on the event loop.

:class:`EngineHost` drives one engine instance through one *work call* (finishes, starts, one
batched step) and isolates failures per request. It is synchronous and runs on a worker thread
(:class:`ThreadWorker`) or inside a worker process (``runtime.process_worker``). The replica's
scheduler on the event loop only builds :class:`WorkCall` values and applies :class:`CallResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from runtime.connectors import Connector, ConnectorError, Handle
from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput, StepOutput
from runtime.kv import SessionKVStore, bind_thread_store
from runtime.payloads import Conditioning, Payload

log = logging.getLogger(__name__)

_MISSING = object()


@dataclass(slots=True)
class ChunkRef:
    """An :class:`EdgeChunk` whose payloads are still connector handles."""

    items: list[Handle]
    context: list[Handle] = field(default_factory=list)
    finished: bool = False
    index: int = 0
    source: str = ""
    release: list[Handle] = field(default_factory=list)  # free once this chunk was consumed

    def absorb(self, later: ChunkRef) -> None:
        """Take in ``later`` (the next chunk of the same edge, not consumed yet either): one
        chunk with both chunks' items in order, this chunk's context and index (``later``'s
        context lies in this chunk or before it), and both chunks' releases."""
        self.items.extend(later.items)
        self.release.extend(later.release)
        self.finished = self.finished or later.finished


@dataclass(slots=True)
class WorkItem:
    request_id: str
    chunks: list[ChunkRef] = field(default_factory=list)
    inputs: list[Payload] = field(default_factory=list)
    updates: list[Conditioning] = field(default_factory=list)
    upstream_finished: bool = False


@dataclass(slots=True)
class WorkCall:
    finishes: list[tuple[str, bool]] = field(default_factory=list)  # (request_id, cancelled)
    starts: list[EngineRequest] = field(default_factory=list)
    items: list[WorkItem] = field(default_factory=list)  # stepped together in one engine.step

    def releases(self) -> list[Handle]:
        return [h for item in self.items for chunk in item.chunks for h in chunk.release]


@dataclass(slots=True)
class ItemResult:
    request_id: str
    downstream: dict[str, list[Handle]] = field(default_factory=dict)  # connector kind -> handles
    client: list[Any] = field(default_factory=list)  # payloads (handles while crossing a process)
    done: bool = False
    wait_for_input: bool = False
    error: str | None = None
    not_before: float | None = None  # StepOutput.not_before (time.monotonic)
    counters: dict[str, int] = field(default_factory=dict)  # StepOutput.counters


@dataclass(slots=True)
class CallResult:
    items: list[ItemResult] = field(default_factory=list)
    step_s: float = 0.0  # engine.step wall time
    batch: int = 0


Resolve = Callable[[Handle], Payload]
Store = Callable[[str, str, Payload, str, int], Handle]  # (request, key, payload, kind, refs)


class EngineHost:
    """One engine instance plus its per-request states, driven one work call at a time."""

    def __init__(
        self,
        stage: str,
        engine_cls: type[Engine],
        options: Mapping[str, Any],
        *,
        resolve: Resolve,
        store: Store,
        out_kinds: Mapping[str, int],
        client_kind: str | None = None,
        key_prefix: str = "",
    ) -> None:
        self.stage = stage
        self._cls = engine_cls
        self._options = dict(options)
        self._resolve = resolve
        self._store = store
        self._out_kinds = dict(out_kinds)  # connector kind -> number of edges using it
        self._client_kind = client_kind  # store client payloads too (crossing a process)
        self._keys = itertools.count()
        self._key_prefix = key_prefix or stage
        self.engine: Engine | None = None
        self.states: dict[str, Any] = {}

    def open(self) -> None:
        engine = self._cls(self._options)
        engine.load()
        self.engine = engine

    def run(self, call: WorkCall) -> CallResult:
        engine = self.engine
        if engine is None:
            raise RuntimeError(f"stage {self.stage}: engine not loaded")
        for request_id, cancelled in call.finishes:
            self._finish(request_id, cancelled=cancelled)
        errors: dict[str, str] = {}
        for request in call.starts:
            try:
                self.states[request.request_id] = engine.start(request)
            except Exception as exc:
                errors[request.request_id] = self._describe("engine.start", exc)
        inputs: list[StepInput] = []
        items: list[WorkItem] = []
        for item in call.items:
            if item.request_id in errors:
                continue
            state = self.states.get(item.request_id, _MISSING)
            if state is _MISSING:
                errors[item.request_id] = f"stage {self.stage}: request was not started"
                continue
            try:
                chunks = [self._chunk(c) for c in item.chunks]
            except ConnectorError as exc:
                errors[item.request_id] = f"stage {self.stage}: {exc}"
                continue
            inputs.append(
                StepInput(state, chunks, list(item.inputs), list(item.updates), item.upstream_finished)
            )
            items.append(item)
        started = time.perf_counter()
        outputs = self._step(engine, inputs, items, errors)
        step_s = time.perf_counter() - started
        result = CallResult(step_s=step_s, batch=len(inputs))
        for item, output in zip(items, outputs, strict=True):
            if output is None:
                continue
            try:
                result.items.append(self._result(item.request_id, output))
            except Exception as exc:
                errors[item.request_id] = self._describe("storing outputs", exc)
                continue
            if output.done:
                self._finish(item.request_id, cancelled=False)
        for request_id, error in errors.items():
            self._finish(request_id, cancelled=True)
            result.items.append(ItemResult(request_id, error=error))
        return result

    def close(self) -> None:
        for request_id in list(self.states):
            self._finish(request_id, cancelled=True)
        if self.engine is not None:
            try:
                self.engine.close()
            except Exception:
                log.exception("stage %s: engine.close failed", self.stage)

    # -- helpers ------------------------------------------------------------------------------

    def _chunk(self, ref: ChunkRef) -> EdgeChunk:
        return EdgeChunk(
            items=[self._resolve(h) for h in ref.items],
            context=[self._resolve(h) for h in ref.context],
            finished=ref.finished,
            index=ref.index,
            source=ref.source,
        )

    def _step(
        self, engine: Engine, inputs: list[StepInput], items: list[WorkItem], errors: dict[str, str]
    ) -> list[StepOutput | None]:
        if not inputs:
            return []
        try:
            return list(self._checked_step(engine, inputs))
        except Exception as exc:
            if len(inputs) == 1:
                errors[items[0].request_id] = self._describe("engine.step", exc)
                return [None]
        # The batch failed: step each request alone so only the faulty one fails. (An engine
        # that mutated state before raising may see the survivors stepped a second time.)
        outputs: list[StepOutput | None] = []
        for one, item in zip(inputs, items, strict=True):
            try:
                outputs.append(self._checked_step(engine, [one])[0])
            except Exception as exc:
                errors[item.request_id] = self._describe("engine.step", exc)
                outputs.append(None)
        return outputs

    def _checked_step(self, engine: Engine, inputs: list[StepInput]) -> list[StepOutput]:
        outputs = engine.step(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"engine returned {len(outputs)} outputs for {len(inputs)} inputs")
        for output in outputs:
            if not isinstance(output, StepOutput):
                raise TypeError(f"engine returned {type(output).__name__}, expected StepOutput")
        return outputs

    def _result(self, request_id: str, output: StepOutput) -> ItemResult:
        downstream: dict[str, list[Handle]] = {}
        if output.downstream:
            for kind, refs in self._out_kinds.items():
                downstream[kind] = [self._put(request_id, p, kind, refs) for p in output.downstream]
        client: list[Any] = list(output.client)
        if self._client_kind is not None:
            client = [self._put(request_id, p, self._client_kind, 1) for p in client]
        return ItemResult(
            request_id,
            downstream,
            client,
            output.done,
            output.wait_for_input,
            not_before=output.not_before,
            counters=dict(output.counters),
        )

    def _put(self, request_id: str, payload: Payload, kind: str, refs: int) -> Handle:
        return self._store(request_id, f"{self._key_prefix}.{next(self._keys)}", payload, kind, refs)

    def _finish(self, request_id: str, *, cancelled: bool) -> None:
        state = self.states.pop(request_id, _MISSING)
        if state is _MISSING or self.engine is None:
            return
        try:
            self.engine.finish(state, cancelled=cancelled)
        except Exception:
            log.exception("stage %s: engine.finish failed for %s", self.stage, request_id)

    def _describe(self, what: str, exc: BaseException) -> str:
        return f"stage {self.stage}: {what} failed: {type(exc).__name__}: {exc}"


class WorkerDied(RuntimeError):
    """The worker (process) running a replica's engine is gone; its requests are lost."""


Outcome = CallResult | BaseException  # what a submitted call came to: its result or its error
Done = Callable[[Outcome], None]


class Worker(ABC):
    """The async face of an engine host, used by a replica's scheduler on the event loop."""

    @abstractmethod
    async def open(self) -> None: ...

    @abstractmethod
    def submit(self, call: WorkCall, done: Done) -> None:
        """Run ``call`` off the loop; ``done(outcome)`` then runs on the loop, as a callback of
        its own (:func:`submit_on`): one loop iteration after the call ends, no task between."""

    @abstractmethod
    async def close(self) -> None: ...

    def watch(self, on_death: Callable[[str], None]) -> None:  # noqa: B027 - optional hook
        """Call ``on_death(reason)`` on the loop if the worker dies between calls."""

    async def restart(self) -> None:
        """Replace a dead worker with a fresh one (engine loaded again)."""
        raise NotImplementedError(f"{type(self).__name__} cannot restart")


class ThreadWorker(Worker):
    """Engine calls on dedicated threads of this replica (``workers`` of them)."""

    def __init__(
        self,
        stage: str,
        engine_cls: type[Engine],
        options: Mapping[str, Any],
        connectors: Mapping[str, Connector],
        out_kinds: Mapping[str, int],
        *,
        threads: int = 1,
        kv_store: SessionKVStore | None = None,
        name: str = "",
    ) -> None:
        self._connectors = dict(connectors)
        self.host = EngineHost(
            stage,
            engine_cls,
            options,
            resolve=self._resolve,
            store=self._store,
            out_kinds=out_kinds,
            key_prefix=name or stage,
        )
        self._executor = ThreadPoolExecutor(
            max_workers=threads,
            thread_name_prefix=f"stage-{name or stage}",
            initializer=bind_thread_store,
            initargs=(kv_store,),
        )

    def _resolve(self, handle: Handle) -> Payload:
        connector = self._connectors.get(handle.kind)
        if connector is None:
            raise ConnectorError(f"no {handle.kind} connector in this process")
        return connector.get(handle)

    def _store(self, request_id: str, key: str, payload: Payload, kind: str, refs: int) -> Handle:
        return self._connectors[kind].put(request_id, key, payload, refs=refs)

    def _run_sync(self, call: WorkCall) -> CallResult:
        try:
            return self.host.run(call)
        finally:
            for handle in call.releases():
                self._connectors[handle.kind].release(handle)

    async def open(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._executor, self.host.open)

    def submit(self, call: WorkCall, done: Done) -> None:
        submit_on(self._executor, self._run_sync, call, done)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self.host.close)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)


def submit_on(executor: Executor, fn: Callable[[WorkCall], CallResult], call: WorkCall, done: Done) -> None:
    """Run ``fn(call)`` on ``executor`` and call ``done(outcome)`` on the running loop when it
    ends, as a callback of its own (``call_soon_threadsafe``). Awaiting ``run_in_executor``
    costs two loop iterations more on the way back (the asyncio future's callback, then the
    awaiting task's step); on a loop busy with hundreds of sessions an iteration can last tens
    of milliseconds, and a paced stage's every step takes this way. A ``done`` that never runs
    (the loop closed first) is dropped: nothing waits for it then."""
    loop = asyncio.get_running_loop()

    def report(future: Future[CallResult]) -> None:
        try:
            outcome: Outcome = future.result()
        except BaseException as exc:  # cancelled (executor shut down) or the call's error
            outcome = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            loop.call_soon_threadsafe(done, outcome)

    try:
        future = executor.submit(fn, call)
    except RuntimeError as exc:  # shut down: the worker is closing
        loop.call_soon(done, exc)
        return
    future.add_done_callback(report)
