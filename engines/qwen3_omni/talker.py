"""The talker stage: one codec frame (c0 + 15 code-predictor residuals) per step.

Follows the talker-stage loop of QWEN3_OMNI.md §5: the codec embedding sum of frame t plus the
text row t (the thinker's ``text_token`` rows, then ``tts_eos`` once, then ``tts_pad``) is the
talker's next input. When the talker has caught up with the thinker it stalls
(``wait_for_input``) instead of padding, as ``generate`` would only pad after ``tts_eos``.
"""

from __future__ import annotations

import contextlib
import secrets
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from engines.qwen3_omni.batched import packable, talker_hidden, talker_prefill_hidden
from engines.qwen3_omni.model import ModelEngine
from engines.qwen3_omni.sampling import (
    SamplingParams,
    apply_repetition_penalty,
    make_generator,
    mask_tokens,
    select_token,
    select_tokens,
)
from engines.qwen3_omni.talker_prompt import special_text_rows
from engines.rowbatch import rows_exact
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.payloads import CodecCodes, Embeddings


@dataclass(slots=True)
class TalkerState:
    request_id: str
    sampling: SamplingParams
    predictor_sampling: SamplingParams
    generator: torch.Generator
    min_frames: int
    max_frames: int
    prefill: torch.Tensor | None = None
    texts: deque[tuple[torch.Tensor, bool]] = field(default_factory=deque)  # (row, is tts_eos)
    text_ended: bool = False  # tts_eos consumed: tts_pad from now on
    cache: DynamicCache | None = None
    position: int = 0
    pending: torch.Tensor | None = None  # codec embedding sum of the last frame, awaiting its text row
    hidden: torch.Tensor | None = None
    c0_history: list[int] = field(default_factory=list)
    frames: int = 0
    upstream_done: bool = False
    done: bool = False


def _as_tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    tensor = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.asarray(value))
    return tensor.to(dtype)


