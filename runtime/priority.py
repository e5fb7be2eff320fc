"""Critical-path-first scheduling across a pipeline's stages (``scheduling: critical_path``).

Each stage schedules its own replicas (runtime.stage); on a host with fewer cores than stages,
the stages' calls then run side by side and slow each other down (small ops on one GIL and a
few cores), while the first audio of a new request waits for the *last* stage. The floor,
the same work run one call after another, is faster than that. This object lets the work
that is on a request's path to its first output go first:

* A request is *waiting* from admission until a sink stage (one with no outgoing edge) has
  given the client its first output for it, or finished it.
* A work call is *critical* while one of the requests it steps is waiting.
* A critical call of stage S is held back (parked, not yet handed to its worker) while a
  critical call of a stage downstream of S is running: the upstream stage would only be running
  ahead (the thinker beyond the row the talker needs, the talker's next frames while code2wav
  decodes the first chunk). It starts when no such call runs any more.
* Calls that step only requests past their first output are never held, and never hold others:
  steady streaming keeps the stages' own overlap.

Nothing is held for long: a parked call waits for calls that are running, and the calls it
waits for can only be critical while a waiting request is in them (a request whose next step
needs the parked upstream call waits for input instead, and its stage's calls stop being
critical). :class:`CriticalPath` is the policy, with no I/O (unit-tested alone);
:class:`GatedWorker` applies it to a replica's worker on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from runtime.spec import PipelineSpec
from runtime.worker import Done, Outcome, WorkCall, Worker


@dataclass(eq=False, slots=True)
class Ticket:
    """One work call of ``stage`` stepping ``requests``, from ready to done."""

    stage: str
    requests: frozenset[str]
    start: Callable[[], None] = lambda: None  # hands the call to its worker (the adapter's)
    running: bool = False
    order: int = 0  # arrival, so parked calls start in the order they came


@dataclass(eq=False, slots=True)
class CriticalPath:
    """The policy: which calls may start now (sans-I/O: the caller runs what it returns)."""

    downstream: Mapping[str, frozenset[str]]  # stage -> the stages strictly downstream of it
    sinks: frozenset[str]  # stages whose first client output is the request's first output
    waiting: set[str] = field(default_factory=set)  # requests before their first output
    held: int = 0  # calls parked so far (tests and metrics read it)
    settling: int = 0  # calls whose results are being applied (GatedWorker): admit after them
    _running: list[Ticket] = field(default_factory=list)
    _parked: list[Ticket] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    @classmethod
    def of(cls, spec: PipelineSpec) -> CriticalPath:
        downstream = {s.name: frozenset(spec.reachable(s.name)) - {s.name} for s in spec.stages}
        sinks = frozenset(s.name for s in spec.stages if not spec.outgoing(s.name))
        return cls(downstream, sinks)

    # -- requests -----------------------------------------------------------------------------

    def opened(self, request_id: str) -> None:
        self.waiting.add(request_id)

    def output(self, stage: str, request_id: str) -> list[Ticket]:
        """``stage`` gave the client output for the request, or finished it: past its first
        output once that stage is a sink. Returns the parked calls that may start now (none
        while a call's results are being applied: its :meth:`done` admits them after)."""
        if stage not in self.sinks or request_id not in self.waiting:
            return []
        self.waiting.discard(request_id)
        return self._admit() if not self.settling else []

    def closed(self, request_id: str) -> list[Ticket]:
        """The request ended (any outcome): it holds nothing back any more."""
        if request_id not in self.waiting:
            return []
        self.waiting.discard(request_id)
        return self._admit() if not self.settling else []

    # -- calls --------------------------------------------------------------------------------

    def critical(self, ticket: Ticket) -> bool:
        return not self.waiting.isdisjoint(ticket.requests)

    def ready(self, ticket: Ticket) -> bool:
        """A call is ready to run: True if it may start now (it is then running), else it is
        parked until :meth:`done` or :meth:`output` returns it."""
        ticket.order = next(self._order)
        if self._held(ticket):
            self._parked.append(ticket)
            self.held += 1
            return False
        ticket.running = True
        self._running.append(ticket)
        return True

    def done(self, ticket: Ticket) -> list[Ticket]:
        """A running call ended: the parked calls that may start now (they are running)."""
        if ticket.running:
            ticket.running = False
            self._running.remove(ticket)
        return self._admit()

    def drop(self, stage: str) -> list[Ticket]:
        """Forget the parked calls of ``stage`` (its replica closes); they are returned."""
        dropped = [t for t in self._parked if t.stage == stage]
        self._parked = [t for t in self._parked if t.stage != stage]
        return dropped

    @property
    def parked(self) -> list[Ticket]:
        return list(self._parked)

    def _held(self, ticket: Ticket) -> bool:
        if not self.critical(ticket):
            return False
        below = self.downstream.get(ticket.stage, frozenset())
        return any(t.stage in below and self.critical(t) for t in self._running)

    def _admit(self) -> list[Ticket]:
        started: list[Ticket] = []
        for ticket in sorted(self._parked, key=lambda t: t.order):
            if not self._held(ticket):
                self._parked.remove(ticket)
                ticket.running = True
                self._running.append(ticket)
                started.append(ticket)
        return started


def run_started(tickets: Iterable[Ticket]) -> None:
    for ticket in tickets:
        ticket.start()


def _ended(policy: CriticalPath, ticket: Ticket) -> None:
    run_started(policy.done(ticket))


class GatedWorker(Worker):
    """A replica's worker whose calls pass the pipeline's :class:`CriticalPath` first (on the
    event loop, like every other use of a worker). The policy hears that a call ended only
    after the replica's result callback and one more turn of the loop: the results a call
    hands downstream schedule the downstream stages' next calls (``Replica.wake``: a callback
    of its own) and those, when critical, keep the upstream stages held; a call the stage
    submits from its own callback (code2wav's next requests' first chunks) does so at once.
    Without it, the upstream call parked behind a finished one (the thinker behind the talker's
    frame) would start before the call it would only run ahead of (code2wav's first chunk of
    that frame) and share the cores with it. Parked calls never wait for more than that turn.
    Outside a running loop (tests driving it by hand) the policy hears it at once."""

    def __init__(self, inner: Worker, policy: CriticalPath, stage: str) -> None:
        self.inner = inner
        self._policy = policy
        self._stage = stage

    async def open(self) -> None:
        await self.inner.open()

    def submit(self, call: WorkCall, done: Done) -> None:
        ticket = Ticket(self._stage, frozenset(item.request_id for item in call.items))

        def finished(outcome: Outcome) -> None:
            policy = self._policy
            policy.settling += 1
            try:
                done(outcome)
            finally:
                policy.settling -= 1
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    run_started(policy.done(ticket))
                else:
                    loop.call_soon(_ended, policy, ticket)

        ticket.start = lambda: self.inner.submit(call, finished)
        if self._policy.ready(ticket):
            ticket.start()

    async def close(self) -> None:
        # Parked calls never reach the worker now: the replica is closing and ignores them.
        self._policy.drop(self._stage)
        await self.inner.close()

    def watch(self, on_death: Callable[[str], None]) -> None:
        self.inner.watch(on_death)

    async def restart(self) -> None:
        await self.inner.restart()
