"""Driving the three Qwen3-Omni engines directly through start/step, with no orchestrator.

``run_pipeline`` interleaves the stages the way the runtime would with async_chunk edges:
thinker → talker hands over every item at once (chunk 1/1/0), talker → code2wav in chunks of
``first``/``steady`` frames with ``left_context`` frames of context. With ``full=True`` every edge
delivers one finished chunk when its upstream is done.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.qwen3_omni.stages import Code2WavEngine, TalkerEngine, ThinkerEngine
from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, CodecCodes, Payload, TextDelta

TINY = {"model": "tiny", "seed": 0}


@dataclass
class Engines:
    thinker: ThinkerEngine
    talker: TalkerEngine
    code2wav: Code2WavEngine


def make_engines(gain: float = 1.0, batch_invariant: bool = True) -> Engines:
    """The three engines on the tiny model; ``batch_invariant`` is the thinker's and the talker's
    option of that name (code2wav's output is samples: always row-exact)."""
    models = {**TINY, "batch_invariant": batch_invariant}
    engines = Engines(ThinkerEngine(models), TalkerEngine(models), Code2WavEngine({**TINY, "gain": gain}))
    for engine in (engines.thinker, engines.talker, engines.code2wav):
        engine.load()
    return engines


@dataclass
class Run:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    codes: list[np.ndarray] = field(default_factory=list)  # [1, 16] per frame
    audio: list[np.ndarray] = field(default_factory=list)  # one array per AudioChunk
    downstream_roles: list[str] = field(default_factory=list)

    @property
    def code_matrix(self) -> np.ndarray:
        return np.concatenate(self.codes, axis=0) if self.codes else np.zeros((0, 16), dtype=np.int64)

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)


class Edge:
    """The chunking policy of one edge (as CONTRACTS.md defines async_chunk and full)."""

    def __init__(self, first: int, steady: int, left_context: int, full: bool = False) -> None:
        self.first, self.steady, self.left_context, self.full = first, steady, left_context, full
        self.items: list[Payload] = []
        self.sent = 0
        self.index = 0
        self.closed = False

    def put(self, items: list[Payload]) -> None:
        self.items.extend(items)

    def take(self, upstream_done: bool) -> list[EdgeChunk]:
        chunks: list[EdgeChunk] = []
        if self.closed:
            return chunks
        if not self.full:
            while True:
                need = self.first if self.index == 0 else self.steady
                if len(self.items) - self.sent < need:
                    break
                chunks.append(self._chunk(self.sent + need, finished=False))
        if upstream_done:
            chunks.append(self._chunk(len(self.items), finished=True))
            self.closed = True
        return chunks

    def _chunk(self, end: int, finished: bool) -> EdgeChunk:
        ctx_start = max(0, self.sent - self.left_context) if not self.full else self.sent
        chunk = EdgeChunk(
            items=self.items[self.sent : end],
            context=self.items[ctx_start : self.sent],
            finished=finished,
            index=self.index,
        )
        self.sent = end
        self.index += 1
        return chunk


def _step(engine: Engine, state: Any, chunks: list[EdgeChunk], upstream_finished: bool) -> StepOutput:
    return engine.step([StepInput(state=state, chunks=chunks, upstream_finished=upstream_finished)])[0]


def run_pipeline(
    engines: Engines,
    params: Mapping[str, Any],
    *,
    full: bool = False,
    c2w_chunk: tuple[int, int, int] = (4, 25, 25),
    session_key: str | None = None,
    request_id: str = "r0",
) -> Run:
    """One request through thinker → talker → code2wav, round-robin, one step per stage per turn."""
    request = EngineRequest(request_id=request_id, params=dict(params), session_key=session_key)
    states = [engines.thinker.start(request), engines.talker.start(request), engines.code2wav.start(request)]
    stages: list[Engine] = [engines.thinker, engines.talker, engines.code2wav]
    edges = [Edge(1, 1, 0, full=full), Edge(*c2w_chunk, full=full)]
    done = [False, False, False]
    waiting = [False, False, False]
    pending: list[list[EdgeChunk]] = [[], [], []]
    run = Run()
    for _ in range(100_000):
        if all(done):
            break
        progressed = False
        for i, engine in enumerate(stages):
            if done[i]:
                continue
            if i > 0:
                pending[i].extend(edges[i - 1].take(done[i - 1]))
            if waiting[i] and not pending[i]:
                continue
            chunks, pending[i] = pending[i], []
            upstream_finished = i > 0 and done[i - 1] and edges[i - 1].closed
            out = _step(engine, states[i], chunks, upstream_finished)
            progressed = True
            waiting[i] = out.wait_for_input
            for payload in out.client:
                if isinstance(payload, TextDelta):
                    run.text += payload.text
                elif isinstance(payload, AudioChunk):
                    assert payload.sample_rate == 24_000
                    run.audio.append(payload.samples)
            for payload in out.downstream:
                if isinstance(payload, CodecCodes):
                    run.codes.append(payload.codes)
                run.downstream_roles.append(getattr(payload, "role", type(payload).__name__))
            if i < 2:
                edges[i].put(list(out.downstream))
            if out.done:
                done[i] = True
                engine.finish(states[i], cancelled=False)
        if not progressed:
            raise AssertionError("pipeline stalled: every stage waits for input")
    run.tokens = list(states[0].generated)
    return run
