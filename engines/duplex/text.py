"""The model's text stream → text pieces, and the stretches of speech it marks.

Moshi writes its inner monologue as one text token per 80 ms frame, aligned with its audio:
a *pad* token (id 3) while it has nothing to say, an *end-of-padding* token (id 0) just before
a word, and word pieces while it speaks. :class:`SpeechStretches` turns that stream into
stretches of speech (which the session maps onto responses): a stretch starts at the first
word piece and ends after ``end_pad_frames`` pad frames in a row, or at ``max_frames`` so a
client is never left with a response that does not end.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_PAD_ID = 3  # Moshi's "existing text padding" id
TEXT_EPAD_ID = 0  # Moshi's "end of text padding" id
TINY_FIRST_CHAR = 4  # tiny vocabulary: ids 4.. are printable ASCII 32..126


class TextPieces:
    """Text of one token: printable ASCII for the tiny model, the checkpoint's tokenizer else."""

    def __init__(self, tokenizer: Any | None = None, *, special: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._special = special | {TEXT_PAD_ID, TEXT_EPAD_ID}

    @classmethod
    def for_model(cls, model: str) -> TextPieces:
        if model == "tiny":
            return cls()
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(Path(model)))
        return cls(tokenizer, special=frozenset(tokenizer.all_special_ids))

    def is_word(self, token: int) -> bool:
        return token not in self._special

    def piece(self, token: int) -> str:
        if token in self._special:
            return ""
        if self._tokenizer is None:
            printable = TINY_FIRST_CHAR <= token < TINY_FIRST_CHAR + 95
            return chr(32 + token - TINY_FIRST_CHAR) if printable else ""
        piece = self._tokenizer.convert_ids_to_tokens(token)
        return str(piece).replace("▁", " ")


@dataclass(slots=True)
class StretchStep:
    started: bool = False  # this frame opens a stretch
    speaking: bool = False  # this frame belongs to a stretch (its audio and text go out)
    stopped: bool = False  # this frame closes it (after its audio)
    cut: bool = False  # ... because it reached max_frames, not because the model fell silent


class SpeechStretches:
    """Sans-I/O: one text token per frame in, stretch boundaries out."""

    def __init__(self, *, end_pad_frames: int = 6, max_frames: int = 250, pad_id: int = TEXT_PAD_ID) -> None:
        if end_pad_frames < 1 or max_frames < 1:
            raise ValueError("end_pad_frames and max_frames must be >= 1")
        self.end_pad_frames = end_pad_frames
        self.max_frames = max_frames
        self.pad_id = pad_id
        self.active = False
        self.count = 0  # stretches started
        self._frames = 0
        self._quiet = 0

    def push(self, token: int) -> StretchStep:
        step = StretchStep()
        if not self.active:
            if token == self.pad_id:
                return step
            self.active, self._frames, self._quiet = True, 0, 0
            self.count += 1
            step.started = True
        step.speaking = True
        self._frames += 1
        self._quiet = self._quiet + 1 if token == self.pad_id else 0
        if self._quiet >= self.end_pad_frames or self._frames >= self.max_frames:
            self.active = False
            step.stopped = True
            step.cut = self._quiet < self.end_pad_frames
        return step

    def close(self) -> bool:
        """End an open stretch (the request ends); True if one was open."""
        was, self.active = self.active, False
        return was
