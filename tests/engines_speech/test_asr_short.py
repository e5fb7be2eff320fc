"""The short encode: whisper sees only the utterance, the transcript must not change.

The guard is tested on strings (it is a pure function); the model path on real Piper speech:
the short path must give the test sentences word for word *without* falling back (natural
voices, whose close calls may fall back, are in test_asr_tts), and a short encode that really
loops (the decoder given the bare short encoder output, as before the splice) must be caught
by the guard and answered from the 30 s window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engines.speech.asr import max_new_tokens, short_encode_suspect
from tests.engines_speech.conftest import SENTENCE, words

pytestmark = pytest.mark.system

TEST_SENTENCES = [
    SENTENCE,
    "Hello, how are you today?",
    "Please send the report to Alice by Friday.",
    "What time does the train leave tomorrow morning?",
    "I would like a cup of coffee, please.",
    "Wait, stop please.",
    "Wait, stop. I have another question.",
]


# ------------------------------------------------------------------------------ the guard


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("The quick brown fox jumps over the lazy dog.", 2.8),
        ("Hello, how are you today?", 1.5),
        ("Wait, stop please.", 1.4),
        ("", 1.0),
        ("Yes.", 0.4),
        (
            "The quick brown fox jumps over the lazy dog, then the five boxing wizards jump "
            "quickly, and a lazy cat sleeps all afternoon.",
            7.5,
        ),
        ("No, no, no, not that one.", 1.6),  # short repeats are speech, not a loop
    ],
)
def test_guard_accepts_ordinary_transcripts(text: str, seconds: float) -> None:
    assert short_encode_suspect(text, seconds) is None


@pytest.mark.parametrize(
    ("text", "seconds", "reason"),
    [
        # What the decoder produced on the bare short encode, cut by the token budget.
        (
            "Hello? How are you today? Hello? How are you today? Hello? How are you today?",
            1.5,
            "word_rate",
        ),
        (
            "Could you play some quite music while I read? Could you play some",
            2.1,
            "repeated_phrase",
        ),
        ("The quick brown fox jumps over the lazy dog. " * 6, 30.0, "compression"),
        ("one two three four five six seven eight nine ten eleven twelve", 1.0, "word_rate"),
    ],
)
def test_guard_flags_repetitive_or_impossible_transcripts(text: str, seconds: float, reason: str) -> None:
    assert short_encode_suspect(text, seconds) == reason


def test_guard_flags_a_decode_that_hit_its_token_budget() -> None:
    assert short_encode_suspect("Hello there", 2.0, hit_token_limit=True) == "token_limit"


def test_guard_flags_a_transcript_that_hinged_on_an_unsure_token() -> None:
    """ "The quit brown fox" (for "quick") came with its least likely token at -1.2 to -1.4;
    the right words at such a close call come from the 30 s window."""
    text = "The quit brown fox jumps over the lazy dog."
    assert short_encode_suspect(text, 2.8, min_token_logprob=-1.25) == "low_confidence"
    assert short_encode_suspect(text, 2.8, min_token_logprob=-0.7) is None


def test_min_token_logprob_is_the_least_likely_chosen_token() -> None:
    from engines.speech.asr import _min_token_logprob

    steps = [np.log(np.array([0.7, 0.2, 0.1])), np.log(np.array([0.25, 0.5, 0.25]))]
    steps.append(np.zeros(3))  # the end-of-text step has no chosen token
    assert _min_token_logprob(steps, [0, 2]) == pytest.approx(np.log(0.25))
    assert _min_token_logprob(steps, []) == 0.0


def test_token_budget_grows_with_the_audio_and_leaves_room_for_fast_speech() -> None:
    assert max_new_tokens(0.0) == 10
    assert max_new_tokens(1.0) < max_new_tokens(3.0) < max_new_tokens(10.0)
    # ~5 words/s at ~1.4 tokens a word, punctuation included, still fits.
    for seconds in (1.0, 2.8, 7.5, 29.0):
        assert max_new_tokens(seconds) >= 7 * seconds


# -------------------------------------------------------------------------- the real model


def _short_only(asr: Any, audio: np.ndarray) -> tuple[str, dict[str, Any]]:
    before = asr.stats()
    text = asr.transcribe(audio)
    after = asr.stats()
    delta = {
        "short": after["short"] - before["short"],
        "full": after["full"] - before["full"],
        "fallbacks": sum(after["fallbacks"].values()) - sum(before["fallbacks"].values()),
    }
    return text, delta


@pytest.mark.parametrize("sentence", TEST_SENTENCES)
def test_short_encode_transcribes_the_test_sentences_exactly(
    asr: Any, speak16k: Callable[[str], np.ndarray], sentence: str
) -> None:
    audio = speak16k(sentence)
    text, delta = _short_only(asr, audio)
    assert delta == {"short": 1, "full": 0, "fallbacks": 0}, "the short path must answer alone"
    assert words(text) == words(sentence)
    # Word for word what the padded 30 s window gives (which writes "Wait, stop,
    # please." for the fifth; the first five are exact strings in test_asr_tts as well).
    assert words(text) == words(asr.transcribe_full(audio))


def test_short_encode_with_vad_silence_around_the_speech(
    asr: Any, speak16k: Callable[[str], np.ndarray]
) -> None:
    """What the session hands over: the turn with some silence before and after."""
    audio = np.concatenate([np.zeros(4800, np.float32), speak16k(SENTENCE), np.zeros(8000, np.float32)])
    text, delta = _short_only(asr, audio)
    assert delta["full"] == 0
    assert words(text) == words(SENTENCE)


def test_short_encode_on_a_longer_turn(asr: Any, speak16k: Callable[[str], np.ndarray]) -> None:
    long_turn = (
        "The quick brown fox jumps over the lazy dog, then the five boxing wizards jump "
        "quickly, and a lazy cat sleeps all afternoon."
    )
    text, delta = _short_only(asr, speak16k(long_turn))
    assert delta["full"] == 0
    assert words(text) == words(long_turn)


def test_a_looping_short_decode_falls_back_to_the_30s_window(
    asr: Any, speak16k: Callable[[str], np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the spliced padding states the short encode makes greedy decoding repeat
    itself (the failure the splice fixes); the guard must catch every such loop and the
    answer must come from the 30 s window, word for word."""
    pad = asr._pad_states
    monkeypatch.setattr(asr, "_pad_states", pad[:, :0])  # bare short encoder output
    fallbacks = 0
    for sentence in TEST_SENTENCES[:5]:
        text, delta = _short_only(asr, speak16k(sentence))
        assert words(text) == words(sentence)  # casing of the first word varies by build
        assert delta["full"] == delta["fallbacks"]
        fallbacks += delta["fallbacks"]
    assert fallbacks >= 2, "the bare short encode used to loop on most of these sentences"


