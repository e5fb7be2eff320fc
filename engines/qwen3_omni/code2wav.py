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

from engines.qwen3_omni.model import SAMPLE_RATE_OUT, ModelEngine
from engines.rowbatch import RowExact
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, CodecCodes, Payload


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


def decode_rows(code2wav: Any, codes: torch.Tensor) -> torch.Tensor:
    """``code2wav(codes)`` for a batch ``[B, Q, T]`` with every row bit-identical to that row
    decoded alone: the embedding and the transformer run batched under
    :class:`~engines.rowbatch.RowExact`; the convolutional stages run per row (oneDNN picks
    another convolution algorithm for another batch size or a short window: ~1e-12 differences
    that a batched call would leave in the samples)."""
    if codes.shape[1] != code2wav.config.num_quantizers:
        raise ValueError(f"Expected {code2wav.config.num_quantizers} layer of codes, got {codes.shape[1]}")
    with RowExact():
        hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
        hidden = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state
    rows = []
    for i in range(hidden.shape[0]):
        wav = hidden[i : i + 1].clone().permute(0, 2, 1)
        for blocks in code2wav.upsample:
            for block in blocks:
                wav = block(wav)
        for block in code2wav.decoder:
            wav = block(wav)
        rows.append(wav.clamp(min=-1, max=1))
    return torch.cat(rows, dim=0)


class Code2WavEngine(ModelEngine):
    """Batches equal-length windows of several requests into one forward."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.gain = float(self.options.get("gain", 1.0))
        # Frames (rows × window) per forward: bounds the activations of batched long decodes.
        self.max_batch_frames = max(1, int(self.options.get("max_batch_frames", 400)))
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
        by_length: dict[int, list[_Job]] = {}
        for job in jobs:
            by_length.setdefault(job.codes.shape[0], []).append(job)
        code2wav = self.loaded.model.code2wav
        groups: list[list[_Job]] = []
        for same in by_length.values():
            rows = max(1, self.max_batch_frames // same[0].codes.shape[0])
            groups += [same[i : i + rows] for i in range(0, len(same), rows)]
        for group in groups:
            codes = torch.from_numpy(np.stack([j.codes.T for j in group]))  # [B, Q, T]
            self.last_batch_shapes.append(tuple(codes.shape))
            wav = decode_rows(code2wav, codes).float()[:, 0]  # [B, samples]
            for row, job in enumerate(group):
                samples = wav[row, job.trim :].numpy()
                if self.gain != 1.0:
                    samples = np.clip(samples * self.gain, -1.0, 1.0)
                samples = np.ascontiguousarray(samples, dtype=np.float32)
                state: Code2WavState = batch[job.index].state
                state.samples_out += samples.shape[0]
                outputs[job.index].client.append(AudioChunk(samples=samples, sample_rate=SAMPLE_RATE_OUT))
