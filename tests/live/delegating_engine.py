"""A test engine standing in for a duplex model that delegates (no such checkpoint can be had
here; it is named as what it is): it takes a live request's 24 kHz audio like ``duplex.moshi``,
and once ``delegate_after_s`` of it has come it hands work off once (``Delegate(task)``). Text
that comes back as the delegation's result (``Conditioning`` with an ``append`` of kind
``result``, or a commentary naming a ``delegation_id``) it "speaks": ``ResponseStarted``, the
text as one ``TextDelta``, 200 ms of a 440 Hz tone, ``ResponseDone``. It also speaks every
instruction it is given back as ``instructions: <text>``, so a test sees what reached it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.capabilities import RESPONSES
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import (
    AudioChunk,
    AudioInput,
    Delegate,
    Payload,
    ResponseDone,
    ResponseStarted,
    TextDelta,
)

RATE = 24_000
TONE = (0.3 * np.sin(2 * np.pi * 440 * np.arange(RATE // 5) / RATE)).astype(np.float32)


@dataclass
class _State:
    heard: int = 0
    asked: bool = False
    say: list[str] = field(default_factory=list)


class DelegatingEngine(Engine):
    provides = frozenset({RESPONSES})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.after = int(float(self.options.get("delegate_after_s", 0.5)) * RATE)
        self.task = str(self.options.get("task", "What is the weather?"))

    def start(self, request: EngineRequest) -> _State:
        return _State()

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        return [self._one(item) for item in batch]

    def _one(self, item: StepInput) -> StepOutput:
        state: _State = item.state
        out = StepOutput(wait_for_input=True)
        for payload in item.inputs:
            if isinstance(payload, AudioInput):
                state.heard += int(np.asarray(payload.samples).size)
        for update in item.updates:
            append = update.values.get("append")
            if isinstance(append, dict) and (append.get("kind") == "result" or append.get("delegation_id")):
                state.say.append(str(append.get("text", "")))
            elif isinstance(append, dict) and append.get("kind") == "instructions":
                state.say.append(f"instructions: {append.get('text', '')}")
        if not state.asked and state.heard >= self.after:
            state.asked = True
            out.client.append(Delegate(self.task))
        for text in state.say:
            spoken: list[Payload] = [ResponseStarted(), TextDelta(text), AudioChunk(TONE.copy(), RATE)]
            out.client.extend([*spoken, ResponseDone()])
        state.say.clear()
        return out
