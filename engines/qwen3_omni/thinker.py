"""The thinker stage: prompt prefill, then one reply token per step.

Client output: ``TextDelta`` (UTF-8 safe). Downstream (to the talker), as ``Embeddings``:
``talker_prefill`` once the first token exists, one ``text_token`` per later token that will be
fed back (the EOS, and the last token when ``max_tokens`` cuts the reply, never are, exactly as in
``generate``), then ``tts_eos``.
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicCache

from engines.qwen3_omni.batched import packable, thinker_logits, thinker_prefill_logits
from engines.qwen3_omni.model import ModelEngine
from engines.qwen3_omni.prompt import Prompt, build_prompt
from engines.qwen3_omni.sampling import (
    SamplingParams,
    make_generator,
    mask_tokens,
    select_token,
    select_tokens,
)
from engines.qwen3_omni.session_kv import SessionEntry, common_prefix
from engines.qwen3_omni.talker_prompt import (
    project_text,
    resolve_speaker,
    special_text_rows,
    talker_prefill,
    thinker_embed,
    thinker_embed_rows,
)
from engines.qwen3_omni.tokenizer import IncrementalDecoder
from engines.rowbatch import rows_exact
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.kv import SessionKVStore, current_kv_store
from runtime.payloads import Embeddings, Payload, TextDelta


def to_payload_array(tensor: torch.Tensor) -> np.ndarray:
    """Float32 numpy (zero-copy for float32 CPU tensors) so any connector can move it."""
    return tensor.detach().to(torch.float32).cpu().numpy()


@dataclass(slots=True)
class ThinkerState:
    request_id: str
    session_key: str | None
    prompt: Prompt
    cache: DynamicCache
    keys: list[int]  # one per position in ``cache``
    accept_hidden: dict[int, torch.Tensor]
    sampling: SamplingParams
    generator: torch.Generator
    max_tokens: int
    min_tokens: int
    speaker_id: int
    audio_out: bool
    decoder: IncrementalDecoder
    reused_tokens: int = 0
    prefill_tokens: int = 0
    generated: list[int] = field(default_factory=list)
    next_embed: torch.Tensor | None = None  # embedding of generated[-1], fed at the next step
    talker_started: bool = False
    finished: bool = False
    broken: bool = False  # a step raised: the cache may hold a partial update, never retain it


def _int_param(params: Mapping[str, Any], options: Mapping[str, Any], name: str, default: int) -> int:
    value = params.get(name, options.get(name, default))
    return int(value)


class ThinkerEngine(ModelEngine):
    """Qwen3-Omni thinker over ``transformers`` with its own KV cache per request or session."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        budget = self.options.get("session_kv_bytes")
        self._private_store = SessionKVStore(int(budget)) if budget is not None else None
        #: Counters of the last request that started (tests read them), and totals.
        self.stats: dict[str, int] = {
            "prefill_tokens": 0,
            "reused_tokens": 0,
            "requests": 0,
            "packed_prefills": 0,
        }
        self._tts_eos: np.ndarray | None = None
        self._eos_banned: torch.Tensor | None = None
        self._special: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def sessions(self) -> SessionKVStore:
        """Where session caches live: the private store, else the replica's (thread-bound) one."""
        return self._private_store if self._private_store is not None else current_kv_store()

    # -- request lifecycle -------------------------------------------------------------------

    def start(self, request: EngineRequest) -> ThinkerState:
        loaded = self.loaded
        params = request.params
        prompt = build_prompt(loaded, params)
        greedy = bool(params.get("greedy", self.options.get("greedy", False)))
        seed = params.get("seed")
        sampling = SamplingParams(
            greedy=greedy,
            temperature=float(params.get("temperature", self.options.get("temperature", 0.7))),
            top_k=int(params.get("top_k", self.options.get("top_k", 20))),
            top_p=float(params.get("top_p", self.options.get("top_p", 0.8))),
        )
        modalities = params.get("modalities") or ("text", "audio")
        max_tokens = _int_param(params, self.options, "max_tokens", 512)
        if max_tokens < 1:
            raise ValueError("qwen3_omni: max_tokens must be >= 1")
        state = ThinkerState(
            request_id=request.request_id,
            session_key=request.session_key,
            prompt=prompt,
            cache=loaded.thinker_cache(),
            keys=[],
            accept_hidden={},
            sampling=sampling,
            generator=make_generator(int(seed) if seed is not None else secrets.randbits(62)),
            max_tokens=max_tokens,
            min_tokens=max(0, _int_param(params, self.options, "min_tokens", 0)),
            speaker_id=resolve_speaker(loaded, params.get("speaker", self.options.get("speaker"))),
            audio_out="audio" in modalities,
            decoder=IncrementalDecoder(loaded.tokenizer),  # type: ignore[arg-type]
        )
        if request.session_key is not None:
            self._reuse_session(state)
        state.prefill_tokens = len(prompt.ids) - len(state.keys)
        self.stats["prefill_tokens"] = state.prefill_tokens
        self.stats["reused_tokens"] = state.reused_tokens
        self.stats["requests"] += 1
        return state

    def _reuse_session(self, state: ThinkerState) -> None:
        assert state.session_key is not None
        entry = self.sessions.pop(state.session_key)  # a concurrent turn of the session starts cold
        if not isinstance(entry, SessionEntry):
            return
        keys = state.prompt.keys
        # Keep at least one prompt token to prefill: the first reply token needs its logits.
        keep = min(common_prefix(entry.keys, keys), len(keys) - 1)
        pad = self.loaded.ids.audio_pad
        new_pads = sum(1 for t in state.prompt.ids[keep:] if t == pad)
        if keep <= 0 or new_pads not in (0, state.prompt.audio_tokens):
            return  # nothing shared, or an audio clip would be split across the seam
        drop = entry.cache.get_seq_length() - keep
        if drop > 0:
            entry.cache.crop(-drop)
        state.cache = entry.cache
        state.keys = list(keys[:keep])
        state.accept_hidden = {p: h for p, h in entry.accept_hidden.items() if p < keep}
        state.reused_tokens = keep

    def finish(self, state: Any, *, cancelled: bool) -> None:
        if not isinstance(state, ThinkerState) or state.session_key is None or state.broken:
            return
        if state.cache.get_seq_length() != len(state.keys) or not state.keys:
            return
        entry = SessionEntry(cache=state.cache, keys=state.keys, accept_hidden=state.accept_hidden)
        self.sessions.put(state.session_key, entry, nbytes=entry.nbytes)

    # -- compute -------------------------------------------------------------------------------

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        """Every request past its prefill decodes in one batched forward, and the new requests'
        text prompts prefill together in one packed forward (continuous batching: requests join
        in the step they arrive and leave when done); the rest (audio prompts, prompts on a
        reused session cache, a lone prefill) one by one. Every row is bit-identical to the
        request stepped alone."""
        outputs: list[StepOutput | None] = [None] * len(batch)
        decoding = [i for i, item in enumerate(batch) if item.state.generated and not item.state.finished]
        if len(decoding) < 2:
            decoding = []
        packing = [i for i, item in enumerate(batch) if self._packable(item.state)]
        if len(packing) < 2:
            packing = []
        with torch.inference_mode():
            if packing:
                states = [batch[i].state for i in packing]
                logits = self._batch_guarded(states, self._prefill_packed)
                self.stats["packed_prefills"] += len(states)
                for i, out in zip(packing, self._select_rows(states, logits), strict=True):
                    outputs[i] = out
            for i, item in enumerate(batch):
                if i not in decoding and outputs[i] is None:
                    outputs[i] = self._guarded(item.state, self._advance)
            if decoding:
                states = [batch[i].state for i in decoding]
                logits = self._batch_guarded(states, self._decode_batch)
                for i, out in zip(decoding, self._select_rows(states, logits), strict=True):
                    outputs[i] = out
        return [out if out is not None else StepOutput() for out in outputs]

    def _select_rows(self, states: list[ThinkerState], logits: torch.Tensor) -> list[StepOutput]:
        """:meth:`_select` of every row of a batched forward's logits ``[B, vocab]``: the EOS
        ban of the rows under ``min_tokens``, the greedy rows' argmax, the next embeddings and
        their talker projections each in one call for all rows (every row's bits its own)."""
        try:
            banned = [len(s.generated) < s.min_tokens for s in states]
            if any(banned):
                rows = torch.tensor(banned).unsqueeze(1)
                logits = logits.masked_fill(rows & self._eos_mask(logits.shape[-1]), float("-inf"))
            tokens = select_tokens(logits, [s.sampling for s in states], [s.generator for s in states])
            embeds = thinker_embed_rows(self.loaded, tokens)
            projected = None
            if any(s.audio_out and s.generated for s in states):
                with rows_exact(self.batch_invariant):
                    projected = project_text(self.loaded, embeds)
        except BaseException:
            for state in states:
                state.broken = True
            raise
        outputs = []
        for row, (state, token) in enumerate(zip(states, tokens, strict=True)):
            emit = functools.partial(
                self._emit,
                token=token,
                embed=embeds[row : row + 1],
                projected=projected[row : row + 1] if projected is not None else None,
            )
            outputs.append(self._guarded(state, emit))
        return outputs

    def _eos_mask(self, vocab: int) -> torch.Tensor:
        """A bool row over the vocabulary, True at the thinker's stop tokens (kept once)."""
        mask = self._eos_banned
        if mask is None or mask.shape[-1] != vocab:
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[list(self.loaded.ids.eos)] = True
            self._eos_banned = mask
        return mask

    @staticmethod
    def _batch_guarded(
        states: list[ThinkerState], fn: Callable[[list[ThinkerState]], torch.Tensor]
    ) -> torch.Tensor:
        try:
            return fn(states)
        except BaseException:
            for state in states:
                state.broken = True
            raise

    def _packable(self, state: ThinkerState) -> bool:
        """A fresh request whose whole prompt is text (no audio features to merge, no reused
        session cache): its prefill may share a packed forward."""
        if state.generated or state.finished or state.keys or state.prompt.input_features is not None:
            return False
        return packable(len(state.prompt.ids))

    def _prefill_packed(self, states: list[ThinkerState]) -> torch.Tensor:
        embeds = []
        for state in states:
            embeds.append(thinker_embed(self.loaded, state.prompt.ids))
            state.keys.extend(state.prompt.keys)
        return thinker_prefill_logits(self.loaded, embeds, [s.cache for s in states], self.batch_invariant)

    @staticmethod
    def _guarded(state: ThinkerState, fn: Callable[[ThinkerState], StepOutput]) -> StepOutput:
        try:
            return fn(state)
        except BaseException:
            state.broken = True
            raise

    def _advance(self, state: ThinkerState) -> StepOutput:
        if state.finished:
            return StepOutput(done=True)
        logits = self._prefill(state) if not state.generated else self._decode(state)
        return self._select(state, logits)

    def _select(self, state: ThinkerState, logits: torch.Tensor) -> StepOutput:
        k = len(state.generated)
        if k < state.min_tokens:
            logits = mask_tokens(logits, self._eos_mask(logits.shape[-1]))
        token = select_token(logits, state.sampling, state.generator)
        return self._emit(state, token)

    def _forward(self, state: ThinkerState, embeds: torch.Tensor, want_accept: bool) -> torch.Tensor:
        """Run the text decoder over ``embeds`` at the next positions; return last-token logits."""
        thinker = self.loaded.model.thinker
        start = len(state.keys) - embeds.shape[1]
        positions = torch.arange(start, start + embeds.shape[1]).view(1, 1, -1).expand(4, 1, -1)
        layer = self.loaded.accept_hidden_layer
        out = thinker.model.language_model(
            inputs_embeds=embeds,
            position_ids=positions,
            cache=state.cache,
            use_cache=True,
            output_hidden_states=[layer] if want_accept else None,
        )
        if want_accept:
            states = out.hidden_states[layer][0]
            for i, token in enumerate(state.prompt.ids[start : start + embeds.shape[1]]):
                if token in self.loaded.ids.multimodal:
                    state.accept_hidden[start + i] = states[i].clone()
        return thinker.lm_head(out.last_hidden_state[:, -1]).reshape(-1)

    def _prefill(self, state: ThinkerState) -> torch.Tensor:
        prompt = state.prompt
        begin = len(state.keys)
        new_ids = prompt.ids[begin:]
        embeds = thinker_embed(self.loaded, new_ids)
        multimodal = self.loaded.ids.multimodal
        has_audio = prompt.input_features is not None and any(t in multimodal for t in new_ids)
        if has_audio:
            thinker = self.loaded.model.thinker
            features = thinker.model.get_audio_features(
                prompt.input_features, feature_attention_mask=prompt.feature_attention_mask
            ).last_hidden_state
            mask = torch.tensor([t == self.loaded.ids.audio_pad for t in new_ids]).view(1, -1, 1)
            embeds = embeds.masked_scatter(mask, features.to(embeds.dtype))
        state.keys.extend(prompt.keys[begin:])
        return self._forward(state, embeds, want_accept=has_audio)

    def _decode(self, state: ThinkerState) -> torch.Tensor:
        embed = state.next_embed
        if embed is None:
            embed = thinker_embed(self.loaded, state.generated[-1:])
        state.keys.append(state.generated[-1])
        state.next_embed = None
        return self._forward(state, embed, want_accept=False)

    def _decode_batch(self, states: Sequence[ThinkerState]) -> torch.Tensor:
        embeds, starts = [], []
        for state in states:
            embed = state.next_embed
            if embed is None:
                embed = thinker_embed(self.loaded, state.generated[-1:])
            embeds.append(embed)
            starts.append(len(state.keys))
            state.keys.append(state.generated[-1])
            state.next_embed = None
        return thinker_logits(self.loaded, embeds, starts, [s.cache for s in states], self.batch_invariant)

    def _emit(
        self,
        state: ThinkerState,
        token: int,
        embed: torch.Tensor | None = None,
        projected: torch.Tensor | None = None,
    ) -> StepOutput:
        """``token`` out: text to the client, rows to the talker. ``embed`` (its embedding) and
        ``projected`` (that through the talker's text projection), when a batch made them."""
        loaded = self.loaded
        k = len(state.generated)
        state.generated.append(token)
        is_eos = token in loaded.ids.eos
        last = is_eos or k + 1 >= state.max_tokens
        out = StepOutput()
        if not is_eos:
            text = state.decoder.push(token)
            if last:
                text += state.decoder.flush()
            if text:
                out.client.append(TextDelta(text))
        elif last:
            tail = state.decoder.flush()
            if tail:
                out.client.append(TextDelta(tail))
        if not last:
            state.next_embed = embed if embed is not None else thinker_embed(loaded, [token])
        if state.audio_out:
            out.downstream.extend(self._talker_items(state, token, k, is_eos, last, projected))
        if last:
            state.finished = True
            out.done = True
        return out

    def _talker_items(
        self,
        state: ThinkerState,
        token: int,
        k: int,
        is_eos: bool,
        last: bool,
        projected: torch.Tensor | None = None,
    ) -> list[Payload]:
        items: list[Payload] = []
        if k == 0 and not is_eos:
            prefill = talker_prefill(
                self.loaded,
                state.prompt.ids,
                state.accept_hidden,
                token,
                state.speaker_id,
                special=self._special_rows(),
            )
            items.append(Embeddings(to_payload_array(prefill), role="talker_prefill"))
            state.talker_started = True
        elif k > 0 and not last:
            assert state.next_embed is not None
            if projected is None:
                projected = project_text(self.loaded, state.next_embed)
            items.append(Embeddings(to_payload_array(projected), role="text_token"))
        if last and state.talker_started:
            items.append(Embeddings(self._tts_eos_row().copy(), role="tts_eos"))
        return items

    def _special_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tts_bos, tts_eos, tts_pad through the talker's text projection, made once."""
        if self._special is None:
            self._special = special_text_rows(self.loaded)
        return self._special

    def _tts_eos_row(self) -> np.ndarray:
        if self._tts_eos is None:
            _bos, eos, _pad = self._special_rows()
            self._tts_eos = to_payload_array(eos)
        return self._tts_eos
