"""The TTS stage's chunk schedule: audio runs ahead of a real-time playout from the first chunk.

Piper synthesises a whole sentence per call, so the engine says a long clause in pieces sized
to the audio already ahead of playout. These tests drive the engine with the real Piper voice
as its stage worker would (one step after another) and time each chunk with a monotonic clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from engines.speech.stages import TtsEngine, TtsState
from engines.speech.tts import ClauseSplitter, head_words
from runtime.engine import EdgeChunk, EngineRequest, StepInput
from runtime.payloads import AudioChunk, TextDelta
from tests.engines_speech.conftest import DETERMINISTIC_VOICE, run_engine, text_chunks, words

pytestmark = pytest.mark.system

# 51 words; a first clause of one word, then one of 39 words without a mark (the splitter cuts
# it at max_words), then the rest.
REPLY = (
    "Well, I looked at the forecast for the whole week and it looks like rain on Monday and "
    "Tuesday but the rest of the week should be sunny and warm with a light breeze from the west "
    "in the afternoon, so you can plan the picnic for Saturday without worrying about the weather."
)


# ------------------------------------------------------------------------------ text cutting


def test_head_words_balances_pieces() -> None:
    # 9 words at limit 4: three pieces of 3, not 4 + 4 + 1.
    assert head_words("one two three four five six seven eight nine", 4) == (
        "one two three",
        "four five six seven eight nine",
    )
    assert head_words("short clause,", 4) == ("short clause,", "")


def test_head_words_cuts_before_a_conjunction_when_near() -> None:
    head, rest = head_words("the fox ran and the dog sat down", 4)
    assert (head, rest) == ("the fox ran", "and the dog sat down")


def test_head_words_bad_limit() -> None:
    with pytest.raises(ValueError):
        head_words("a b", 0)


def test_take_words_only_takes_complete_words() -> None:
    splitter = ClauseSplitter()
    assert splitter.feed("I think the answ") == []
    assert splitter.take_words(4) is None  # "answ" may still be growing
    assert splitter.take_words(3) == "I think the"
    assert splitter.pending_text == " answ"
    assert splitter.feed("er is yes.") == ["answer is yes."]


def test_bad_piece_options() -> None:
    with pytest.raises(ValueError, match="min_words"):
        TtsEngine({"min_words": 0})
    with pytest.raises(ValueError, match="first_words"):
        TtsEngine({"first_words": 20, "max_words": 12})


def test_piece_words_follows_the_lead() -> None:
    engine = TtsEngine({"first_words": 4, "min_words": 3, "max_words": 12})
    state = TtsState(audio_out=True, splitter=ClauseSplitter())
    assert engine.piece_words(state, now=100.0) == 4  # no audio yet: the first piece
    state.first_audio_at, state.audio_s, state.words_said = 100.0, 3.0, 10  # 0.3 s per word
    assert engine.piece_words(state, now=102.8) == 3  # 0.2 s ahead: the shortest piece
    assert engine.piece_words(state, now=101.2) == 6  # 1.8 s ahead
    assert engine.piece_words(state, now=100.0) == 10  # 3.0 s ahead
    state.audio_s, state.words_said = 30.0, 100  # 30 s ahead
    assert engine.piece_words(state, now=100.0) == 12  # never more than max_words


# ------------------------------------------------------------------ schedule with real Piper


@dataclass
class Piece:
    text: str
    started: float  # monotonic, when the step began
    produced: float  # monotonic, when the step returned its audio
    audio_s: float


class _Recording:
    """The real voice, noting the text of each piece it is asked to say."""

    def __init__(self, tts: Any) -> None:
        self._tts = tts
        self.sample_rate = tts.sample_rate
        self.texts: list[str] = []

    def synthesize(self, text: str) -> Iterator[np.ndarray]:
        self.texts.append(text)
        return self._tts.synthesize(text)


def _schedule(options: dict[str, Any], text: str = REPLY) -> list[Piece]:
    """Drive one reply whose text is all there at once (a fast responder) through the engine."""
    engine = TtsEngine({**DETERMINISTIC_VOICE, **options})
    engine.load()
    recording = _Recording(engine._tts)
    engine._tts = recording  # type: ignore[assignment]
    state = engine.start(EngineRequest(request_id="r", params={}))
    chunks = [EdgeChunk(items=[TextDelta(text)], finished=True, source="responder")]
    pieces: list[Piece] = []
    for _ in range(200):
        started = time.monotonic()
        out = engine.step([StepInput(state=state, chunks=chunks, upstream_finished=True)])[0]
        produced = time.monotonic()
        chunks = []
        audio = [p for p in out.client if isinstance(p, AudioChunk)]
        if audio:
            seconds = sum(a.samples.size for a in audio) / audio[0].sample_rate
            pieces.append(Piece(recording.texts[-1], started, produced, seconds))
        if out.done:
            return pieces
    raise AssertionError("the reply never finished")


def _leads(pieces: list[Piece]) -> list[float]:
    """For each piece after the first: audio produced before it, minus the time a real-time
    playout started at the first chunk has played when the piece's step begins."""
    t0, out, leads = pieces[0].produced, pieces[0].audio_s, []
    for piece in pieces[1:]:
        leads.append(out - (piece.started - t0))
        out += piece.audio_s
    return leads


