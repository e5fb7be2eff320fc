"""What a client sees of a request: its output stream and its final status with timings."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from runtime.payloads import Payload

FinalStatus = Literal["completed", "failed", "cancelled"]


class AdmissionError(RuntimeError):
    """The pipeline (or a stage's replicas) cannot take another request right now."""


@dataclass(slots=True)
class StageTiming:
    """One stage's part of a request, in ms since admission (None: did not happen)."""

    replica: int = 0
    started_ms: float | None = None  # engine.start returned
    first_output_ms: float | None = None  # first downstream or client payload
    done_ms: float | None = None  # done, failed or cancelled on this stage
    steps: int = 0
    busy_ms: float = 0.0  # engine.step time of the steps this request was part of
    outputs: int = 0  # payloads produced (downstream + client)


@dataclass(slots=True)
class RequestStatus:
    status: FinalStatus
    error: str | None = None
    timings: dict[str, StageTiming] = field(default_factory=dict)
    request_id: str = ""
    total_ms: float = 0.0  # admission to done
    first_client_ms: float | None = None  # admission to the first client-visible payload


class RequestHandle:
    """The client side of one request: ``async for out in handle`` yields client-visible
    payloads and, last, the :class:`RequestStatus`.

    A consumer that does its work at once can :meth:`listen` instead: each payload is handed to
    its listener in the stage step that produced it, saving a task wake-up (a loop iteration)
    per payload, and the iterator yields only the status.

    On cancel the payloads not read yet are dropped: the status follows at once.
    The buffer is bounded (``bound`` payloads): while it is full the request's stages are not
    stepped, so a consumer that stops reading stalls its own request, never memory. A stage step
    may overshoot the bound by what that one step produced.
    """

    def __init__(self, request_id: str, bound: int, on_drain: Callable[[], None] | None = None) -> None:
        self.request_id = request_id
        self.bound = bound
        self._on_drain = on_drain
        self._buffer: deque[Payload] = deque()
        self._event = asyncio.Event()
        self._status: RequestStatus | None = None
        self._status_yielded = False
        self._listener: Callable[[Payload], None] | None = None
        self._listener_error: BaseException | None = None

    # -- producer side (the orchestrator, on the event loop) ---------------------------------

    def _push(self, payload: Payload) -> None:
        listener = self._listener
        if listener is not None:
            try:
                listener(payload)
            except Exception as exc:  # the consumer's failure, raised in its own task
                self._listener, self._listener_error = None, exc
                self._event.set()
            return
        self._buffer.append(payload)
        self._event.set()

    def _close(self, status: RequestStatus, *, drop_unread: bool = False) -> None:
        if self._status is None:
            self._status = status
            if drop_unread:  # a cancelled response's queued audio must not be played
                self._buffer.clear()
            self._event.set()

    @property
    def full(self) -> bool:
        return len(self._buffer) >= self.bound

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    # -- consumer side ------------------------------------------------------------------------

    @property
    def status(self) -> RequestStatus | None:
        """The final status once the request ended (before or after it was read)."""
        return self._status

    def listen(self, listener: Callable[[Payload], None] | None) -> None:
        """Hand payloads to `listener` as they are produced (on the loop, synchronously, inside
        the stage step) instead of buffering them; the ones already buffered go to it now. None
        stops listening (later payloads are buffered). A listener that raises is dropped, and
        the iterator raises its exception next, in the consumer's task."""
        was_full = self.full
        self._listener = listener
        while listener is not None and self._buffer and self._listener is listener:
            self._push(self._buffer.popleft())
        if was_full and not self.full and self._on_drain is not None:
            self._on_drain()

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> Payload | RequestStatus:
        while not self._buffer and self._status is None and self._listener_error is None:
            self._event.clear()
            await self._event.wait()
        if self._listener_error is not None:
            error, self._listener_error = self._listener_error, None
            raise error
        if self._buffer:
            was_full = self.full
            payload = self._buffer.popleft()
            if was_full and not self.full and self._on_drain is not None:
                self._on_drain()
            return payload
        if self._status is not None and not self._status_yielded:
            self._status_yielded = True
            return self._status
        raise StopAsyncIteration

    async def collect(self) -> tuple[list[Payload], RequestStatus]:
        """Read the stream to its end: every payload and the final status."""
        outputs: list[Payload] = []
        async for out in self:
            if isinstance(out, RequestStatus):
                return outputs, out
            outputs.append(out)
        assert self._status is not None
        return outputs, self._status

    async def wait(self) -> RequestStatus:
        """The final status; payloads not read yet are read and dropped (so nothing stalls)."""
        _, status = await self.collect()
        return status
