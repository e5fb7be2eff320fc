"""`speech.live_asr` with its background lane (engines/speech/asr_lane.py), stepped directly with
fake Whisper models: a decision's draft is made on the step while the lane is busy with work no
decision waits on; the lane takes one run at a time and a later step sends its words; with
`nice` > 0 the threads the lane's model creates run at a lower CPU priority, the lane's own
thread not."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from engines.speech.asr_lane import AsrLane
from engines.speech.live_asr import LiveAsrEngine, LiveAsrState
from runtime.payloads import Payload
from tests.engines_speech.test_live_asr_jobs import (
    FakeWhisper,
    S,
    control,
    finals,
    scored,
    start,
    step,
    texts,
)

pytestmark = pytest.mark.unit

WAIT_S = 10  # a lane run's end, awaited (never reached: the fakes answer at once once let go)


class GatedWhisper(FakeWhisper):
    """The lane's model: each run waits until the test lets it go (`gate`)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Event()

    def transcribe(self, audio: np.ndarray) -> str:
        self.started.set()
        assert self.gate.wait(WAIT_S)
        return super().transcribe(audio)


def engine() -> tuple[LiveAsrEngine, FakeWhisper, GatedWhisper]:
    eng = LiveAsrEngine({"idle_audio_s": 1, "max_audio_s": 20, "partial_interval_ms": 300})
    whisper, background = FakeWhisper(), GatedWhisper()
    eng._asr = whisper  # type: ignore[assignment]
    eng._lane = AsrLane(lambda: background, nice=0)
    return eng, whisper, background


def settle(state: LiveAsrState) -> None:
    """Wait for the request's lane run to end (the next step collects it)."""
    assert state.lane is not None
    state.lane.future.result(WAIT_S)


def test_a_decisions_draft_is_made_while_the_lane_runs_another_sessions_transcript() -> None:
    """b's pause transcript (a response waits on it) goes to the lane, which is held mid-run;
    a's decision asks for its draft meanwhile: the step makes it at once. b's words come in a
    later step, once the lane's run has ended; until then b is stepped again on a short timer."""
    eng, whisper, background = engine()
    a, b = start(eng), start(eng)
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2)]
    out = step(eng, (b, b_in))
    assert texts(out[0]) == [] and background.started.wait(WAIT_S)
    assert out[0].wait_for_input is False and out[0].not_before is not None  # polls the lane
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 4, first=True)]
    out = step(eng, (a, a_in), (b, []))
    assert [texts(o) for o in out] == [[("a1", f"[0:{S // 4}]")], []]
    assert whisper.runs == [(0, S // 4)]  # the draft, on the step's model
    background.gate.set()
    settle(b)
    out = step(eng, (a, []), (b, []))
    assert [texts(o) for o in out] == [[], [("b1", f"[0:{S // 2}]")]]
    assert background.runs == [(0, S // 2)] and out[1].wait_for_input is True and b.lane is None


def test_a_doubted_draft_is_redone_on_the_lane_on_the_30_s_window() -> None:
    eng, whisper, background = engine()
    whisper.sure = False
    background.gate.set()
    a = start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 2, first=True)]
    out = step(eng, (a, a_in))
    assert finals(out[0]) == [("a1", f"~[0:{S // 2}]", False)]
    settle(a)
    out = step(eng, (a, []))
    assert finals(out[0]) == [("a1", f"[0:{S // 2}]", True)]
    assert whisper.full == 0 and background.full == 1  # the redo ran on the lane's model


def test_the_lane_takes_one_run_at_a_time_the_oldest_first() -> None:
    eng, _, background = engine()
    a, b = start(eng), start(eng)
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2)]
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 4)]
    out = step(eng, (b, b_in), (a, a_in))
    assert b.lane is not None and a.lane is None and [j.ref for j in a.jobs] == ["a1"]
    assert out[1].not_before is not None  # a waits for the lane on a timer, not at once
    background.gate.set()
    settle(b)
    out = step(eng, (b, []), (a, []))  # b's words out; the idle lane takes a's
    assert [texts(o) for o in out] == [[("b1", f"[0:{S // 2}]")], []] and a.lane is not None
    settle(a)
    out = step(eng, (b, []), (a, []))
    assert [texts(o) for o in out] == [[], [("a1", f"[0:{S // 4}]")]]


