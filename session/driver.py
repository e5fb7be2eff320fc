"""The async driver of one realtime session: it runs the sans-I/O core against a transport
and the orchestrator.

The core decides; the driver performs its effects: VAD scoring and transcription run in worker
threads (never on the event loop), responses are orchestrator requests whose client-visible
outputs are fed back into the core, and server events leave through one bounded outbox drained
by a single sender task (so events keep their order, and a client that stops reading is
closed with 1008 instead of growing memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioChunk, TextDelta, Transcript
from runtime.progress import AdmissionError, RequestStatus
from session.realtime.core import RealtimeSessionCore
from session.realtime.effects import (
    CancelResponse,
    ClearAudioOutput,
    Close,
    CoreOutput,
    DetectSpeech,
    PlayAudio,
    StartResponse,
    TranscribeInput,
)

log = logging.getLogger(__name__)


class VadScorer(Protocol):
    """Speech probabilities of one audio stream (silero's `VadStream` fits)."""

    def reset(self) -> None: ...

    def speech_probs(self, frames16k: np.ndarray) -> list[float]: ...


class Transcriber(Protocol):
    def transcribe(self, audio16k: np.ndarray) -> str: ...


class AudioSink(Protocol):
    """Track transports (WebRTC): where `PlayAudio` / `ClearAudioOutput` effects go."""

    def play(self, effect: PlayAudio) -> None: ...

    def clear(self, response_id: str) -> None: ...


class DriverObserver(Protocol):
    """Metrics hooks (web/metrics.py): one call per response start, first audio and end, and
    per error event; never per audio frame."""

    def response_started(self) -> None: ...

    def first_audio(self, seconds: float) -> None: ...

    def response_finished(self, status: str, seconds: float) -> None: ...

    def error(self, code: str) -> None: ...


SendEvent = Callable[[dict[str, Any]], Awaitable[None]]
CloseTransport = Callable[[int, str], Awaitable[None]]
EventSink = Callable[[list[dict[str, Any]]], None]


@dataclass(slots=True)
class DriverOptions:
    outbox_limit: int = 4096  # server events queued for a client before it counts as not reading
    session_key: str | None = None  # sticky key for the orchestrator (the session id)
    clock: Callable[[], float] = time.monotonic
    epoch: Callable[[], float] = time.time
    observer: DriverObserver | None = None  # metrics hooks


@dataclass(slots=True)
class _Response:
    response_id: str
    task: asyncio.Task[None] | None = None
    request_id: str | None = None
    cancelled: bool = False


@dataclass(slots=True)
class _Stats:
    responses: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class RealtimeDriver:
    def __init__(
        self,
        core: RealtimeSessionCore,
        orchestrator: Orchestrator | None,
        *,
        send: SendEvent,
        close: CloseTransport,
        vad: VadScorer | None = None,
        transcriber: Transcriber | None = None,
        audio_sink: AudioSink | None = None,
        event_sink: EventSink | None = None,
        options: DriverOptions | None = None,
    ) -> None:
        self.core = core
        self._orch = orchestrator
        self._send = send
        self._close = close
        self._vad = vad
        self._transcriber = transcriber
        self._audio_sink = audio_sink
        self._event_sink = event_sink
        self.options = options or DriverOptions()
        self._outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(self.options.outbox_limit)
        self._vad_queue: asyncio.Queue[DetectSpeech] = asyncio.Queue()
        self._responses: dict[str, _Response] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timer_wake = asyncio.Event()
        self._closing: tuple[int, str] | None = None
        self._done = asyncio.Event()
        self._receive_error: Exception | None = None
        self.stats = _Stats()

    # --- lifecycle -----------------------------------------------------------------------

    def now(self) -> float:
        return self.options.clock()

    async def run(self, incoming: Callable[[], Awaitable[str | None]]) -> None:
        """Serve until the client goes away or the core closes the session.

        `incoming()` returns the next client text frame, or None when the client is gone.
        """
        sender = self._spawn(self._sender(), "sender")
        self._spawn(self._vad_worker(), "vad")
        self._spawn(self._timer(), "timer")
        self.apply(self.core.start(self.now(), self.options.epoch()))
        # One long-lived receiver task, not a task (or two) per client frame: at 25 appends a
        # second per session, per-frame tasks were the driver's largest event-loop cost.
        self._spawn(self._receive(incoming), "receiver")
        try:
            await self._done.wait()
        finally:
            await self.shutdown(sender)
        if self._receive_error is not None:
            raise self._receive_error

    async def _receive(self, incoming: Callable[[], Awaitable[str | None]]) -> None:
        try:
            while self._closing is None:
                raw = await incoming()
                if raw is None:
                    return
                self.apply(self.core.handle_client_event(raw, self.now()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # re-raised by run() after shutdown
            self._receive_error = exc
        finally:
            self._done.set()

    async def shutdown(self, sender: asyncio.Task[Any] | None = None) -> None:
        for resp in list(self._responses.values()):
            await self._cancel_request(resp)
        with contextlib.suppress(asyncio.QueueFull):
            self._outbox.put_nowait(None)
        if sender is not None and self._closing is not None:
            # Let the sender deliver what the core said before closing (e.g. session_expired).
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(asyncio.shield(sender), timeout=2.0)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._closing is not None:
            code, reason = self._closing
            with contextlib.suppress(Exception):
                await self._close(code, reason)

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.core.session_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def request_close(self, code: int, reason: str) -> None:
        if self._closing is None:
            self._closing = (code, reason)
            self._done.set()

    # --- feeding the core from other sources ---------------------------------------------

    def feed_input_audio(self, samples: np.ndarray, rate: int) -> None:
        """Mic audio from a media track (WebRTC)."""
        self.apply(self.core.feed_input_audio(samples, rate, self.now()))

    def playout(self, response_id: str, played_ms: float) -> None:
        self.apply(self.core.on_playout(response_id, played_ms, self.now()))

    def playout_finished(self, response_id: str) -> None:
        self.apply(self.core.on_playout_finished(response_id, self.now()))

    # --- effects -------------------------------------------------------------------------

    def apply(self, out: CoreOutput) -> None:
        """Queue the core's events, then perform its effects. Never blocks."""
        if out.events:
            if self._event_sink is not None:
                self._event_sink(out.events)
            for event in out.events:
                if event.get("type") == "error":
                    code = str(event.get("error", {}).get("code"))
                    self.stats.errors[code] = self.stats.errors.get(code, 0) + 1
                    if self.options.observer is not None:
                        self.options.observer.error(code)
                try:
                    self._outbox.put_nowait(event)
                except asyncio.QueueFull:
                    self.request_close(1008, "client is not reading its events")
                    break
            self._timer_wake.set()
        for effect in out.effects:
            if isinstance(effect, DetectSpeech):
                self._vad_queue.put_nowait(effect)
            elif isinstance(effect, StartResponse):
                self._start_response(effect)
            elif isinstance(effect, CancelResponse):
                resp = self._responses.get(effect.response_id)
                if resp is not None:
                    resp.cancelled = True
                    self.stats.cancelled += 1
                    self._spawn(self._cancel_request(resp), f"cancel:{resp.response_id}")
            elif isinstance(effect, TranscribeInput):
                self._spawn(self._transcribe(effect), f"transcribe:{effect.item_id}")
            elif isinstance(effect, PlayAudio):
                if self._audio_sink is not None:
                    self._audio_sink.play(effect)
            elif isinstance(effect, ClearAudioOutput):
                if self._audio_sink is not None:
                    self._audio_sink.clear(effect.response_id)
            elif isinstance(effect, Close):
                self.request_close(effect.code, effect.reason)

    async def _sender(self) -> None:
        while True:
            event = await self._outbox.get()
            if event is None:
                return
            try:
                await self._send(event)
            except Exception:  # the transport is gone: end the session, nothing left to say
                log.debug("session %s: send failed", self.core.session_id, exc_info=True)
                self._done.set()
                return

    async def _vad_worker(self) -> None:
        while True:
            effect = await self._vad_queue.get()
            batch = [effect]
            # Coalesce contiguous pending requests into one thread hop.
            while not self._vad_queue.empty():
                nxt = self._vad_queue.get_nowait()
                if nxt.reset or nxt.start_sample != batch[-1].start_sample + len(batch[-1].samples):
                    await self._score(batch)
                    batch = []
                batch.append(nxt)
            await self._score(batch)

    async def _score(self, batch: list[DetectSpeech]) -> None:
        if not batch:
            return
        vad = self._vad
        if vad is None:
            return
        samples = np.concatenate([e.samples for e in batch]) if len(batch) > 1 else batch[0].samples
        reset = batch[0].reset

        def work() -> list[float]:
            if reset:
                vad.reset()
            return vad.speech_probs(samples)

        probs = await asyncio.to_thread(work)
        self.apply(self.core.feed_vad(probs, self.now(), start_sample=batch[0].start_sample))

    async def _timer(self) -> None:
        while True:
            deadline = self.core.next_deadline()
            self._timer_wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.now())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._timer_wake.wait(), timeout=timeout)
            if deadline is not None and self.now() >= deadline:
                self.apply(self.core.tick(self.now()))

    async def _transcribe(self, effect: TranscribeInput) -> None:
        if self._transcriber is None:
            self.apply(self.core.on_input_transcript_failed(effect.item_id, "no transcription model"))
            return
        transcriber = self._transcriber
        try:
            text = await asyncio.to_thread(transcriber.transcribe, effect.audio)
        except Exception as exc:  # a model failure fails this transcription only
            log.exception("transcription failed")
            self.apply(self.core.on_input_transcript_failed(effect.item_id, str(exc)))
            return
        self.apply(self.core.on_input_transcript(effect.item_id, text, now=self.now()))

    # --- responses -----------------------------------------------------------------------

    def _start_response(self, effect: StartResponse) -> None:
        resp = _Response(effect.response_id)
        self._responses[effect.response_id] = resp
        self.stats.responses += 1
        resp.task = self._spawn(self._run_response(resp, effect.params), f"response:{resp.response_id}")

    async def _run_response(self, resp: _Response, params: dict[str, Any]) -> None:
        rid = resp.response_id
        observer = self.options.observer
        started = self.now()
        awaiting_audio = observer is not None
        if observer is not None:
            observer.response_started()
        try:
            if self._orch is None:
                self.apply(self.core.on_response_done(rid, "failed", "no pipeline", now=self.now()))
                return
            try:
                handle = await self._orch.submit(params, session_key=self.options.session_key)
            except AdmissionError as exc:
                self.apply(self.core.on_response_done(rid, "failed", str(exc), now=self.now()))
                return
            resp.request_id = handle.request_id
            if resp.cancelled:
                await self._orch.cancel(handle.request_id)
            async for out in handle:
                if isinstance(out, AudioChunk):
                    if awaiting_audio and observer is not None:
                        awaiting_audio = False
                        observer.first_audio(self.now() - started)
                    self.apply(self.core.on_response_audio(rid, out.samples, out.sample_rate, self.now()))
                elif isinstance(out, TextDelta):
                    self.apply(self.core.on_response_text(rid, out.text, self.now()))
                elif isinstance(out, Transcript):
                    self.apply(self.core.on_input_transcript(rid, out.text, final=out.final, now=self.now()))
                elif isinstance(out, RequestStatus):
                    if observer is not None:
                        observer.response_finished(out.status, self.now() - started)
                    self.apply(self.core.on_response_done(rid, out.status, out.error, now=self.now()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("response %s failed", rid)
            self.apply(self.core.on_response_done(rid, "failed", str(exc), now=self.now()))
        finally:
            self._responses.pop(rid, None)

    async def _cancel_request(self, resp: _Response) -> None:
        resp.cancelled = True
        if self._orch is not None and resp.request_id is not None:
            await self._orch.cancel(resp.request_id)
