"""One model response: its GA event sequence, output audio framing and stored output.

Event order (audio): response.created → output_item.added → conversation.item.added →
content_part.added(audio) → {output_audio_transcript.delta, output_audio.delta}* →
output_audio.done → output_audio_transcript.done → content_part.done → output_item.done →
conversation.item.done → response.done. Text responses use output_text.delta/done and a
text part. The output item is opened on the first text or audio from the pipeline, so a
response cancelled before any output has `output: []`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from media.audio import PCM24K, AudioFramer, StreamingResampler, WireFormat, b64encode_audio
from session.realtime.conversation import Content, Conversation, Item
from session.realtime.effects import PlayAudio
from session.realtime.server_events import Outbox, usage

ResponseStatus = Literal["in_progress", "completed", "cancelled", "failed", "incomplete"]
CancelReason = Literal["turn_detected", "client_cancelled"]


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a response ended: its status and, for a cancelled or a failed one, why."""

    status: ResponseStatus
    reason: CancelReason | None = None  # cancelled
    error: str | None = None  # failed: the message
    error_code: str = "pipeline_failed"

    def details(self) -> dict[str, Any] | None:
        """The response's ``status_details``."""
        if self.status == "cancelled":
            return {"type": "cancelled", "reason": self.reason or "client_cancelled"}
        if self.status == "failed":
            return {
                "type": "failed",
                "error": {
                    "type": "server_error",
                    "code": self.error_code,
                    "message": self.error or "The response failed.",
                },
            }
        if self.status == "incomplete":
            return {"type": "incomplete", "reason": "max_output_tokens"}
        return None


@dataclass(slots=True)
class ResponseSettings:
    """Per-response settings, fixed when the response starts."""

    modalities: list[Literal["text", "audio"]]
    output_format: WireFormat
    voice: Any
    max_output_tokens: int | Literal["inf"]
    metadata: dict[str, str] | None = None
    in_conversation: bool = True  # False for `conversation: "none"` (out-of-band)
    frame_ms: int = 40
    via_track: bool = False  # WebRTC: audio leaves on a media track, not in events

    @property
    def audio(self) -> bool:
        return "audio" in self.modalities


@dataclass(slots=True)
class PromptStats:
    """What went into the response (for usage estimates and transcript routing)."""

    # Characters of prompt text (the trailing turn, the history, the instructions): only its
    # length goes into usage, so the text is not joined into one more copy of the history.
    text_chars: int = 0
    audio_s: float = 0.0
    audio_item_ids: list[str] = field(default_factory=list)


