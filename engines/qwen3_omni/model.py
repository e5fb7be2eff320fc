"""Loading Qwen3-Omni (tiny random weights built in code, or a local checkpoint directory).

One model object per ``(model, seed)`` and process, shared by the thinker, talker and code2wav
engines. The engines never call ``generate`` or ``forward`` methods that keep per-request state on
the module (``rope_deltas``); they pass position ids and their own caches, so concurrent stages
on different threads can share the object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    WhisperFeatureExtractor,
)
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qmodeling

from engines.model_cache import ModelCache
from engines.qwen3_omni.config import tiny_config
from engines.qwen3_omni.seeded import build_tiny_model
from engines.qwen3_omni.tokenizer import build_tiny_tokenizer
from engines.rowbatch import install_row_exact, install_rows_attention, install_rows_experts
from runtime.engine import Engine

TINY = "tiny"
SAMPLE_RATE_OUT = 24_000
SAMPLE_RATE_IN = 16_000


@dataclass(frozen=True, slots=True)
class SpecialIds:
    im_start: int
    im_end: int
    assistant: int
    user: int
    newline: int
    audio_start: int
    audio_pad: int
    multimodal: frozenset[int]  # placeholder ids whose talker rows come from accept-layer states
    tts_pad: int
    tts_bos: int
    tts_eos: int
    eos: frozenset[int]  # thinker stop tokens
    codec_pad: int
    codec_bos: int
    codec_eos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int


@dataclass(slots=True)
class LoadedModel:
    """The model and everything derived from its config that the engines need."""

    name: str
    model: Qwen3OmniMoeForConditionalGeneration
    tokenizer: PreTrainedTokenizerBase
    feature_extractor: WhisperFeatureExtractor
    ids: SpecialIds
    speakers: dict[str, int]
    accept_hidden_layer: int
    num_code_groups: int
    codebook_size: int
    samples_per_frame: int  # 1920: code2wav upsampling
    lookahead_samples: int  # 555: samples of frame k-1 that depend on frame k
    dtype: torch.dtype

    @property
    def config(self) -> Qwen3OmniMoeConfig:
        return self.model.config

    @property
    def thinker_config(self) -> Any:
        return self.config.thinker_config

    @property
    def talker_config(self) -> Any:
        return self.config.talker_config

    @property
    def talker_hidden(self) -> int:
        return int(self.talker_config.text_config.hidden_size)

    def thinker_cache(self) -> DynamicCache:
        return DynamicCache(config=self.thinker_config.text_config)

    def talker_cache(self) -> DynamicCache:
        return DynamicCache(config=self.talker_config.text_config)

    def predictor_cache(self) -> DynamicCache:
        return DynamicCache(config=self.talker_config.code_predictor_config)


_MODELS: ModelCache[tuple[str, int], LoadedModel] = ModelCache()


def _num_threads(options: Mapping[str, Any], tiny: bool) -> int:
    if "num_threads" in options:
        return max(1, int(options["num_threads"]))
    # The tiny model's matrices are far too small for intra-op parallelism to pay off (one thread
    # was faster per talker frame on 2 cores); concurrent stages then use the cores instead.
    return 1 if tiny else max(1, (os.cpu_count() or 1))


def default_feature_extractor() -> WhisperFeatureExtractor:
    """Qwen3-Omni's audio front end, built offline (what AutoFeatureExtractor would load)."""
    return WhisperFeatureExtractor(
        feature_size=128,
        sampling_rate=SAMPLE_RATE_IN,
        hop_length=160,
        n_fft=400,
        return_attention_mask=True,
    )


def load_model(options: Mapping[str, Any]) -> LoadedModel:
    """The model named by ``options["model"]`` ("tiny" or a local directory), cached per process."""
    name = str(options.get("model", TINY))
    seed = int(options.get("seed", 0))
    return _MODELS.get((name, seed), lambda: _build(name, seed, options))


def _build(name: str, seed: int, options: Mapping[str, Any]) -> LoadedModel:
    tiny = name == TINY
    torch.set_num_threads(_num_threads(options, tiny))
    tokenizer: PreTrainedTokenizerBase
    if tiny:
        # A pure function of the seed: private generator, no allocator garbage, no global dtype.
        model = build_tiny_model(tiny_config(), seed)
        tokenizer = build_tiny_tokenizer()
        extractor = default_feature_extractor()
    else:
        path = Path(name).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"qwen3_omni: model must be 'tiny' or a local directory, got {name!r}")
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(path), dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        try:
            extractor = WhisperFeatureExtractor.from_pretrained(str(path))
        except (OSError, ValueError):
            extractor = default_feature_extractor()
    model.eval()
    model.requires_grad_(False)
    if not model.has_talker:
        raise ValueError(f"qwen3_omni: {name} has enable_audio_output=False; the talker is required")
    # Batched decode steps keep every row bit-identical to the row alone (engines.rowbatch);
    # every unbatched call still runs sdpa and grouped_mm exactly as before.
    thinker_text = model.thinker.model.language_model.config
    talker_text = model.talker.model.config
    install_rows_attention(thinker_text, talker_text, model.talker.code_predictor.model.config)
    install_rows_experts(thinker_text, talker_text)
    routers = (qmodeling.Qwen3OmniMoeThinkerTextTopKRouter, qmodeling.Qwen3OmniMoeTalkerTextTopKRouter)
    install_row_exact(
        model.thinker.model.language_model,
        model.thinker.lm_head,
        model.talker,
        model.code2wav.pre_transformer,
        routers=routers,
    )
    loaded = _describe(name, model, tokenizer, extractor)
    _warm_up(loaded)
    return loaded


