"""A stage: one engine, a resource budget and a pool of replicas, each with its own scheduler.

A replica's scheduler runs on the event loop as callbacks, with up to ``budget.workers`` calls
in flight. It picks runnable requests (new chunks, inputs or updates, or not waiting and not
paced to a later time by the engine's ``not_before``), up to ``max_batch``, packs them with
pending starts and finishes into one :class:`~runtime.worker.WorkCall` and submits it to the
replica's worker (thread or process; never the loop). When the call ends, the worker hands
its outcome to the loop (`Worker.submit`); that callback gives each request's result to the
orchestrator (the *sink*) and builds and submits the next call at once. Nothing runs when
there is nothing to run: new input, a drained consumer or a finish schedules a build, and a
timer fires when the earliest paced request falls due (its callback builds the call itself).
With ``budget.gather_ms``, a build waits that long first, so that small inputs arriving close
together (every session's next VAD frame) are stepped together; not when the replica holds one
request only, or every request has input already, nor for turn control (`TurnControl` appended
to a request: a pause to score or transcribe, which a decision waits on; a build waiting out its
window is brought forward, and one after a step in flight is not held).

Why callbacks and not tasks: on a busy loop every hand-off costs one loop iteration, and an
iteration then lasts tens of milliseconds. A step cycle here costs one (the worker's outcome
arriving), and a paced request's release costs the timer's iteration and that one. Stepper
tasks awaiting ``run_in_executor`` cost three more on that way (the timer waking the task, the
asyncio future's callback, the task's resumption); a task per call with a done-callback that
woke a scheduler task cost five, and a paced stage (audio released in real time) fell ~100 ms
behind under 200 sessions (docs/benchmarks.md, "Null pipeline at default niceness").
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

from runtime.connectors import Connector
from runtime.engine import Engine, EngineRequest
from runtime.kv import SessionKVStore
from runtime.metrics import RuntimeMetrics
from runtime.payloads import Conditioning, Payload, TurnControl
from runtime.progress import AdmissionError, StageTiming
from runtime.spec import StageSpec
from runtime.worker import ChunkRef, ItemResult, Outcome, ThreadWorker, WorkCall, Worker, WorkerDied, WorkItem

log = logging.getLogger(__name__)

MIN_TIMER_S = 0.001  # the shortest pacing timer (uvloop's resolution)
STICKY_KEYS = 65536  # session bindings remembered per stage (least recently used dropped)


class StageSink(Protocol):
    """What a replica reports to (and asks of) the orchestrator; all calls on the loop."""

    def can_step(self, stage: str, request_id: str) -> bool: ...

    def on_result(self, stage: str, request_id: str, result: ItemResult) -> None: ...

    def on_failed(self, stage: str, request_id: str, error: str) -> None: ...

    def on_taken(self, stage: str, request_id: str, chunks: list[ChunkRef]) -> None: ...


@dataclass(eq=False, slots=True)
class Slot:
    """One request on one replica."""

    request: EngineRequest
    prewarm: bool  # start at admission (async_chunk downstream, entry) or at first input
    waiting: bool  # do not step until something new arrives
    incoming: int  # incoming edges
    admitted_at: float
    timing: StageTiming
    chunks: list[ChunkRef] = field(default_factory=list)
    inputs: list[Payload] = field(default_factory=list)
    updates: list[Conditioning] = field(default_factory=list)
    finished_edges: int = 0
    not_before: float | None = None  # the engine's pacing hint (StepOutput.not_before)
    start_sent: bool = False
    in_flight: bool = False
    closed: bool = False
    input_room: asyncio.Event = field(default_factory=asyncio.Event)  # set when inputs were taken

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def has_work(self) -> bool:
        return bool(self.chunks or self.inputs or self.updates)


class Replica:
    def __init__(
        self,
        spec: StageSpec,
        index: int,
        worker: Worker,
        *,
        sink: StageSink,
        metrics: RuntimeMetrics,
        connectors: Mapping[str, Connector],
        clock: Callable[[], float],
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.index = index
        self.worker = worker
        self._sink = sink
        self._metrics = metrics
        self._connectors = connectors
        self._clock = clock
        self._slots: OrderedDict[str, Slot] = OrderedDict()
        self._finishes: dict[str, bool] = {}
        self._inflight_ids: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None  # from start(): builds run on it
        self._build_at: asyncio.Handle | None = None  # a build scheduled by wake() (or gather)
        self._gathering = False  # ... and it waits out the gather window
        self._turn_control: set[str] = set()  # requests whose inputs hold turn control (no window)
        self._timer: asyncio.TimerHandle | None = None  # wakes the loop at the next paced step
        self._timer_at = 0.0
        self._calls = 0  # work calls in flight (at most budget.workers)
        self._gather_s = spec.budget.gather_ms / 1000
        self._restart_task: asyncio.Task[None] | None = None
        self._closed = False
        self.ready = False
        self.restarts = 0

    @property
    def load(self) -> int:
        return len(self._slots)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.worker.open()
        self.worker.watch(self._on_worker_died)
        self.ready = True
        self.wake()

    async def close(self) -> None:
        self.ready = False
        self._closed = True  # a restart under way gives up (should its cancel be lost)
        for handle in (self._timer, self._build_at):
            if handle is not None:
                handle.cancel()
        self._timer = self._build_at = None
        if self._restart_task is not None:
            self._restart_task.cancel()
            await asyncio.gather(self._restart_task, return_exceptions=True)
        await self.worker.close()

    # -- requests (called by the orchestrator) -----------------------------------------------

    def open_request(
        self, request: EngineRequest, *, prewarm: bool, waiting: bool, incoming: int, admitted_at: float
    ) -> StageTiming:
        timing = StageTiming(replica=self.index)
        self._slots[request.request_id] = Slot(request, prewarm, waiting, incoming, admitted_at, timing)
        self.wake()
        return timing

    def _open_slot(self, request_id: str) -> Slot | None:
        """The request's slot while it takes input (None: gone or closed)."""
        slot = self._slots.get(request_id)
        return None if slot is None or slot.closed else slot

    def deliver(self, request_id: str, chunk: ChunkRef, *, coalesce: bool = False) -> bool:
        """Hand the request ``chunk``; with ``coalesce`` (a coalescing edge) it joins the last
        chunk held from the same source, if that is the newest chunk held."""
        slot = self._open_slot(request_id)
        if slot is None:
            return False
        held = slot.chunks
        if coalesce and held and held[-1].source == chunk.source and not held[-1].finished:
            held[-1].absorb(chunk)
        else:
            held.append(chunk)
        if chunk.finished:
            slot.finished_edges += 1
        self.wake()
        return True

    def add_inputs(self, request_id: str, payloads: list[Payload]) -> bool:
        slot = self._open_slot(request_id)
        if slot is not None:
            slot.inputs.extend(payloads)
            if any(isinstance(p, TurnControl) for p in payloads):
                self._turn_control.add(request_id)
            self.wake()
        return slot is not None

    def add_update(self, request_id: str, update: Conditioning) -> bool:
        slot = self._open_slot(request_id)
        if slot is not None:
            slot.updates.append(update)
            self.wake()
        return slot is not None

    async def wait_input_room(self, request_id: str, limit: int) -> bool:
        """Wait until the request holds fewer than ``limit`` unconsumed inputs; False if it ended."""
        while True:
            slot = self._slots.get(request_id)
            if slot is None or slot.closed:
                return False
            if len(slot.inputs) < limit:
                return True
            slot.input_room.clear()
            await slot.input_room.wait()

    def inbox_size(self, request_id: str) -> int:
        slot = self._slots.get(request_id)
        return len(slot.chunks) if slot is not None else 0

    def held_items(self, request_id: str, source: str) -> int:
        """Items held for the request from ``source`` (not taken into a step yet)."""
        slot = self._slots.get(request_id)
        if slot is None:
            return 0
        return sum(len(chunk.items) for chunk in slot.chunks if chunk.source == source)

    def close_request(self, request_id: str, *, outcome: str = "cancelled") -> None:
        """Stop a request here: never stepped again; the engine's finish runs on the worker."""
        slot = self._slots.pop(request_id, None)
        if slot is None:
            return
        self._close_slot(slot, outcome, finish=slot.start_sent)

    def wake(self) -> None:
        """Something may have become runnable: build the next call in a callback of its own
        (not here: the caller is in the middle of its own work, often another replica's)."""
        if self._loop is None:
            return
        urgent = bool(self._turn_control)  # turn control waits for no window
        if urgent and self._gathering and self._build_at is not None:
            self._build_at.cancel()
            self._build_at = None
        if self._build_at is None:
            self._gathering = not urgent and self._gather_s > 0 and self._others_may_come()
            if self._gathering:
                self._build_at = self._loop.call_later(self._gather_s, self._build_scheduled)
            else:
                self._build_at = self._loop.call_soon(self._build_scheduled)

    # -- scheduling ---------------------------------------------------------------------------

    def _build_scheduled(self) -> None:
        self._build_at = None
        self._run_calls()

    def _build_next(self) -> None:
        """After a step or at a paced request's time: the next call now, unless gathering
        pays (``budget.gather_ms``), then after that wait."""
        if self._gather_s > 0 and not self._turn_control and self._others_may_come():
            self.wake()
        else:
            self._run_calls()

    def _run_calls(self) -> None:
        """Submit calls while the worker has room and something is runnable."""
        while self.ready and self._calls < max(1, self.spec.budget.workers):
            try:
                built = self._build_call()
            except Exception:  # a bug here must not leave the replica stuck with calls to run
                log.exception("stage %s replica %d: building a call failed", self.name, self.index)
                return
            if built is None:
                return
            call, slots = built
            self._inflight_ids |= {slot.request_id for slot in slots}  # before the next build
            self._calls += 1
            self.worker.submit(call, functools.partial(self._on_outcome, slots))

    def _on_outcome(self, slots: list[Slot], outcome: Outcome) -> None:
        """A call ended (on the loop, in the worker's callback): apply it, then the next one."""
        self._calls -= 1
        for slot in slots:
            slot.in_flight = False
        self._inflight_ids -= {slot.request_id for slot in slots}
        if isinstance(outcome, (asyncio.CancelledError, futures.CancelledError)):
            return  # never ran: the worker is closing
        try:
            self._settle(slots, outcome)
        except Exception:  # a bug applying one call's results must not stop the replica
            log.exception("stage %s replica %d: applying a result failed", self.name, self.index)
        self._build_next()

    def _others_may_come(self) -> bool:
        """Worth waiting for more input: some live request has none yet (with one request, or
        with every request's input here already, there is nothing to gather)."""
        live = ready = 0
        for slot in self._slots.values():
            if slot.closed:
                continue
            live += 1
            ready += slot.has_work
        return live > 1 and ready < live

    def _build_call(self) -> tuple[WorkCall, list[Slot]] | None:
        call = WorkCall()
        for request_id in [r for r in self._finishes if r not in self._inflight_ids]:
            call.finishes.append((request_id, self._finishes.pop(request_id)))
        slots: list[Slot] = []
        runnable = 0
        max_batch = self.spec.budget.max_batch
        now = self._clock()
        paced_until: float | None = None  # the earliest not_before still in the future
        for slot in self._slots.values():
            if slot.closed or slot.in_flight:
                continue
            has_work = slot.has_work
            needs_start = not slot.start_sent and (slot.prewarm or has_work)
            if not (slot.start_sent or needs_start):
                continue
            paced = slot.not_before
            due = paced is None or has_work or paced <= now
            if paced is not None and not due and (paced_until is None or paced < paced_until):
                paced_until = paced
            wants_step = (
                (has_work or (not slot.waiting and due)) and self._sink.can_step(self.name, slot.request_id)
            )
            if wants_step:
                runnable += 1
                if len(call.items) >= max_batch:
                    continue  # batch full: start and step it together in a later call
            if needs_start:
                call.starts.append(slot.request)
                slot.start_sent = True
            if wants_step:
                call.items.append(self._take_item(slot))
            if needs_start or wants_step:
                slot.in_flight = True
                slots.append(slot)
        if call.items:
            # round robin: the requests stepped now go to the back of the line
            for item in call.items:
                self._slots.move_to_end(item.request_id)
        self._metrics.queue(self.name, self.index, max(0, runnable - len(call.items)), len(self._slots))
        if paced_until is not None:
            self._wake_at(paced_until, now)
        if not (call.finishes or call.starts or call.items):
            return None
        return call, slots

    def _wake_at(self, when: float, now: float) -> None:
        """Have the scheduler look again at `when` (the earliest paced request's time)."""
        if self._timer is not None:
            if self._timer_at <= when:
                return  # an earlier (or equal) wake-up is still to come
            self._timer.cancel()
        self._timer_at = when
        # At least 1 ms: after an early fire, a shorter delay rounds to 0 in uvloop and the
        # scheduler would rescan every slot on each loop pass until the request is due.
        delay = max(when - now, MIN_TIMER_S)
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        # The loop's timers may fire up to a millisecond early: the next build then finds the
        # request not yet due and sets a new timer, which it can only do once this one is gone.
        self._timer = None
        self._build_next()

    def _take_item(self, slot: Slot) -> WorkItem:
        item = WorkItem(
            slot.request_id,
            slot.chunks,
            slot.inputs,
            slot.updates,
            upstream_finished=slot.incoming > 0 and slot.finished_edges >= slot.incoming,
        )
        slot.chunks, slot.inputs, slot.updates = [], [], []
        self._turn_control.discard(slot.request_id)
        slot.input_room.set()
        if item.chunks:
            self._sink.on_taken(self.name, slot.request_id, item.chunks)
        return item

    def _settle(self, slots: list[Slot], outcome: Outcome) -> None:
        if isinstance(outcome, WorkerDied):
            self._on_worker_died(str(outcome))
            return
        if isinstance(outcome, BaseException):
            log.error(
                "stage %s replica %d: work call failed",
                self.name,
                self.index,
                exc_info=(type(outcome), outcome, outcome.__traceback__),
            )
            for slot in slots:
                self._fail(slot, f"stage {self.name}: worker error: {type(outcome).__name__}: {outcome}")
            return
        result = outcome
        now = self._clock()
        if result.batch:
            self._metrics.step(self.name, self.index, result.batch, result.step_s)
        failed = {item.request_id for item in result.items if item.error}
        for slot in slots:
            if slot.timing.started_ms is None and not slot.closed and slot.request_id not in failed:
                slot.timing.started_ms = (now - slot.admitted_at) * 1e3
        for item in result.items:
            live = self._slots.get(item.request_id)
            if live is None or live.closed:
                self._release(item)
                continue
            self._apply(live, item, result.step_s, now)

    def _apply(self, slot: Slot, item: ItemResult, step_s: float, now: float) -> None:
        if item.error is not None:
            self._fail(slot, item.error, finish=False)  # the host already finished it
            return
        timing = slot.timing
        timing.steps += 1
        timing.busy_ms += step_s * 1e3
        produced = max((len(v) for v in item.downstream.values()), default=0) + len(item.client)
        timing.outputs += produced
        if produced and timing.first_output_ms is None:
            timing.first_output_ms = (now - slot.admitted_at) * 1e3
        if item.counters:
            self._metrics.counters(self.name, item.counters)
        slot.waiting = item.wait_for_input
        slot.not_before = item.not_before
        if item.done:
            self._slots.pop(slot.request_id, None)
            self._close_slot(slot, "completed", finish=False)
        self._sink.on_result(self.name, slot.request_id, item)

    def _fail(self, slot: Slot, error: str, *, finish: bool = True) -> None:
        if slot.closed:
            return
        self._slots.pop(slot.request_id, None)
        self._close_slot(slot, "failed", finish=finish and slot.start_sent)
        self._sink.on_failed(self.name, slot.request_id, error)

    def _close_slot(self, slot: Slot, outcome: str, *, finish: bool) -> None:
        slot.closed = True
        self._turn_control.discard(slot.request_id)
        slot.input_room.set()
        # Chunks never consumed (the engine finished before its upstream): free their data now.
        for chunk in slot.chunks:
            for handle in chunk.release:
                connector = self._connectors.get(handle.kind)
                if connector is not None:
                    connector.release(handle)
        slot.chunks = []
        now = self._clock()
        slot.timing.done_ms = (now - slot.admitted_at) * 1e3
        self._metrics.request(self.name, now - slot.admitted_at, outcome)
        if finish:
            self._finishes[slot.request_id] = True
            self.wake()

    def _release(self, item: ItemResult) -> None:
        """Free what a step produced for a request that ended meanwhile (cancelled, failed):
        the orchestrator already cleaned the request up, so whatever it holds now is garbage."""
        for connector in self._connectors.values():
            connector.cleanup(item.request_id)

    # -- worker process death -----------------------------------------------------------------

    def _on_worker_died(self, reason: str) -> None:
        if self._closed or (self._restart_task is not None and not self._restart_task.done()):
            return
        self.ready = False
        log.error("stage %s replica %d: %s; restarting", self.name, self.index, reason)
        self._finishes.clear()
        for slot in list(self._slots.values()):
            if slot.start_sent:
                self._fail(slot, reason, finish=False)
        self._restart_task = asyncio.create_task(self._restart(), name=f"restart-{self.name}-{self.index}")

    async def _restart(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                await self.worker.restart()
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("stage %s replica %d: restart failed", self.name, self.index)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        if self._closed:
            return
        self.restarts += 1
        self.ready = True
        self.wake()


class Stage:
    """A replica pool with sticky assignment by session key."""

    def __init__(self, spec: StageSpec, replicas: list[Replica]) -> None:
        self.spec = spec
        self.name = spec.name
        self.replicas = replicas
        self._sticky: OrderedDict[str, int] = OrderedDict()

    @classmethod
    def build(
        cls,
        spec: StageSpec,
        engine_cls: type[Engine],
        *,
        connectors: Mapping[str, Connector],
        out_kinds: Mapping[str, int],
        sink: StageSink,
        metrics: RuntimeMetrics,
        clock: Callable[[], float],
    ) -> Stage:
        metrics.add_stage(spec.name, spec.replicas)
        replicas = []
        for index in range(spec.replicas):
            kv = SessionKVStore(spec.budget.kv_bytes)
            worker: Worker
            if spec.budget.worker == "process":
                from runtime.process_worker import ProcessWorker
                from runtime.shm import SharedMemoryConnector

                shm = connectors["shm"]
                assert isinstance(shm, SharedMemoryConnector)
                worker = ProcessWorker(
                    spec.name,
                    engine_cls,
                    spec.options,
                    shm,
                    out_kinds,
                    index=index,
                    kv_bytes=spec.budget.kv_bytes,
                )
            else:
                worker = ThreadWorker(
                    spec.name,
                    engine_cls,
                    spec.options,
                    connectors,
                    out_kinds,
                    threads=spec.budget.workers,
                    kv_store=kv,
                    name=f"{spec.name}.{index}",
                )
            replicas.append(
                Replica(
                    spec,
                    index,
                    worker,
                    sink=sink,
                    metrics=metrics,
                    connectors=connectors,
                    clock=clock,
                )
            )
        return cls(spec, replicas)

    async def start(self) -> None:
        await asyncio.gather(*(r.start() for r in self.replicas))

    async def close(self) -> None:
        await asyncio.gather(*(r.close() for r in self.replicas), return_exceptions=True)

    def assign(self, session_key: str | None) -> Replica:
        """The replica for a new request: the session's replica while it has room, else the
        least loaded one (which the session then sticks to)."""
        cap = self.spec.budget.max_concurrency
        if session_key is not None and session_key in self._sticky:
            replica = self.replicas[self._sticky[session_key]]
            self._sticky.move_to_end(session_key)
            if replica.load < cap:
                return replica
        candidates = [r for r in self.replicas if r.load < cap]
        if not candidates:
            raise AdmissionError(
                f"stage {self.name}: all {len(self.replicas)} replica(s) at max_concurrency {cap}"
            )
        replica = min(candidates, key=lambda r: (r.load, r.index))
        if session_key is not None:
            self._sticky[session_key] = replica.index
            self._sticky.move_to_end(session_key)
            while len(self._sticky) > STICKY_KEYS:
                self._sticky.popitem(last=False)
        return replica

    def replica_for(self, session_key: str) -> int | None:
        return self._sticky.get(session_key)
