"""The async driver of one realtime session: it runs the sans-I/O core against a transport
and the orchestrator.

The core decides; the driver performs its effects: VAD scoring and transcription run in worker
threads (never on the event loop), responses are orchestrator requests whose client-visible
outputs are fed back into the core, and server events leave through the attached
:class:`~session.link.TransportLink`: one bounded outbox drained by a single sender task (so
events keep their order, and a client that stops reading is closed with 1008 instead of
growing memory).

The session outlives its connections: with a :class:`SessionLog` (the store's
``SessionWriter``) every server event is first stamped and logged, and the stamped copy is
what the client gets; conversation items and config changes are logged as they happen. A
connection can then drop (`attach` returns a link whose end the host watches) while the
session runs on, and a new one can be attached later (the host, session/voice/hosting.py,
owns that life: attach, detach, shutdown).

Model audio leaves as the attached transport says (:func:`transport_audio_sink`): on a media
track (WebRTC) as `PlayAudio` effects, otherwise as `response.output_audio.delta` events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.capabilities import PipelineCapabilities
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioChunk, Payload, TextDelta, Transcript
from runtime.progress import AdmissionError, RequestHandle, RequestStatus
from session.internal_errors import client_facing, report_internal
from session.link import AudioSink, LinkEnd, Transport, TransportLink
from session.realtime.core import RealtimeSessionCore
from session.realtime.effects import (
    CancelResponse,
    ClearAudioOutput,
    Close,
    CoreOutput,
    DetectSpeech,
    DropAhead,
    DropTranscript,
    LiveAudio,
    LiveControl,
    LiveUpdate,
    NeedTranscript,
    PlayAudio,
    PrepareTranscript,
    RespondAhead,
    StartResponse,
    TranscribeInput,
)
from session.store.aio import cancel_and_wait
from session.voice.ahead import ResponseAhead, with_transcript
from session.voice.driver_hooks import DriverObserver, SessionLog
from session.voice.live_request import LiveEntry, LiveRequest
from session.voice.prepared import PreparedTranscript
from session.voice.retrieved import logged_form
from session.voice.turn_gate import TurnGate, TurnRejected

log = logging.getLogger(__name__)


def transport_audio_sink(transport: Transport) -> AudioSink | None:
    """The media track a transport plays model audio on, or None when audio travels as
    `response.output_audio.delta` events (WebSocket)."""
    return transport.info.audio_sink


@dataclass(slots=True)
class DriverOptions:
    outbox_limit: int = 4096  # server events queued for a client before it counts as not reading
    outbox_max_bytes: int = 8 * 1024 * 1024  # ... and bytes of their JSON (close 1008 past either)
    session_key: str | None = None  # sticky key for the orchestrator (the session id)
    clock: Callable[[], float] = time.monotonic
    epoch: Callable[[], float] = time.time
    observer: DriverObserver | None = None  # metrics hooks
    turn_gate: TurnGate | None = None  # per-replica bound on generating responses (shared)
    # The session's live request (session/voice/live_request.py): a pipeline that takes its own turns
    # (the core has `live_responses`), or one whose live entry scores VAD frames (`frames`).
    # None: no live request (server VAD then never detects a turn).
    live: LiveEntry | None = None
    live_input_bytes: int = 1 << 20  # mic audio waiting for the live request (input_audio_overflow)
    # What the pipeline offers (`Orchestrator.capabilities()`), for the transcribe entry.
    capabilities: PipelineCapabilities | None = None


@dataclass(slots=True)
class _Response:
    response_id: str
    # The prompt, until the response's task takes it; dropped if the response is cancelled
    # before that (a client alternating response.create / response.cancel faster than the
    # loop runs the tasks queued hundreds of prompts, each a copy of the history: issue 33).
    params: dict[str, Any] | None = None
    task: asyncio.Task[None] | None = None
    request_id: str | None = None
    cancelled: bool = False
    slot: TurnGate | None = None  # the turn gate it holds a slot of


@dataclass(slots=True)
class _Stats:
    responses: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    transcripts_prepared: int = 0  # PrepareTranscript runs
    transcripts_prepared_used: int = 0  # ... whose text a response used instead of audio


class RealtimeDriver:
    def __init__(
        self,
        core: RealtimeSessionCore,
        orchestrator: Orchestrator | None,
        *,
        audio_sink: AudioSink | None = None,
        log: SessionLog | None = None,
        options: DriverOptions | None = None,
    ) -> None:
        self.core = core
        self._orch = orchestrator
        self._audio_sink = audio_sink  # `attach` replaces it with the transport's (if any)
        self._track_response: str | None = None  # the last response with audio for a track
        self._log = log
        self.options = options or DriverOptions()
        self._overflow_reported_at: float | None = None  # input overflow errors: one a second
        self._responses: dict[str, _Response] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._timer_wake = asyncio.Event()
        self._timer_deadline: float | None = None  # what the timer task is waiting for
        self._closing: tuple[int, str] | None = None
        self.closed = asyncio.Event()  # set once the session asked to close (`request_close`)
        self.on_close: Callable[[], None] | None = None  # the host's hook for `closed`
        self.link: TransportLink | None = None
        self._links = 0
        self._started = False
        self.last_event_id: str | None = None  # of the last event sent or logged
        self.last_activity = self.now()  # client input or server events (retention's idle clock)
        self.stats = _Stats()
        self._prepared = PreparedTranscript(core, self.apply, self.now, self._spawn, self._transcribe_audio)
        self._ahead: ResponseAhead | None = None
        if orchestrator is not None:
            opts = self.options
            self._ahead = ResponseAhead(
                orchestrator, gate=opts.turn_gate, session_key=opts.session_key, spawn=self._spawn
            )
        self.live: LiveRequest | None = None
        if self.options.live is not None and orchestrator is not None:
            self.live = LiveRequest(
                orchestrator,
                self.options.live,
                core,
                self.apply,
                self.now,
                session_key=self.options.session_key,
                input_limit_bytes=self.options.live_input_bytes,
            )

    # --- lifecycle -----------------------------------------------------------------------

    def held_event_bytes(self) -> int:
        """Bytes of this session's events its log keeps in this process for a resume here
        (its audio deltas, which Redis does not keep; what /metrics sums)."""
        return self._log.held_bytes if self._log is not None else 0

    def audio_bytes_in_memory(self) -> int:
        """Bytes of audio this session's conversation items hold in memory (what /metrics sums):
        spilled audio counts only while its write to the spool is pending (or failed)."""
        return self.core.conversation.audio_bytes_in_memory()

    def now(self) -> float:
        return self.options.clock()

    def start(self, epoch: float | None = None) -> None:
        """Start the session's own tasks and open it (`session.created`; a restored core
        only starts its timers). `epoch`: wall seconds of the session's creation."""
        if self._started:
            return
        self._started = True
        self._spawn(self._timer(), "timer")
        if self.live is not None:
            self._spawn(self.live.run(), "live")
        if not self.core.started:
            self.apply(self.core.start(self.now(), self.options.epoch() if epoch is None else epoch))

    def attach(self, transport: Transport, *, held: bool = False) -> TransportLink:
        """Serve the session on `transport` from now on (a previous link is closed with 4000,
        "replaced"). `held`: queue events until `link.release(...)` (resume handoff)."""
        old = self.link
        if old is not None:
            old.finish(LinkEnd.REPLACED, 4000, "session resumed on another connection")
            self._drop_audio_sink()
        self._links += 1
        self._use_audio_sink(transport_audio_sink(transport))
        self.link = TransportLink(
            transport,
            self._on_client_text,
            limit=self.options.outbox_limit,
            max_bytes=self.options.outbox_max_bytes,
            held=held,
            name=f"{self.core.session_id}:link{self._links}",
            send_nowait=transport.info.send_nowait,
            deliver=transport.info.deliver,
        )
        return self.link

    def detach(self, link: TransportLink) -> None:
        """Forget `link` if it is still the current one (its connection ended)."""
        if self.link is link:
            self.link = None
            self._drop_audio_sink()

    def _use_audio_sink(self, sink: AudioSink | None) -> None:
        """Model audio of responses started from now on leaves on `sink` (PlayAudio effects,
        playout reported back for truncation) or, without one, as audio delta events. A
        response keeps the mode it started with (the core fixes it per response)."""
        self._audio_sink = sink
        self.core.options.audio_out_via_track = sink is not None

    def _drop_audio_sink(self) -> None:
        """The track went with its connection: audio it still held is lost. A finished
        response that was playing on it counts as played out (so the core stops waiting for
        the track); one still running is settled when it ends (`_run_response`)."""
        if self._audio_sink is None:
            return
        self._audio_sink = None
        if self._track_response is not None:
            self.playout_finished(self._track_response)

    def _on_client_text(self, raw: str) -> None:
        now = self.now()
        self.last_activity = now
        if self._log is not None:
            self._log.mark_activity()
        self.apply(self.core.handle_client_event(raw, now))

    async def shutdown(self, *, drain_s: float = 2.0) -> None:
        """End the session here: cancel responses, close the link (after up to `drain_s` of
        delivering what the core said last, e.g. session_expired, when closing), stop tasks,
        discard the conversation's spilled audio (a later resume rebuilds it from Redis)."""
        try:
            if self._ahead is not None:
                self._ahead.drop()
            for resp in list(self._responses.values()):
                await self._cancel_request(resp)
            link, self.link = self.link, None
            if link is not None:
                if self._closing is not None:
                    code, reason = self._closing
                    await link.aclose(code, reason, drain_s=drain_s)
                else:
                    await link.aclose()
            for task in list(self._tasks):
                await cancel_and_wait(task)
            self._tasks.clear()
        finally:
            self.core.release_audio()

    @property
    def response_ahead(self) -> ResponseAhead | None:
        """Responses started ahead of their turn's end (counters `started`, `used`, `dropped`)."""
        return self._ahead

    @property
    def active_responses(self) -> int:
        return len(self._responses)

    async def wait_responses(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for in-flight responses to finish; True if none is left."""
        tasks = [r.task for r in self._responses.values() if r.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        return not self._responses

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=f"{self.core.session_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def request_close(self, code: int, reason: str) -> None:
        """Close the session: the link delivers what is queued, then closes with `code`."""
        if self._closing is None:
            self._closing = (code, reason)
            if self.link is not None:
                self.link.close_after_drain(code, reason)
            self.closed.set()
            if self.on_close is not None:
                self.on_close()

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
        """Log and queue the core's events, log its state changes, then perform its
        effects. Never blocks, never does I/O (the log batches)."""
        log = self._log
        if out.events:
            link = self.link
            for event in out.events:
                sent = log.append(event, logged_form(event)) if log is not None else event
                if sent["type"] == "error":
                    code = str(sent.get("error", {}).get("code"))
                    self.stats.errors[code] = self.stats.errors.get(code, 0) + 1
                    if self.options.observer is not None:
                        self.options.observer.error(code)
                if link is not None and not link.push(sent):
                    link = None  # closing (or just overflowed: 1008); the log keeps the rest
            self.last_event_id = sent["event_id"]
            self.last_activity = self.now()
            if self.core.next_deadline() != self._timer_deadline:
                # Only when the deadline moved: waking the timer on every event (each audio
                # delta) cost a timeout context and two task switches per delta per session.
                self._timer_wake.set()
        if log is not None:
            changes = self.core.take_state_changes()
            if changes is not None:
                for item_id in changes.deletes:
                    log.delete_item(item_id)
                for record, previous in changes.upserts:
                    log.put_item(record, previous)
                if changes.config is not None:
                    log.set_config(changes.config)
                if changes.open_response_changed:
                    log.set_open_response(changes.open_response)
        for effect in out.effects:
            if isinstance(effect, DetectSpeech):
                if self.live is not None:  # else no VAD in this pipeline (or it is off)
                    self.live.push_frames(effect)
            elif isinstance(effect, StartResponse):
                self._start_response(effect)
            elif isinstance(effect, PrepareTranscript):
                self._prepare_transcript(effect)
            elif isinstance(effect, RespondAhead):
                self._respond_ahead(effect)
            elif isinstance(effect, DropAhead):
                if self._ahead is not None:
                    self._ahead.drop(effect.key)
            elif isinstance(effect, DropTranscript):
                self._prepared.drop(effect.key)
            elif isinstance(effect, NeedTranscript):
                self._prepared.need(effect.key, self.live)
            elif isinstance(effect, CancelResponse):
                resp = self._responses.get(effect.response_id)
                if resp is not None:
                    resp.cancelled = True
                    resp.params = None  # not begun yet: it never will, its prompt can go now
                    self.stats.cancelled += 1
                    self._spawn(self._cancel_request(resp), f"cancel:{resp.response_id}")
            elif isinstance(effect, TranscribeInput):
                self._spawn(self._transcribe(effect), f"transcribe:{effect.item_id}")
            elif isinstance(effect, PlayAudio):
                self._track_response = effect.response_id
                if self._audio_sink is not None:
                    self._audio_sink.play(effect)
            elif isinstance(effect, ClearAudioOutput):
                if self._audio_sink is not None:
                    self._audio_sink.clear(effect.response_id)
            elif isinstance(effect, Close):
                self.request_close(effect.code, effect.reason)
            elif isinstance(effect, LiveAudio) and self.live is not None:
                self.live.push(effect)
            elif isinstance(effect, LiveUpdate) and self.live is not None:
                self.live.update(effect.values)
            elif isinstance(effect, LiveControl) and self.live is not None:
                self.live.control(effect)

    # --- transcription on the pipeline's transcribe entry ----------------------------------

    async def _transcribe_audio(self, audio: np.ndarray) -> str:
        """Transcribe one stretch of 16 kHz audio on the pipeline's transcribe entry."""
        caps = self.options.capabilities
        if self._orch is None or caps is None or caps.transcribe_entry is None:
            raise RuntimeError("no transcription model")
        handle = await self._orch.submit(
            {"audio": audio}, session_key=self.options.session_key, entry=caps.transcribe_entry
        )
        try:
            payloads, status = await handle.collect()
        except asyncio.CancelledError:  # given up (`DropTranscript`): so is the request
            await asyncio.shield(self._orch.cancel(handle.request_id))
            raise
        if status.status != "completed":
            raise RuntimeError(status.error or f"transcription {status.status}")
        finals = [p.text for p in payloads if isinstance(p, Transcript) and p.final]
        return finals[-1] if finals else ""

    async def _timer(self) -> None:
        while True:
            deadline = self._timer_deadline = self.core.next_deadline()
            self._timer_wake.clear()
            timeout = None if deadline is None else max(0.0, deadline - self.now())
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as
            # the wake event fires, and shutdown() then waited forever for this task.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._timer_wake.wait()
            if deadline is not None and self.now() >= deadline:
                self.apply(self.core.tick(self.now()))

    async def _transcribe(self, effect: TranscribeInput) -> None:
        try:
            text = await self._transcribe_audio(effect.audio)
        except Exception as exc:  # a model failure fails this transcription only
            message = report_internal(log, f"transcription of {effect.item_id} failed", exc, exc_info=True)
            self.apply(self.core.on_input_transcript_failed(effect.item_id, message))
            return
        self.apply(self.core.on_input_transcript(effect.item_id, text, now=self.now()))

    def _prepare_transcript(self, effect: PrepareTranscript) -> None:
        """Transcribe the turn so far at a pause (`session.voice.prepared`): on the live
        request if it transcribes, or else on the transcribe entry."""
        caps = self.options.capabilities
        live = self.live if self.live is not None and self.live.transcribes else None
        if live is None and (caps is None or caps.transcribe_entry is None):
            return
        self.stats.transcripts_prepared += 1
        self._prepared.prepare(effect, live)

    def _respond_ahead(self, effect: RespondAhead) -> None:
        pending = self._prepared.pending(effect.key)
        if self._ahead is None or pending is None:
            return
        self._ahead.start(effect.key, effect.params, asyncio.shield(pending))

    async def _prepared_params(
        self, rid: str, key: tuple[str, int], params: dict[str, Any]
    ) -> dict[str, Any]:
        """`params` with the prepared transcript of its audio as `text` (what an ASR-first
        pipeline would have made of it), or unchanged if there is none."""
        text = await self._prepared.take(key)
        if text is None:
            return params
        self.stats.transcripts_prepared_used += 1
        # Made by the pipeline's ASR during the silence that ended the turn: the client gets
        # what the deltas during speech did not say, then the completed transcript, before any
        # response output.
        self.apply(self.core.on_input_transcript(rid, text, final=True, now=self.now()))
        return with_transcript(params, text)

    # --- responses -----------------------------------------------------------------------

    def _start_response(self, effect: StartResponse) -> None:
        if self._ahead is not None and self._ahead.key != effect.transcript_key:
            self._ahead.drop()  # started for a pause that did not end this turn
        resp = _Response(effect.response_id, params=effect.params)
        self._responses[effect.response_id] = resp
        self.stats.responses += 1
        resp.task = self._spawn(
            self._run_response(resp, effect.transcript_key), f"response:{resp.response_id}"
        )

    async def _run_response(self, resp: _Response, transcript_key: tuple[str, int] | None = None) -> None:
        rid = resp.response_id
        params, resp.params = resp.params, None
        observer = self.options.observer
        started = self.now()
        awaiting_audio = observer is not None
        if observer is not None:
            observer.response_started()

        def on_output(out: Payload) -> None:
            """One payload of the response, handled in the stage step that produced it."""
            nonlocal awaiting_audio
            if isinstance(out, AudioChunk):
                if awaiting_audio and observer is not None:
                    awaiting_audio = False
                    observer.first_audio(self.now() - started)
                self.apply(self.core.on_response_audio(rid, out.samples, out.sample_rate, self.now()))
            elif isinstance(out, TextDelta):
                self.apply(self.core.on_response_text(rid, out.text, self.now()))
            elif isinstance(out, Transcript):
                self.apply(self.core.on_input_transcript(rid, out.text, final=out.final, now=self.now()))

        handle: RequestHandle | None = None
        try:
            if params is None:
                return  # cancelled before it began (the core has ended it): nothing to submit
            if self._orch is None:
                self.apply(self.core.on_response_done(rid, "failed", "no pipeline", now=self.now()))
                return
            if transcript_key is not None:
                params = await self._prepared_params(rid, transcript_key, params)
            taken = None
            if transcript_key is not None and self._ahead is not None and "text" in params:
                taken = await self._ahead.take(transcript_key, params)
            if taken is not None:
                handle, resp.slot = taken.handle, taken.slot
            else:
                if not await self._take_turn_slot(resp):
                    return
                try:
                    handle = await self._orch.submit(params, session_key=self.options.session_key)
                except AdmissionError as exc:
                    self.apply(self.core.on_response_done(rid, "failed", str(exc), now=self.now()))
                    return
            resp.request_id = handle.request_id
            if resp.cancelled:
                await self._orch.cancel(handle.request_id)
            # Payloads are handled as the stage step makes them (no task wake-up per delta);
            # the loop below sees the final status, or a payload's failure raised here.
            handle.listen(on_output)
            async for out in handle:
                if not isinstance(out, RequestStatus):
                    on_output(out)
                else:
                    if observer is not None:
                        observer.response_finished(out.status, self.now() - started)
                    error = out.error  # the runtime's text (stage, exception): for the log only
                    if error is not None and out.status == "failed":
                        error = client_facing(error) or report_internal(
                            log, f"response {rid} failed in the pipeline", error
                        )
                    self.apply(self.core.on_response_done(rid, out.status, error, now=self.now()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            message = report_internal(log, f"response {rid} failed", exc, exc_info=True)
            self.apply(self.core.on_response_done(rid, "failed", message, now=self.now()))
        finally:
            if handle is not None:
                handle.listen(None)  # a cancelled task hands on nothing more
                if handle.status is None and self._orch is not None:
                    # Ended here (the driver failed on a payload, or the task was cancelled)
                    # while the pipeline still runs it: stop its stages, free its slot.
                    await self._orch.cancel(handle.request_id)
            self._responses.pop(rid, None)
            if self._audio_sink is None and self._track_response == rid:
                # Its track went away (the peer vanished, or the session moved to a
                # WebSocket) before the response ended: nothing will report its playout.
                self.apply(self.core.on_playout_finished(rid, self.now()))
            if resp.slot is not None:
                resp.slot.release()
                resp.slot = None

    async def _take_turn_slot(self, resp: _Response) -> bool:
        """Wait for a generation slot (if the replica bounds them); False: the turn failed."""
        gate = self.options.turn_gate
        if gate is None:
            return True
        try:
            await gate.acquire()
        except TurnRejected as exc:
            self.apply(self.core.on_response_done(resp.response_id, "failed", str(exc), now=self.now()))
            return False
        resp.slot = gate
        return True

    async def _cancel_request(self, resp: _Response) -> None:
        resp.cancelled = True
        if self._orch is not None and resp.request_id is not None:
            await self._orch.cancel(resp.request_id)
