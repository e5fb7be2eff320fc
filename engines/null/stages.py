"""No-model engines for the ``null`` benchmark pipeline: they measure what the server costs.

Nothing here runs a model. :class:`NullAudioEngine` answers every request with a fixed
transcript, a fixed text reply and a fixed 440 Hz tone after a fixed delay, so a load test
against the ``null`` pipeline measures the transport, session and runtime overhead alone.
:class:`PassthroughEngine` forwards whatever it receives, to wire up test pipelines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, Payload, TextDelta, Transcript

Clock = Callable[[], float]

NULL_TRANSCRIPT = "null benchmark input"
NULL_REPLY = "This is the null benchmark pipeline."


def tone(duration_ms: int, sample_rate: int, freq_hz: float = 440.0, amplitude: float = 0.3) -> np.ndarray:
    """A float32 sine tone with 5 ms fades, so chunk edges never click."""
    n = round(sample_rate * duration_ms / 1000)
    t = np.arange(n, dtype=np.float64) / sample_rate
    wave = amplitude * np.sin(2.0 * math.pi * freq_hz * t)
    fade = min(n // 2, round(sample_rate * 0.005))
    if fade:
        ramp = np.linspace(0.0, 1.0, fade)
        wave[:fade] *= ramp
        wave[n - fade :] *= ramp[::-1]
    return wave.astype(np.float32)


@dataclass(slots=True)
class NullState:
    started_at: float
    audio_out: bool
    next_chunk: int = 0
    replied: bool = False


class NullAudioEngine(Engine):
    """``null.audio``: the null benchmark responder (no model).

    Per request, ``delay_ms`` (200) after admission it emits ``Transcript(transcript)`` and
    ``TextDelta(reply)``, then ``audio_ms`` (2000) of a 440 Hz tone at ``sample_rate``
    (24000) as ``AudioChunk``s of ``chunk_ms`` (100), one chunk per step; with
    ``realtime: true`` chunk *i* is not released before ``delay + i * chunk_ms``, and a step
    releases every chunk already due (a late step catches up). ``modalities`` without
    ``"audio"`` skips the tone.

    Nothing here sleeps or polls: every output carries ``not_before``, the time of the
    request's next release, so the stage steps a request only when it is due (a step before
    then returns nothing and the same hint). ``tick_ms`` (0: off) puts those times on a shared
    grid (rounded up), so requests due within one tick are stepped together: with hundreds of
    paced requests, a 10 ms tick means ~100 batched steps a second instead of one per chunk.
    The grid delays a release by less than a tick but by the same amount for every chunk of a
    request (``chunk_ms`` a multiple of ``tick_ms``), so the spacing of its chunks is exact.
    Option ``clock`` (a callable, for tests) replaces ``time.monotonic``, the runtime's clock.
    """

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.delay_s = float(self.options.get("delay_ms", 200)) / 1000
        self.audio_ms = int(self.options.get("audio_ms", 2000))
        self.chunk_ms = max(1, int(self.options.get("chunk_ms", 100)))
        self.sample_rate = int(self.options.get("sample_rate", 24000))
        self.realtime = bool(self.options.get("realtime", False))
        self.tick_s = float(self.options.get("tick_ms", 0)) / 1000
        self.transcript = str(self.options.get("transcript", NULL_TRANSCRIPT))
        self.reply = str(self.options.get("reply", NULL_REPLY))
        clock = self.options.get("clock")
        self._clock: Clock = clock if callable(clock) else time.monotonic
        self._chunks = self._make_chunks()

    def _make_chunks(self) -> list[np.ndarray]:
        audio = tone(self.audio_ms, self.sample_rate)
        step = max(1, round(self.sample_rate * self.chunk_ms / 1000))
        return [audio[i : i + step] for i in range(0, audio.size, step)]

    def start(self, request: EngineRequest) -> NullState:
        modalities = request.params.get("modalities") or ("text", "audio")
        return NullState(started_at=self._clock(), audio_out="audio" in modalities)

    def _due_at(self, state: NullState) -> float:
        due = state.started_at + self.delay_s
        if self.realtime and state.replied:
            due += state.next_chunk * self.chunk_ms / 1000
        if self.tick_s > 0:
            due = math.ceil(due / self.tick_s - 1e-6) * self.tick_s
        return due

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        now = self._clock() + _EPSILON_S
        return [self._step_one(item.state, now) for item in batch]

    def _step_one(self, state: NullState, now: float) -> StepOutput:
        if now < self._due_at(state):
            return StepOutput(not_before=self._due_at(state))
        out = StepOutput()
        if not state.replied:
            state.replied = True
            out.client += [Transcript(self.transcript), TextDelta(self.reply)]
        total = len(self._chunks) if state.audio_out else 0
        while state.next_chunk < total and now >= self._due_at(state):
            out.client.append(
                AudioChunk(samples=self._chunks[state.next_chunk], sample_rate=self.sample_rate)
            )
            state.next_chunk += 1
            if not self.realtime:
                break  # one chunk per step
        out.done = state.next_chunk >= total
        if not out.done:
            out.not_before = self._due_at(state)
        return out


_EPSILON_S = 1e-6  # a step at the due time (up to float rounding of the grid) releases


@dataclass(slots=True)
class PassthroughState:
    pending_text: str | None
    ended: bool = False


class PassthroughEngine(Engine):
    """``noop.passthrough``: forwards its inputs unchanged (no model; for test pipelines).

    Each step forwards the new items of arrived chunks and the streamed inputs, in that order,
    to downstream and, with option ``client`` (default true), to the client; a ``text`` submit
    param goes first, as one ``TextDelta``. The request ends once every upstream edge has
    finished or an ``AudioInput(final=True)`` passed through; until then it waits for input.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.to_client = bool(self.options.get("client", True))

    def start(self, request: EngineRequest) -> PassthroughState:
        text = request.params.get("text")
        return PassthroughState(pending_text=str(text) if text is not None else None)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        return [self._step_one(item) for item in batch]

    def _step_one(self, item: StepInput) -> StepOutput:
        state: PassthroughState = item.state
        forwarded: list[Payload] = []
        if state.pending_text is not None:
            forwarded.append(TextDelta(state.pending_text))
            state.pending_text = None
        for chunk in item.chunks:
            forwarded.extend(chunk.items)
        for payload in item.inputs:
            forwarded.append(payload)
            if isinstance(payload, AudioInput) and payload.final:
                state.ended = True
        state.ended = state.ended or item.upstream_finished
        return StepOutput(
            downstream=forwarded,
            client=list(forwarded) if self.to_client else [],
            done=state.ended,
            wait_for_input=not state.ended,
        )
