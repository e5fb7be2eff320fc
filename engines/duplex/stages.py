"""``duplex.moshi``: a native full-duplex speech model (Moshi family) as one frame-synchronous stage.

One live request is one conversation. The session appends the user's microphone audio with
``append_input(AudioInput(samples, 24000))`` as it arrives; every 80 ms frame of it is
encoded by Mimi, stepped through the temporal + depth transformers together with the frames
of every other session due in the same step, and the model's own frame (one text token + 8
audio codes) is decoded back to 80 ms of 24 kHz audio. The model decides when it speaks: its
text stream marks stretches of speech (:mod:`engines.duplex.text`), and the engine emits
``ResponseStarted``, the stretch's ``TextDelta``/``AudioChunk`` payloads, then ``ResponseDone``
(``completed`` when the model fell silent, ``incomplete`` when ``max_response_frames`` cut it,
``cancelled`` when the request ended mid-stretch): the "responses" capability of the live
voice request contract (docs/CONTRACTS.md). Between stretches nothing goes out unless ``stream_silence`` is
set (then every frame's audio does: a client that plays the raw duplex stream).

Clock: a frame is stepped as soon as 1,920 samples of it are buffered (the user's audio is
the clock, so a client streaming a file runs the model faster than real time, one frame a
step); when the user's audio stops for ``idle_grace_ms`` past a frame's time, the model is
stepped on silence every 80 ms, so it can keep talking while the user is quiet, for up to
``idle_stop_s`` (5 s) without any input: then it pauses until audio comes again (a client that
went away, or stopped streaming, costs no model time). Audio more
than ``max_buffer_s`` ahead of the model fails the request with a clear error (bounded per
session). ``AudioInput(final=True)`` ends the request once its buffered frames are stepped.

Options: ``model`` (``tiny`` or a local checkpoint directory, see :mod:`engines.duplex.config`),
``seed``, ``context`` (frames of temporal KV: 250 = 20 s; Moshi 3000), ``max_sessions``
(KV slots, one per live request; a request past them fails with a clear error),
``acoustic_delay`` (1), sampling (``text_temperature``, ``text_top_k``,
``audio_temperature``, ``audio_top_k``, ``text_pad_bias``: a silence prior for random
weights only, 0 for real ones), ``end_pad_frames``, ``max_response_frames``,
``idle_grace_ms``, ``idle_stop_s``, ``max_buffer_s``, ``stream_silence``, ``threads`` (torch intra-op
threads of the worker, 1 by default so a step does not fight the event loop for cores).
Submit params: ``seed`` (per-session sampling seed). ``update(Conditioning)`` values are
accepted and ignored (the base Moshi model takes no text prompt).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engines.duplex.codec import MimiStreams
from engines.duplex.config import NUM_CODEBOOKS, build_model
from engines.duplex.lm import FrameLM, Sampling
from engines.duplex.text import SpeechStretches, TextPieces
from runtime.capabilities import RESPONSES
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, Payload, ResponseDone, ResponseStarted, TextDelta

SAMPLE_RATE = 24000


@dataclass(slots=True)
class DuplexState:
    """One live conversation: its KV slot, input buffer, sampler and speech stretches."""

    slot: int
    generator: torch.Generator
    stretches: SpeechStretches
    buffered: list[np.ndarray] = field(default_factory=list)
    buffered_samples: int = 0
    frames: int = 0  # model frames stepped
    last_step: float = 0.0
    last_input: float = 0.0  # when audio last arrived
    on_silence: bool = False  # the last step ran on silence (the next is due one frame later)
    ending: bool = False  # AudioInput(final=True) seen
    released: bool = False

    def take_frame(self, size: int) -> np.ndarray | None:
        if self.buffered_samples < size:
            return None
        joined = np.concatenate(self.buffered) if len(self.buffered) > 1 else self.buffered[0]
        frame, rest = joined[:size], joined[size:]
        self.buffered = [rest] if rest.size else []
        self.buffered_samples = int(rest.size)
        return frame


class DuplexEngine(Engine):
    """The Moshi-family full-duplex model over ``transformers``' Moshi and Mimi classes."""

    batchable = True
    provides = frozenset({RESPONSES})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        o = self.options
        self.model_name = str(o.get("model", "tiny"))
        self.seed = int(o.get("seed", 0))
        self.context = int(o.get("context", 250))
        self.max_sessions = int(o.get("max_sessions", 64))
        self.acoustic_delay = int(o.get("acoustic_delay", 1))
        self.sampling = Sampling(
            text_temperature=float(o.get("text_temperature", 0.7)), text_top_k=int(o.get("text_top_k", 25)),
            audio_temperature=float(o.get("audio_temperature", 0.8)),
            audio_top_k=int(o.get("audio_top_k", 250)), text_pad_bias=float(o.get("text_pad_bias", 0.0)),
        )
        self.end_pad_frames = int(o.get("end_pad_frames", 6))
        self.max_response_frames = int(o.get("max_response_frames", 250))
        self.idle_grace_s = float(o.get("idle_grace_ms", 120)) / 1000
        self.idle_stop_s = float(o.get("idle_stop_s", 5))
        self.max_buffer_s = float(o.get("max_buffer_s", 10))
        self.stream_silence = bool(o.get("stream_silence", False))
        self.threads = int(o.get("threads", 1))
        clock = o.get("clock")
        self._clock: Callable[[], float] = clock if callable(clock) else time.monotonic
        self._lm: FrameLM | None = None
        self._codec: MimiStreams | None = None
        self._text: TextPieces | None = None
        self._free: list[int] = []

    # -- lifecycle ---------------------------------------------------------------------------

    def load(self) -> None:
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        model, _ = build_model(self.model_name, seed=self.seed, context=self.context)
        self._codec = MimiStreams(
            model.audio_encoder, slots=self.max_sessions, num_codebooks=NUM_CODEBOOKS
        )
        if self._codec.sample_rate != SAMPLE_RATE:
            raise ValueError(f"duplex engine expects a 24 kHz Mimi (got {self._codec.sample_rate})")
        self._lm = FrameLM(
            model, slots=self.max_sessions, context=self.context, acoustic_delay=self.acoustic_delay,
            sampling=self.sampling,
        )
        self._text = TextPieces.for_model(self.model_name)
        self._free = list(range(self.max_sessions - 1, -1, -1))

    @property
    def frame_size(self) -> int:
        return self._ready()[1].frame_size

    def _ready(self) -> tuple[FrameLM, MimiStreams, TextPieces]:
        if self._lm is None or self._codec is None or self._text is None:
            self.load()
        assert self._lm is not None and self._codec is not None and self._text is not None
        return self._lm, self._codec, self._text

    def start(self, request: EngineRequest) -> DuplexState:
        lm, codec, _ = self._ready()
        if not self._free:
            raise RuntimeError(f"duplex engine is full: all {self.max_sessions} session slots are in use")
        slot = self._free.pop()
        lm.reset(slot)
        codec.reset(slot)
        seed = int(request.params.get("seed", self.seed))
        return DuplexState(
            slot=slot, generator=torch.Generator().manual_seed(seed),
            stretches=SpeechStretches(
                end_pad_frames=self.end_pad_frames, max_frames=self.max_response_frames
            ),
            last_step=self._clock(), last_input=self._clock(),
        )

    def finish(self, state: Any, *, cancelled: bool) -> None:
        if isinstance(state, DuplexState) and not state.released:
            state.released = True
            self._free.append(state.slot)

    # -- stepping ----------------------------------------------------------------------------

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        lm, codec, text = self._ready()
        now = self._clock()
        frame_s = codec.frame_size / SAMPLE_RATE
        outputs = [StepOutput() for _ in batch]
        rows: list[int] = []
        frames: list[np.ndarray] = []
        for item in batch:
            # Bad input raises before any state changes: the stage then steps each request of
            # the batch alone, and the good ones must not see their inputs twice.
            self._check(item.state, item.inputs)
        for i, item in enumerate(batch):
            state: DuplexState = item.state
            if self._absorb(state, item.inputs):
                state.last_input = now
            frame = state.take_frame(codec.frame_size)
            if frame is not None:
                state.on_silence = False
            elif self._steps_on_silence(state, now, frame_s):
                frame = np.zeros(codec.frame_size, dtype=np.float32)  # the user is quiet: step on silence
                state.on_silence = True
            if frame is not None:
                rows.append(i)
                frames.append(frame)
        if rows:
            self._run(batch, outputs, rows, frames, lm, codec, text, now)
        for item, out in zip(batch, outputs, strict=True):
            self._pace(item.state, out, codec.frame_size, frame_s)
        return outputs

    def _silence_due(self, state: DuplexState, frame_s: float) -> float:
        """When the next frame runs on silence: the user's audio is `idle_grace` late, then
        every frame (80 ms) while it stays away."""
        return state.last_step + frame_s + (0.0 if state.on_silence else self.idle_grace_s)

    def _steps_on_silence(self, state: DuplexState, now: float, frame_s: float) -> bool:
        if state.ending or now - state.last_input > self.idle_stop_s:
            return False
        return now >= self._silence_due(state, frame_s)

    def _check(self, state: DuplexState, inputs: list[Payload]) -> None:
        """Raise for input this request cannot take (changes nothing)."""
        total = state.buffered_samples
        for payload in inputs:
            if not isinstance(payload, AudioInput):
                continue  # control inputs have no meaning to a model that owns its turns
            if payload.sample_rate != SAMPLE_RATE:
                raise ValueError(
                    f"duplex input must be {SAMPLE_RATE} Hz audio (got {payload.sample_rate} Hz)"
                )
            total += int(np.asarray(payload.samples).size)
        if total > self.max_buffer_s * SAMPLE_RATE:
            raise ValueError(
                f"input audio is {total / SAMPLE_RATE:.1f} s ahead of the model "
                f"(at most {self.max_buffer_s:g} s): send it in real time"
            )

    def _absorb(self, state: DuplexState, inputs: list[Payload]) -> bool:
        """Buffer the audio inputs (checked); True if any audio came."""
        got = False
        for payload in inputs:
            if not isinstance(payload, AudioInput):
                continue
            samples = np.asarray(payload.samples, dtype=np.float32).reshape(-1)
            if samples.size:
                got = True
                state.buffered.append(samples)
                state.buffered_samples += int(samples.size)
            state.ending = state.ending or payload.final
        return got

    def _run(
        self, batch: Sequence[StepInput], outputs: list[StepOutput], rows: list[int],
        frames: list[np.ndarray], lm: FrameLM, codec: MimiStreams, text: TextPieces, now: float,
    ) -> None:
        states: list[DuplexState] = [batch[i].state for i in rows]
        slots = torch.tensor([s.slot for s in states], dtype=torch.long)
        with torch.inference_mode():
            user_codes = codec.encode(slots, torch.from_numpy(np.stack(frames)))
            out = lm.step(slots, user_codes, [s.generator for s in states])
            ready = out.ready.nonzero()[:, 0]
            audio = codec.decode(slots[ready], out.codes[ready]) if ready.numel() else None
        pcm = np.clip(audio.numpy(), -1.0, 1.0) if audio is not None else None
        for n, r in enumerate(ready.tolist()):
            assert pcm is not None
            state = states[r]
            self._emit(state, int(out.text[r]), pcm[n], outputs[rows[r]].client, text)
        for state in states:
            state.frames += 1
            state.last_step = now

    def _emit(
        self, state: DuplexState, token: int, pcm: np.ndarray, client: list[Payload], text: TextPieces
    ) -> None:
        step = state.stretches.push(token)
        if step.started:
            client.append(ResponseStarted(modalities=("text", "audio")))
        if step.speaking or self.stream_silence:
            piece = text.piece(token) if step.speaking else ""
            if piece:
                client.append(TextDelta(piece))
            client.append(AudioChunk(samples=pcm.astype(np.float32, copy=True), sample_rate=SAMPLE_RATE))
        if step.stopped:
            client.append(ResponseDone(status="incomplete" if step.cut else "completed"))

    def _pace(self, state: DuplexState, out: StepOutput, frame_size: int, frame_s: float) -> None:
        if state.ending and state.buffered_samples < frame_size:
            if state.stretches.close():  # the conversation ends mid-stretch
                out.client.append(ResponseDone(status="cancelled"))
            out.done = True
            return
        if state.buffered_samples >= frame_size:
            return  # another frame is waiting: step again at once
        if self._clock() - state.last_input > self.idle_stop_s:
            out.wait_for_input = True  # paused: no input for idle_stop_s
            return
        out.not_before = self._silence_due(state, frame_s)