@pytest.mark.usefixtures("tts")
def test_long_reply_stays_ahead_of_real_time_playout() -> None:
    pieces = _schedule({"first_words": 4, "min_words": 3, "max_words": 12})
    said = [p.text for p in pieces]
    assert words(" ".join(said)) == words(REPLY)  # every word, in order, once
    assert said[0] == "Well,"
    # Structural: no piece is much longer than the audio ahead of playout when its step began
    # (or than the shortest piece, 3 words), so at any real-time factor well below 1 its
    # synthesis ends before the playout reaches it.
    for piece, lead in zip(pieces[1:], _leads(pieces), strict=True):
        assert piece.audio_s <= max(lead, 0.0) + 1.3, (piece.text, piece.audio_s, lead)
    # Timing: each piece exists before a playout that started at the first chunk needs it.
    t0 = pieces[0].produced
    cumulative = pieces[0].audio_s
    for piece in pieces[1:]:
        assert piece.produced - t0 < cumulative, (piece.text, piece.produced - t0, cumulative)
        cumulative += piece.audio_s
    # The lead grows, so later pieces are whole 12-word clauses (fewer, longer syntheses).
    assert max(len(p.text.split()) for p in pieces[-3:]) >= 8


@pytest.mark.usefixtures("tts")
def test_old_schedule_falls_behind_structurally() -> None:
    """The schedule before pieces (whole clauses of up to 12 words): after the one-word first
    clause, the next chunk is ~2.3 s of audio against a lead of under 0.55 s; on a loaded machine
    its synthesis outlasts the lead and the track runs dry (the issue this fixes)."""
    pieces = _schedule({"first_words": 12, "min_words": 12, "max_words": 12})
    assert pieces[1].audio_s > 3 * pieces[0].audio_s
    assert len(pieces[1].text.split()) == 12


@pytest.mark.usefixtures("tts")
def test_unpunctuated_stream_speaks_after_first_words() -> None:
    """A reply streamed a word per step without marks: the first audio comes once
    ``first_words`` words are complete, not after ``max_words`` + 1 of them."""
    engine = TtsEngine({**DETERMINISTIC_VOICE, "first_words": 4})
    engine.load()
    sentence = "I think the answer is probably going to be yes in the end"
    deltas = [w if i == 0 else f" {w}" for i, w in enumerate(sentence.split(" "))]
    steps = run_engine(engine, {}, text_chunks(deltas))
    first = next(delivered for delivered, out in steps if out.client)
    assert first == 5  # "I think the answer" is complete once " is" has arrived
    audio = [p for _, out in steps for p in out.client if isinstance(p, AudioChunk)]
    assert sum(a.samples.size for a in audio) / 22050 > 2.0


if __name__ == "__main__":  # print the schedule: python -m tests.engines_speech.test_tts_pacing
    for opts in ({"first_words": 4, "min_words": 3, "max_words": 12}, {"first_words": 12, "min_words": 12}):
        ps = _schedule(opts)
        print(opts)
        for p, lead in zip(ps, [0.0, *_leads(ps)], strict=True):
            print(
                f"  +{p.produced - ps[0].produced:5.2f}s lead {lead:5.2f} audio {p.audio_s:4.2f} {p.text!r}"
            )
