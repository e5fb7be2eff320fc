from __future__ import annotations

import pytest

from engines.speech.tts import ClauseSplitter, split_clauses

pytestmark = pytest.mark.system


@pytest.mark.parametrize(
    ("text", "clauses"),
    [
        ("You said: the quick brown fox.", ["You said:", "the quick brown fox."]),
        ("Hi! How are you? Fine; thanks, really.", ["Hi!", "How are you?", "Fine;", "thanks,", "really."]),
        ("Mr. Smith paid 3.5 dollars, or 1,000 cents.", ["Mr. Smith paid 3.5 dollars,", "or 1,000 cents."]),
        ("e.g. this one", ["e.g. this one"]),
        ('He said "stop." Then left', ['He said "stop."', "Then left"]),
        ("... ?! ", []),
        ("no punctuation at all", ["no punctuation at all"]),
        ("", []),
    ],
)
def test_split_clauses(text: str, clauses: list[str]) -> None:
    assert split_clauses(text) == clauses


def test_long_clause_is_cut_at_word_limit() -> None:
    text = " ".join(f"w{i}" for i in range(10)) + "."
    assert split_clauses(text, max_words=4) == ["w0 w1 w2 w3", "w4 w5 w6 w7", "w8 w9."]


def test_streaming_cuts_as_soon_as_a_clause_is_known() -> None:
    splitter = ClauseSplitter(max_words=4)
    assert splitter.feed("You") == []
    assert splitter.feed(" said:") == ["You said:"]  # end of text so far counts as a boundary
    assert splitter.feed(" one two three four") == []  # "four" may still be growing
    assert splitter.feed(" five") == ["one two three four"]
    assert splitter.feed(" costs 3.") == []  # could become 3.5
    assert splitter.feed("5 now.") == ["five costs 3.5 now."]
    assert splitter.feed(" tail") == []
    assert splitter.pending_text == " tail"
    assert splitter.flush() == ["tail"]
    assert splitter.flush() == []


def test_streaming_equals_whole_text() -> None:
    text = "Well, I think so. It is 4.25 percent; isn't it? Maybe not at all, but fine."
    splitter = ClauseSplitter()
    got: list[str] = []
    for i in range(0, len(text), 3):
        got += splitter.feed(text[i : i + 3])
    got += splitter.flush()
    assert " ".join(got) == " ".join(split_clauses(text)) == text


def test_bad_max_words() -> None:
    with pytest.raises(ValueError):
        ClauseSplitter(0)
