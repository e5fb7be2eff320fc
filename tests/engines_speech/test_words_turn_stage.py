"""The end-of-turn stage's words cue: SmolLM2-135M-Instruct (the bundled weights, on CTranslate2)
scores how likely the user's message ends after a transcript; finished sentences of the
evaluation set score above the bar, first halves Whisper closed with a period far below it; the
stage answers "score_words" beside Smart Turn's "score_turn" on one live request."""

from __future__ import annotations

import asyncio
import math

import pytest

from engines.speech.words_turn import WordsTurn, message_words
from runtime.orchestrator import Orchestrator
from runtime.payloads import TurnControl, TurnScore
from runtime.spec import parse_pipeline
from session.realtime.words_turn import WORDS_BARS
from tests.engines_speech.test_turn_stage import PIPELINE as TURN_PIPELINE

pytestmark = pytest.mark.system

# test_turn_stage's pipeline with this end-of-turn engine.
PIPELINE = TURN_PIPELINE.replace(
    "engines.speech.turn_stage:EndOfTurnEngine", "engines.speech.words_turn_stage:EndOfTurnWordsEngine"
)
# Whisper's words at the end of two finished sentences Smart Turn called unfinished 30 ms into
# the pause (s07, s16), and of two first halves it closed with a period (s00, s18).
FINISHED = (
    "The meeting with the design team has been moved to Thursday afternoon.",
    "Is there a pharmacy open near the station at this hour?",
)
HALVES = ("I would like to book a flight.", "Turn off the lights in the light.")


def test_message_words_drop_case_and_punctuation() -> None:
    assert message_words("  Set an alarm for 7.30, please!  ") == "set an alarm for 730 please"
    assert message_words("I'm done - thanks.") == "i'm done - thanks"


def test_finished_sentences_score_above_the_bar_and_closed_halves_below() -> None:
    model = WordsTurn()
    finished, halves = model.logp_end(FINISHED), model.logp_end(HALVES)
    bar = WORDS_BARS["auto"]
    assert min(finished) >= bar and max(halves) < bar - 5, (finished, halves)
    # One call per text: the same score alone as among others.
    assert abs(model.logp_end([FINISHED[0]])[0] - finished[0]) < 1e-4


async def test_the_stage_answers_words_beside_audio_scores() -> None:
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        caps = orch.capabilities()
        assert caps.end_of_turn and caps.end_of_turn_words
        handle = await orch.submit({"live": True}, session_key="s", entry="vad")
        texts = {"done": FINISHED[0], "half": HALVES[0]}
        for ref, text in texts.items():
            ask = TurnControl("score_words", params={"ref": ref, "text": text})
            assert await orch.append_input(handle.request_id, ask)
        got: dict[str, float] = {}
        async with asyncio.timeout(60):
            async for out in handle:
                if isinstance(out, TurnScore):
                    got[out.ref] = out.probability
                    if len(got) == len(texts):
                        break
        assert math.log(got["done"]) >= WORDS_BARS["auto"] > math.log(got["half"]), got
        assert orch.metrics.stages["end_of_turn"].counters["word_decisions"] == 2
    finally:
        await orch.close()
