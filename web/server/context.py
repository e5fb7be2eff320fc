"""What one server process holds: the pipeline's orchestrator, Redis, credentials.

Built once in the app's lifespan; the routes only translate bytes to calls on it. Every model
(VAD and ASR included) runs in the orchestrator; what the pipeline offers a session comes from
`Orchestrator.capabilities()`, never from engine names.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff

from runtime.capabilities import PipelineCapabilities
from runtime.orchestrator import Orchestrator
from runtime.spec import PipelineSpec, load_pipeline
from session.identity import ApiKeyMap, EphemeralKeys
from session.live.hosting import LiveHost
from session.realtime.audio_store import SpoolAudioStore
from session.robot.hosting import RobotHost
from session.store.embedded import redis_connection
from session.voice.driver import RealtimeDriver
from session.voice.hosting import SessionHost
from session.voice.turn_gate import TurnGate
from session.world.hosting import WorldHost
from web.deploy.replica import ReplicaMembership
from web.server.metrics import ServerMetrics, loop_lag_watcher
from web.server.session_factory import CoreFactory, DriverFactory, build_host
from web.settings import ServerSettings

log = logging.getLogger(__name__)

# Fail fast when Redis is unreachable (open → 503, a writer retries on its own backoff)
# rather than redis-py's default of 10 retries and 5 s timeouts per call.
REDIS_CLIENT_OPTIONS: dict[str, Any] = {
    "socket_timeout": 2.0,
    "socket_connect_timeout": 1.0,
    "retry": Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.2), retries=2),
    # redis-py's pool raises past 100 connections in use; hundreds of sessions opening or
    # flushing at once need more (Redis itself allows 10,000 clients).
    "max_connections": 1024,
}

# The cyclic GC's young-generation threshold: Python's default (700 net container allocations)
# ran a collection every ~1 ms with 200 sessions; objects living a few tens of ms (events
# waiting for a flush, pending futures) survived two young collections and were promoted, so
# full collections (20-70 ms loop stalls with a few 10k live objects) came every ~1.2 s and made
# the p99 interval between audio deltas. Almost everything here is freed by reference counting:
# at 20000, the same load ran 4 young collections in 35 s and no full one (loadtest null, 200
# sessions: delta gap p99 133 → 80 ms, loop lag p99 55 → 25 ms on a busy host).
# But once the ramp is over, what a young collection finds is long-lived (the conversations'
# items: `collected=0`), so generation 1 grows by the whole threshold each time, and the
# twelfth young collection, a generation-1 one, scanned 20,000 × 11 survivors: ~200 ms with the
# loop stopped, every ~8 minutes at null-200 (docs/benchmarks.md, "Longer runs"). A
# generation-1 collection scans at most threshold0 × (threshold1 + 1) objects: 2,000 keeps it
# at about what a young one at 20,000 cost (8–33 ms), and young ones at ~2 ms. threshold2 100
# keeps full collections as rare as before (one per 100 generation-1 collections, each 10 times
# as frequent as before). The conversations' items have since left the collector's scans
# (session/realtime/gc_untrack.py): its oldest generation no longer grows with them (null-200,
# minute 1.5 to 5: 62,900 → 64,100 objects, against 74,700 → 132,700 before).
GC_THRESHOLDS = (2_000, 10, 100)


RESPONDER = "speech.responder"
# The responder on vLLM batches every live turn in one engine: its stage steps them together.
VLLM_RESPONDER_BATCH = 64
VLLM_RESPONDER = "engines.vllm.stages:VllmResponderEngine"


def pipeline_spec(settings: ServerSettings) -> PipelineSpec:
    """The pipeline with the command line's responder choices applied (``--responder``,
    ``--llm``, ``--llm-engine``) to its ``speech.responder`` stage, if it has one."""
    spec = load_pipeline(settings.pipeline).with_edge_modes(settings.edge_modes or None)
    if not any(stage.engine == RESPONDER for stage in spec.stages):
        return spec
    options: dict[str, object] = {}
    if settings.responder:
        options["responder"] = settings.responder
    if settings.llm:
        options["llm"] = settings.llm
    if settings.llm_engine == "vllm" and settings.responder != "echo":
        stage = next(s for s in spec.stages if s.engine == RESPONDER)
        if stage.options.get("responder") == "echo" and "responder" not in options:
            return spec.with_stage(RESPONDER, options=options)
        model = options.get("llm") or stage.options.get("llm") or "smollm2"
        batch = max(stage.budget.max_batch, VLLM_RESPONDER_BATCH)
        return spec.with_stage(
            RESPONDER,
            options={"model": model},
            # by path: loads even where the installed entry points predate vllm.responder
            new_engine=VLLM_RESPONDER,
            budget={"max_batch": batch, "max_concurrency": max(stage.budget.max_concurrency, batch)},
        )
    return spec.with_stage(RESPONDER, options=options) if options else spec


@dataclass(slots=True)
class ServerContext:
    """The composition root: every part a route or transport reaches, typed, built once by
    :func:`server_context`."""

    settings: ServerSettings
    api_keys: ApiKeyMap
    spec: PipelineSpec
    orchestrator: Orchestrator
    redis: Redis
    ephemeral: EphemeralKeys
    capabilities: PipelineCapabilities
    metrics: ServerMetrics
    turn_gate: TurnGate  # generating responses per replica
    host: SessionHost  # the realtime sessions, WebSocket and WebRTC (resume, retention)
    sessions: dict[str, RealtimeDriver] = field(default_factory=dict)  # session id → live driver
    audio_spool: SpoolAudioStore | None = None  # conversations' spilled audio (None: kept in memory)
    # The other session kinds' hosts and the deployment's membership, set by the app's lifespan
    # once the context is up (they are built on `host`); None until then, or where not offered.
    world: WorldHost | None = None  # world-model video sessions
    robot: RobotHost | None = None  # robot policy sessions
    live: LiveHost | None = None  # GPT-Live sessions (None: the pipeline does not take its own turns)
    replica: ReplicaMembership | None = None  # scale-out: registry lease and drain (None: standalone)
    ready: bool = False

    @property
    def open_mode(self) -> bool:
        return len(self.api_keys) == 0



@contextlib.asynccontextmanager
async def audio_spool(settings: ServerSettings) -> AsyncIterator[SpoolAudioStore | None]:
    """This process's spool for conversation audio under the data dir (stale ones of dead
    processes removed first), removed on exit; None when `audio_spool` is off."""
    if not settings.audio_spool:
        yield None
        return
    spool = await asyncio.to_thread(SpoolAudioStore.open, settings.data_dir)
    try:
        yield spool
    finally:
        await asyncio.to_thread(spool.close)


def build_orchestrator(settings: ServerSettings, spec: PipelineSpec, redis: Redis) -> Orchestrator:
    """The pipeline's orchestrator; with `remote_stages`, those run on stage hosts (web/deploy/stages.py)."""
    if not settings.remote_stages:
        return Orchestrator.from_spec(spec)
    from web.deploy.stages import remote_orchestrator

    return remote_orchestrator(settings, spec, redis)


