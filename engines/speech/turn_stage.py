"""``speech.end_of_turn``: Smart Turn v3.2 on a voice session's live request, batched across sessions.

A stage after the VAD stage (an edge from it, beside the live ASR's): it gets every scored
16 kHz frame with its position (``AudioInput.start_sample``) and the session's ``TurnControl``
in order with it. At a candidate pause of a ``semantic_vad`` turn the session appends
``TurnControl("score_turn", {"ref", "start", "end"})`` (positions on the request's input
timeline); the stage answers with one ``TurnScore(ref, probability)``: the probability that the
speech in [start, end) (its last 8 s) ends a finished turn. The session decides from it
(``session.realtime.semantic_turn``); this stage only scores.

Every score waiting in a step goes through the model in one call, whichever sessions they
come from (the replica pool gathers the sessions with input ready, ``gather_ms``). A score
whose stretch has not all arrived yet waits for it (the VAD stage hands audio on before the
control that follows it, so this is rare). Audio is held as int16, at most ``max_audio_s``
(8 s: what the model sees) per session, ~256 KB; ``TurnControl("clear")`` forgets it (the
timeline goes on at its ``at``), and so does audio that does not continue what is held.

The edge into this stage is gated in voice-cascade (``EdgeSpec.gated``): a session's audio
comes here only while it uses ``semantic_vad`` (``session.voice.turn_feed``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.speech.held_audio import held_span
from engines.speech.smart_turn import SAMPLE_RATE, WINDOW_SAMPLES, SmartTurn
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioInput, Payload, TurnControl, TurnScore

MAX_JOBS = 4  # scores a session may have waiting (a fifth drops the oldest: the session moved on)


@dataclass(slots=True)
class TurnState:
    audio: deque[tuple[int, np.ndarray]] = field(default_factory=deque)  # (start sample, int16)
    held: int = 0  # samples held
    end: int = 0  # the sample after the last audio received
    jobs: list[TurnControl] = field(default_factory=list)  # "score_turn" waiting for its audio

    def span(self, start: int, end: int) -> np.ndarray:
        return held_span(self.audio, start, end, np.int16).astype(np.float32) / 32768.0

    def add(self, start: int, samples: np.ndarray, limit: int) -> None:
        if self.held and start != self.end:
            # Not the audio after what is held (the edge was closed between: the session left
            # semantic_vad and came back): what is held is another stretch of the timeline.
            self.audio.clear()
            self.held = 0
        pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)
        self.audio.append((start, pcm))
        self.held += len(pcm)
        self.end = start + len(pcm)
        while self.audio and self.held - len(self.audio[0][1]) >= limit:
            self.held -= len(self.audio.popleft()[1])

    def clear(self, at: int | None) -> None:
        self.audio.clear()
        self.held = 0
        self.jobs.clear()
        if at is not None:
            self.end = at


class EndOfTurnEngine(Engine):
    """``speech.end_of_turn``. Options: ``max_audio_s`` (8: what the model sees), ``threads``
    (ONNX intra-op threads, 1)."""

    batchable = True
    provides = frozenset({"end_of_turn"})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.max_audio = min(int(float(self.options.get("max_audio_s", 8)) * SAMPLE_RATE), WINDOW_SAMPLES)
        self.threads = int(self.options.get("threads", 1))
        self._model: SmartTurn | None = None
        self.scored = 0  # decisions made (all requests)

    def load(self) -> None:
        self._model = SmartTurn(threads=self.threads)
        self._model.scores([np.zeros(SAMPLE_RATE, dtype=np.float32)])  # warm: the first run is slow

    def start(self, request: EngineRequest) -> TurnState:
        if self._model is None:
            raise RuntimeError("EndOfTurnEngine.load() must run before the first request")
        return TurnState()

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        for item in batch:
            self._take(item)
        ready: list[tuple[int, TurnControl, np.ndarray]] = []
        for i, item in enumerate(batch):
            state: TurnState = item.state
            waiting = []
            for job in state.jobs:
                start, end = int(job.params.get("start", 0)), int(job.params.get("end", 0))
                if end > state.end:
                    waiting.append(job)  # its audio is still on the way
                else:
                    ready.append((i, job, state.span(max(start, end - self.max_audio), end)))
            state.jobs = waiting
        model = self._model
        assert model is not None
        began = time.perf_counter()
        probs = model.scores([audio for _, _, audio in ready]) if ready else []
        spent_ms = round((time.perf_counter() - began) * 1000)
        self.scored += len(ready)
        client: list[list[Payload]] = [[] for _ in batch]
        for (i, job, _), p in zip(ready, probs, strict=True):
            end = int(job.params.get("end", 0))
            client[i].append(TurnScore(str(job.params.get("ref", "")), p, end_sample=end))
        # Counters (per stage, on /metrics): decisions, and the wall ms of the model calls
        # (counted once, on the first request of the step that had a score).
        counters: list[dict[str, int]] = [{} for _ in batch]
        for i, out in enumerate(client):
            if out:
                counters[i] = {"decisions": len(out)}
        first = next((i for i, out in enumerate(client) if out), None)
        if first is not None:
            counters[first]["model_ms"] = spent_ms
        return [
            StepOutput(client=out, wait_for_input=True, counters=c)
            for out, c in zip(client, counters, strict=True)
        ]

    def _take(self, item: StepInput) -> None:
        state: TurnState = item.state
        for chunk in item.chunks:
            for payload in chunk.items:
                if isinstance(payload, AudioInput) and payload.start_sample is not None:
                    samples = np.asarray(payload.samples, dtype=np.float32).reshape(-1)
                    state.add(payload.start_sample, samples, self.max_audio)
                elif isinstance(payload, TurnControl) and payload.kind == "clear":
                    at = payload.params.get("at")
                    state.clear(int(at) if at is not None else None)
                elif isinstance(payload, TurnControl) and payload.kind == "score_turn":
                    state.jobs.append(payload)
                    if len(state.jobs) > MAX_JOBS:
                        state.jobs.pop(0)
