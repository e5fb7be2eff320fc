"""`loadtest.clause_cuts`: the cuts fall after a word a clause can end on (never one the words'
veto reads), and the report counts per half what each eagerness's rule ends."""

from __future__ import annotations

import pytest

from loadtest.clause_cuts import CUTS, report
from loadtest.turn_set import SENTENCES
from session.realtime.semantic_turn import transcript_cue

pytestmark = pytest.mark.unit


def test_every_cut_ends_on_a_word_the_veto_does_not_read() -> None:
    assert len(CUTS) == len(SENTENCES)
    for (text, _), cut in zip(SENTENCES, CUTS, strict=True):
        assert 0 < cut < len(text.split())
        assert transcript_cue(" ".join(text.split()[:cut]) + ".") == "closed", text


def test_report_counts_each_rule_per_half() -> None:
    rows = [
        {"sentence": 0, "p": 0.6, "draft": "I would like to book a flight."},  # auto and high end it
        {"sentence": 1, "p": 0.1, "draft": "Can you tell me the weather in Boston?"},  # none
        {"sentence": 12, "p": 0.95, "draft": "I want to send a message"},  # plain words: p decides
        {"sentence": 13, "p": 0.99, "draft": "Tell me a short story about"},  # open: vetoed
    ]
    out = report(rows)
    tuning, held = out["s00-s09"], out["s10-s19"]
    assert tuning["first_halves"] == 2 and held["first_halves"] == 2
    assert tuning["words_end_a_sentence"] == 2 and held["words_end_a_sentence"] == 0
    ended = {name.split(":")[0]: n for name, n in tuning["ended_at_the_pause"].items()}
    assert ended == {"high": 1, "auto": 1, "low": 0}
    ended = {name.split(":")[0]: n for name, n in held["ended_at_the_pause"].items()}
    assert ended == {"high": 1, "auto": 1, "low": 1}