def test_a_draft_is_the_short_encodes_words_and_says_whether_they_are_final(
    asr: Any, speak16k: Callable[[str], np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`draft` (what an end-of-turn decision reads) never takes the 30 s window for a suspect
    short transcript: it hands it over marked not final, and `transcribe` redoes it."""
    audio = speak16k(TEST_SENTENCES[0])
    assert asr.draft(audio) == (asr.transcribe(audio), True)  # sound: the final words at once
    monkeypatch.setattr(asr, "_pad_states", asr._pad_states[:, :0])  # the looping short encode
    drafts = [asr.draft(speak16k(sentence)) for sentence in TEST_SENTENCES[:5]]
    suspect = [text for text, final in drafts if not final]
    assert len(suspect) >= 2, "the bare short encode loops on most of these sentences"
    before = asr.stats()["full"]
    for sentence in TEST_SENTENCES[:5]:
        asr.draft(speak16k(sentence))
    assert asr.stats()["full"] == before  # a draft never runs the 30 s window for a suspect one


def test_silence_is_dropped_on_the_short_path(asr: Any) -> None:
    text, delta = _short_only(asr, np.zeros(16000, dtype=np.float32))
    assert delta["short"] == 1
    assert len(text.split()) <= 1


def test_audio_longer_than_one_window_takes_the_30s_path(asr: Any) -> None:
    text, delta = _short_only(asr, np.zeros(31 * 16000, dtype=np.float32))
    assert delta == {"short": 0, "full": 1, "fallbacks": 0}
    assert len(text.split()) <= 2


def test_the_stage_option_switches_the_short_path_off() -> None:
    from engines.speech.asr import AsrConfig
    from engines.speech.stages import AsrEngine

    engine = AsrEngine({"short_encode": False})
    assert engine.config == AsrConfig(short_encode=False)
    assert AsrEngine({}).config.short_encode


def test_the_environment_switch_turns_the_short_path_off(
    speak16k: Callable[[str], np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("faster_whisper")
    from engines.speech.asr import SHORT_ENCODE_ENV, AsrConfig, WhisperAsr

    monkeypatch.setenv(SHORT_ENCODE_ENV, "0")
    asr = WhisperAsr(AsrConfig())  # a private instance: the shared one keeps its short path
    assert words(asr.transcribe(speak16k(SENTENCE))) == words(SENTENCE)
    assert asr.stats() == {"short": 0, "full": 1, "fallbacks": {}}