class ResponseRun:
    """The server side of one response, fed by pipeline progress."""

    def __init__(
        self,
        response_id: str,
        settings: ResponseSettings,
        *,
        outbox: Outbox,
        conversation: Conversation,
        item_id: str,
        conversation_id: str,
        prompt: PromptStats,
    ) -> None:
        self.id = response_id
        self.settings = settings
        self.prompt = prompt
        self.status: ResponseStatus = "in_progress"
        self.item: Item | None = None
        self.audio_started_at: float | None = None  # `now` of the first audio out
        self._out = outbox
        self._conversation = conversation
        self._item_id = item_id
        self._conversation_id = conversation_id
        self._text = ""
        self._audio_bytes = 0
        # Over a track the stored/played audio is PCM16 24 kHz whatever the wire format says.
        self._format = PCM24K if settings.via_track else settings.output_format
        self._resampler: StreamingResampler | None = None
        self._framer = AudioFramer.for_duration(self._format, settings.frame_ms)

    @classmethod
    def orphaned(
        cls,
        item: Item,
        settings: ResponseSettings,
        *,
        outbox: Outbox,
        conversation: Conversation,
        conversation_id: str,
    ) -> ResponseRun:
        """A response that a dead process left in progress, rebuilt from its stored output item
        so that `finish` can end it (the client saw it start and must see it end)."""
        run = cls(
            item.response_id or "",
            settings,
            outbox=outbox,
            conversation=conversation,
            item_id=item.id,
            conversation_id=conversation_id,
            prompt=PromptStats(),
        )
        if not item.content:
            item.content.append(
                Content(type="output_audio", transcript="")
                if settings.audio
                else Content(type="output_text", text="")
            )
        run.item = item
        part = item.content[0]
        run._text = (part.transcript if settings.audio else part.text) or ""
        return run

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self.status == "in_progress"

    @property
    def audio_ms(self) -> float:
        return self._format.duration_ms(self._audio_bytes)

    def start(self) -> None:
        self._out.event("response.created", response=self._response_object())

    def on_text(self, text: str) -> None:
        if not self.active or not text:
            return
        self._open()
        self._text += text
        self._store_text(self._text)
        kind = (
            "response.output_audio_transcript.delta" if self.settings.audio else "response.output_text.delta"
        )
        self._out.event(kind, **self._where(), delta=text)

    def on_audio(self, samples: np.ndarray, rate: int, now: float) -> None:
        if not self.active or not self.settings.audio or len(samples) == 0:
            return
        self._open()
        if self._resampler is not None and self._resampler.src_rate != rate:
            self._emit_audio(self._resampler.flush(), now)
            self._resampler = None
        if self._resampler is None:
            self._resampler = StreamingResampler(rate, self._format.rate)
        self._emit_audio(self._resampler.process(samples), now)

    def finish(self, outcome: Outcome, *, now: float, reported_usage: dict[str, Any] | None = None) -> None:
        """Close open parts and emit `response.done`. Cancelled/failed output is dropped
        where it was still buffered (only audio already sent is kept)."""
        if not self.active:
            return
        status = outcome.status
        if status == "completed" and self.settings.audio:
            if self._resampler is not None:
                self._emit_audio(self._resampler.flush(), now, final=True)
            else:
                self._emit_frames(self._framer.flush(), now)
        else:
            self._framer.discard()
        self._resampler = None
        self.status = status
        if self.item is not None:
            self._close_item("completed" if status == "completed" else "incomplete")
        self._out.event(
            "response.done",
            response=self._response_object(
                status_details=outcome.details(),
                reported_usage=reported_usage,
            ),
        )

    # --- internals -----------------------------------------------------------------------

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self._item_id, "output_index": 0, "content_index": 0}

    def _open(self) -> None:
        if self.item is not None:
            return
        part = (
            Content(type="output_audio", transcript="")
            if self.settings.audio
            else Content(type="output_text", text="")
        )
        if self.settings.audio:
            part.output_audio = bytearray()
            part.output_format = self._format
        self.item = Item(
            id=self._item_id, type="message", role="assistant", status="in_progress", response_id=self.id
        )
        self._out.event(
            "response.output_item.added", response_id=self.id, output_index=0, item=self.item.to_wire()
        )
        if self.settings.in_conversation:
            previous = self._conversation.insert(self.item)
            self._out.event("conversation.item.added", previous_item_id=previous, item=self.item.to_wire())
        self.item.content.append(part)
        wire_part = (
            {"type": "audio", "transcript": ""} if self.settings.audio else {"type": "text", "text": ""}
        )
        self._out.event("response.content_part.added", **self._where(), part=wire_part)

    def _store_text(self, text: str) -> None:
        assert self.item is not None
        part = self.item.content[0]
        if self.settings.audio:
            if not part.truncated:
                part.transcript = text
        else:
            part.text = text

    def _emit_audio(self, samples: np.ndarray, now: float, *, final: bool = False) -> None:
        data = self._format.encode(samples) if len(samples) else b""
        if self.settings.via_track:
            if len(samples):
                self._note_audio_start(now)
                self._store_audio(data)
                assert self.item is not None
                self._out.effect(PlayAudio(self.id, self.item.id, samples, self._format.rate))
            return
        for frame in self._framer.push(data):
            self._emit_frames(frame, now)
        if final:
            self._emit_frames(self._framer.flush(), now)

    def _emit_frames(self, frame: bytes, now: float) -> None:
        if not frame:
            return
        self._note_audio_start(now)
        self._store_audio(frame)
        self._out.event("response.output_audio.delta", **self._where(), delta=b64encode_audio(frame))

    def _note_audio_start(self, now: float) -> None:
        if self.audio_started_at is None:
            self.audio_started_at = now
            if self.settings.via_track:
                self._out.event("output_audio_buffer.started", response_id=self.id)

    def _store_audio(self, data: bytes) -> None:
        self._audio_bytes += len(data)
        assert self.item is not None
        part = self.item.content[0]
        if part.output_audio is not None and not part.truncated:
            part.output_audio += data

    def _close_item(self, item_status: Literal["completed", "incomplete"]) -> None:
        assert self.item is not None
        where = self._where()
        part = self.item.content[0]
        if self.settings.audio:
            transcript = part.transcript or ""
            self._out.event("response.output_audio.done", **where)
            self._out.event("response.output_audio_transcript.done", **where, transcript=transcript)
            self._out.event(
                "response.content_part.done", **where, part={"type": "audio", "transcript": transcript}
            )
        else:
            text = part.text or ""
            self._out.event("response.output_text.done", **where, text=text)
            self._out.event("response.content_part.done", **where, part={"type": "text", "text": text})
        if self.item.status == "in_progress":
            self.item.status = item_status
        self._conversation.mark_changed(self.item.id)
        wire = self.item.to_wire()
        self._out.event("response.output_item.done", response_id=self.id, output_index=0, item=wire)
        if self.settings.in_conversation and self.item.id in self._conversation:
            previous = _previous_id(self._conversation, self.item.id)
            self._out.event("conversation.item.done", previous_item_id=previous, item=wire)

    def _response_object(
        self, *, status_details: dict[str, Any] | None = None, reported_usage: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        s = self.settings
        done = self.status != "in_progress"
        return {
            "object": "realtime.response",
            "id": self.id,
            "status": self.status,
            "status_details": status_details,
            "output": [self.item.to_wire()] if self.item is not None else [],
            "conversation_id": self._conversation_id if s.in_conversation else None,
            "output_modalities": list(s.modalities),
            "max_output_tokens": s.max_output_tokens,
            "audio": {"output": {"format": _format_wire(s.output_format), "voice": _voice_name(s.voice)}},
            "usage": usage(
                input_text_chars=self.prompt.text_chars,
                input_audio_s=self.prompt.audio_s,
                output_text=self._text,
                output_audio_s=self.audio_ms / 1000.0,
                reported=reported_usage,
            )
            if done
            else None,
            "metadata": s.metadata,
        }


def end_orphaned_responses(
    conversation: Conversation,
    settings_for: Callable[[bool], ResponseSettings],
    *,
    outbox: Outbox,
    conversation_id: str,
    now: float,
    error_code: str = "pipeline_failed",
    message: str = "The server restarted during this response.",
    open_response: Mapping[str, Any] | None = None,
) -> None:
    """End, with `response.done` failed, every response whose output item a dead process left
    in progress (`settings_for(audio)` gives the settings to close it with), and
    `open_response` (the response the store had as in progress: `{"id", "audio"}`) unless that
    just ended it: it had no output item yet (the process died before its first output), or
    its item was truncated while it ran. Scale-out failover passes `error_code="replica_lost"`."""
    ended: set[str] = set()
    for item in conversation.items:
        if item.status != "in_progress" or item.role != "assistant" or item.response_id is None:
            continue
        ended.add(item.response_id)
        audio = any(c.type == "output_audio" for c in item.content)
        run = ResponseRun.orphaned(
            item,
            settings_for(audio),
            outbox=outbox,
            conversation=conversation,
            conversation_id=conversation_id,
        )
        run.finish(Outcome("failed", error=message, error_code=error_code), now=now)
    response_id = str((open_response or {}).get("id") or "")
    if response_id and response_id not in ended:
        run = ResponseRun(
            response_id,
            settings_for(bool(open_response and open_response.get("audio"))),
            outbox=outbox,
            conversation=conversation,
            item_id="",  # never opened: the response ends with no output
            conversation_id=conversation_id,
            prompt=PromptStats(),
        )
        run.finish(Outcome("failed", error=message, error_code=error_code), now=now)


def _format_wire(fmt: WireFormat) -> dict[str, Any]:
    return {"type": "audio/pcm", "rate": fmt.rate} if fmt.name == "audio/pcm" else {"type": fmt.name}


def _voice_name(voice: Any) -> str | None:
    return voice.get("id") if isinstance(voice, dict) else voice


def _previous_id(conversation: Conversation, item_id: str) -> str | None:
    previous = None
    for item in conversation.items:
        if item.id == item_id:
            return previous
        previous = item.id
    return None