class TalkerEngine(ModelEngine):
    """Qwen3-Omni talker + code predictor over ``transformers``, one cache per request."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self._tts_pad: torch.Tensor | None = None
        self._banned: torch.Tensor | None = None
        self.packed_prefills = 0  # requests prefilled in a packed forward (tests read it)

    def load(self) -> None:
        loaded = self.loaded
        with torch.inference_mode():
            _bos, _eos, pad = special_text_rows(loaded)
        self._tts_pad = pad.clone()
        vocab = int(loaded.talker_config.text_config.vocab_size)
        banned = torch.zeros(vocab, dtype=torch.bool)
        # generate() suppresses [vocab - 1024, vocab) but codec EOS; codes at or above the
        # codebook would not decode either.
        banned[min(loaded.codebook_size, max(0, vocab - 1024)) :] = True
        banned[loaded.ids.codec_eos] = False
        self._banned = banned

    def start(self, request: EngineRequest) -> TalkerState:
        if self._tts_pad is None:
            self.load()
        params = request.params
        greedy = bool(params.get("greedy", self.options.get("greedy", False)))
        seed = params.get("seed")
        max_frames = int(params.get("max_frames", self.options.get("max_frames", 4096)))
        if max_frames < 1:
            raise ValueError("qwen3_omni: max_frames must be >= 1")
        return TalkerState(
            request_id=request.request_id,
            sampling=SamplingParams(
                greedy=greedy,
                temperature=float(self.options.get("temperature", 0.9)),
                top_k=int(self.options.get("top_k", 50)),
                top_p=float(self.options.get("top_p", 1.0)),
                repetition_penalty=float(self.options.get("repetition_penalty", 1.05)),
            ),
            predictor_sampling=SamplingParams(greedy=greedy, temperature=1.0, top_k=50, top_p=0.8),
            # Offset from the thinker's seed so the two streams differ yet stay reproducible.
            generator=make_generator((int(seed) + 1) if seed is not None else secrets.randbits(62)),
            min_frames=max(0, int(params.get("min_frames", self.options.get("min_frames", 0)))),
            max_frames=max_frames,
        )

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        """One frame per request. The prefills of the requests that join in this step run in one
        packed forward, the talker decode rows of every request with its next input ready in one
        batched forward, and so does the code predictor (15 of the 16 passes of a frame); every
        row bit-identical to the request alone (engines.rowbatch)."""
        outputs: list[StepOutput | None] = [None] * len(batch)
        framing: list[tuple[int, TalkerState, int]] = []
        with torch.inference_mode():
            talking: list[tuple[int, torch.Tensor]] = []
            for item in batch:
                self._ingest(item.state, item)
            self._prefill_packed([item.state for item in batch])
            for i, item in enumerate(batch):
                state: TalkerState = item.state
                out, embeds = self._advance(state)
                if embeds is not None:
                    talking.append((i, embeds))
                outputs[i] = out
            self._talk_rows([batch[i].state for i, _ in talking], [e for _, e in talking])
            choosing = [i for i in range(len(batch)) if outputs[i] is None]
            c0s = self._first_codes([batch[i].state for i in choosing])
            for i, c0 in zip(choosing, c0s, strict=True):
                if c0 is None:
                    outputs[i] = StepOutput(done=True)
                else:
                    framing.append((i, batch[i].state, c0))
            if framing:
                codes, sums = self._residuals([s for _, s, _ in framing], [c for _, _, c in framing])
                for row, (i, state, _c0) in enumerate(framing):
                    state.frames += 1
                    state.pending = sums[row : row + 1]
                    state.done = state.frames >= state.max_frames
                    outputs[i] = StepOutput(
                        downstream=[CodecCodes(codes[row : row + 1].copy())],
                        done=state.done,
                        # The next frame needs a text row not here yet: not stepped until it arrives
                        # (an empty step would only answer wait_for_input).
                        wait_for_input=not state.done and not self._text_ready(state),
                    )
        return [out if out is not None else StepOutput() for out in outputs]

    def _talk_rows(self, states: Sequence[TalkerState], embeds: Sequence[torch.Tensor]) -> None:
        """Advance each state's talker by its one input row: batched when several decode."""
        if len(states) < 2:
            for state, row in zip(states, embeds, strict=True):
                self._talk(state, row)
            return
        caches = [s.cache for s in states]
        assert all(c is not None for c in caches)
        positions = [s.position for s in states]
        hidden = talker_hidden(self.loaded, embeds, positions, caches, self.batch_invariant)  # type: ignore[arg-type]
        for i, state in enumerate(states):
            state.position += 1
            state.hidden = hidden[i : i + 1]

    def _prefill_packed(self, states: Sequence[TalkerState]) -> None:
        """Prefill every state whose prefill arrived (two or more) in one packed forward."""
        ready = [
            s
            for s in states
            if not s.done and s.cache is None and s.prefill is not None and packable(s.prefill.shape[1])
        ]
        if len(ready) < 2:
            return
        caches = [self.loaded.talker_cache() for _ in ready]
        embeds = [s.prefill for s in ready if s.prefill is not None]
        hidden = talker_prefill_hidden(self.loaded, embeds, caches, self.batch_invariant)
        for i, (state, cache) in enumerate(zip(ready, caches, strict=True)):
            state.cache = cache
            state.position = embeds[i].shape[1]
            state.hidden = hidden[i : i + 1]
            state.prefill = None
        self.packed_prefills += len(ready)

    def _ingest(self, state: TalkerState, item: StepInput) -> None:
        dtype = self.loaded.dtype
        for chunk in item.chunks:
            for payload in chunk.items:
                if not isinstance(payload, Embeddings):
                    continue
                tensor = _as_tensor(payload.tensor, dtype)
                if payload.role == "talker_prefill":
                    state.prefill = tensor
                elif payload.role in ("text_token", "tts_eos"):
                    state.texts.append((tensor.reshape(1, 1, -1), payload.role == "tts_eos"))
            if chunk.finished:
                state.upstream_done = True
        if item.upstream_finished:
            state.upstream_done = True

    @staticmethod
    def _text_ready(state: TalkerState) -> bool:
        """Whether :meth:`_next_text` has a row for the next frame now."""
        return bool(state.texts) or state.text_ended or state.upstream_done

    def _next_text(self, state: TalkerState) -> torch.Tensor | None:
        if state.texts:
            row, is_eos = state.texts.popleft()
            state.text_ended = state.text_ended or is_eos
            return row
        if state.text_ended or state.upstream_done:
            assert self._tts_pad is not None
            return self._tts_pad
        return None

    def _talk(self, state: TalkerState, embeds: torch.Tensor) -> None:
        assert state.cache is not None
        n = embeds.shape[1]
        positions = torch.arange(state.position, state.position + n).view(1, 1, -1).expand(4, 1, -1)
        out = self.loaded.model.talker.model(
            inputs_embeds=embeds, position_ids=positions, cache=state.cache, use_cache=True
        )
        state.position += n
        state.hidden = out.last_hidden_state[:, -1:]

    def _advance(self, state: TalkerState) -> tuple[StepOutput | None, torch.Tensor | None]:
        """(an output, None) when this step ends here; else (None, the decode row to feed first,
        or None when the hidden state is ready)."""
        if state.done:
            return StepOutput(done=True), None
        if state.cache is None:
            if state.prefill is None:
                out = StepOutput(done=True) if state.upstream_done else StepOutput(wait_for_input=True)
                return out, None
            state.cache = self.loaded.talker_cache()
            self._talk(state, state.prefill)
            state.prefill = None
        elif state.pending is not None:
            text = self._next_text(state)
            if text is None:
                return StepOutput(wait_for_input=True), None
            row = state.pending + text
            state.pending = None
            return None, row
        return None, None  # the hidden state is ready: sample this frame

    def _first_codes(self, states: Sequence[TalkerState]) -> list[int | None]:
        """:meth:`_first_code` of every state: the codec head over all rows in one row-exact
        product, each row's repetition penalty on its own row, the suppression of all rows in
        one masked_fill and the greedy rows' choice in one argmax (every row's bits its own)."""
        if len(states) < 2:
            return [self._first_code(state) for state in states]
        loaded = self.loaded
        hiddens = [s.hidden for s in states]
        assert all(h is not None for h in hiddens)
        hidden = torch.cat(hiddens, dim=0)  # type: ignore[arg-type]
        with rows_exact(self.batch_invariant):
            logits = loaded.model.talker.codec_head(hidden)
        logits = logits.reshape(len(states), -1).float()
        rows = [
            apply_repetition_penalty(logits[b], s.c0_history, s.sampling.repetition_penalty)
            for b, s in enumerate(states)
        ]
        banned = self._banned
        if banned is not None:
            mask = banned.expand(len(states), -1)
            early = [b for b, s in enumerate(states) if s.frames < s.min_frames]
            if early:
                mask = mask.clone()
                mask[early, loaded.ids.codec_eos] = True
            logits = torch.stack(rows).masked_fill(mask, float("-inf"))
        else:
            logits = torch.stack(rows)
        picked = select_tokens(logits, [s.sampling for s in states], [s.generator for s in states])
        codes: list[int | None] = []
        for state, c0 in zip(states, picked, strict=True):
            state.c0_history.append(c0)
            if c0 == loaded.ids.codec_eos:
                state.done = True
                codes.append(None)
            else:
                codes.append(c0)
        return codes

    def _first_code(self, state: TalkerState) -> int | None:
        """c0 from the codec head (repetition penalty, suppression); None at codec EOS."""
        loaded = self.loaded
        talker = loaded.model.talker
        assert state.hidden is not None
        logits = talker.codec_head(state.hidden).reshape(-1).float()
        logits = apply_repetition_penalty(logits, state.c0_history, state.sampling.repetition_penalty)
        banned = self._banned
        if state.frames < state.min_frames and banned is not None:
            banned = banned.clone()
            banned[loaded.ids.codec_eos] = True
        logits = mask_tokens(logits, banned)
        c0 = select_token(logits, state.sampling, state.generator)
        state.c0_history.append(c0)
        if c0 == loaded.ids.codec_eos:
            state.done = True
            return None
        return c0

    def _residuals(
        self, states: Sequence[TalkerState], c0s: Sequence[int]
    ) -> tuple[np.ndarray, torch.Tensor]:
        """c1..c_{N-1} of every row from the code predictor, and each frame's codec embedding sum
        [B, 1, D]. The predictor starts a fresh cache every frame, so every row has the same
        positions and cache length: one batched cache, and each attention a plain batched
        ``sdpa`` whose rows keep their bits (its CPU kernel runs every (row, head) alone, with
        blocks sized by the lengths only), instead of one ``sdpa`` per row and layer (15 passes of
        a frame: the per-row calls were most of a batched frame's overhead). The products still
        run per row under :class:`~engines.rowbatch.RowExact` (``batch_invariant``, the default)."""
        loaded = self.loaded
        talker = loaded.model.talker
        predictor = talker.code_predictor
        hidden = torch.cat([s.hidden for s in states if s.hidden is not None], dim=0)
        first = talker.get_input_embeddings()(torch.tensor([[c] for c in c0s]))
        embeds = predictor.get_input_embeddings()
        batch = len(states)
        cache = loaded.predictor_cache()
        exact = rows_exact(self.batch_invariant) if batch > 1 else contextlib.nullcontext()
        sampling = [s.predictor_sampling for s in states]
        generators = [s.generator for s in states]
        with exact:
            prefix = torch.cat([hidden, first], dim=1)
            out = predictor(inputs_embeds=prefix, cache=cache, use_cache=True)
            codes = [list(c0s)]
            rows = [first]
            groups = loaded.num_code_groups
            for g in range(1, groups):
                logits = out.logits[:, -1]
                step = select_tokens(logits, sampling, generators)
                codes.append(step)
                code_t = torch.tensor([[c] for c in step])
                rows.append(embeds[g - 1](code_t))
                if g < groups - 1:
                    out = predictor(input_ids=code_t, generation_steps=g, cache=cache, use_cache=True)
        # One reduction over the stacked rows, as generate() sums them (same rounding).
        total = torch.cat(rows, dim=1).sum(1, keepdim=True)
        return np.asarray(codes, dtype=np.int64).T.copy(), total
