"""A test engine for the live request's fault path (importable by path from a pipeline YAML).

`PoisonVad` is the real Silero VAD stage (`engines.speech.vad_stage.VadEngine`) that, as a
stand-in for a model that chokes on some input, raises on a frame whose peak is at full scale
(the test clips one burst of a session's audio to ±1), and that can be made slow. Everything
else is the real stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from engines.speech.vad_stage import VadEngine
from runtime.engine import StepInput, StepOutput
from runtime.payloads import AudioInput

POISON_PEAK = 0.999


class PoisonVad(VadEngine):
    """Option `step_delay_s`: sleep that long per step (a slower model than Silero)."""

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        time.sleep(float(self.options.get("step_delay_s", 0.0)))
        return super().step(batch)

    def check_inputs(self, item: StepInput) -> None:
        super().check_inputs(item)
        for payload in item.inputs:
            if not isinstance(payload, AudioInput):
                continue
            if float(np.max(np.abs(payload.samples), initial=0.0)) >= POISON_PEAK:
                raise RuntimeError("poisoned frame (full-scale audio)")
