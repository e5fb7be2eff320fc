"""A test responder that says what it was given: the user's text and the conversation history.

``test.history_echo`` answers ``"<text> | history: <h1> / <h2> ..."`` (the history entries as
``role:text``) word by word, then ``audio_ms`` of a tone in ``chunk_ms`` chunks, paced in real
time from ``delay_ms`` after admission. So a test sees, in the reply itself, that a restored
session still had its history, and a response lasts long enough to be interrupted.

In-process servers call :func:`register` first; a server in a subprocess runs
``python -m tests.sessions.serve_with_test_engines serve ...``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from engines.null.stages import tone
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, TextDelta
from runtime.registry import register_engine

ENGINE = "test.history_echo"
PIPELINE = Path(__file__).with_name("history_echo.yaml")


def pipeline_file(folder: Path, **options: Any) -> Path:
    """A copy of the test pipeline with engine options overridden (e.g. a longer audio_ms)."""
    spec = yaml.safe_load(PIPELINE.read_text())
    spec["stages"][0]["options"].update(options)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "history_echo.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def reply_for(params: Mapping[str, Any]) -> str:
    history = " / ".join(f"{h.get('role')}:{h.get('text')}" for h in params.get("history") or [])
    return f"{params.get('text') or ''} | history: {history or '-'}"


@dataclass(slots=True)
class EchoState:
    started_at: float
    words: list[str]
    audio: bool
    sent: int = 0  # words and chunks handed out so far
    chunks: list[np.ndarray] = field(default_factory=list)


class HistoryEchoEngine(Engine):
    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.delay_s = float(self.options.get("delay_ms", 50)) / 1000
        self.chunk_s = float(self.options.get("chunk_ms", 40)) / 1000
        rate = int(self.options.get("sample_rate", 24000))
        self.rate = rate
        audio = tone(int(self.options.get("audio_ms", 800)), rate)
        step = round(rate * self.chunk_s)
        self._chunks = [audio[i : i + step] for i in range(0, audio.size, step)]

    def start(self, request: EngineRequest) -> EchoState:
        words = reply_for(request.params).split(" ")
        words = [w if i == 0 else " " + w for i, w in enumerate(words)]
        audio = "audio" in (request.params.get("modalities") or ("text", "audio"))
        return EchoState(time.monotonic(), words, audio, chunks=self._chunks if audio else [])

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        marker = self.options.get("fail_on")  # a test's internal failure: the step raises
        for item in batch:
            if marker and item.state.words and item.state.words[0].startswith(str(marker)):
                raise RuntimeError(f"secret internal detail of {item.state.words[0]!r}")
        now = time.monotonic()
        outputs = [self._one(item.state, now) for item in batch]
        if all(not (o.client or o.done) for o in outputs):
            time.sleep(0.002)
        return outputs

    def _one(self, state: EchoState, now: float) -> StepOutput:
        total = len(state.words) + len(state.chunks)
        due = state.started_at + self.delay_s + state.sent * self.chunk_s
        if state.sent >= total or now < due:
            return StepOutput(done=state.sent >= total)
        if state.sent < len(state.words):
            out: list[Any] = [TextDelta(state.words[state.sent])]
        else:
            out = [AudioChunk(samples=state.chunks[state.sent - len(state.words)], sample_rate=self.rate)]
        state.sent += 1
        return StepOutput(client=out, done=state.sent >= total)


def register() -> None:
    register_engine(ENGINE, HistoryEchoEngine)
