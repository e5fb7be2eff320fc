"""The control plane: ZeroMQ DEALER (server side) to ROUTER (stage host), one I/O thread each.

A ZeroMQ socket belongs to one thread, so each end runs its socket on an I/O thread of its
own; other threads hand it messages through a queue and wake it through a pipe. Nothing here
ever blocks the caller: :meth:`ControlClient.request` and :meth:`ControlClient.post` queue and
return, and the reply (or the loss of the host) comes back through a callback on the I/O
thread. Frames: ``[kind, call id, body]`` from a client, ``[status, call id, body]`` back;
bodies are pickles (the channel is authenticated: :mod:`runtime.remote.auth`).

A host that dies is seen at once on loopback and on a LAN (the TCP connection closes), and a
host that goes silent within ``HEARTBEAT_TIMEOUT_MS`` (ZMTP heartbeats): either way every call
waiting on it gets ``lost`` and the owner's ``on_lost`` runs.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.remote.auth import CurveKeys, secure_client, secure_server

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
POLL_MS = 200

Reply = Callable[[str, bytes], None]  # (status: "ok" | "error" | "lost", body)

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = zmq.EVENT_DISCONNECTED
_REFUSED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def _tune(sock: zmq.Socket[Any]) -> None:
    sock.linger = 0
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)


class _Waker:
    """A pipe the I/O thread polls; any thread writes a byte to wake it."""

    def __init__(self) -> None:
        self.rfd, self.wfd = os.pipe()
        os.set_blocking(self.rfd, False)
        os.set_blocking(self.wfd, False)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self.wfd, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.rfd, 4096):
                pass

    def close(self) -> None:
        for fd in (self.rfd, self.wfd):
            with contextlib.suppress(OSError):
                os.close(fd)


Item = TypeVar("Item")


def _received(sock: zmq.Socket[Any]) -> Iterator[list[bytes]]:
    """The messages waiting on ``sock``, read without blocking."""
    while True:
        try:
            yield sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return


class _IoThread(Generic[Item]):
    """What both ends share: a socket's I/O thread, the outbox other threads put to (waking
    it), and its stop."""

    _thread: threading.Thread

    def __init__(self) -> None:
        self._outbox: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._waker = _Waker()
        self._closing = False

    def _put(self, item: Item) -> None:
        self._outbox.put(item)
        self._waker.wake()

    def _poll(self, poller: zmq.Poller) -> dict[Any, int]:
        """The sockets ready within a poll period (a wake-up is consumed here: what woke the
        thread is in the outbox)."""
        events = dict(poller.poll(POLL_MS))
        if self._waker.rfd in events:
            self._waker.drain()
        return events

    def _queued(self) -> Iterator[Item]:
        """What other threads put to the outbox so far."""
        while True:
            try:
                yield self._outbox.get_nowait()
            except queue.Empty:
                return

    def close(self) -> None:
        self._closing = True
        self._waker.wake()
        self._thread.join(timeout=5)
        self._waker.close()


class ControlClient(_IoThread[tuple[bytes, bytes, bytes, "Reply | None"]]):
    """One connection to one stage host; thread-safe, non-blocking."""

    def __init__(
        self,
        endpoint: str,
        keys: CurveKeys | None,
        *,
        name: str = "",
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.on_lost = on_lost
        self.up = False
        self.refused = False  # the handshake failed: another key (or none) on the host
        self.last_event = ""
        self._keys = keys
        self._name = name or endpoint
        self.client_id = uuid.uuid4().bytes
        self._pending: dict[bytes, Reply] = {}
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=f"control-{self._name}", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------------------------

    def request(self, kind: str, body: bytes, on_reply: Reply) -> None:
        self._put((kind.encode(), str(next(self._ids)).encode(), body, on_reply))

    def post(self, kind: str, body: bytes) -> None:
        """Fire and forget (release, cleanup): dropped when the host is not connected."""
        self._put((kind.encode(), b"0", body, None))

    # -- the I/O thread -----------------------------------------------------------------------

    def _run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        sock = ctx.socket(zmq.DEALER)
        _tune(sock)
        sock.setsockopt(zmq.ROUTING_ID, self.client_id)  # stable: a host knows us after a reconnect
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a host that is not connected
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        secure_client(sock, self._keys)
        monitor = sock.get_monitor_socket(_UP | _DOWN | _REFUSED | zmq.EVENT_CLOSED)
        sock.connect(self.endpoint)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        try:
            while not self._closing:
                events = self._poll(poller)
                if monitor in events:
                    self._on_monitor(recv_monitor_message(monitor))
                if sock in events:
                    for frames in _received(sock):
                        self._on_reply(frames)
                self._send_queued(sock)
        finally:
            self._fail_all("control connection closed")
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _send_queued(self, sock: zmq.Socket[Any]) -> None:
        for kind, call_id, body, on_reply in self._queued():
            try:
                sock.send_multipart([kind, call_id, body], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if on_reply is not None:
                    reason = "refused (another stage key?)" if self.refused else "not connected"
                    self._call(on_reply, "lost", f"stage host {self.endpoint} {reason}".encode())
                continue
            if on_reply is not None:
                self._pending[call_id] = on_reply

    def _on_reply(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        status, call_id, body = frames
        on_reply = self._pending.pop(call_id, None)
        if on_reply is not None:
            self._call(on_reply, status.decode(), body)

    def _on_monitor(self, message: dict[str, Any]) -> None:
        event = message["event"]
        if event == _UP:
            self.up, self.refused, self.last_event = True, False, "connected"
        elif event & _REFUSED:
            self.refused, self.last_event = True, "handshake failed (another stage key?)"
            log.warning("stage host %s: control handshake failed (another stage key?)", self.endpoint)
        elif event == _DOWN and self.up:
            self.up, self.last_event = False, "disconnected"
            reason = f"stage host {self.endpoint} lost (connection closed)"
            self._fail_all(reason)
            if self.on_lost is not None:
                self._call_lost(reason)

    def _fail_all(self, reason: str) -> None:
        pending, self._pending = self._pending, {}
        for on_reply in pending.values():
            self._call(on_reply, "lost", reason.encode())

    def _call(self, on_reply: Reply, status: str, body: bytes) -> None:
        try:
            on_reply(status, body)
        except Exception:
            log.exception("control %s: a reply callback failed", self._name)

    def _call_lost(self, reason: str) -> None:
        assert self.on_lost is not None
        try:
            self.on_lost(reason)
        except Exception:
            log.exception("control %s: on_lost failed", self._name)


Handler = Callable[[bytes, str, bytes, bytes], None]  # (peer, kind, call id, body)


class ControlServer(_IoThread[list[bytes]]):
    """The stage host's end: one ROUTER socket; ``handler`` runs on the I/O thread and must
    not block (it hands work to other threads, which answer with :meth:`reply`)."""

    def __init__(self, bind: str, keys: CurveKeys | None, handler: Handler) -> None:
        super().__init__()
        self._handler = handler
        self._keys = keys
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = ""
        self._thread = threading.Thread(target=self._run, args=(bind,), name="control-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def reply(self, peer: bytes, status: str, call_id: bytes, body: bytes) -> None:
        self._put([peer, status.encode(), call_id, body])

    def _run(self, bind: str) -> None:
        ctx: zmq.Context[Any] = zmq.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        _tune(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a peer that is gone raises, not blocks
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting server takes its identity back
        auth = None
        try:
            auth = secure_server(ctx, sock, self._keys)
            sock.bind(bind)
            self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as exc:
            self._error = exc
            sock.close(0)
            if auth is not None:
                auth.stop()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._waker.rfd, zmq.POLLIN)
        try:
            while not self._closing:
                if sock in self._poll(poller):
                    for frames in _received(sock):
                        if len(frames) == 4:
                            peer, kind, call_id, body = frames
                            try:
                                self._handler(peer, kind.decode(), call_id, body)
                            except Exception:
                                log.exception("control server: handling %r failed", kind)
                                self.reply(
                                    peer, "error", call_id, b"the stage host failed to handle the message"
                                )
                for out in self._queued():
                    with contextlib.suppress(zmq.Again, zmq.ZMQError):  # the peer is gone: nobody waits
                        sock.send_multipart(out, zmq.NOBLOCK, copy=False)
        finally:
            sock.close(0)
            if auth is not None:
                auth.stop()
