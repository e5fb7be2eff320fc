"""Several requests through the three Qwen3-Omni engines at once, every stage stepping all of its
live requests in one ``step`` call (what a stage with ``max_batch`` > 1 does), with requests
joining late and being cancelled mid-way. Outputs are collected per request as in
:func:`tests.engines_qwen.driver.run_pipeline`, so a request's run here compares to its run alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput
from runtime.payloads import AudioChunk, CodecCodes, TextDelta
from tests.engines_qwen.driver import Edge, Engines, Run


@dataclass
class Member:
    """One request's pipeline: its three states, edges and progress."""

    params: Mapping[str, Any]
    join_at: int = 0  # the round it is admitted in
    cancel_at: int | None = None  # the round it is cancelled in (every stage finishes it)
    states: list[Any] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    done: list[bool] = field(default_factory=lambda: [False, False, False])
    waiting: list[bool] = field(default_factory=lambda: [False, False, False])
    pending: list[list[EdgeChunk]] = field(default_factory=lambda: [[], [], []])
    run: Run = field(default_factory=Run)
    batch_sizes: list[int] = field(default_factory=list)  # size of each thinker batch it was in

    @property
    def finished(self) -> bool:
        return all(self.done)


def run_batched(engines: Engines, members: Sequence[Member]) -> list[Member]:
    stages: list[Engine] = [engines.thinker, engines.talker, engines.code2wav]
    max_batch: dict[int, int] = {0: 0, 1: 0, 2: 0}
    for round_no in range(100_000):
        for k, m in enumerate(members):
            if m.join_at == round_no:
                request = EngineRequest(request_id=f"b{k}", params=dict(m.params))
                m.states = [engine.start(request) for engine in stages]
                m.edges = [Edge(1, 1, 0), Edge(4, 25, 25)]
            if m.cancel_at == round_no and m.states and not m.finished:
                for i, engine in enumerate(stages):
                    if not m.done[i]:
                        engine.finish(m.states[i], cancelled=True)
                        m.done[i] = True
        live = [m for m in members if m.states and not m.finished]
        if not live and all(m.join_at <= round_no for m in members):
            break
        for i, engine in enumerate(stages):
            inputs: list[StepInput] = []
            owners: list[Member] = []
            for m in live:
                if m.done[i]:
                    continue
                if i > 0:
                    m.pending[i].extend(m.edges[i - 1].take(m.done[i - 1]))
                if m.waiting[i] and not m.pending[i]:
                    continue
                chunks, m.pending[i] = m.pending[i], []
                upstream_finished = i > 0 and m.done[i - 1] and m.edges[i - 1].closed
                step_input = StepInput(state=m.states[i], chunks=chunks, upstream_finished=upstream_finished)
                inputs.append(step_input)
                owners.append(m)
            if not inputs:
                continue
            max_batch[i] = max(max_batch[i], len(inputs))
            outs = engine.step(inputs)
            for m, out in zip(owners, outs, strict=True):
                if i == 0:
                    m.batch_sizes.append(len(inputs))
                m.waiting[i] = out.wait_for_input
                for payload in out.client:
                    if isinstance(payload, TextDelta):
                        m.run.text += payload.text
                    elif isinstance(payload, AudioChunk):
                        m.run.audio.append(payload.samples)
                for payload in out.downstream:
                    if isinstance(payload, CodecCodes):
                        m.run.codes.append(payload.codes)
                if i < 2:
                    m.edges[i].put(list(out.downstream))
                if out.done:
                    m.done[i] = True
                    engine.finish(m.states[i], cancelled=False)
    for m in members:
        if m.states:
            m.run.tokens = list(m.states[0].generated)
    return list(members)
