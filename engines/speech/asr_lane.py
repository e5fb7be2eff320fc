"""The live ASR's background lane: Whisper runs no end-of-turn decision waits on, beside the stage.

A ``semantic_vad`` decision waits for Whisper's draft of the turn so far (``first`` jobs of
:mod:`engines.speech.live_asr`); everything else the live ASR makes (a response's words, the
30 s-window redo of a draft the guard doubts, the partials while the user speaks) has hundreds
of milliseconds to spare. With every run on the stage's own step, a draft asked while another
session's run was under way waited for it: the redo's 30 s encode is ~0.6 s of one core, 2-3x
that next to a busy neighbour (a draft's wait was 2.0-2.3 s with one CPU hog, docs/benchmarks.md).
Ranking the queue cannot help a run already started.

So those runs go here: one thread of their own, one run at a time, on a Whisper model of their
own whose compute threads can run at a lower CPU priority (``nice``, 0 by default: at +10
the lane starved beside other processes' work, and a response waits on its words): the model is built on a
short-lived thread whose priority was lowered, and CTranslate2's worker threads, which it
creates and which do the work with the GIL released, inherit it. With `nice` > 0 the scheduler then gives
a draft on the stage's thread the core first and the background run what is left. The lane's
own thread, which holds the GIL for faster-whisper's Python and numpy work, keeps the normal
priority: a niced thread descheduled while holding the GIL would stall every other thread of
the process (measured: the server's CPU +28 % and drafts waiting 1.8 s with one CPU hog, when
the whole lane was niced). A run is handed over only when the lane is idle (the work left waits
in the stage, ranked as before) and collected by a later step of its request
(``engines.speech.live_asr``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class LaneModel(Protocol):
    """What the lane runs (:class:`engines.speech.asr.WhisperAsr`)."""

    def transcribe(self, audio16k: np.ndarray) -> str: ...

    def transcribe_full(self, audio16k: np.ndarray) -> str: ...


def transcribe_on(model: LaneModel, *, audio: np.ndarray, full: bool = False) -> str:
    """A background run (picklable, for a lane in a process): the transcript of `audio`
    (`full`: the 30 s window's, a draft's redo)."""
    if not len(audio):
        return ""
    return model.transcribe_full(audio) if full else model.transcribe(audio)


class BackgroundLane(Protocol):
    """What the live ASR hands background runs to: this module's :class:`AsrLane` (a thread)
    or :class:`engines.speech.lane_process.ProcessLane` (a process a draft can hold still)."""

    @property
    def idle(self) -> bool: ...

    def try_run(self, work: Callable[[LaneModel], str]) -> Future[str] | None: ...

    def close(self) -> None: ...


def _lower_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (Linux: per thread; threads it creates inherit
    it). Where that is not possible the lane runs at normal priority."""
    if nice <= 0:
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except (AttributeError, OSError) as exc:  # pragma: no cover - platform dependent
        log.warning("asr lane: cannot lower its priority (%s); it runs at normal priority", exc)


class AsrLane:
    """One background thread and its model. `build` makes the model (called on a thread whose
    priority is lowered by `nice` first, so the threads the model starts run at it; 0: not
    lowered)."""

    def __init__(self, build: Callable[[], LaneModel], nice: int = 0) -> None:
        built: list[LaneModel | BaseException] = []

        def build_niced() -> None:
            _lower_priority(nice)
            try:
                built.append(build())
            except BaseException as exc:  # raised again on the caller's thread
                built.append(exc)

        builder = threading.Thread(target=build_niced, name="asr-lane-build")
        builder.start()
        builder.join()
        if isinstance(built[0], BaseException):
            raise built[0]
        self._model = built[0]
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="asr-lane")
        self._lock = threading.Lock()  # two stage workers may offer work at once
        self._running: Future[str] | None = None

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._running is None or self._running.done()

    def try_run(self, work: Callable[[LaneModel], str]) -> Future[str] | None:
        """Start `work(model)` if the lane is idle; None if a run is under way."""
        with self._lock:
            if self._running is not None and not self._running.done():
                return None
            self._running = self._executor.submit(work, self._model)
            return self._running

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
