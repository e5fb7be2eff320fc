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
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from media.audio import AudioFormatError, b64decode_audio, b64encode_audio, float32_to_pcm16, pcm16_to_float32
from session.json_guard import JsonRejected, loads_checked
from session.live import events as ev
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

RATE: Final = ev.SAMPLE_RATE
MAX_OPEN_DELEGATIONS: Final = 64  # answers to older ones are refused as unknown
# The output stream is continuous, as GPT-Live's is: while the model is quiet the session sends
# silence, keeping the output this far behind the input timeline (so speech the model starts
# meanwhile does not land on silence already sent). A client's own gate finds the turns in it.
SILENCE_LAG_MS: Final = 200


class Phase(enum.Enum):
    AWAITING_START = "awaiting_start"
    LIVE = "live"
    CLOSED = "closed"


@dataclass(slots=True)
class Emit:
    event: dict[str, Any]


@dataclass(slots=True)
class Begin:
    config: StartConfig


@dataclass(slots=True)
class Feed:
    samples: np.ndarray  # float32 mono at 24 kHz


@dataclass(slots=True)
class Condition:
    values: dict[str, Any]


@dataclass(slots=True)
class RunDelegation:
    delegation_id: str
    task: str
    items: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Close:
    code: int
    reason: str


Effect = Emit | Begin | Feed | Condition | RunDelegation | Close

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
        self.delegation: DelegationTarget = "client"
        self.responses: dict[str, Any] = {}
        self.muted = False
        self.input_samples = 0  # the session's timeline
        self.usage_reported_s = 0.0
        self.context: list[tuple[str, str]] = []  # (kind, text) appended, for a reopened request
        self.context_bytes = 0
        self.speaking = False
        self.out_ms = 0  # where the model's output stream stands on the timeline
        self.in_transcript_ms = 0
        self.open_delegations: deque[str] = deque(maxlen=MAX_OPEN_DELEGATIONS)
        self.pending_items: list[dict[str, Any]] = []
        self.stats = {"appends": 0, "audio_out_ms": 0, "errors": 0, "stretches": 0}

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
        if len(text) > self.limits.max_message_bytes:
            return self._refuse(
                LiveProtocolError(
                    ev.MESSAGE_TOO_LARGE,
                    f"A client event may be at most {self.limits.max_message_bytes} bytes (got {len(text)}).",
                )
            )
        try:
            data = loads_checked(text)
            event = ev.parse_client_event(data)
        except JsonRejected as exc:
            return self._refuse(LiveProtocolError(exc.code, exc.message, param=exc.param))
        except LiveProtocolError as exc:
            return self._refuse(exc)
        try:
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
            return [
                Emit(
                    ev.ack(
                        "session.input_audio.muted" if event.muted else "session.input_audio.unmuted",
                        event.event_id,
                    )
                )
            ]
        if isinstance(event, ContextAppend):
            return self._append_context(event)
        if isinstance(event, SessionUpdate):
            return self._update(event)
        if isinstance(event, ItemCreate):
            return self._item_create(event)
        if isinstance(event, ResponseCreate):
            return self._response_create(event)
        assert isinstance(event, SessionClose)
        return self.close("client_closed")

    def _refuse(self, exc: LiveProtocolError) -> list[Effect]:
        self.stats["errors"] += 1
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
        config = event.config
        limits = self.limits
        pipeline = self.options.pipeline
        if config.model != pipeline and not config.model.startswith("gpt-live"):
            raise LiveProtocolError(
                ev.MODEL_NOT_FOUND,
                f"The model '{config.model[:64]}' is not served here; this server's duplex model is "
                f"'{pipeline}' (gpt-live names are taken as it).",
                param="session.model",
                event_id=event.event_id,
            )
        if len(config.instructions.encode()) > limits.max_instructions_bytes:
            raise LiveProtocolError(
                ev.TEXT_TOO_LARGE,
                f"session.instructions may be at most {limits.max_instructions_bytes} bytes.",
                param="session.instructions",
                event_id=event.event_id,
            )
        if len(config.history) > limits.max_input_items:
            raise LiveProtocolError(
                ev.INVALID_VALUE,
                f"session.input may hold at most {limits.max_input_items} items.",
                param="session.input",
                event_id=event.event_id,
            )
        history_bytes = sum(len(item.text.encode()) for item in config.history)
        if history_bytes + len(config.instructions.encode()) > limits.max_context_bytes:
            raise LiveProtocolError(
                ev.CONTEXT_FULL,
                f"session.instructions and session.input may hold at most "
                f"{limits.max_context_bytes} bytes together.",
                param="session.input",
                event_id=event.event_id,
            )
        target = config.delegation or ("responses" if "responses" in self.options.delegations else "client")
        if target not in self.options.delegations:
            raise LiveProtocolError(
                ev.DELEGATION_UNAVAILABLE,
                f"The pipeline '{pipeline}' has no text model stage to run 'responses' delegation; "
                'start the session with delegation {"type": "client"}.',
                param="session.delegation.type",
                event_id=event.event_id,
            )
        self.config = config
        self.delegation = target
        self.responses = dict(config.responses)
        self.context_bytes = history_bytes + len(config.instructions.encode())
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
        self.stats["appends"] += 1
        if self.muted:
            samples = np.zeros(samples.size, dtype=np.float32)
        out: list[Effect] = [Feed(samples)]
        gap = self.input_ms - SILENCE_LAG_MS - self.out_ms
        if not self.speaking and gap >= 20:
            self.out_ms += gap
            out.append(Emit(ev.audio_delta(_silence(gap * RATE // 1000))))
        interval = self.limits.usage_interval_s
        if int(self.usage_s // interval) > int(before // interval):
            self.usage_reported_s = self.usage_s
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
        if event.delegation_id is not None and event.delegation_id not in self.open_delegations:
            raise LiveProtocolError(
                ev.UNKNOWN_DELEGATION,
                f"No open delegation '{event.delegation_id[:64]}'.",
                param="delegation_id",
                event_id=event.event_id,
            )
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

    def _update(self, event: SessionUpdate) -> list[Effect]:
        if event.delegation != self.delegation:
            raise LiveProtocolError(
                ev.DELEGATION_FIXED,
                f"The delegation type is fixed for the session ('{self.delegation}'); only its "
                "responses settings can change.",
                param="session.delegation.type",
                event_id=event.event_id,
            )
        self.responses.update({k: v for k, v in event.responses.items() if v is not None})
        return [
            Emit(
                {
                    **ev.ack("session.updated", event.event_id),
                    "session": {"delegation": {"type": self.delegation}},
                }
            )
        ]

    # --- delegation results ------------------------------------------------------------------

    def _item_create(self, event: ItemCreate) -> list[Effect]:
        if len(self.pending_items) >= self.limits.max_pending_items:
            raise LiveProtocolError(
                ev.CONTEXT_FULL,
                f"At most {self.limits.max_pending_items} items may wait for response.create.",
                param="item",
                event_id=event.event_id,
            )
        text = item_text(event.item)
        self.context_bytes += self._keep(text, event.event_id, "item")
        self.pending_items.append(event.item)
        return [Emit(ev.ack("response.item.created", event.event_id))]

    def _response_create(self, event: ResponseCreate) -> list[Effect]:
        """The queued items go to the delegation they answer: to the model as its result
        (``client``), or to the text model with them (``responses``)."""
        items, self.pending_items = self.pending_items, []
        delegation_id = self.open_delegations[-1] if self.open_delegations else None
        if self.delegation == "responses" and delegation_id is not None:
            return [RunDelegation(delegation_id, "", items)]
        if not items:
            raise LiveProtocolError(
                ev.INVALID_VALUE,
                "response.create has no items to deliver: send response.item.create first.",
                event_id=event.event_id,
            )
        text = "\n".join(item_text(item) for item in items)
        self.context.append(("result", text))
        result = {"kind": "result", "text": text, "delegation_id": delegation_id}
        response = {"id": f"resp_{uuid.uuid4().hex[:20]}", "model": self.options.pipeline}
        return [
            Condition({"append": result}),
            Emit(ev.response_event(delegation_id, {"type": "response.created", "response": response})),
            Emit(ev.response_event(delegation_id, {"type": "response.completed", "response": response})),
        ]

    # --- the model's progress ----------------------------------------------------------------

    def on_delegate(self, task: str) -> list[Effect]:
        """The model hands work to the session's delegation target."""
        if self.phase is not Phase.LIVE:
            return []
        delegation_id = f"dlg_{uuid.uuid4().hex[:20]}"
        self.open_delegations.append(delegation_id)
        out: list[Effect] = [Emit(ev.delegation_created(delegation_id, self.delegation))]
        if self.delegation == "responses":
            out.append(RunDelegation(delegation_id, task))
        return out

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
        self.speaking = True
        self.stats["stretches"] += 1
        return []

    def on_model_text(self, text: str, frame_ms: int = 80) -> list[Effect]:
        if self.phase is not Phase.LIVE or not text:
            return []
        return [Emit(ev.transcript_delta("output", text, self.out_ms, self.out_ms + frame_ms))]

    def on_model_audio(self, samples: np.ndarray, rate: int) -> list[Effect]:
        if self.phase is not Phase.LIVE or not samples.size:
            return []
        ms = samples.size * 1000 // rate
        self.out_ms += ms
        self.stats["audio_out_ms"] += ms
        return [Emit(ev.audio_delta(b64encode_audio(float32_to_pcm16(samples))))]

    def on_speech_stopped(self) -> list[Effect]:
        self.speaking = False
        return []

    def on_input_transcript(self, text: str) -> list[Effect]:
        """The pipeline's transcript of the user's audio up to now."""
        if self.phase is not Phase.LIVE or not text:
            return []
        start, self.in_transcript_ms = self.in_transcript_ms, self.input_ms
        return [Emit(ev.transcript_delta("input", text, start, max(start, self.input_ms)))]

    def live_error(self, code: str, message: str) -> list[Effect]:
        """A server-side problem the client should hear about (the session goes on)."""
        self.stats["errors"] += 1
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


_SILENCE: dict[int, str] = {}


def _silence(samples: int) -> str:
    """Base64 PCM16 silence (the few lengths a session uses, encoded once)."""
    text = _SILENCE.get(samples)
    if text is None:
        text = b64encode_audio(bytes(2 * samples))
        if len(_SILENCE) < 64:
            _SILENCE[samples] = text
    return text


def item_text(item: dict[str, Any]) -> str:
    """The text a Responses input item carries (a function call's output, a message's text)."""
    output = item.get("output")
    if isinstance(output, str):
        return output
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""
