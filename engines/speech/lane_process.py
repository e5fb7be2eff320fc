"""The live ASR's background lane in a process of its own, held still while a decision drafts.

Why (docs/benchmarks.md, issue 30): a ``semantic_vad`` decision waits for Whisper's draft of the
turn so far (~110 ms of one core on an AVX2 host) beside Smart Turn's score (~90 ms). The
background lane (:mod:`engines.speech.asr_lane`) runs the Whisper work no decision waits on (the
30 s-window redo of a doubted draft, ~0.75 s; the partials). A draft asked while such a run is
under way shares the cores with it: on a 2-core host bulk Whisper work already in flight ran
113 / 378 ms of CPU beside each draft (quiet / one CPU hog) and the draft's thread waited 62 /
196 ms for a core. CTranslate2 cannot pause a run once started (its Whisper ``generate`` has no
step callback, and a forced prefix costs what decoding it does), and a lower static priority
starves the lane beside other processes' work, where a response waits on its words.

So here the lane's model lives in a child process, and a draft *holds* it: the process is
stopped (``SIGSTOP``) while a draft runs and continued (``SIGCONT``) when the last one ends; the
run keeps its place and loses nothing. No new run is handed over during a hold. Every such
process is held at once (:func:`hold_background`): the live ASR's lane and a ``speech.asr``
stage's (whose transcriptions, the words of a response with none made ahead, ran beside
another session's draft as often as the lane's did). A hold is
bounded: ``max_hold_s`` each (a timer continues the process), and never more than
``hold_share`` of any ``window_s`` (drafts back to back cannot starve the lane): past that a
draft runs beside it, as with the thread lane. The child dies with the server
(``PR_SET_PDEATHSIG``, which reaches a stopped process too); a child that dies fails its run
(the step's error, as a run on the step would fail) and a fresh one is started.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engines.speech.asr import AsrConfig, WhisperAsr
from engines.speech.asr_lane import LaneModel

log = logging.getLogger(__name__)

START_TIMEOUT_S = 180.0  # the child imports faster-whisper and loads its model
JOIN_TIMEOUT_S = 5.0
_PR_SET_PDEATHSIG = 1


class LaneDied(RuntimeError):
    """The lane's process ended while a run was under way."""


