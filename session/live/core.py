"""One GPT-Live session, sans-I/O: client frames and the model's progress in, effects out.

The core never touches a socket, a task or a clock. Its driver (:mod:`session.live.driver`)
hands it every client text frame (:meth:`LiveSessionCore.receive`) and every payload of the
pipeline's live request (``on_*``), and carries out what comes back, in order:

* :class:`Emit`: a server event for the client;
* :class:`Begin`: the session started: open the live request on the pipeline;
* :class:`Feed`: input audio for the model (float32, 24 kHz; silence while muted, so the
  model's clock never stops);
* :class:`Condition`: text for the model as conditioning (instructions, thinking, commentary,
  a delegation's result), in order with the audio;
* :class:`RunDelegation`: a ``responses`` delegation for the pipeline's text model;
* :class:`Close`: send what is queued, then close the connection; the session is over.

States: ``awaiting_start`` (only ``session.start`` is taken; anything else gets
``session_not_started``), ``live``, ``closed``. Timeline: the session's clock is its input
audio (every appended sample, muted ones included): usage seconds, the ``start_ms`` /
``end_ms`` of transcripts and ``session.usage.updated`` every ``usage_interval_s`` of it. The
output is one continuous stream on the same timeline: the model's audio as it comes, and
silence while it is quiet (kept ``SILENCE_LAG_MS`` behind the input); its transcript's
``start_ms`` / ``end_ms`` are positions in that stream.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from media.audio import AudioFormatError, b64decode_audio, pcm16_to_float32
from session.json_guard import JsonRejected, loads_checked
from session.live import events as ev
from session.live.effects import Begin, Close, Condition, Effect, Emit, Feed, RunDelegation
from session.live.events import (
    AudioAppend,
    ContextAppend,
    DelegationTarget,
    ItemCreate,
    LiveLimits,
    LiveProtocolError,
    MuteInput,
    ResponseCreate,
    SessionClose,
    SessionStart,
    SessionUpdate,
    StartConfig,
)
from session.live.handoff import Delegations, item_text
from session.live.output import SILENCE_LAG_MS, OutputStream
from session.live.start import check_start

__all__ = [
    "SILENCE_LAG_MS",
    "Begin",
    "Close",
    "Condition",
    "Effect",
    "Emit",
    "Feed",
    "LiveCoreOptions",
    "LiveSessionCore",
    "Phase",
    "RunDelegation",
]

RATE: Final = ev.SAMPLE_RATE


class Phase(enum.Enum):
    AWAITING_START = "awaiting_start"
    LIVE = "live"
    CLOSED = "closed"


# session.closed reasons (GPT-Live's) by why the server ends a session
CLOSE_REASONS: Final = {
    "client_closed": "close_requested",
    "lifetime_expired": "expired",
    "idle_expired": "expired",
    "deleted": "remote_hangup",
    "hangup": "remote_hangup",
}


@dataclass(frozen=True, slots=True)
class LiveCoreOptions:
    session_id: str
    pipeline: str  # the model name clients ask for (``gpt-live*`` names are taken as it too)
    expires_at: int
    delegations: frozenset[DelegationTarget] = frozenset({"client"})  # what the pipeline can do
    limits: LiveLimits = field(default_factory=LiveLimits)
    resume: dict[str, Any] | None = None  # omni resume data for session.started (a client that asked)


class LiveSessionCore:
    """The protocol state of one session (module docstring)."""

    def __init__(self, options: LiveCoreOptions) -> None:
        self.options = options
        self.limits = options.limits
        self.session_id = options.session_id
        self.phase = Phase.AWAITING_START
        self.config: StartConfig | None = None
        self.delegations = Delegations(options.pipeline, options.limits.max_pending_items)
        self.output = OutputStream()
        self.muted = False
        self.input_samples = 0  # the session's timeline
        self.context: list[tuple[str, str]] = []  # (kind, text) appended, for a reopened request
        self.context_bytes = 0
        self.in_transcript_ms = 0
        self.counts = {"appends": 0, "errors": 0}

    @property
    def delegation(self) -> DelegationTarget:
        return self.delegations.target

    @property
    def stats(self) -> dict[str, int]:
        out = self.output
        return {**self.counts, "audio_out_ms": out.audio_ms, "stretches": out.stretches}

    # --- timeline ----------------------------------------------------------------------------

    @property
    def input_ms(self) -> int:
        return self.input_samples * 1000 // RATE

    @property
    def usage_s(self) -> float:
        return self.input_samples / RATE

    # --- client frames -----------------------------------------------------------------------

    def receive(self, text: str) -> list[Effect]:
        """One client text frame."""
        if self.phase is Phase.CLOSED:
            return []
        limit = self.limits.max_message_bytes
        try:
            if len(text) > limit:
                raise LiveProtocolError(
                    ev.MESSAGE_TOO_LARGE, f"A client event may be at most {limit} bytes (got {len(text)})."
                )
            try:
                event = ev.parse_client_event(loads_checked(text))
            except JsonRejected as exc:
                raise LiveProtocolError(exc.code, exc.message, param=exc.param) from None
            return self._dispatch(event)
        except LiveProtocolError as exc:
            return self._refuse(exc)

    def _dispatch(self, event: ev.ClientEvent) -> list[Effect]:
        if isinstance(event, AudioAppend):
            return self._append_audio(event)
        if isinstance(event, SessionStart):
            return self._start(event)
        if self.phase is not Phase.LIVE:
            raise LiveProtocolError(
                ev.NOT_STARTED,
                "The session has not started: the first event must be session.start "
                "(and nothing else before session.started).",
                event_id=getattr(event, "event_id", None),
            )
        if isinstance(event, MuteInput):
            self.muted = event.muted
            kind = "session.input_audio.muted" if event.muted else "session.input_audio.unmuted"
            return [Emit(ev.ack(kind, event.event_id))]
        if isinstance(event, ContextAppend):
            return self._append_context(event)
        if isinstance(event, SessionUpdate):
            return self.delegations.update(event)
        if isinstance(event, ItemCreate):
            return self._item_create(event)
        if isinstance(event, ResponseCreate):
            return self._response_create(event)
        assert isinstance(event, SessionClose)
        return self.close("client_closed")

    def _refuse(self, exc: LiveProtocolError) -> list[Effect]:
        self.counts["errors"] += 1
        out: list[Effect] = [Emit(exc.to_event())]
        if self.phase is Phase.AWAITING_START:  # no session to keep: the connection ends
            self.phase = Phase.CLOSED
            out.append(Close(1008, f"session not started: {exc.code}"))
        return out

    # --- session.start -----------------------------------------------------------------------

    def _start(self, event: SessionStart) -> list[Effect]:
        if self.phase is not Phase.AWAITING_START:
            raise LiveProtocolError(
                ev.ALREADY_STARTED, "The session has already started.", event_id=event.event_id
            )
        target, size = check_start(
            event, pipeline=self.options.pipeline, targets=self.options.delegations, limits=self.limits
        )
        config = event.config
        self.config = config
        self.delegations.start(target, config.responses)
        self.context_bytes = size
        self.phase = Phase.LIVE
        return [Emit(ev.started(self.session_resource())), Begin(config)]

    def session_resource(self) -> dict[str, Any]:
        """``session.started``'s session: GPT-Live's ``id`` and what this server adds (a stock
        client reads only ``id``)."""
        assert self.config is not None
        voice = self.config.voice
        resource: dict[str, Any] = {
            "id": self.session_id,
            "object": "live.session",
            "model": self.options.pipeline,
            "audio": {"format": {"type": "audio/pcm", "rate": RATE}, "output": {"voice": voice}},
            "delegation": {"type": self.delegation},
            "expires_at": self.options.expires_at,
        }
        if self.options.resume is not None:
            resource["omni"] = dict(self.options.resume)
        return resource

    def resumed(self) -> list[dict[str, Any]]:
        """A connection resumed the session: it gets ``session.started`` again (``omni.resumed``)."""
        if self.phase is not Phase.LIVE:
            return []
        resource = self.session_resource()
        resource["omni"] = {"resumed": True, "usage_s": round(self.usage_s, 3)}
        return [ev.started(resource)]

    def conditioning(self) -> dict[str, Any]:
        """Everything the model has been told, for a live request that is (re)opened."""
        assert self.config is not None
        return {
            "instructions": self.config.instructions,
            "history": [{"role": item.role, "text": item.text} for item in self.config.history],
            "appends": [{"kind": kind, "text": text} for kind, text in self.context],
            "voice": self.config.voice,
        }

    # --- input -------------------------------------------------------------------------------

    def _append_audio(self, event: AudioAppend) -> list[Effect]:
        if self.phase is not Phase.LIVE:
            raise LiveProtocolError(
                ev.NOT_STARTED, "Audio before session.started is refused: send session.start first."
            )
        limit = self.limits.max_append_audio_bytes
        if len(event.audio) > (limit + 2) // 3 * 4:
            raise LiveProtocolError(
                ev.AUDIO_TOO_LARGE,
                f"An append may carry at most {limit} bytes of audio ({limit * 500 // RATE} ms); "
                "send it in chunks as it is recorded.",
                param="audio",
            )
        try:
            samples = pcm16_to_float32(b64decode_audio(event.audio))
        except AudioFormatError as exc:
            raise LiveProtocolError(
                ev.INVALID_AUDIO, f"The audio is not base64 PCM16: {exc}.", param="audio"
            ) from None
        return self.push_audio(samples)

    def push_audio(self, samples: np.ndarray) -> list[Effect]:
        """Input audio (float32, 24 kHz) of an append, or of a WebRTC call's track (which
        streams from the connect on: what comes before ``session.started`` is dropped)."""
        if self.phase is not Phase.LIVE or not samples.size:
            return []
        before = self.usage_s
        self.input_samples += samples.size
        self.counts["appends"] += 1
        if self.muted:
            samples = np.zeros(samples.size, dtype=np.float32)
        out: list[Effect] = [Feed(samples)]
        out += self.output.fill(self.input_ms)
        interval = self.limits.usage_interval_s
        if int(self.usage_s // interval) > int(before // interval):
            out.append(Emit(ev.usage_updated(self.usage_s)))
        return out

    def _keep(self, text: str, event_id: str | None, param: str) -> int:
        size = len(text.encode())
        if size > self.limits.max_append_bytes:
            raise LiveProtocolError(
                ev.TEXT_TOO_LARGE,
                f"An append may be at most {self.limits.max_append_bytes} bytes.",
                param=param,
                event_id=event_id,
            )
        if self.context_bytes + size > self.limits.max_context_bytes:
            raise LiveProtocolError(
                ev.CONTEXT_FULL,
                f"The session holds {self.context_bytes} bytes of text, at most "
                f"{self.limits.max_context_bytes}: nothing more can be appended.",
                param=param,
                event_id=event_id,
            )
        return size

    def _append_context(self, event: ContextAppend) -> list[Effect]:
        self.delegations.check(event.delegation_id, event.event_id)
        self.context_bytes += self._keep(event.content, event.event_id, "content")
        self.context.append((event.kind, event.content))
        append: dict[str, Any] = {"kind": event.kind, "text": event.content}
        if event.delegation_id is not None:
            append["delegation_id"] = event.delegation_id
        values: dict[str, Any] = {"append": append}
        if event.kind == "instructions":
            values["instructions"] = self.instructions_text()
        return [Condition(values), Emit(ev.ack(f"session.{event.kind}.appended", event.event_id))]

    def instructions_text(self) -> str:
        """The startup instructions and every instructions append, in order."""
        assert self.config is not None
        parts = [self.config.instructions] if self.config.instructions else []
        parts += [text for kind, text in self.context if kind == "instructions"]
        return "\n\n".join(parts)

    # --- delegation ------------------------------------------------------------------------

    def _item_create(self, event: ItemCreate) -> list[Effect]:
        size = self._keep(item_text(event.item), event.event_id, "item")
        out = self.delegations.queue(event)
        self.context_bytes += size
        return out

    def _response_create(self, event: ResponseCreate) -> list[Effect]:
        out, result = self.delegations.deliver(event)
        if result is not None:
            self.context.append(("result", result))
        return out

    def on_delegate(self, task: str) -> list[Effect]:
        """The model hands work to the session's delegation target."""
        return self.delegations.created(task) if self.phase is Phase.LIVE else []

    def on_delegation_event(self, delegation_id: str, event: dict[str, Any]) -> list[Effect]:
        """A Responses event of a delegation the text model runs."""
        return [Emit(ev.response_event(delegation_id, event))] if self.phase is Phase.LIVE else []

    def on_delegation_result(self, delegation_id: str, text: str) -> list[Effect]:
        """The text model's answer goes to the voice model, to be spoken in its own words."""
        if self.phase is not Phase.LIVE or not text:
            return []
        self.context.append(("result", text))
        return [Condition({"append": {"kind": "result", "text": text, "delegation_id": delegation_id}})]

    def on_speech_started(self) -> list[Effect]:
        self.output.started()
        return []

    def on_model_text(self, text: str) -> list[Effect]:
        return self.output.text(text) if self.phase is Phase.LIVE else []

    def on_model_audio(self, samples: np.ndarray, rate: int) -> list[Effect]:
        return self.output.audio(samples, rate) if self.phase is Phase.LIVE else []

    def on_speech_stopped(self) -> list[Effect]:
        self.output.stopped()
        return []

    def on_input_transcript(self, text: str) -> list[Effect]:
        """The pipeline's transcript of the user's audio up to now."""
        if self.phase is not Phase.LIVE or not text:
            return []
        start, self.in_transcript_ms = self.in_transcript_ms, self.input_ms
        return [Emit(ev.transcript_delta("input", text, start, max(start, self.input_ms)))]

    def live_error(self, code: str, message: str) -> list[Effect]:
        """A server-side problem the client should hear about (the session goes on)."""
        self.counts["errors"] += 1
        return [Emit(ev.error(code, message, kind="server_error"))] if self.phase is not Phase.CLOSED else []

    # --- the end -----------------------------------------------------------------------------

    def start_timed_out(self) -> list[Effect]:
        if self.phase is not Phase.AWAITING_START:
            return []
        return self._refuse(
            LiveProtocolError(
                ev.START_TIMEOUT, f"No session.start within {self.limits.start_timeout_s:g} s of connecting."
            )
        )

    def close(self, cause: str, *, code: int = 1000, reason: str = "session closed") -> list[Effect]:
        """End the session: the final usage and ``session.closed``, then the close."""
        if self.phase is Phase.CLOSED:
            return []
        started = self.phase is Phase.LIVE
        self.phase = Phase.CLOSED
        out: list[Effect] = []
        if started:
            out.append(Emit(ev.usage_updated(self.usage_s)))
            out.append(Emit(ev.closed(CLOSE_REASONS.get(cause, "connection_lost"), self.usage_s)))
        out.append(Close(code, reason))
        return out
