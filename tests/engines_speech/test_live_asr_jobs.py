"""`speech.live_asr`'s pause transcripts, stepped directly (no orchestrator; a fake Whisper that
says how many samples it was given): what a step makes when its input comes coalesced (a
backlog of several pauses at once), which transcripts it drops, and in what order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engines.speech.live_asr import LiveAsrEngine, LiveAsrState
from engines.speech.vad import FRAME_SAMPLES
from runtime.edges import Chunk
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioInput, Payload, Transcript, TurnControl, VoiceActivity

pytestmark = pytest.mark.unit

PIECE = 8 * FRAME_SAMPLES  # what the VAD hands on at a time here (256 ms)
S = 4 * PIECE  # "a second" in these tests: whole pieces (1.02 s)


class FakeWhisper:
    """Each run's audio, as (first sample value, length): the audio is the timeline's sample
    index (so a span's first sample names where it starts)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, int]] = []
        self.sure = True  # what `draft` says of its words (False: the guard would redo them)
        self.full = 0  # runs on the 30 s window

    def transcribe(self, audio: np.ndarray) -> str:
        self.runs.append((int(audio[0]), len(audio)))
        return f"[{int(audio[0])}:{int(audio[0]) + len(audio)}]"

    def draft(self, audio: np.ndarray) -> tuple[str, bool]:
        text = self.transcribe(audio)
        return (text, True) if self.sure else ("~" + text, False)

    def transcribe_full(self, audio: np.ndarray) -> str:
        self.full += 1
        return self.transcribe(audio)


def engine() -> tuple[LiveAsrEngine, FakeWhisper]:
    eng = LiveAsrEngine({"idle_audio_s": 1, "max_audio_s": 20})
    whisper = FakeWhisper()
    eng._asr = whisper  # type: ignore[assignment]
    return eng, whisper


def scored(start: int, seconds: float, prob: float) -> list[Payload]:
    """`seconds` (of S) of scored audio as the VAD stage hands it on, in quarters of S; sample
    values = their timeline index."""
    out: list[Payload] = []
    for at in range(start, start + round(seconds * 4) * PIECE, PIECE):
        samples = np.arange(at, at + PIECE, dtype=np.float32)
        out += [AudioInput(samples, 16000, start_sample=at), VoiceActivity(at, [prob] * 8)]
    return out


def control(kind: str, **params: Any) -> TurnControl:
    return TurnControl(kind, params=params)


def step(eng: LiveAsrEngine, *sessions: tuple[LiveAsrState, list[Payload]]) -> list[StepOutput]:
    """One step; each session's input in one coalesced chunk."""
    batch = [StepInput(state, chunks=[Chunk(list(items))]) for state, items in sessions]  # type: ignore[arg-type]
    return eng.step(batch)


def texts(out: StepOutput) -> list[tuple[str | None, str]]:
    return [(t.ref, t.text) for t in out.client if isinstance(t, Transcript)]


def start(eng: LiveAsrEngine) -> LiveAsrState:
    return eng.start(EngineRequest(request_id="r", params={}))


def test_a_backlog_with_pauses_spoken_past_makes_only_the_current_pause() -> None:
    """A Whisper run held the stage for 3 s: the session asked for pauses at 1.0 s and 2.0 s of
    the one utterance and went on speaking past both (it said so for the first); only the last
    pause is current. One Whisper run, of the turn so far; the others answered with no words."""
    eng, whisper = engine()
    st = start(eng)
    u = 0  # the utterance's start
    backlog: list[Payload] = [control("speech_started", ref="i1", start=u)]
    backlog += scored(0, 1.0, 0.9)
    backlog += [control("transcribe", ref="t1", start=u, end=S), *scored(S, 0.5, 0.9)]
    backlog += [control("spoken_past", start=u, end=S), *scored(S + S // 2, 0.5, 0.9)]
    backlog += [control("transcribe", ref="t2", start=u, end=2 * S), *scored(2 * S, 0.75, 0.9)]
    backlog += [control("transcribe", ref="t3", start=u, end=2 * S + S // 2)]
    (out,) = step(eng, (st, backlog))
    assert whisper.runs == [(0, 2 * S + S // 2)]  # the turn so far, to the current pause
    assert texts(out) == [("t1", ""), ("t2", ""), ("t3", f"[0:{2 * S + S // 2}]")]
    assert out.counters["transcripts_dropped"] == 2 and out.counters["transcripts"] == 1


def test_a_pause_that_ended_a_turn_is_made_whatever_the_next_turn_does() -> None:
    """The pause at 1 s ended its turn (speech_stopped); the next utterance (start 1.5 s) is
    spoken past its own pause: that drops its own transcript only. The finished turn's is made
    whole, exactly its stretch."""
    eng, whisper = engine()
    st = start(eng)
    backlog: list[Payload] = [control("speech_started", ref="i1", start=0), *scored(0, 1.0, 0.9)]
    backlog += [control("transcribe", ref="t1", start=0, end=S), *scored(S, 0.5, 0.0)]
    backlog += [control("speech_stopped", ref="i1", end=S + S // 2)]
    second = S + S // 2
    backlog += [control("speech_started", ref="i2", start=second), *scored(second, 1.0, 0.9)]
    backlog += [control("transcribe", ref="t2", start=second, end=second + S // 2)]
    backlog += [control("spoken_past", start=second, end=second + S // 2), *scored(second + S, 0.5, 0.9)]
    (out,) = step(eng, (st, backlog))
    assert whisper.runs == [(0, S)]
    assert texts(out) == [("t2", ""), ("t1", f"[0:{S}]")]


def test_one_run_a_step_the_oldest_ask_first_and_the_rest_stepped_again_at_once() -> None:
    """Two sessions with a pause each (b asked first) and one of a's still waiting for its
    audio: the first step makes b's, a's next; a request left with a transcript to make asks to
    be stepped again without new input, one waiting for its audio does not."""
    eng, whisper = engine()
    a, b = start(eng), start(eng)
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2)]
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 4)]
    first = step(eng, (b, b_in), (a, a_in))
    assert [texts(o) for o in first] == [[("b1", f"[0:{S // 2}]")], []]
    assert first[0].wait_for_input and not first[1].wait_for_input
    a_more = [control("transcribe", ref="a2", start=S // 4 * 3, end=3 * S)]  # audio not here yet
    second = step(eng, (b, []), (a, a_more))
    assert [texts(o) for o in second] == [[], [("a1", f"[0:{S // 4}]")]]
    assert second[1].wait_for_input  # a2 waits for its audio
    assert len(whisper.runs) == 2


def test_partials_wait_for_a_step_with_no_pause_to_transcribe() -> None:
    eng, whisper = engine()
    eng.partial_interval = S // 2
    a, b = start(eng), start(eng)
    a_in = [control("speech_started", ref="ia", start=0, partials=True), *scored(0, 1.0, 0.9)]
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2)]
    out = step(eng, (a, a_in), (b, b_in))
    assert texts(out[1]) == [("b1", f"[0:{S // 2}]")] and texts(out[0]) == []
    out = step(eng, (a, scored(S, 0.25, 0.9)), (b, []))
    assert len(whisper.runs) == 2 and whisper.runs[1][0] == 0  # now a's partial: its utterance so far


def test_a_coalesced_backlog_holds_what_the_same_input_step_by_step_holds() -> None:
    """Coalescing changes how many steps the input comes in, not what the stage keeps."""
    items = [*scored(0, 2.0, 0.0), *scored(2 * S, 1.0, 0.9), *scored(3 * S, 4.0, 0.0)]
    items.insert(len(items) // 2, control("speech_started", ref="i1", start=2 * S - PIECE))
    eng, _ = engine()
    one, many = start(eng), start(eng)
    step(eng, (one, items))
    for k in range(0, len(items), 3):
        step(eng, (many, items[k : k + 3]))
    assert one.held_from() == many.held_from() and one.end == many.end
    assert one.span(2 * S - PIECE, 3 * S).tolist() == many.span(2 * S - PIECE, 3 * S).tolist()


def test_a_transcript_a_decision_waits_on_goes_before_older_ones_a_response_reads() -> None:
    eng, _ = engine()
    a, b = start(eng), start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 2)]
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 4, first=True)]
    out = step(eng, (a, a_in), (b, b_in))
    assert [texts(o) for o in out] == [[], [("b1", f"[0:{S // 4}]")]]
    out = step(eng, (a, []), (b, []))
    assert [texts(o) for o in out] == [[("a1", f"[0:{S // 2}]")], []]


def test_decisions_newest_first_a_turns_end_demotes_and_a_cancel_is_never_made() -> None:
    """Under load an old decision is past its maximum pause: of the asks a decision waits on,
    the newest goes first. Once its turn has ended (speech_stopped) only a response waits on
    an ask: it goes behind the decisions. An ask the session stopped waiting for is never made."""
    eng, whisper = engine()
    a, b, c = start(eng), start(eng), start(eng)
    a_in = [control("speech_started", ref="ia", start=0), *scored(0, 1.0, 0.9)]
    a_in.append(control("transcribe", ref="a1", start=0, end=S // 4, first=True))
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2, first=True)]
    c_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="c1", start=0, end=S // 2)]
    c_in.append(control("transcribe_cancel", ref="c1"))
    out = step(eng, (a, a_in), (b, b_in), (c, c_in))
    assert [texts(o) for o in out] == [[], [("b1", f"[0:{S // 2}]")], []]  # b1: the newer decision
    a_more = [control("transcribe", ref="a2", start=S // 2, end=S, first=True)]
    a_more.insert(0, control("speech_stopped", ref="ia", end=S // 2))  # a1's turn ended: demoted
    out = step(eng, (a, a_more), (b, []), (c, []))
    assert texts(out[0]) == [("a2", f"[{S // 2}:{S}]")]
    out = step(eng, (a, []), (b, []), (c, []))
    assert texts(out[0]) == [("a1", f"[0:{S // 4}]")]
    assert len(whisper.runs) == 3 and not any(texts(o) for o in out[1:])  # c1 never made


def finals(out: StepOutput) -> list[tuple[str | None, str, bool]]:
    return [(t.ref, t.text, t.final) for t in out.client if isinstance(t, Transcript)]


def test_a_decision_gets_a_draft_at_once_and_the_final_words_after_the_other_decisions() -> None:
    """A decision's words the ASR's guard would redo on the 30 s window come as a draft at
    once (where the words stop is what the decision reads); the redo follows as a transcript
    only a response waits on: behind the other sessions' decisions."""
    eng, whisper = engine()
    whisper.sure = False
    a, b = start(eng), start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 2, first=True)]
    out = step(eng, (a, a_in), (b, []))
    assert finals(out[0]) == [("a1", f"~[0:{S // 2}]", False)] and out[0].wait_for_input is False
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 4, first=True)]
    whisper.sure = True
    out = step(eng, (a, []), (b, b_in))
    assert [finals(o) for o in out] == [[], [("b1", f"[0:{S // 4}]", True)]]
    out = step(eng, (a, []), (b, []))
    assert finals(out[0]) == [("a1", f"[0:{S // 2}]", True)] and whisper.full == 1
    assert out[0].wait_for_input is True


def test_the_final_words_of_a_pause_spoken_past_are_never_made() -> None:
    eng, whisper = engine()
    whisper.sure = False
    a = start(eng)
    a_in = [control("speech_started", ref="ia", start=0), *scored(0, 1.0, 0.9)]
    a_in.append(control("transcribe", ref="a1", start=0, end=S // 2, first=True))
    out = step(eng, (a, a_in))
    assert finals(out[0]) == [("a1", f"~[0:{S // 2}]", False)]
    out = step(eng, (a, [control("spoken_past", start=0, end=S // 2)]))
    assert finals(out[0]) == [("a1", "", True)] and whisper.full == 0 and len(whisper.runs) == 1


def test_a_decision_known_to_wait_goes_before_newer_ones_whose_score_is_not_back() -> None:
    """`transcribe_needed`: the decision's score came back and waits for these words; of the
    asks a decision may wait on, such ones go first (the oldest first), ahead of newer ones
    whose pause the model may yet call unfinished."""
    eng, _ = engine()
    a, b, c = start(eng), start(eng), start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 4, first=True)]
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2, first=True)]
    b_in.append(control("transcribe_needed", ref="b1"))
    c_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="c1", start=0, end=S // 2, first=True)]
    out = step(eng, (a, a_in), (b, b_in), (c, c_in))
    assert [texts(o) for o in out] == [[], [("b1", f"[0:{S // 2}]")], []]  # not c1, the newest
    out = step(eng, (a, [control("transcribe_needed", ref="a1")]), (b, []), (c, []))
    assert [texts(o) for o in out] == [[("a1", f"[0:{S // 4}]")], [], []]
    out = step(eng, (a, []), (b, []), (c, []))
    assert [texts(o) for o in out] == [[], [], [("c1", f"[0:{S // 2}]")]]
