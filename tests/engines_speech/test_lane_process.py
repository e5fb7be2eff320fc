"""The live ASR's background lane in a process (engines/speech/lane_process.py), with the real
Whisper model in a real child process: its words are the in-process model's; a hold stops the
process while a run is under way (the kernel says so) and continues it after, the run losing
nothing; no run is handed over during a hold; holds are bounded by a timer and by a budget; a
child that dies fails its run with a clear error and a fresh one takes the next; closing leaves
no process. The budget is also tested on its own (sans-I/O)."""

from __future__ import annotations

import functools
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest

from engines.speech.asr import AsrConfig
from engines.speech.asr_lane import transcribe_on
from engines.speech.lane_process import HoldBudget, LaneDied, ProcessLane
from tests.engines_speech.conftest import SENTENCE, words

pytestmark = pytest.mark.system

CONFIG = AsrConfig(compute_type="int8", cpu_threads=1)
WAIT_S = 60


def state_of(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, want: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    got = state_of(pid)
    while (got == "T") != (want == "T") and time.monotonic() < deadline:
        time.sleep(0.005)
        got = state_of(pid)
    return got


def slow_work(model: Any, *, audio: np.ndarray, seconds: float) -> str:
    """A run that takes `seconds` of CPU in the child (wall time grows while it is stopped)."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
    return str(model.transcribe(audio))


def crash(model: Any) -> str:
    os._exit(3)


@pytest.fixture(scope="module")
def lane() -> Iterator[ProcessLane]:
    lane = ProcessLane(CONFIG, max_hold_s=2.0, hold_share=0.9, window_s=10.0)
    yield lane
    lane.close()


def run(lane: ProcessLane, work: Callable[[Any], str]) -> Future[str]:
    future = lane.try_run(work)
    assert future is not None
    return future


def slow_run(lane: ProcessLane, audio: np.ndarray, seconds: float) -> tuple[int, Future[str]]:
    """The lane's pid and a run that is under way in the child (`seconds` of its CPU)."""
    pid = lane.pid
    assert pid is not None
    future = run(lane, functools.partial(slow_work, audio=audio, seconds=seconds))
    time.sleep(0.05)
    return pid, future


def test_the_lane_transcribes_in_a_child_process_as_the_model_does_here(
    lane: ProcessLane, sentence16k: np.ndarray, asr: Any
) -> None:
    assert lane.pid is not None and lane.pid != os.getpid()
    text = run(lane, functools.partial(transcribe_on, audio=sentence16k)).result(WAIT_S)
    assert words(text) == words(SENTENCE)
    assert text == asr.transcribe(sentence16k)
    full = run(lane, functools.partial(transcribe_on, audio=sentence16k, full=True)).result(WAIT_S)
    assert words(full) == words(SENTENCE)
    assert lane.idle


def test_a_hold_stops_the_process_while_a_run_is_under_way_and_the_run_finishes_after(
    lane: ProcessLane, sentence16k: np.ndarray
) -> None:
    pid = lane.pid
    assert pid is not None
    future = run(lane, functools.partial(slow_work, audio=sentence16k, seconds=0.6))
    time.sleep(0.1)  # the child is in its run
    holds = lane.holds
    with lane.hold() as held:
        assert held
        assert wait_state(pid, "T") == "T"
        # Held: no run is handed over.
        assert lane.try_run(functools.partial(transcribe_on, audio=sentence16k)) is None
        time.sleep(0.3)
        assert not future.done()
    assert wait_state(pid, "R") != "T"
    assert words(future.result(WAIT_S)) == words(SENTENCE)
    assert lane.holds == holds + 1
    assert lane.held_s >= 0.3


def test_a_hold_with_no_run_under_way_stops_nothing_but_hands_none_over(
    lane: ProcessLane, sentence16k: np.ndarray
) -> None:
    assert lane.idle and lane.pid is not None
    with lane.hold() as held:
        assert not held
        assert state_of(lane.pid) != "T"
        assert not lane.idle
        assert lane.try_run(functools.partial(transcribe_on, audio=sentence16k)) is None
    assert lane.idle


def test_two_drafts_hold_it_until_the_last_one_ends(lane: ProcessLane, sentence16k: np.ndarray) -> None:
    pid, future = slow_run(lane, sentence16k, 0.4)
    with lane.hold() as first:
        assert first and wait_state(pid, "T") == "T"
        with lane.hold() as second:
            assert second
        assert state_of(pid) == "T"  # the first draft still runs
    assert wait_state(pid, "R") != "T"
    future.result(WAIT_S)


def test_a_hold_longer_than_max_hold_continues_the_process(sentence16k: np.ndarray) -> None:
    lane = ProcessLane(CONFIG, max_hold_s=0.2, hold_share=0.9, window_s=10.0)
    try:
        pid, future = slow_run(lane, sentence16k, 0.3)
        with lane.hold() as held:
            assert held and wait_state(pid, "T") == "T"
            time.sleep(0.5)
            assert state_of(pid) != "T"  # the timer continued it
            assert words(future.result(WAIT_S)) == words(SENTENCE)  # it ended while still "held"
        assert 0.15 <= lane.held_s <= 0.45
    finally:
        lane.close()


def test_the_budget_refuses_a_hold_past_its_share(sentence16k: np.ndarray) -> None:
    lane = ProcessLane(CONFIG, max_hold_s=1.0, hold_share=0.1, window_s=2.0)
    try:
        future = run(lane, functools.partial(slow_work, audio=sentence16k, seconds=1.0))
        time.sleep(0.05)
        with lane.hold() as held:
            assert held
            time.sleep(0.25)  # past 10 % of 2 s
        with lane.hold() as again:
            assert not again
            assert lane.pid is not None and state_of(lane.pid) != "T"
        assert lane.skipped == 1 and lane.holds == 1
        future.result(WAIT_S)
    finally:
        lane.close()


def test_a_child_that_dies_fails_its_run_and_a_fresh_one_takes_the_next(sentence16k: np.ndarray) -> None:
    lane = ProcessLane(CONFIG)
    try:
        first = lane.pid
        with pytest.raises(LaneDied, match=r"died \(exit code 3\)"):
            run(lane, crash).result(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while not lane.idle and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lane.idle and lane.pid not in (None, first)
        text = run(lane, functools.partial(transcribe_on, audio=sentence16k)).result(WAIT_S)
        assert words(text) == words(SENTENCE)
    finally:
        lane.close()


def test_close_ends_the_process_even_while_it_is_held(sentence16k: np.ndarray) -> None:
    lane = ProcessLane(CONFIG)
    pid, _run = slow_run(lane, sentence16k, 5.0)
    with lane.hold() as held:
        assert held
        lane.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the lane's process outlived close()")


def test_hold_budget_counts_the_held_time_in_its_window() -> None:
    budget = HoldBudget(share=0.5, window_s=2.0)
    assert budget.allows(10.0)
    budget.record(10.0, 10.6)
    assert budget.held(10.6) == pytest.approx(0.6)
    assert budget.allows(10.6)
    budget.record(10.7, 11.2)
    assert budget.held(11.2) == pytest.approx(1.1)
    assert not budget.allows(11.2)  # 1.1 s of the last 2 s
    assert budget.held(12.3) == pytest.approx(0.3 + 0.5)  # of (10.3, 12.3]
    assert budget.allows(12.3)
    assert budget.held(13.0, since=12.8) == pytest.approx(0.2 + 0.2)  # (11.0, 13.0]: one ended, one under way
    assert not HoldBudget(share=0.0, window_s=2.0).allows(0.0)


class HoldWatchingWhisper:
    """The live ASR's step model (a fake): each draft records the lane process's state."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.states: list[str] = []

    def draft(self, audio: np.ndarray) -> tuple[str, bool]:
        self.states.append(wait_state(self.pid, "T"))
        return "the words.", True


def test_a_decisions_draft_on_the_live_asr_holds_the_background_process_still(
    lane: ProcessLane, sentence16k: np.ndarray
) -> None:
    """A run of the lane's process under way (a response's words, say) is stopped while the
    live ASR makes a decision's draft on its step, and goes on after it."""
    from engines.speech.live_asr import LiveAsrEngine
    from tests.engines_speech.test_live_asr_jobs import S, control, scored, start, step, texts

    assert lane.pid is not None
    eng = LiveAsrEngine({"idle_audio_s": 1, "max_audio_s": 20})
    whisper = HoldWatchingWhisper(lane.pid)
    eng._asr = whisper  # type: ignore[assignment]
    future = lane.submit(functools.partial(slow_work, audio=sentence16k, seconds=0.5))
    time.sleep(0.05)
    a = start(eng)
    out = step(
        eng, (a, [*scored(0, 1.0, 0.9), control("transcribe", ref="a1", start=0, end=S // 2, first=True)])
    )
    assert texts(out[0]) == [("a1", "the words.")]
    assert whisper.states == ["T"] and out[0].counters["lane_holds"] == 1
    assert wait_state(lane.pid, "R") != "T"
    assert words(future.result(WAIT_S)) == words(SENTENCE)


def test_a_speech_asr_stage_in_a_process_transcribes_in_order_between_holds(
    lane: ProcessLane, sentence16k: np.ndarray
) -> None:
    """``speech.asr`` with ``background_process``: its words come from a Whisper in a child
    process (the in-process model's words), queued behind a hold."""
    from engines.speech.lane_process import hold_background
    from engines.speech.stages import AsrEngine
    from tests.engines_speech.conftest import run_engine

    eng = AsrEngine({"compute_type": "int8", "cpu_threads": 1, "background_process": True})
    eng.load()
    try:
        assert eng._lane is not None and eng._lane.pid not in (None, os.getpid())
        queued = eng._lane.submit(functools.partial(slow_work, audio=sentence16k, seconds=0.3))
        time.sleep(0.05)
        with hold_background() as held:
            assert held >= 1 and state_of(eng._lane.pid or 0) == "T"
            behind = eng._lane.submit(functools.partial(transcribe_on, audio=sentence16k))
            time.sleep(0.2)
            assert not queued.done() and not behind.done()
        assert words(behind.result(WAIT_S)) == words(SENTENCE) and queued.done()
        steps = run_engine(eng, {"audio": sentence16k})
        assert words(steps[-1][1].client[0].text) == words(SENTENCE)  # type: ignore[attr-defined]
    finally:
        eng.close()
    assert eng._lane.pid is None or not os.path.exists(f"/proc/{eng._lane.pid}")
