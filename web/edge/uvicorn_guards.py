"""uvicorn's HTTP and WebSocket protocols with the deadlines a public server needs.

uvicorn alone keeps a connection forever while the client sends nothing (no request yet, or
half a request line, or headers that never end: its keep-alive timer only starts after a
response), and a WebSocket whose client stops reading blocks every send once the socket
buffer is full, for as long as the TCP connection stays up. 200 such connections held 200 fds
(and, before authentication, nothing else limited them). Here:

* :class:`GuardedHttpToolsProtocol`: a request's headers must be complete within
  ``http_timeout_s`` of its first byte (or of the connection, for the first request), and at
  most :data:`MAX_HEADER_BYTES` long (431 past it); otherwise the connection is closed. A
  body's own deadline is in web/edge/bodies.py; idle keep-alive is uvicorn's ``timeout_keep_alive``.
* :class:`GuardedWebSocketProtocol`: once the send buffer has stayed full (the transport
  paused writing) for ``ws_send_timeout_s``, the connection is closed with 1008 ``client is
  not reading its events`` and dropped (a peer that reads nothing cannot receive the close
  frame, and must not hold the socket). The app sees a disconnect: the session is detached,
  resumable, and its slot goes back when its grace ends. A text frame that is not UTF-8 is
  closed with 1007 and logged as one line, not uvicorn's traceback. Reading is paused once
  :data:`READ_AHEAD_BYTES` of messages wait for the app (uvicorn pauses after every message:
  two ``epoll_ctl`` calls per audio append, 10,000 a second at 200 sessions), and resumed
  when the app has taken them down to half of that. The scope's extension
  :data:`SEND_NOWAIT` writes a text message at once when nothing needs waiting for (see
  :meth:`GuardedWebSocketProtocol.send_text_nowait`), so a session's event can leave in the
  loop iteration that made it instead of waking its sender task for the next one; and
  :data:`SET_RECEIVER` hands each message to a callback as it is parsed (see
  :meth:`GuardedWebSocketProtocol.set_receiver`) instead of queueing it for a task to
  ``receive()`` one loop iteration later: 25 audio appends a second per session skip the queue,
  the task wake-up and the ASGI receive chain.

The deadlines come from :class:`~web.settings.ServerSettings` through the uvicorn ``Config``
(:func:`install`), so tests can set them small.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import InvalidState

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 64 * 1024
SLOW_CLIENT_CODE = 1008
SLOW_CLIENT_REASON = "client is not reading its events"
# Bytes of received messages one WebSocket may hold ahead of the app before reading pauses
# (the messages themselves are bounded by ``ws_max_size``): ~25 audio appends of 40 ms.
READ_AHEAD_BYTES = 64 * 1024
# Received bytes handed to the WebSocket parser at a time. The parser parses (and, with
# permessage-deflate, inflates) every frame of what it is given before the app sees the first:
# a 1.9 MB text of one repeated letter deflates to ~2 KB, so one 256 KiB read of such frames
# was ~100 of them inflated at once (~12 MB live in issue 33's lone fuzzer). Fed this much at a
# time, at most ~3 frames' worth (each bounded by ``ws_max_size``) are inflated and not yet handled.
PARSE_SLICE_BYTES = 4 * 1024
# The ASGI scope extension (``scope["extensions"]``) holding ``send_text_nowait``.
SEND_NOWAIT = "omni.websocket.send_text_nowait"
# ... and ``set_receiver``.
SET_RECEIVER = "omni.websocket.set_receiver"


class Deadlines:
    """What the protocols read from ``config.omni_deadlines``."""

    def __init__(self, http_timeout_s: float = 10.0, ws_send_timeout_s: float = 15.0) -> None:
        self.http_timeout_s = http_timeout_s
        self.ws_send_timeout_s = ws_send_timeout_s


def _deadlines(config: uvicorn.Config) -> Deadlines:
    found = getattr(config, "omni_deadlines", None)
    return found if isinstance(found, Deadlines) else Deadlines()


class OneShot:
    """A deadline on the loop: armed once (while ``seconds`` > 0) until it fires or is
    cancelled; ``expired`` runs when it fires."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float, expired: Callable[[], None]) -> None:
        self.loop = loop
        self.seconds = seconds
        self._expired = expired
        self._handle: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        if self._handle is None and self.seconds > 0:
            self._handle = self.loop.call_later(self.seconds, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._expired()


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_deadline = OneShot(self.loop, _deadlines(config).http_timeout_s, self._headers_late)
        self._header_bytes = 0
        self._in_headers = True  # from the connection until the first request's headers

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._header_deadline.arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._header_deadline.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._in_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Still in the headers after this much (a chunk that also ends them may carry a body):
        if self._in_headers and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse(431, b"Request Header Fields Too Large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_headers:  # a later request on a keep-alive connection
            self._in_headers = True
            self._header_bytes = 0
            self._header_deadline.arm()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._header_deadline.cancel()
        super().on_headers_complete()

    def _headers_late(self) -> None:
        if self._in_headers and not self.transport.is_closing():
            seconds = self._header_deadline.seconds
            log.debug("%s: no complete request within %.1f s: closed", self.client, seconds)
            self.transport.abort()  # it sent nothing worth answering; nothing waits to be flushed

    def _refuse(self, status: int, phrase: bytes) -> None:
        self._header_deadline.cancel()
        self._in_headers = False
        body = phrase + b"\n"
        head = (
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head % (status, phrase, len(body)) + body)
        self.transport.close()


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._stall_deadline = OneShot(self.loop, _deadlines(config).ws_send_timeout_s, self._send_stalled)
        self._ahead: deque[int] = deque()  # sizes of the received messages queued for the app
        self._ahead_bytes = 0
        self._receiver: Callable[[str | bytes], None] | None = None

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope: Any = getattr(self, "scope", None)  # set unless the handshake was refused
        if scope is not None:
            scope["extensions"][SEND_NOWAIT] = self.send_text_nowait
            scope["extensions"][SET_RECEIVER] = self.set_receiver

    def set_receiver(self, receiver: Callable[[str | bytes], None] | None) -> None:
        """From now on hand each complete message to `receiver` as it is parsed (inside the
        transport's data callback), text as `str` and binary as `bytes`, instead of queueing
        it for ``receive()``; the messages already queued go to it first, in order. The
        disconnect still queues: the app keeps awaiting ``receive()`` for it. None goes back
        to queueing. A receiver must not raise: one that does is logged and the connection is
        closed with 1011."""
        self._receiver = receiver
        if receiver is None:
            return
        kept: list[Any] = []
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if kept or message["type"] != "websocket.receive":
                kept.append(message)  # the disconnect, and anything queued after it
                continue
            if self._ahead:
                self._ahead_bytes -= self._ahead.popleft()
            text = message.get("text")
            self._deliver(receiver, text if text is not None else message.get("bytes") or b"")
        for message in kept:
            self.queue.put_nowait(message)
        if self.read_paused and self._ahead_bytes < READ_AHEAD_BYTES // 2:
            self.read_paused = False
            self.transport.resume_reading()

    def _deliver(self, receiver: Callable[[str | bytes], None], data: str | bytes) -> None:
        try:
            receiver(data)
        except Exception:
            log.exception("%s: a WebSocket message receiver failed: closing 1011", self.client)
            self._receiver = None
            if not self.close_sent and not self.transport.is_closing():
                self.conn.send_close(1011, "internal error")
                self.handle_parser_exception()  # queues the disconnect, writes the close, closes

    def send_text_nowait(self, text: str) -> bool:
        """Write one text message now, as ASGI ``websocket.send`` would, when that needs no
        wait: True if it was written. False (nothing written) while writing is paused (the
        send buffer is full), before the handshake completed, after a close was sent, or once
        the client is gone: the caller then uses the ASGI send, which waits or raises."""
        if (
            not self.writable.is_set()
            or self.disconnected
            or not self.handshake_complete
            or self.close_sent
            or self.initial_response is not None
            or self.transport.is_closing()
        ):
            return False
        try:
            self.conn.send_text(text.encode())
        except InvalidState:
            return False
        self.transport.write(b"".join(self.conn.data_to_send()))
        return True

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall_deadline.arm()

    def resume_writing(self) -> None:
        self._stall_deadline.cancel()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stall_deadline.cancel()
        super().connection_lost(exc)

    def _send_stalled(self) -> None:
        if self.transport.is_closing() and self.disconnected:
            return
        log.info(
            "%s: WebSocket closed 1008: its send buffer stayed full for %.1f s",
            self.client,
            self._stall_deadline.seconds,
        )
        if not self.close_sent and self.handshake_complete and self.initial_response is None:
            try:  # behind everything unread: a client that reads again before the reset sees it
                self.conn.send_close(SLOW_CLIENT_CODE, SLOW_CLIENT_REASON)
                self.transport.write(b"".join(self.conn.data_to_send()))
            except Exception:  # the protocol state refused a close frame: drop the socket anyway
                log.debug("no close frame for a stalled WebSocket", exc_info=True)
            self.close_sent = True
        self.transport.abort()  # connection_lost follows: the app sees a disconnect

    def data_received(self, data: bytes) -> None:
        if len(data) <= PARSE_SLICE_BYTES:
            super().data_received(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), PARSE_SLICE_BYTES):
            super().data_received(bytes(view[start : start + PARSE_SLICE_BYTES]))
            if self.transport.is_closing():
                return

    def send_receive_event_to_app(self) -> None:
        data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
        self.frames = []
        if self.close_sent:  # past `websocket.close`: dropped, reads stay on for the close reply
            return
        if self.curr_msg_data_type == "text":
            try:
                text = data.decode()
            except UnicodeDecodeError as exc:
                log.warning(
                    "%s: WebSocket closed 1007: a text frame is not UTF-8 (%s)", self.client, exc.reason
                )
                self.conn.send_close(1007, "invalid UTF-8 in a text frame")
                self.handle_parser_exception()
                return
            if self._receiver is not None:
                self._deliver(self._receiver, text)
                return
            message: Any = {"type": "websocket.receive", "text": text}
        else:
            if self._receiver is not None:
                self._deliver(self._receiver, data)
                return
            message = {"type": "websocket.receive", "bytes": data}
        self.queue.put_nowait(message)
        self._ahead.append(len(data))
        self._ahead_bytes += len(data)
        if self._ahead_bytes >= READ_AHEAD_BYTES and not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    async def receive(self) -> Any:
        message = await self.queue.get()
        if message["type"] == "websocket.receive" and self._ahead:
            self._ahead_bytes -= self._ahead.popleft()
        if self.read_paused and (self.queue.empty() or self._ahead_bytes < READ_AHEAD_BYTES // 2):
            self.read_paused = False
            self.transport.resume_reading()
        return message


def install(config: uvicorn.Config, *, http_timeout_s: float, ws_send_timeout_s: float) -> uvicorn.Config:
    """Use the guarded protocols with these deadlines on ``config`` (before ``config.load``)."""
    config.omni_deadlines = Deadlines(http_timeout_s, ws_send_timeout_s)  # type: ignore[attr-defined]
    config.http = GuardedHttpToolsProtocol
    config.ws = guarded_ws_protocol(config.ws)
    return config


def guarded_ws_protocol(chosen: Any) -> type[WebSocketsSansIOProtocol]:
    """The guarded protocol, on top of `chosen` when that is already a sans-I/O subclass
    (e.g. the robot route's frame limit, web/transports/robot.py), so both behaviours hold."""
    if isinstance(chosen, type) and issubclass(chosen, WebSocketsSansIOProtocol):
        if issubclass(chosen, GuardedWebSocketProtocol):
            return chosen
        return type(f"Guarded{chosen.__name__}", (GuardedWebSocketProtocol, chosen), {})
    return GuardedWebSocketProtocol
