"""The effective session configuration (GA session object) and `session.update` merging.

`SessionIn` is what a client may send inside `session.update` (every GA field, unknown ones
rejected). `SessionConfig` is the effective configuration: `apply_update` merges a partial
update into a copy and validates cross-field rules, so a rejected update changes nothing.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from media.audio import PCM24K, PCMA, PCMU, WireFormat
from session.realtime.errors import INVALID_VALUE, ProtocolError
from session.realtime.session_fields import (
    check_prompt,
    check_tool_choice,
    check_tools,
    check_tracing,
    check_truncation,
)
from session.realtime.validation import WireModel

Modality = Literal["text", "audio"]


def _check_max_tokens(value: Any) -> Any:
    if value == "inf" or value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise ValueError("expected an integer between 1 and 4096, or 'inf'")
    return value


def _check_voice(value: Any) -> Any:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, dict) and isinstance(value.get("id"), str) and set(value) == {"id"}:
        return value
    raise ValueError("expected a voice name or {id: ...}")


MaxTokens = Annotated[Any, BeforeValidator(_check_max_tokens)]
ToolChoice = Annotated[Any, BeforeValidator(check_tool_choice)]
Tools = Annotated[Any, BeforeValidator(check_tools)]
Tracing = Annotated[Any, BeforeValidator(check_tracing)]
Truncation = Annotated[Any, BeforeValidator(check_truncation)]
PromptRef = Annotated[Any, BeforeValidator(check_prompt)]
Voice = Annotated[Any, BeforeValidator(_check_voice)]


class AudioFormatIn(WireModel):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"] = "audio/pcm"
    rate: Literal[24000] | None = None


class ServerVadIn(WireModel):
    type: Literal["server_vad"]
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    prefix_padding_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    silence_duration_ms: Annotated[int, Field(ge=0, le=10_000)] | None = None
    idle_timeout_ms: Annotated[int, Field(ge=1, le=3_600_000)] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


class SemanticVadIn(WireModel):
    type: Literal["semantic_vad"]
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    create_response: bool | None = None
    interrupt_response: bool | None = None


class TranscriptionIn(WireModel):
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    delay: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None
    keywords: list[str] | None = None
    languages: list[str] | None = None


class NoiseReductionIn(WireModel):
    type: Literal["near_field", "far_field"] | None = None
    strength: Annotated[float, Field(ge=0.0)] | None = None


class AudioInputIn(WireModel):
    format: AudioFormatIn | None = None
    noise_reduction: NoiseReductionIn | None = None
    transcription: TranscriptionIn | None = None
    turn_detection: Annotated[ServerVadIn | SemanticVadIn, Field(discriminator="type")] | None = None


class AudioOutputIn(WireModel):
    format: AudioFormatIn | None = None
    voice: Voice = None
    speed: Annotated[float, Field(ge=0.25, le=1.5)] | None = None


class AudioIn(WireModel):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class SessionIn(WireModel):
    """The `session` object of `session.update` (GA)."""

    type: Literal["realtime", "transcription"]
    model: str | None = None
    instructions: str | None = None
    output_modalities: list[Modality] | None = None
    audio: AudioIn | None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = None
    max_output_tokens: MaxTokens = None
    tools: Tools = None
    tool_choice: ToolChoice = None
    tracing: Tracing = None
    truncation: Truncation = None
    prompt: PromptRef = None
    reasoning: Any = None
    parallel_tool_calls: bool | None = None
    # Read-only fields of the session object; accepted (and ignored) so that a client may
    # send back the object it received in session.created.
    id: str | None = None
    object: Literal["realtime.session"] | None = None
    expires_at: int | None = None


# --- effective configuration -------------------------------------------------------------

_SEMANTIC_SILENCE_MS = {"low": 1000, "medium": 500, "auto": 500, "high": 250}


@dataclass(slots=True)
class TurnDetection:
    """Server VAD settings. `semantic_vad` is served by the same VAD with an eagerness-based
    silence duration (no semantic model runs)."""

    type: Literal["server_vad", "semantic_vad"] = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    idle_timeout_ms: int | None = None
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: Literal["low", "medium", "high", "auto"] = "auto"

    def effective_silence_ms(self) -> int:
        if self.type == "semantic_vad":
            return _SEMANTIC_SILENCE_MS[self.eagerness]
        return self.silence_duration_ms

    def to_wire(self) -> dict[str, Any]:
        if self.type == "semantic_vad":
            return {
                "type": "semantic_vad",
                "eagerness": self.eagerness,
                "create_response": self.create_response,
                "interrupt_response": self.interrupt_response,
            }
        return {
            "type": "server_vad",
            "threshold": self.threshold,
            "prefix_padding_ms": self.prefix_padding_ms,
            "silence_duration_ms": self.silence_duration_ms,
            "idle_timeout_ms": self.idle_timeout_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


def format_of(fmt: AudioFormatIn) -> WireFormat:
    return {"audio/pcm": PCM24K, "audio/pcmu": PCMU, "audio/pcma": PCMA}[fmt.type]


def _format_to_wire(fmt: WireFormat) -> dict[str, Any]:
    if fmt.name == "audio/pcm":
        return {"type": "audio/pcm", "rate": fmt.rate}
    return {"type": fmt.name}


@dataclass(slots=True)
class SessionConfig:
    """Effective configuration of one realtime session."""

    model: str = "omniduplex"
    instructions: str = ""
    output_modalities: list[Modality] = field(default_factory=lambda: ["audio"])
    input_format: WireFormat = PCM24K
    output_format: WireFormat = PCM24K
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    transcription: dict[str, Any] | None = None
    noise_reduction: dict[str, Any] | None = None
    voice: str | dict[str, str] = "alloy"
    speed: float = 1.0
    max_output_tokens: int | Literal["inf"] = "inf"
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    tracing: Any = None
    truncation: Any = "auto"
    prompt: Any = None
    include: list[str] | None = None

    @property
    def audio_out(self) -> bool:
        return "audio" in self.output_modalities

    def copy(self) -> SessionConfig:
        return copy.deepcopy(self)

    def apply_update(self, update: SessionIn, *, voice_locked: bool = False) -> SessionConfig:
        """A new config with `update` merged in; raises `ProtocolError` (nothing changed)."""
        cfg = self.copy()
        fields = update.model_fields_set
        if update.type != "realtime":
            raise ProtocolError(
                INVALID_VALUE,
                "This is a 'realtime' session; its type cannot be changed to 'transcription'.",
                param="session.type",
            )
        if "model" in fields and update.model is not None:
            cfg.model = update.model
        if "instructions" in fields:
            cfg.instructions = update.instructions or ""
        if "output_modalities" in fields and update.output_modalities is not None:
            cfg.output_modalities = normalize_modalities(
                update.output_modalities, "session.output_modalities"
            )
        if "max_output_tokens" in fields:
            cfg.max_output_tokens = "inf" if update.max_output_tokens is None else update.max_output_tokens
        if "tools" in fields:
            cfg.tools = list(update.tools or [])
        if "tool_choice" in fields:
            cfg.tool_choice = update.tool_choice or "auto"
        for name in ("tracing", "truncation", "prompt", "include"):
            if name in fields:
                setattr(cfg, name, getattr(update, name))
        if update.audio is not None:
            _merge_audio(cfg, update.audio, voice_locked=voice_locked)
        return cfg

    def to_wire(self, *, session_id: str, expires_at: int) -> dict[str, Any]:
        """The GA session object (`session.created` / `session.updated`)."""
        return {
            "type": "realtime",
            "object": "realtime.session",
            "id": session_id,
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "tools": copy.deepcopy(self.tools),
            "tool_choice": copy.deepcopy(self.tool_choice),
            "max_output_tokens": self.max_output_tokens,
            "tracing": self.tracing,
            "truncation": self.truncation,
            "prompt": self.prompt,
            "expires_at": expires_at,
            "include": self.include,
            "audio": {
                "input": {
                    "format": _format_to_wire(self.input_format),
                    "transcription": copy.deepcopy(self.transcription),
                    "noise_reduction": copy.deepcopy(self.noise_reduction),
                    "turn_detection": self.turn_detection.to_wire() if self.turn_detection else None,
                },
                "output": {
                    "format": _format_to_wire(self.output_format),
                    "voice": copy.deepcopy(self.voice),
                    "speed": self.speed,
                },
            },
        }


def normalize_modalities(values: list[Modality], param: str) -> list[Modality]:
    """`["audio"]` or `["text"]`; `["text", "audio"]` means audio (audio always has a transcript)."""
    if not values:
        raise ProtocolError(
            INVALID_VALUE, f"Invalid value for '{param}': expected ['audio'] or ['text'].", param=param
        )
    return ["audio"] if "audio" in values else ["text"]


def _merge_audio(cfg: SessionConfig, audio: AudioIn, *, voice_locked: bool) -> None:
    inp = audio.input
    if inp is not None:
        fields = inp.model_fields_set
        if inp.format is not None:
            cfg.input_format = format_of(inp.format)
        if "transcription" in fields:
            cfg.transcription = inp.transcription.model_dump(exclude_none=True) if inp.transcription else None
        if "noise_reduction" in fields:
            cfg.noise_reduction = _merge_noise(cfg.noise_reduction, inp.noise_reduction)
        if "turn_detection" in fields:
            cfg.turn_detection = _merge_turn_detection(cfg.turn_detection, inp.turn_detection)
    out = audio.output
    if out is not None:
        if out.format is not None:
            cfg.output_format = format_of(out.format)
        if out.speed is not None:
            cfg.speed = out.speed
        if out.voice is not None and out.voice != cfg.voice:
            if voice_locked:
                raise ProtocolError(
                    INVALID_VALUE,
                    "Cannot update a conversation's voice if assistant audio is present.",
                    param="session.audio.output.voice",
                )
            cfg.voice = out.voice


def _merge_noise(current: dict[str, Any] | None, new: NoiseReductionIn | None) -> dict[str, Any] | None:
    if new is None:
        return None
    merged = {"type": "near_field", "strength": 1.0} if current is None else dict(current)
    merged.update(new.model_dump(exclude_none=True))
    return merged


def _merge_turn_detection(
    current: TurnDetection | None, new: ServerVadIn | SemanticVadIn | None
) -> TurnDetection | None:
    if new is None:
        return None
    # Same type: fields not given keep their values. A new type starts from defaults.
    merged = (
        copy.deepcopy(current)
        if current is not None and current.type == new.type
        else TurnDetection(new.type)
    )
    for name, value in new.model_dump(exclude_unset=True).items():
        if name != "type" and value is not None:
            setattr(merged, name, value)
        elif name == "idle_timeout_ms":
            merged.idle_timeout_ms = None
    return merged