@contextlib.asynccontextmanager
async def server_context(settings: ServerSettings) -> AsyncIterator[ServerContext]:
    """Start everything a server needs; stop it all on exit."""
    api_keys = ApiKeyMap.parse(settings.api_keys) if settings.api_keys else ApiKeyMap()
    spec = pipeline_spec(settings)
    async with (
        redis_connection(settings.redis_url, data_dir=settings.data_dir, **REDIS_CLIENT_OPTIONS) as redis,
        audio_spool(settings) as spool,
    ):
        orchestrator = build_orchestrator(settings, spec, redis)
        await orchestrator.start()
        capabilities = orchestrator.capabilities()
        metrics = ServerMetrics()
        turn_gate = TurnGate(
            settings.max_generating or orchestrator.capacity,
            queue_limit=settings.turn_queue_max,
            wait_s=settings.turn_queue_s,
        )
        drivers = DriverFactory(CoreFactory(settings, capabilities, spool), orchestrator, metrics, turn_gate)
        sessions: dict[str, RealtimeDriver] = {}
        replica_id = settings.replica_id or f"standalone-{uuid.uuid4().hex[:12]}"
        ctx = ServerContext(
            settings=settings,
            api_keys=api_keys,
            spec=spec,
            orchestrator=orchestrator,
            redis=redis,
            ephemeral=EphemeralKeys(redis),
            capabilities=capabilities,
            metrics=metrics,
            turn_gate=turn_gate,
            host=build_host(drivers, redis, sessions, replica_id),
            sessions=sessions,
            audio_spool=spool,
        )
        metrics.bind_runtime(orchestrator.metrics)
        if settings.remote_stages:
            from web.deploy.stages import bind_stage_metrics

            bind_stage_metrics(metrics.registry, orchestrator)
        metrics.bind_sessions(sessions.values)
        if spool is not None:
            metrics.bind_audio_spool(lambda: spool.spooled_bytes)
        await ctx.host.start()
        # Everything loaded so far (modules, torch, models) lives as long as the process. Out
        # of the cyclic GC's sight, full collections stop scanning it: under load they had
        # been stopping the event loop for ~100 ms each (see omniduplex_gc_pause_seconds).
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        ctx.ready = True
        try:
            async with loop_lag_watcher(ctx.metrics):
                yield ctx
        finally:
            ctx.ready = False
            await ctx.host.close()  # parks its sessions in Redis: resumable after a restart
            for driver in list(ctx.sessions.values()):
                driver.request_close(1001, "server shutting down")
            await orchestrator.close()
