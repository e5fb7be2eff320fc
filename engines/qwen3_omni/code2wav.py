"""The code2wav stage: codec frames → 24 kHz audio, chunk by chunk, gap-free.

A chunk of frames ``[s, e)`` arrives with ``c`` frames of left context. Decoding
``context + items`` and dropping the first ``c·1920 − 555`` samples (none when ``s = 0``) yields
the full decode's samples ``[1920·s − 555, 1920·e − 555)`` (QWEN3_OMNI.md §3), so the chunks join
with no gap or overlap. They are exact while the context covers the receptive field (and always
for the chunks whose context reaches back to frame 0), approximate beyond it. With no context at
``s > 0`` the 555 samples before the seam cannot be produced and the stream has a gap there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engines.qwen3_omni.code2wav_rows import decode_windows
from engines.qwen3_omni.model import SAMPLE_RATE_OUT, ModelEngine
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, CodecCodes, Payload

PAD_SLACK = 1.25  # padded frames of a decode call / its windows' own frames, at most


@dataclass(slots=True)
class Code2WavState:
    request_id: str
    received: int = 0  # frames received so far: the absolute index of the next new frame
    samples_out: int = 0
    done: bool = False


@dataclass(slots=True)
class _Job:
    index: int  # position in the step's batch
    codes: np.ndarray  # [T, num_quantizers]: context then new frames
    trim: int  # leading samples to drop


def _frames(payloads: Sequence[Payload]) -> list[np.ndarray]:
    return [
        np.asarray(p.codes, dtype=np.int64).reshape(-1, np.asarray(p.codes).shape[-1])
        for p in payloads
        if isinstance(p, CodecCodes)
    ]


class Code2WavEngine(ModelEngine):
    """Decodes the windows of several requests, of any lengths, in one call
    (:func:`~engines.qwen3_omni.code2wav_rows.decode_windows`): every request's samples are
    bit-identical to its window decoded alone. Windows are grouped by length so that padding
    never costs more than :data:`PAD_SLACK` of the group's own frames (a 4-frame first chunk is
    not padded to a 50-frame steady one)."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.gain = float(self.options.get("gain", 1.0))
        # Frames (rows × window) per forward. Batching pays while the batch's activations stay in
        # cache: 8 first chunks (32 frames) in one call cost ~3× one, 8 steady windows (400
        # frames) cost more than 8 calls of one (loadtest.bench_code2wav).
        self.max_batch_frames = max(1, int(self.options.get("max_batch_frames", 64)))
        #: Shapes of the batched forwards of the last step (tests and metrics read it).
        self.last_batch_shapes: list[tuple[int, ...]] = []

    def start(self, request: EngineRequest) -> Code2WavState:
        return Code2WavState(request_id=request.request_id)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = [StepOutput() for _ in batch]
        jobs: list[_Job] = []
        for i, item in enumerate(batch):
            state: Code2WavState = item.state
            finished = item.upstream_finished or any(ch.finished for ch in item.chunks)
            job = self._job(i, state, item)
            if job is not None:
                jobs.append(job)
            if finished:
                state.done = True
                outputs[i].done = True
            else:  # every chunk that arrived is decoded below: nothing to do until the next one
                outputs[i].wait_for_input = True
        with torch.inference_mode():
            self._decode(jobs, batch, outputs)
        return outputs

    def _job(self, index: int, state: Code2WavState, item: StepInput) -> _Job | None:
        chunks = [ch for ch in item.chunks if ch.items]
        if not chunks:
            return None
        # Several chunks that arrived together are consecutive: decode them as one window.
        context = _frames(chunks[0].context)
        new = [f for ch in chunks for f in _frames(ch.items)]
        if not new:
            return None
        start = state.received
        n_new = sum(f.shape[0] for f in new)
        n_ctx = sum(f.shape[0] for f in context)
        state.received += n_new
        loaded = self.loaded
        trim = 0 if start == 0 or n_ctx == 0 else n_ctx * loaded.samples_per_frame - loaded.lookahead_samples
        return _Job(index=index, codes=np.concatenate(context + new, axis=0), trim=trim)

    def _decode(self, jobs: list[_Job], batch: Sequence[StepInput], outputs: list[StepOutput]) -> None:
        self.last_batch_shapes = []
        code2wav = self.loaded.model.code2wav
        for group in self._groups(jobs):
            windows = [torch.from_numpy(np.ascontiguousarray(j.codes.T)) for j in group]
            longest = max(w.shape[1] for w in windows)
            self.last_batch_shapes.append((len(group), windows[0].shape[0], longest))
            wavs = decode_windows(code2wav, windows)
            for job, wav in zip(group, wavs, strict=True):
                samples = wav.float()[job.trim :].numpy()
                if self.gain != 1.0:
                    samples = np.clip(samples * self.gain, -1.0, 1.0)
                samples = np.ascontiguousarray(samples, dtype=np.float32)
                state: Code2WavState = batch[job.index].state
                state.samples_out += samples.shape[0]
                outputs[job.index].client.append(AudioChunk(samples=samples, sample_rate=SAMPLE_RATE_OUT))

    def _groups(self, jobs: list[_Job]) -> list[list[_Job]]:
        """Jobs by length, shortest first; a group grows while its padded frames stay within
        ``max_batch_frames`` and :data:`PAD_SLACK` times its own frames."""
        groups: list[list[_Job]] = []
        group: list[_Job] = []
        frames = 0
        for job in sorted(jobs, key=lambda j: j.codes.shape[0]):
            n = job.codes.shape[0]  # the longest so far: jobs come shortest first
            padded = (len(group) + 1) * n
            if group and (padded > self.max_batch_frames or padded > PAD_SLACK * (frames + n)):
                groups.append(group)
                group, frames = [], 0
            group.append(job)
            frames += n
        if group:
            groups.append(group)
        return groups