def _token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"qwen3_omni: {text!r} is not a single token in this vocabulary")
    return int(ids[0])


def _describe(
    name: str,
    model: Qwen3OmniMoeForConditionalGeneration,
    tokenizer: PreTrainedTokenizerBase,
    extractor: WhisperFeatureExtractor,
) -> LoadedModel:
    cfg: Any = model.config
    thinker, talker, c2w = cfg.thinker_config, cfg.talker_config, cfg.code2wav_config
    eos = {int(cfg.im_end_token_id)}
    for token in ("<|endoftext|>",):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            eos.add(tid)
    ids = SpecialIds(
        im_start=int(cfg.im_start_token_id),
        im_end=int(cfg.im_end_token_id),
        assistant=int(cfg.assistant_token_id),
        user=int(cfg.user_token_id),
        newline=_token_id(tokenizer, "\n"),
        audio_start=int(thinker.audio_start_token_id),
        audio_pad=int(thinker.audio_token_id),
        multimodal=frozenset(
            {int(thinker.audio_token_id), int(thinker.image_token_id), int(thinker.video_token_id)}
        ),
        tts_pad=int(cfg.tts_pad_token_id),
        tts_bos=int(cfg.tts_bos_token_id),
        tts_eos=int(cfg.tts_eos_token_id),
        eos=frozenset(eos),
        codec_pad=int(talker.codec_pad_id),
        codec_bos=int(talker.codec_bos_id),
        codec_eos=int(talker.codec_eos_token_id),
        codec_nothink=int(talker.codec_nothink_id),
        codec_think_bos=int(talker.codec_think_bos_id),
        codec_think_eos=int(talker.codec_think_eos_id),
    )
    rates = list(c2w.upsample_rates) + list(c2w.upsampling_ratios)
    samples_per_frame = 1
    for r in rates:
        samples_per_frame *= int(r)
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        feature_extractor=extractor,
        ids=ids,
        speakers={str(k).lower(): int(v) for k, v in (talker.speaker_id or {}).items()},
        accept_hidden_layer=int(talker.accept_hidden_layer),
        num_code_groups=int(talker.num_code_groups),
        codebook_size=int(c2w.codebook_size),
        samples_per_frame=samples_per_frame,
        lookahead_samples=_measure_lookahead(model, samples_per_frame),
        dtype=model.dtype,
    )


def _measure_lookahead(model: Qwen3OmniMoeForConditionalGeneration, samples_per_frame: int) -> int:
    """Samples missing at the end of a decode: ``samples_per_frame * T - len(decode(T frames))``."""
    c2w = model.code2wav
    codes = torch.zeros((1, c2w.config.num_quantizers, 2), dtype=torch.long)
    with torch.inference_mode():
        length = int(c2w(codes).shape[-1])
    return 2 * samples_per_frame - length


def _warm_up(loaded: LoadedModel) -> None:
    """Run each component once so lazily installed output-capture hooks exist before threads race."""
    model = loaded.model
    lm = model.thinker.model.language_model
    with torch.inference_mode():
        ids = torch.tensor([[loaded.ids.im_start, loaded.ids.assistant]])
        pos = torch.arange(2).view(1, 1, -1).expand(4, 1, -1)
        lm(inputs_embeds=lm.embed_tokens(ids), position_ids=pos, output_hidden_states=[0])
        hidden = torch.zeros(1, 2, loaded.talker_hidden, dtype=loaded.dtype)
        model.talker.model(inputs_embeds=hidden, position_ids=pos)
        model.talker.code_predictor(inputs_embeds=hidden, use_cache=False)


class ModelEngine(Engine):
    """Base of the three stage engines: the shared model, loaded on first use (on a worker)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self._loaded: LoadedModel | None = None
        # Option ``batch_invariant`` (default true): every row of a batched step computed with the
        # bits of its run alone (engines.rowbatch.RowExact); false: plain batched products, equal
        # to the run alone up to the last float bits (engines.rowbatch.rows_exact).
        self.batch_invariant = bool(self.options.get("batch_invariant", True))

    @property
    def loaded(self) -> LoadedModel:
        if self._loaded is None:
            self._loaded = load_model(self.options)
        return self._loaded

    def load(self) -> None:
        _ = self.loaded
