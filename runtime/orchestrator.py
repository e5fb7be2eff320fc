"""The orchestrator: admission, cross-stage advancement, client-visible progress, cancellation.

It owns nothing heavy: stages compute on their workers, connectors hold the payloads, and the
orchestrator moves handles along edges (through each edge's chunk policy) and client payloads
into the request's bounded stream. Every callback from a replica runs on the event loop and
never blocks.

Flow control, per request: a stage is not stepped while the client buffer is full, while a
downstream stage still working on the request holds ``inbox_limit`` chunks, or while an edge with
``max_ahead`` has that many of the stage's items not yet taken into a downstream step (credits,
returned when the downstream takes its inbox). On a coalescing edge (``EdgeSpec.coalesce``) the
target holds one chunk that grows instead, and only its ``inbox_limit`` in items pauses the
upstream. A downstream stage that is done with the request holds nothing back: its upstream
stages are woken and what they still hand it is freed at once.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.capabilities import END_OF_TURN, PipelineCapabilities
from runtime.connector_registry import make_connectors
from runtime.connectors import Connector, Handle
from runtime.edges import AsyncChunker, Chunk, EdgeGate, FullCollector, make_collector
from runtime.engine import Engine, EngineRequest
from runtime.metrics import RuntimeMetrics
from runtime.payloads import Conditioning, Payload
from runtime.priority import CriticalPath, GatedWorker, run_started
from runtime.progress import AdmissionError, FinalStatus, RequestHandle, RequestStatus, StageTiming
from runtime.registry import engine_class
from runtime.spec import EdgeSpec, PipelineSpec, StageSpec, load_pipeline
from runtime.stage import Replica, Stage
from runtime.worker import ChunkRef, ItemResult

DEFAULT_STREAM_BUFFER = 64  # client-visible payloads buffered per request before its stages pause
DEFAULT_INBOX_LIMIT = 32  # chunks waiting at a downstream stage before its upstream pauses
DEFAULT_INPUT_LIMIT = 256  # appended inputs waiting at the entry stage before append_input waits
DEFAULT_COALESCE_LIMIT = 2048  # items a coalescing edge's target may hold before the upstream pauses


@dataclass(eq=False, slots=True)
class _EdgeRun:
    spec: EdgeSpec
    collector: AsyncChunker[Handle] | FullCollector[Handle]
    target: Replica
    produced: int = 0  # items the upstream put on this edge
    taken: int = 0  # items the downstream has taken into a step
    gate: EdgeGate[Handle] | None = None  # a gated edge's switch for this request

    @property
    def out_of_credit(self) -> bool:
        limit = self.spec.max_ahead if self.spec.mode == "async_chunk" else None
        return limit is not None and self.produced - self.taken >= limit


@dataclass(eq=False, slots=True)
class RequestRun:
    """One live request: its replicas, edges and handle (a subclass may end and reopen it)."""

    request_id: str
    handle: RequestHandle
    spec: PipelineSpec  # with this request's edge modes
    replicas: dict[str, Replica]
    admitted_at: float
    entry: str
    timings: dict[str, StageTiming] = field(default_factory=dict)
    edges_out: dict[str, list[_EdgeRun]] = field(default_factory=dict)
    edges_by_key: dict[tuple[str, str], _EdgeRun] = field(default_factory=dict)  # (source, target)
    pending: set[str] = field(default_factory=set)  # stages not done yet
    first_client_at: float | None = None


class Orchestrator:
    def __init__(
        self,
        spec: PipelineSpec,
        *,
        clock: Callable[[], float] = time.monotonic,
        stream_buffer: int = DEFAULT_STREAM_BUFFER,
        inbox_limit: int = DEFAULT_INBOX_LIMIT,
        input_limit: int = DEFAULT_INPUT_LIMIT,
    ) -> None:
        if min(stream_buffer, inbox_limit, input_limit) < 1:
            raise ValueError("stream_buffer, inbox_limit and input_limit must be >= 1")
        self.spec = spec
        self.metrics = RuntimeMetrics()
        self.connectors: dict[str, Connector] = {}
        self.stages: dict[str, Stage] = {}
        self._clock = clock
        self._stream_buffer = stream_buffer
        self._inbox_limit = inbox_limit
        self._input_limit = input_limit
        self._runs: dict[str, RequestRun] = {}
        self._provides: dict[str, frozenset[str]] = {}  # stage → what its engine provides
        # spec.scheduling critical_path: the calls on a request's path to its first output first
        self._critical = CriticalPath.of(spec) if spec.scheduling == "critical_path" else None
        self._started = False
        self._closed = False

    @classmethod
    def from_spec(cls, spec: PipelineSpec, **kwargs: Any) -> Orchestrator:
        return cls(spec, **kwargs)

    @classmethod
    def from_pipeline(cls, name_or_path: str | Path, **kwargs: Any) -> Orchestrator:
        return cls(load_pipeline(name_or_path), **kwargs)

    @property
    def capacity(self) -> int:
        return self.spec.capacity()

    def capabilities(self) -> PipelineCapabilities:
        """What the pipeline offers a session (after `start()`: engines declare it)."""
        spec = self.spec

        def provided(entry: str | None) -> frozenset[str]:
            if entry is None:
                return frozenset()
            stages = spec.reachable(entry)
            return frozenset().union(*(self._provides.get(name, frozenset()) for name in stages))

        live = spec.entries.get("live")
        reachable = spec.reachable(live) if live is not None else ()
        gates = [
            (e.source, e.target)
            for e in spec.edges
            if e.gated and e.source in reachable and END_OF_TURN in self._provides.get(e.target, ())
        ]
        return PipelineCapabilities(
            live_entry=live,
            transcribe_entry=spec.entries.get("transcribe"),
            input_rate=spec.input_rate,
            live=provided(live),
            responses=provided(spec.entry),
            end_of_turn_gate=gates[0] if gates else None,
        )

    @property
    def _main_runs(self) -> int:
        return sum(1 for run in self._runs.values() if run.entry == self.spec.entry)

    @property
    def live_requests(self) -> list[str]:
        return list(self._runs)

    # -- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            raise RuntimeError("orchestrator already started")
        self._started = True
        spec = self.spec
        classes = {}
        for stage in spec.stages:  # importing an engine module can be slow: not on the loop
            classes[stage.name] = await asyncio.to_thread(engine_class, stage.engine)
            self._provides[stage.name] = frozenset(getattr(classes[stage.name], "provides", ()))
        kinds = {e.connector for e in spec.edges}
        if any(s.budget.worker == "process" for s in spec.stages):
            kinds.add("shm")
        self.connectors = self._make_connectors(kinds)
        for stage in spec.stages:
            self.stages[stage.name] = built = self._build_stage(stage, classes[stage.name])
            if self._critical is not None:
                for replica in built.replicas:
                    replica.worker = GatedWorker(replica.worker, self._critical, stage.name)
        results = await asyncio.gather(*(s.start() for s in self.stages.values()), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._closed = True
            await self._shutdown()
            raise errors[0]

    def _make_connectors(self, kinds: Collection[str]) -> dict[str, Connector]:
        """The pipeline's connectors (a subclass adds kinds that need configuration)."""
        return make_connectors(kinds)

    def _build_stage(self, stage: StageSpec, engine_cls: type[Engine]) -> Stage:
        """One stage's replica pool (runtime.remote builds pools of replicas on other hosts)."""
        return Stage.build(
            stage,
            engine_cls,
            connectors=self.connectors,
            out_kinds=Counter(e.connector for e in self.spec.outgoing(stage.name)),
            sink=self,
            metrics=self.metrics,
            clock=self._clock,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for run in list(self._runs.values()):
            self._finalize(run, "cancelled", "orchestrator closed")
        await self._shutdown()

    async def _shutdown(self) -> None:
        await asyncio.gather(*(s.close() for s in self.stages.values()), return_exceptions=True)
        for connector in self.connectors.values():
            connector.close()

    async def __aenter__(self) -> Orchestrator:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- client API ---------------------------------------------------------------------------

    async def submit(
        self,
        params: Mapping[str, Any],
        *,
        session_key: str | None = None,
        request_id: str | None = None,
        edge_modes: Mapping[str, str] | None = None,
        entry: str | None = None,
    ) -> RequestHandle:
        """Admit a request; its handle streams client-visible payloads, then a RequestStatus.

        `entry`: a stage to enter at instead of the pipeline's entry (one of its `entries`, e.g.
        a voice session's live request); the request runs the stages reachable from it."""
        if not self._started or self._closed:
            raise RuntimeError("orchestrator is not running (start() it, and not after close())")
        spec = self.spec.with_edge_modes(edge_modes)
        request_id = request_id or f"req_{uuid.uuid4().hex[:20]}"
        if request_id in self._runs:
            raise ValueError(f"request {request_id!r} is already live")
        entry = entry or spec.entry
        if entry != spec.entry and entry not in spec.entries.values():
            raise ValueError(f"unknown entry {entry!r} of pipeline {spec.name!r}")
        capacity = self.capacity
        if entry == spec.entry and self._main_runs >= capacity:
            # Requests on other entries (a session's live request, a transcription) are bounded
            # by their stages' max_concurrency alone (Stage.assign), not by this count.
            raise AdmissionError(
                f"pipeline {spec.name} is full: {self._main_runs} live requests (max_concurrency {capacity})"
            )
        handle = RequestHandle(request_id, self._stream_buffer, on_drain=lambda: self._wake(request_id))
        self._open_run(spec, request_id, params, session_key, entry, handle)
        return handle

    def _open_run(
        self,
        spec: PipelineSpec,
        request_id: str,
        params: Mapping[str, Any],
        session_key: str | None,
        entry: str,
        handle: RequestHandle,
    ) -> None:
        """Assign the request's stages and open it on their replicas; its output goes to
        ``handle`` (a new one, or one whose run ended before anything reached it: a re-run)."""
        names = spec.reachable(entry)
        replicas = {name: self.stages[name].assign(session_key) for name in names}
        now = self._clock()
        run = RequestRun(request_id, handle, spec, replicas, now, entry, pending=set(replicas))
        for edge in spec.edges:
            if edge.source not in replicas:
                continue
            collector: AsyncChunker[Handle] | FullCollector[Handle] = make_collector(edge.mode, edge.chunk)
            gate: EdgeGate[Handle] | None = EdgeGate() if edge.gated else None
            edge_run = _EdgeRun(edge, collector, replicas[edge.target], gate=gate)
            run.edges_out.setdefault(edge.source, []).append(edge_run)
            run.edges_by_key[(edge.source, edge.target)] = edge_run
        self._runs[request_id] = run
        if self._critical is not None:
            self._critical.opened(request_id)
        request = EngineRequest(request_id, dict(params), session_key)
        for stage in spec.stages:
            if stage.name not in replicas:
                continue
            incoming = [e for e in spec.incoming(stage.name) if e.source in replicas]
            is_entry = stage.name == entry
            run.timings[stage.name] = replicas[stage.name].open_request(
                request,
                prewarm=is_entry or all(e.mode == "async_chunk" for e in incoming),
                waiting=not is_entry,
                incoming=len(incoming),
                admitted_at=now,
            )

    async def append_input(self, request_id: str, payload: Payload) -> bool:
        """Streaming input (audio, text, actions) for the entry stage of a live request.

        Waits while ``input_limit`` earlier inputs are still unconsumed (backpressure on a
        producer that outpaces the entry stage); False when the request is not live.
        """
        run = self._runs.get(request_id)
        if run is None:
            return False
        replica = run.replicas[run.entry]
        if not await replica.wait_input_room(request_id, self._input_limit):
            return False
        return replica.add_inputs(request_id, [payload])

    async def update(self, request_id: str, update: Conditioning) -> bool:
        """A prompt/conditioning change, delivered to every stage still working on the request."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        delivered = [replica.add_update(request_id, update) for replica in run.replicas.values()]
        return any(delivered)

    def open_edge(self, request_id: str, source: str, target: str, open_: bool = True) -> bool:
        """Open (or close) the gated edge ``source -> target`` for a live request: from now on
        what ``source`` hands it goes to ``target`` (or nowhere). False when the request is not
        live; ValueError when the request has no such gated edge."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        edge = run.edges_by_key.get((source, target))
        if edge is None or edge.gate is None:
            raise ValueError(f"request {request_id!r} has no gated edge {source}->{target}")
        edge.gate.open = open_
        return True

    async def cancel(self, request_id: str) -> bool:
        """Stop every stage of a live request and free its connector data; False if not live."""
        run = self._runs.get(request_id)
        if run is None:
            return False
        self._finalize(run, "cancelled", None)
        return True

    def health(self) -> dict[str, Any]:
        return {
            "pipeline": self.spec.name,
            "running": self._started and not self._closed,
            "live": len(self._runs),
            "capacity": self.capacity,
            "connectors": {kind: c.health() for kind, c in self.connectors.items()},
            "stages": {
                name: [
                    {"replica": r.index, "ready": r.ready, "load": r.load, "restarts": r.restarts}
                    for r in stage.replicas
                ]
                for name, stage in self.stages.items()
            },
        }

    # -- StageSink (called by replicas on the loop) ------------------------------------------

    def can_step(self, stage: str, request_id: str) -> bool:
        """False while the client buffer is full, or a downstream stage still working on the
        request holds ``inbox_limit`` chunks or has taken in too few items (``max_ahead``)."""
        run = self._runs.get(request_id)
        if run is None or run.handle.full:
            return False
        for edge in run.edges_out.get(stage, ()):
            if edge.spec.target not in run.pending:
                continue  # that stage is done with the request: it holds nothing back
            if self._holds_back(edge, request_id):
                return False
        return True

    def _holds_back(self, edge: _EdgeRun, request_id: str) -> bool:
        """The edge's target holds enough for the request that its upstream pauses: its inbox
        limit in chunks, its flow credits, or (a coalescing edge) its limit in items."""
        if edge.spec.coalesce:
            return edge.target.held_items(request_id, edge.spec.source) >= self._inbox_of(edge)
        return edge.out_of_credit or edge.target.inbox_size(request_id) >= self._inbox_of(edge)

    def on_result(self, stage: str, request_id: str, result: ItemResult) -> None:
        run = self._runs.get(request_id)
        if run is None:
            for connector in self.connectors.values():
                connector.cleanup(request_id)
            return
        if result.client:
            if run.first_client_at is None:
                run.first_client_at = self._clock()
            for payload in result.client:
                run.handle._push(payload)
        if self._critical is not None and (result.client or result.done):
            run_started(self._critical.output(stage, request_id))
        edges = run.edges_out.get(stage, ())
        if result.downstream:
            for edge in edges:
                handles = result.downstream.get(edge.spec.connector, [])
                if edge.gate is not None:
                    handles, closed = edge.gate.admit(handles)
                    self._release(closed)
                edge.produced += len(handles)
                for chunk in edge.collector.extend(handles):
                    self._deliver(run, edge, chunk)
        if result.done:
            for edge in edges:
                self._deliver(run, edge, edge.collector.finish())
            run.pending.discard(stage)
            if not run.pending:
                self._finalize(run, "completed", None)
            else:
                self._release_upstream(run, stage)

    def on_failed(self, stage: str, request_id: str, error: str) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            self._finalize(run, "failed", error)

    def on_taken(self, stage: str, request_id: str, chunks: list[ChunkRef]) -> None:
        """``stage`` took ``chunks`` (its whole inbox) into a step: wake the upstream stages that
        this frees (inbox back under ``inbox_limit``, ``max_ahead`` credits returned)."""
        run = self._runs.get(request_id)
        if run is None or not chunks:
            return
        counts = Counter[str]()
        for chunk in chunks:
            counts[chunk.source] += len(chunk.items)
        for source, count in counts.items():
            edge = run.edges_by_key.get((source, stage))
            if edge is None:
                continue
            taken = count if edge.spec.coalesce else len(chunks)
            blocked = taken >= self._inbox_of(edge) or edge.out_of_credit
            edge.taken += count
            if blocked and source in run.pending:
                run.replicas[source].wake()

    # -- internals ----------------------------------------------------------------------------

    def _inbox_of(self, edge: _EdgeRun) -> int:
        """Chunks (a coalescing edge: items) the edge's target may hold for a request before
        the upstream pauses."""
        if edge.spec.coalesce:
            return edge.spec.inbox_limit or DEFAULT_COALESCE_LIMIT
        return edge.spec.inbox_limit or self._inbox_limit

    def _deliver(self, run: RequestRun, edge: _EdgeRun, chunk: Chunk[Handle]) -> None:
        ref = ChunkRef(
            chunk.items, chunk.context, chunk.finished, chunk.index, edge.spec.source, chunk.release
        )
        if not edge.target.deliver(run.request_id, ref, coalesce=edge.spec.coalesce):
            # The downstream stage is done with this request: nobody will consume the chunk.
            self._release(ref.release)

    def _release(self, handles: list[Handle]) -> None:
        for handle in handles:
            connector = self.connectors.get(handle.kind)
            if connector is not None:
                connector.release(handle)

    def _release_upstream(self, run: RequestRun, stage: str) -> None:
        """``stage`` finished the request before its upstream stages: they may be paused on its
        inbox (``can_step``) or its flow credits, which nothing else would ever free. Wake them;
        from now on what they hand to ``stage`` is released on delivery."""
        for edge in run.spec.incoming(stage):
            if edge.source in run.pending:
                run.replicas[edge.source].wake()

    def _wake(self, request_id: str) -> None:
        run = self._runs.get(request_id)
        if run is not None:
            for replica in run.replicas.values():
                replica.wake()

    def _detach(self, run: RequestRun, status: FinalStatus) -> bool:
        """End ``run`` on its replicas and free its connector data; False if it had ended."""
        if self._runs.pop(run.request_id, None) is None:
            return False
        if self._critical is not None:
            run_started(self._critical.closed(run.request_id))
        for replica in run.replicas.values():
            replica.close_request(run.request_id, outcome=status)
        for connector in self.connectors.values():
            connector.cleanup(run.request_id)
        return True

    def _finalize(self, run: RequestRun, status: FinalStatus, error: str | None) -> None:
        if not self._detach(run, status):
            return
        now = self._clock()
        first_client = None if run.first_client_at is None else (run.first_client_at - run.admitted_at) * 1e3
        run.handle._close(
            RequestStatus(
                status=status,
                error=error,
                timings=run.timings,
                request_id=run.request_id,
                total_ms=(now - run.admitted_at) * 1e3,
                first_client_ms=first_client,
            ),
            drop_unread=status == "cancelled",
        )
