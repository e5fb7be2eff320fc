"""A byte-level BPE tokenizer built in code for the tiny Qwen3-Omni model.

Ids 0..255 are the 256 byte symbols (GPT-2 byte-to-unicode order); the merges follow (first the
chains that make the ChatML role words single tokens, as in Qwen's vocabulary, then merges learned
deterministically from a fixed corpus); the special tokens come last, at ids the tiny config reads
from :data:`SPECIAL_TOKENS`. Everything is computed from constants, so two processes build the same
vocabulary.
"""

from __future__ import annotations

import codecs
import itertools
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

NUM_MERGES = 256
REGULAR_VOCAB = 256 + NUM_MERGES

#: Special tokens in id order, starting at REGULAR_VOCAB.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|tts_pad|>",
    "<|tts_bos|>",
    "<|tts_eos|>",
)
VOCAB_SIZE = 528  # REGULAR_VOCAB + len(SPECIAL_TOKENS), rounded up to a multiple of 16

ROLE_WORDS: tuple[str, ...] = ("assistant", "system", "user")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = (
    "You are a helpful voice assistant. Hello! How are you today? I am fine, thank you. "
    "What is the weather like in the city this morning? It is sunny and warm, with a light wind. "
    "Please tell me a short story about a robot who learns to sing. Once upon a time there was "
    "a small robot that listened to the birds every day and wanted to sing with them. "
    "The quick brown fox jumps over the lazy dog. Can you hear me now? Yes, I can hear you "
    "clearly. Let's talk about music, science, and the history of the world. Thanks for asking, "
    "that is a great question. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 2025. "
)


@dataclass(frozen=True, slots=True)
class TinyTokenIds:
    """The ids the tiny config declares; they come from the tokenizer's construction."""

    endoftext: int
    im_start: int
    im_end: int
    audio_start: int
    audio_end: int
    audio_pad: int
    image_pad: int
    video_pad: int
    vision_start: int
    vision_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    assistant: int
    system: int
    user: int


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what ByteLevel pre-tokenization uses)."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


def _role_chain_merges() -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for word in ROLE_WORDS:
        current = word[0]
        for ch in word[1:]:
            merges.append((current, ch))
            current += ch
    return merges


def _learn_merges(corpus: str, count: int, seed_merges: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Greedy BPE training with deterministic tie-breaking (highest count, then smallest pair)."""
    splitter = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    words = Counter(piece for piece, _ in splitter.pre_tokenize_str(corpus))
    seqs = {word: list(word) for word in words}
    merges = list(seed_merges)
    known = {a + b for a, b in merges}

    def apply(pair: tuple[str, str]) -> None:
        a, b = pair
        for word, seq in seqs.items():
            i, out = 0, []
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[word] = out

    for pair in seed_merges:
        apply(pair)
    while len(merges) < count:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, seq in seqs.items():
            for a, b in itertools.pairwise(seq):
                pairs[(a, b)] += words[word]
        candidates = [(n, p) for p, n in pairs.items() if p[0] + p[1] not in known]
        if not candidates:
            break
        best = min(candidates, key=lambda item: (-item[0], item[1]))[1]
        merges.append(best)
        known.add(best[0] + best[1])
        apply(best)
    # Pad with merges of byte pairs that never occur, so the vocabulary size is a constant.
    filler = iter(sorted(byte_to_unicode().values()))
    first = next(filler)
    for ch in filler:
        if len(merges) >= count:
            break
        if first + ch not in known:
            merges.append((first, ch))
            known.add(first + ch)
    return merges


@lru_cache(maxsize=1)
def _vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    vocab: dict[str, int] = {byte_to_unicode()[b]: b for b in range(256)}
    merges = _learn_merges(_CORPUS, NUM_MERGES, _role_chain_merges())
    for a, b in merges:
        vocab[a + b] = len(vocab)
    if len(vocab) != REGULAR_VOCAB:
        raise RuntimeError(f"tiny tokenizer: expected {REGULAR_VOCAB} regular tokens, built {len(vocab)}")
    return vocab, merges


@lru_cache(maxsize=1)
def tiny_token_ids() -> TinyTokenIds:
    vocab, _ = _vocab_and_merges()
    # Each special token's field is its name (``<|im_end|>``: ``im_end``), its id its place.
    special = {token.strip("<|>"): REGULAR_VOCAB + i for i, token in enumerate(SPECIAL_TOKENS)}
    return TinyTokenIds(**special, **{word: vocab[word] for word in ROLE_WORDS})


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level BPE tokenizer of the tiny model, with the ChatML template."""
    vocab, merges = _vocab_and_merges()
    core = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), fuse_unk=False, byte_fallback=False))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))  # appended in order: ids REGULAR_VOCAB + i
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )
    for i, name in enumerate(SPECIAL_TOKENS):
        if tokenizer.convert_tokens_to_ids(name) != REGULAR_VOCAB + i:
            raise RuntimeError(f"tiny tokenizer: {name} landed at an unexpected id")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class IncrementalDecoder:
    """Turns generated token ids into text pieces without splitting a UTF-8 character.

    Works for any byte-level BPE vocabulary (the tiny one and Qwen's): each token maps to bytes,
    and an incremental UTF-8 decoder holds back an incomplete multi-byte sequence.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self._tokenizer = tokenizer
        self._special = set(tokenizer.all_special_ids)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._table = unicode_to_byte()

    def push(self, token_id: int) -> str:
        if token_id in self._special:
            return ""
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return ""
        data = bytes(self._table[ch] for ch in piece if ch in self._table)
        if len(data) != len(piece):  # not a byte-level symbol (an added token): take it as text
            data = piece.encode("utf-8")
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
