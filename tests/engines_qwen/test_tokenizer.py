"""The tiny byte-level BPE tokenizer: exact round trips, ids the config declares, ChatML."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from engines.qwen3_omni.config import tiny_config
from engines.qwen3_omni.tokenizer import (
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    IncrementalDecoder,
    build_tiny_tokenizer,
    tiny_token_ids,
)

pytestmark = pytest.mark.unit

SAMPLES = [
    "Hello world!",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\r\n\n",
    "héllo wörld — ünïcödé",
    "日本語のテキスト",
    "emoji 🎉👍🏽 and a family 👨‍👩‍👧",
    "control \x00\x01\x7f bytes",
    "user assistant system username",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_tiny_tokenizer()


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_merges_compress_english(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "Hello! How are you today? Thank you."
    assert len(tokenizer.encode(text, add_special_tokens=False)) < len(text.encode()) * 0.7


def test_special_and_role_ids_match_the_config(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_token_ids()
    cfg = tiny_config()
    assert cfg.im_start_token_id == tokenizer.convert_tokens_to_ids("<|im_start|>") == ids.im_start
    assert cfg.im_end_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == ids.im_end
    assert cfg.tts_pad_token_id == tokenizer.convert_tokens_to_ids("<|tts_pad|>")
    assert cfg.tts_bos_token_id == tokenizer.convert_tokens_to_ids("<|tts_bos|>")
    assert cfg.tts_eos_token_id == tokenizer.convert_tokens_to_ids("<|tts_eos|>")
    assert cfg.thinker_config.audio_token_id == tokenizer.convert_tokens_to_ids("<|audio_pad|>")
    assert cfg.thinker_config.audio_start_token_id == tokenizer.convert_tokens_to_ids("<|audio_start|>")
    assert cfg.thinker_config.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")
    for word, expected in (
        ("user", cfg.user_token_id),
        ("assistant", cfg.assistant_token_id),
        ("system", cfg.system_token_id),
    ):
        assert tokenizer.encode(word, add_special_tokens=False) == [expected]
    assert cfg.thinker_config.text_config.vocab_size == VOCAB_SIZE >= len(tokenizer)
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)


def test_special_tokens_are_atomic_and_not_split(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_token_ids()
    text = "<|im_start|>user\nhi<|im_end|>\n<|audio_start|><|audio_pad|><|audio_end|>"
    encoded = tokenizer.encode(text, add_special_tokens=False)
    assert encoded[:2] == [ids.im_start, ids.user]
    assert encoded[-3:] == [ids.audio_start, ids.audio_pad, ids.audio_end]
    assert tokenizer.decode(encoded) == text


def test_chatml_template(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_building_twice_gives_the_same_vocabulary() -> None:
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    assert a.get_vocab() == b.get_vocab()


def test_incremental_decoder_never_splits_a_character(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "naïve 日本 🎉 done"
    decoder = IncrementalDecoder(tokenizer)
    pieces = [decoder.push(i) for i in tokenizer.encode(text, add_special_tokens=False)]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)
    # Special tokens decode to nothing.
    assert decoder.push(tiny_token_ids().im_end) == ""