def test_a_run_the_session_stopped_waiting_for_sends_no_words() -> None:
    eng, _, background = engine()
    a = start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 2)]
    step(eng, (a, a_in))
    assert background.started.wait(WAIT_S)
    step(eng, (a, [control("transcribe_cancel", ref="a1")]))
    background.gate.set()
    settle(a)
    out = step(eng, (a, []))
    assert texts(out[0]) == [] and a.lane is None


def test_partials_run_on_the_lane_and_their_agreed_words_go_out_when_collected() -> None:
    """While the user speaks, each partial is a lane run; the step that collects the second
    hypothesis sends the words the two agree on."""
    eng, whisper, _ = engine()
    background = SameWords()
    eng._lane = AsrLane(lambda: background, nice=0)
    a = start(eng)
    items: list[Payload] = [control("speech_started", ref="ia", start=0, partials=True), *scored(0, 0.5, 0.9)]
    out = step(eng, (a, items))
    assert texts(out[0]) == [] and a.lane is not None
    settle(a)
    out = step(eng, (a, scored(S // 2, 0.5, 0.9)))  # the first hypothesis: nothing agreed yet
    assert texts(out[0]) == [] and a.lane is not None  # the next partial is on the lane
    settle(a)
    out = step(eng, (a, scored(S, 0.25, 0.9)))
    assert texts(out[0]) == [("ia", "hello there")]
    assert whisper.runs == [] and len(background.runs) == 2  # none on the step's model


class SameWords(FakeWhisper):
    def transcribe(self, audio: np.ndarray) -> str:
        super().transcribe(audio)
        return "hello there"


def test_the_threads_the_lanes_model_starts_run_at_a_lower_priority_the_lane_itself_not() -> None:
    """The model's compute threads (started while it is built) are niced; the lane's own thread,
    which holds the GIL for Python work between them, is not (a niced GIL holder stalls the
    process), nor is the caller's."""
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def build() -> FakeWhisper:
        seen["build"] = priority()
        child = threading.Thread(target=lambda: seen.setdefault("model thread", priority()))
        child.start()
        child.join()
        return FakeWhisper()

    lane = AsrLane(build, nice=5)
    try:
        run = lane.try_run(lambda _model: str(priority()))
        assert run is not None and int(run.result(WAIT_S)) == me
        assert seen == {"build": min(19, me + 5), "model thread": min(19, me + 5)}
        assert priority() == me
    finally:
        lane.close()


def test_a_model_that_fails_to_build_fails_the_lane_on_the_callers_thread() -> None:
    def build() -> FakeWhisper:
        raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match="no model here"):
        AsrLane(build, nice=0)


def test_a_second_decisions_words_wait_for_the_next_step_never_for_the_lane() -> None:
    """Two decisions' asks in one step: the step makes one; the other is made by the next step
    (on the step's model, as a draft), never handed to the lower-priority lane."""
    eng, whisper, background = engine()
    background.gate.set()
    a, b = start(eng), start(eng)
    a_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 4, first=True)]
    b_in = [*scored(0, 1.0, 0.9), control("transcribe", ref="b1", start=0, end=S // 2, first=True)]
    out = step(eng, (a, a_in), (b, b_in))
    assert [texts(o) for o in out] == [[], [("b1", f"[0:{S // 2}]")]]  # the newer decision first
    assert a.lane is None and out[0].wait_for_input is False and out[0].not_before is None
    out = step(eng, (a, []), (b, []))
    assert [texts(o) for o in out] == [[("a1", f"[0:{S // 4}]")], []]
    assert background.runs == [] and len(whisper.runs) == 2
