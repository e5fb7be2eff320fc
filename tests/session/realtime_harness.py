"""Test harness for the realtime core: virtual time, strict schema checks of every event."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from openai.types.realtime import RealtimeServerEvent
from openai.types.realtime.realtime_session_create_response import RealtimeSessionCreateResponse
from pydantic import BaseModel, TypeAdapter

from session.realtime import CoreOptions, RealtimeSessionCore
from session.realtime.effects import CoreOutput, DetectSpeech, StartResponse
from session.realtime.ids import SequentialIds

_SERVER_EVENTS: TypeAdapter[Any] = TypeAdapter(RealtimeServerEvent)
_SESSION_FIELDS_BEYOND_REQUEST = {"id", "object", "expires_at"}
EPOCH = 1_800_000_000.0


def _extras(value: Any, path: str) -> list[str]:
    """Paths of fields the SDK model does not declare (its models allow extras silently)."""
    found: list[str] = []
    if isinstance(value, BaseModel):
        for key in value.model_extra or {}:
            found.append(f"{path}.{key}")
        for name in type(value).model_fields:
            found += _extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for k, v in enumerate(value):
            found += _extras(v, f"{path}[{k}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            found += _extras(v, f"{path}.{k}")
    return found


def assert_valid_server_event(event: dict[str, Any]) -> None:
    """Strict check against the openai SDK: validates (not `construct`), JSON-serializable,
    no undeclared fields (session objects may carry the response-only id/object/expires_at,
    and are then checked against `RealtimeSessionCreateResponse` as well)."""
    assert isinstance(event.get("event_id"), str) and event["event_id"], event
    if event["type"].startswith("omni."):
        return
    wire = json.loads(json.dumps(event))
    model = _SERVER_EVENTS.validate_python(wire)
    assert model.type == event["type"]
    extras = _extras(model, "")
    if event["type"] in ("session.created", "session.updated"):
        extras = [e for e in extras if e.removeprefix(".session.") not in _SESSION_FIELDS_BEYOND_REQUEST]
        full = RealtimeSessionCreateResponse.model_validate(wire["session"])
        assert not _extras(full, "session"), _extras(full, "session")
    assert not extras, f"{event['type']}: undeclared fields {extras}"


def pcm16_b64(samples: np.ndarray) -> str:
    pcm = np.rint(np.clip(samples, -1, 1) * 32767).astype("<i2")
    return base64.b64encode(pcm.tobytes()).decode()


def tone(seconds: float, rate: int = 24_000, amplitude: float = 0.3, freq: float = 220.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def silence(seconds: float, rate: int = 24_000) -> np.ndarray:
    return np.zeros(int(seconds * rate), dtype=np.float32)


def energy_vad(frames: np.ndarray) -> list[float]:
    """A synthetic VAD: probability 0.95 for frames with energy, 0.02 for silence."""
    rms = np.sqrt((frames.reshape(-1, 512) ** 2).mean(axis=1))
    return [0.95 if r > 0.01 else 0.02 for r in rms]


class Harness:
    """Drives one core on virtual time and records everything it emits."""

    def __init__(self, **options: Any) -> None:
        options.setdefault("new_id", SequentialIds())
        self.core = RealtimeSessionCore(CoreOptions(**options))
        self.now = 0.0
        self.events: list[dict[str, Any]] = []
        self.effects: list[Any] = []
        self._seen_ids: set[str] = set()
        self.take(self.core.start(self.now, EPOCH))

    def take(self, out: CoreOutput) -> CoreOutput:
        for event in out.events:
            assert_valid_server_event(event)
            assert event["event_id"] not in self._seen_ids, "duplicate event_id"
            self._seen_ids.add(event["event_id"])
        self.events += out.events
        self.effects += out.effects
        return out

    def send(self, event: dict[str, Any] | str) -> CoreOutput:
        raw = event if isinstance(event, str) else json.dumps(event)
        return self.take(self.core.handle_client_event(raw, self.now))

    def update(self, **session: Any) -> CoreOutput:
        return self.send({"type": "session.update", "session": {"type": "realtime", **session}})

    def push_to_talk(self) -> CoreOutput:
        return self.update(audio={"input": {"turn_detection": None}})

    def append(self, samples: np.ndarray, chunk_s: float = 0.02, rate: int = 24_000) -> CoreOutput:
        """Stream samples as 20 ms appends, running the synthetic VAD on every DetectSpeech."""
        out = CoreOutput()
        step = int(chunk_s * rate)
        for i in range(0, len(samples), step):
            self.now += chunk_s
            res = self.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(samples[i : i + step])})
            out.extend(res)
            for eff in res.effects:
                if isinstance(eff, DetectSpeech):
                    out.extend(
                        self.take(
                            self.core.feed_vad(
                                energy_vad(eff.samples), self.now, start_sample=eff.start_sample
                            )
                        )
                    )
        return out

    def started(self) -> StartResponse:
        starts = [e for e in self.effects if isinstance(e, StartResponse)]
        assert starts, "no StartResponse effect"
        return starts[-1]

    def respond(
        self, text: str = "Hello there.", audio_s: float = 0.5, rate: int = 22_050, status: str = "completed"
    ) -> CoreOutput:
        """Play the pipeline for the latest StartResponse: text, audio in 3 chunks, done."""
        rid = self.started().response_id
        out = CoreOutput()
        out.extend(self.take(self.core.on_response_text(rid, text, self.now)))
        audio = tone(audio_s, rate)
        for part in np.array_split(audio, 3):
            self.now += 0.05
            out.extend(self.take(self.core.on_response_audio(rid, part, rate, self.now)))
        out.extend(self.take(self.core.on_response_done(rid, status, now=self.now)))  # type: ignore[arg-type]
        return out


def types(out: CoreOutput | list[dict[str, Any]]) -> list[str]:
    events = out.events if isinstance(out, CoreOutput) else out
    return [e["type"] for e in events]


def collapse(kinds: list[str]) -> list[str]:
    """Collapse runs of the same delta type into one entry (order checks)."""
    out: list[str] = []
    for k in kinds:
        if not (out and out[-1] == k and k.endswith(".delta")):
            out.append(k)
    return out
