"""``speech.vad``: Silero VAD as a pipeline stage, batched across sessions.

A voice session's live request enters here: the session appends its microphone audio
(``AudioInput``, 16 kHz) and gets back one ``VoiceActivity`` per step with the speech
probability of every whole 32 ms frame that arrived, in order. Turn-taking on those
probabilities (threshold, silence, prefix padding) stays in the session core, which owns the
audio timeline and the protocol's turn settings.

Why a stage: the replica pool batches the frames of every session that has one ready into one
step, and a step advances all of them through Silero together (one ONNX call per round of
frames, :func:`~engines.speech.vad.speech_probs_across_streams`), on the stage's worker
thread. This replaced a hand-made batching runtime in the session layer and a model loaded by
the web layer. ``TurnControl("clear")`` resets the stream (audio after it does not continue
the audio before) and forgets audio not scored yet, as the input buffer does.

Downstream (to a live ASR stage, when the pipeline has an edge from here): the scored audio
with its position (``AudioInput.start_sample``), its ``VoiceActivity``, and every
``TurnControl`` in the order it came, so the next stage sees the same timeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.speech.vad import FRAME_SAMPLES, SAMPLE_RATE, SileroVad, VadStream, speech_probs_across_streams
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioInput, Payload, TurnControl, VoiceActivity


@dataclass(slots=True)
class VadState:
    stream: VadStream
    pending: list[np.ndarray] = field(default_factory=list)  # samples short of a whole frame
    next_sample: int = 0  # input-timeline sample of the next frame to score


class VadEngine(Engine):
    """``speech.vad``: speech probabilities of a live request's audio. Options: none."""

    batchable = True
    provides = frozenset({"voice_activity"})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self._model: SileroVad | None = None

    def load(self) -> None:
        self._model = SileroVad()

    def start(self, request: EngineRequest) -> VadState:
        if self._model is None:
            raise RuntimeError("VadEngine.load() must run before the first request")
        return VadState(self._model.new_stream())

    def check_inputs(self, item: StepInput) -> None:
        """Raise on input this stage cannot take, before any request's state changes (a failed
        batch is re-stepped request by request: the others must not see their audio twice)."""
        for payload in item.inputs:
            if isinstance(payload, AudioInput) and payload.sample_rate != SAMPLE_RATE:
                raise ValueError(f"speech.vad takes {SAMPLE_RATE} Hz audio, got {payload.sample_rate}")

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        for item in batch:
            self.check_inputs(item)
        frames: list[np.ndarray] = []  # per request: [N, 512]
        starts: list[int] = []
        controls: list[list[TurnControl]] = []
        for item in batch:
            state: VadState = item.state
            forward: list[TurnControl] = []
            controls.append(forward)
            for payload in item.inputs:
                if isinstance(payload, TurnControl) and payload.kind == "clear":
                    state.stream.reset()
                    state.next_sample += sum(len(p) for p in state.pending)
                    state.pending.clear()
                    # Where the timeline goes on: the audio before it was dropped unscored.
                    forward.append(TurnControl("clear", params={**payload.params, "at": state.next_sample}))
                elif isinstance(payload, TurnControl):
                    forward.append(payload)
                elif isinstance(payload, AudioInput):
                    state.pending.append(np.asarray(payload.samples, dtype=np.float32).reshape(-1))
            audio = np.concatenate(state.pending) if state.pending else np.zeros(0, dtype=np.float32)
            whole = len(audio) // FRAME_SAMPLES * FRAME_SAMPLES
            state.pending = [audio[whole:]] if whole < len(audio) else []
            frames.append(audio[:whole].reshape(-1, FRAME_SAMPLES))
            starts.append(state.next_sample)
            state.next_sample += whole
        probs = self._score(batch, frames)
        outputs = []
        for start, p, audio, control in zip(starts, probs, frames, controls, strict=True):
            activity: list[Payload] = [VoiceActivity(start, p)] if p else []
            downstream: list[Payload] = list(control)
            if p:
                downstream += [AudioInput(audio.reshape(-1), SAMPLE_RATE, start_sample=start), *activity]
            outputs.append(StepOutput(client=activity, downstream=downstream, wait_for_input=True))
        return outputs

    def _score(self, batch: Sequence[StepInput], frames: list[np.ndarray]) -> list[list[float]]:
        """Advance every stream frame by frame, all streams with a k-th frame in one call."""
        model = self._model
        assert model is not None
        probs: list[list[float]] = [[] for _ in batch]
        rounds = max((len(f) for f in frames), default=0)
        for k in range(rounds):
            rows = [i for i, f in enumerate(frames) if len(f) > k]
            streams = [batch[i].state.stream for i in rows]
            got = speech_probs_across_streams(model, streams, np.stack([frames[i][k] for i in rows]))
            for i, p in zip(rows, got, strict=True):
                probs[i].append(p)
        return probs