def _die_with_parent() -> None:
    """Linux: this process is killed when its parent exits (stopped or not)."""
    if not sys.platform.startswith("linux"):  # pragma: no cover - platform dependent
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_main(conn: Connection, config: AsrConfig, parent_pid: int) -> None:
    """The lane's process: one model, one run at a time, for as long as the pipe is open."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent went before the death signal was armed
        return
    try:
        model: LaneModel = WhisperAsr(config)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            work = conn.recv()
        except (EOFError, OSError):
            return
        if work is None:
            return
        try:
            conn.send(("ok", work(model)))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class HoldBudget:
    """How long the lane has been held of late (sans-I/O: times in, decisions out): a hold
    may start while the held time in the last `window_s` is under `share` of it."""

    def __init__(self, share: float, window_s: float) -> None:
        self.share = share
        self.window_s = window_s
        self._spans: deque[tuple[float, float]] = deque()  # ended holds (start, end)

    def held(self, now: float, since: float | None = None) -> float:
        """Seconds held in (now - window_s, now], with a hold under way since `since`."""
        lo = now - self.window_s
        while self._spans and self._spans[0][1] <= lo:
            self._spans.popleft()
        total = sum(end - max(start, lo) for start, end in self._spans)
        if since is not None:
            total += now - max(since, lo)
        return total

    def allows(self, now: float) -> bool:
        return self.share > 0 and self.held(now) < self.share * self.window_s

    def record(self, start: float, end: float) -> None:
        self._spans.append((start, end))


_LANES: weakref.WeakSet[ProcessLane] = weakref.WeakSet()  # every open lane, held together
_LANES_LOCK = threading.Lock()


@contextlib.contextmanager
def hold_background() -> Iterator[int]:
    """Hold every open lane still for the block (a decision's draft); yields how many were
    stopped (0 where none runs anything, or none exists)."""
    with _LANES_LOCK:
        lanes = list(_LANES)
    with contextlib.ExitStack() as stack:
        yield sum(stack.enter_context(lane.hold()) for lane in lanes)


class ProcessLane:
    """The background lane (:class:`engines.speech.asr_lane.AsrLane`'s interface) on a Whisper
    model in a child process, which :meth:`hold` stops while a decision's draft runs."""

    def __init__(
        self,
        config: AsrConfig,
        *,
        max_hold_s: float = 0.5,
        hold_share: float = 0.5,
        window_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._max_hold_s = max_hold_s
        self._budget = HoldBudget(hold_share, window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._running: Future[str] | None = None
        self._queue: deque[tuple[Callable[[LaneModel], str], Future[str]]] = deque()  # `submit`ted
        self._holders = 0  # drafts under way that asked for a hold
        self._stopped_at: float | None = None  # the process is stopped since then
        self._timer: threading.Timer | None = None
        self._closed = False
        self.holds = 0  # holds that stopped the process
        self.held_s = 0.0
        self.skipped = 0  # holds asked while a run was under way, refused by the budget
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None
        # One thread starts every process of this lane and reads its answers: the child's
        # death signal is tied to the thread that started it, so that thread lives as long as
        # the lane does.
        started = threading.Event()
        self._start_error: BaseException | None = None
        self._keeper = threading.Thread(target=self._keep, args=(started,), name="asr-lane", daemon=True)
        self._keeper.start()
        started.wait()
        if self._start_error is not None:
            raise self._start_error
        with _LANES_LOCK:
            _LANES.add(self)

    # -- the lane's interface ------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._ready() and self._holders == 0 and self._free() and not self._queue

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def try_run(self, work: Callable[[LaneModel], str]) -> Future[str] | None:
        """Send `work(model)` to the process if the lane is idle and not held; None if not."""
        with self._lock:
            if not self._ready() or self._holders or not self._free() or self._queue:
                return None
            future: Future[str] = Future()
            self._send(work, future)
            return future

    def submit(self, work: Callable[[LaneModel], str]) -> Future[str]:
        """Run `work(model)` in the process once the runs before it are done and no draft
        holds it (a ``speech.asr`` stage's transcriptions, in order)."""
        future: Future[str] = Future()
        with self._lock:
            if self._closed:
                future.set_exception(LaneDied("asr lane process: closed"))
                return future
            self._queue.append((work, future))
            self._pump()
        return future

    @contextlib.contextmanager
    def hold(self) -> Iterator[bool]:
        """Stop the process for the block (a draft), if a run is under way and the budget
        allows; yields whether it is stopped."""
        stopped = self._acquire()
        try:
            yield stopped
        finally:
            self._release()

    def close(self) -> None:
        """End the process (its keeper reaps it and closes the pipe); queued runs fail."""
        with _LANES_LOCK:
            _LANES.discard(self)
        with self._lock:
            self._closed = True
            self._continue()
            proc, conn = self._proc, self._conn
            queued, self._queue = list(self._queue), deque()
        for _work, future in queued:
            future.set_exception(LaneDied("asr lane process: closed"))
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        self._keeper.join(JOIN_TIMEOUT_S)  # the keeper reaps the process
        if self._keeper.is_alive() and proc is not None:  # it did not end: kill it
            with contextlib.suppress(OSError):
                proc.kill()
            self._keeper.join(JOIN_TIMEOUT_S)

    # -- holds -----------------------------------------------------------------------------------

    def _acquire(self) -> bool:
        with self._lock:
            self._holders += 1
            if self._stopped_at is not None:
                return True
            now = self._clock()
            if not self._ready() or self._free():
                return False  # nothing to stop: no run is handed over while held
            if not self._budget.allows(now):
                self.skipped += 1
                return False
            assert self._proc is not None and self._proc.pid is not None
            try:
                os.kill(self._proc.pid, signal.SIGSTOP)
            except OSError:
                return False
            self._stopped_at = now
            self.holds += 1
            self._timer = threading.Timer(self._max_hold_s, self._expire)
            self._timer.daemon = True
            self._timer.start()
            return True

    def _release(self) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                self._continue()
                self._pump()

    def _expire(self) -> None:
        with self._lock:
            self._continue()

    def _continue(self) -> None:
        """(Lock held.) Continue a stopped process and count the hold."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._stopped_at is None:
            return
        now = self._clock()
        self._budget.record(self._stopped_at, now)
        self.held_s += now - self._stopped_at
        self._stopped_at = None
        if self._proc is not None and self._proc.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._proc.pid, signal.SIGCONT)

    # -- the process -----------------------------------------------------------------------------

    def _send(self, work: Callable[[LaneModel], str], future: Future[str]) -> None:
        """(Lock held; the process free.) Hand `work` over; `future` gets its answer."""
        assert self._conn is not None
        self._running = future
        try:
            self._conn.send(work)
        except (OSError, ValueError) as exc:
            self._running = None
            future.set_exception(LaneDied(f"asr lane process: cannot send a run ({exc})"))

    def _pump(self) -> None:
        """(Lock held.) The next queued run, if the process is free and not held."""
        while self._queue and self._ready() and not self._holders and self._free():
            work, future = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                self._send(work, future)

    def _ready(self) -> bool:
        return self._conn is not None and not self._closed

    def _free(self) -> bool:
        return self._running is None or self._running.done()

    def _keep(self, started: threading.Event) -> None:
        """The keeper thread: start a process, read its answers until it ends, start a fresh
        one unless the lane is closed."""
        while True:
            try:
                proc, conn = self._spawn()
            except Exception as exc:
                if not started.is_set():
                    self._start_error = exc
                    started.set()
                    return
                log.exception("asr lane: a fresh process did not start")
                with self._lock:
                    self._closed = True
                    queued, self._queue = list(self._queue), deque()
                for _work, waiting in queued:
                    waiting.set_exception(LaneDied(f"asr lane process: no fresh process ({exc})"))
                return
            started.set()
            if self._read(proc, conn):
                return
            log.warning("asr lane process ended (exit code %s); starting a fresh one", proc.exitcode)

    def _spawn(self) -> tuple[BaseProcess, Connection]:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        args = (child, self._config, os.getpid())
        proc = ctx.Process(target=child_main, args=args, name="omniduplex-asr-lane", daemon=True)
        proc.start()
        child.close()
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise TimeoutError(f"asr lane process did not load its model in {START_TIMEOUT_S:.0f} s")
            kind, detail = parent.recv()
        except (EOFError, OSError, TimeoutError) as exc:
            proc.kill()
            proc.join(JOIN_TIMEOUT_S)
            parent.close()
            raise LaneDied(f"asr lane process did not start (exit code {proc.exitcode}): {exc}") from None
        if kind != "ready":
            proc.join(JOIN_TIMEOUT_S)
            parent.close()
            raise RuntimeError(f"asr lane process could not load its model:\n{detail}")
        with self._lock:
            self._proc, self._conn = proc, parent
            self._pump()
        return proc, parent

    def _read(self, proc: BaseProcess, conn: Connection) -> bool:
        """Each run's answer, as it comes, until the process ends: then the run under way fails.
        Returns whether the lane is closed."""
        while True:
            try:
                kind, detail = conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                future, self._running = self._running, None
                self._pump()
            if future is None:
                continue
            if kind == "ok":
                future.set_result(detail)
            else:
                future.set_exception(RuntimeError(f"asr lane process error:\n{detail}"))
        proc.join(JOIN_TIMEOUT_S)
        with self._lock:
            self._proc = self._conn = None  # no signal reaches a reaped process's pid
            self._continue()
            future, self._running = self._running, None
            closed = self._closed
        if future is not None and not future.done():
            future.set_exception(LaneDied(f"asr lane process died (exit code {proc.exitcode})"))
        with contextlib.suppress(OSError):
            conn.close()
        return closed
