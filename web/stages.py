"""Stages on other hosts, the web side: the `omniduplex stage` command and `serve --remote-stage`.

Both sides find each other through Redis, in the registry the replicas and gateways already use
(:mod:`session.affinity`: leases and heartbeats), one index per pipeline stage, so a gateway
never mistakes a stage host for a session replica. A stage host registers each replica with
``url = tcp://host:port/index``; the server's :class:`~runtime.remote.stages.RemoteStages`
reads them. The models themselves run in ``runtime.remote.host`` (never here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from typing import Any

from redis.asyncio import Redis

from runtime.remote.auth import CurveKeys, StageKeyError, check_listen, stage_key
from runtime.remote.orchestrator import RemoteOrchestrator
from runtime.remote.stages import Lister, Registered
from runtime.spec import PipelineSpec, load_pipeline
from session.affinity import ReplicaInfo, ReplicaLease, ReplicaRegistry
from session.store.keys import DEFAULT_PREFIX
from web.settings import ServerSettings

log = logging.getLogger(__name__)

REDIS_OPTIONS: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 1.0}


def stage_registry(redis: Redis, pipeline: str, stage: str, *, lease_s: float = 5.0) -> ReplicaRegistry:
    """The registry of one pipeline stage's replicas (an index of its own)."""
    return ReplicaRegistry(redis, lease_s=lease_s, prefix=f"{DEFAULT_PREFIX}:stage:{pipeline}:{stage}")


def registry_lister(redis: Redis, pipeline: str) -> Lister:
    registries: dict[str, ReplicaRegistry] = {}

    async def live(stage: str) -> list[Registered]:
        registry = registries.get(stage)
        if registry is None:
            registry = registries[stage] = stage_registry(redis, pipeline, stage)
        live = await registry.live_replicas()
        return [Registered(r.replica_id, r.url, r.state, r.load, r.lease_until_ms) for r in live]

    return live


def remote_orchestrator(settings: ServerSettings, spec: PipelineSpec, redis: Redis) -> RemoteOrchestrator:
    if settings.redis_url is None:
        raise SystemExit("--remote-stage needs --redis-url: the Redis the stage hosts register in")
    key = stage_key()
    return RemoteOrchestrator(
        spec,
        remote=settings.remote_stages,
        lister=registry_lister(redis, spec.name),
        keys=CurveKeys.derive(key) if key else None,
        transfer_host=settings.stage_transfer_host,
        pool_bytes=settings.stage_pool_mb << 20,
    )


# -- the stage host command -------------------------------------------------------------------


def split_listen(listen: str) -> tuple[str, int]:
    """``ADDR[:PORT]`` (``[v6]:PORT`` for IPv6) -> (addr, port); port 0 when none."""
    if listen.startswith("["):
        host, _, rest = listen[1:].partition("]")
        port = rest.removeprefix(":")
    elif listen.count(":") == 1:
        host, _, port = listen.partition(":")
    else:
        host, port = listen, ""
    if port and not port.isdigit():
        raise ValueError(f"--listen {listen!r}: the port must be a number")
    return host, int(port or 0)


def run_stage_host(args: Any) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    from runtime.remote.host import StageHost
    from runtime.remote.transfer import TransferError, check_local_address

    key = stage_key()
    try:
        host, port = split_listen(args.listen)
        check_listen(host, key)
        advertise = args.advertise or host
        check_local_address(advertise)
        keys = CurveKeys.derive(key) if key else None
        spec = load_pipeline(args.pipeline)
        spec.stage(args.stage)
    except KeyError:
        print(f"omniduplex stage: pipeline {args.pipeline!r} has no stage {args.stage!r}", file=sys.stderr)
        return 2
    except (StageKeyError, TransferError, ValueError) as exc:
        print(f"omniduplex stage: {exc}", file=sys.stderr)
        return 2
    bind = f"[{host}]:{port or '*'}" if ":" in host else f"{host}:{port or '*'}"
    stage_host = StageHost(
        spec, args.stage, listen=bind, advertise=advertise, keys=keys, replicas=args.replicas,
        pool_bytes=args.pool_mb << 20,
    )
    return asyncio.run(_serve(stage_host, args))


async def _serve(host: Any, args: Any) -> int:
    try:
        await asyncio.to_thread(host.open)
    except Exception as exc:
        log.exception("stage host: could not start")
        print(f"omniduplex stage: could not start: {exc}", file=sys.stderr)
        await asyncio.to_thread(host.close)
        return 1
    redis = Redis.from_url(args.redis_url, decode_responses=True, **REDIS_OPTIONS)
    registry = stage_registry(redis, host.pipeline.name, host.spec.name, lease_s=args.lease_s)
    base = f"{host.spec.name}-{uuid.uuid4().hex[:10]}"
    leases = [
        ReplicaLease(
            registry,
            ReplicaInfo(f"{base}-{r.index}", f"{host.endpoint}/{r.index}", host.spec.budget.max_concurrency),
            refresh_s=max(0.2, args.lease_s / 2.5),
        )
        for r in host.replicas
    ]
    try:
        for lease in leases:
            await lease.start()
    except Exception as exc:
        print(f"omniduplex stage: registry unavailable at start: {exc}", file=sys.stderr)
        await _close(host, redis, leases)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"stage host ready: {host.pipeline.name}/{host.spec.name} x{len(host.replicas)} "
        f"control={host.endpoint} transfer={host.connector.session}",
        flush=True,
    )
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
        for lease, replica in zip(leases, host.replicas, strict=True):
            lease.set_load(replica.load)
        await asyncio.to_thread(host.reap)
    log.info("stage host: draining (%d request(s) held)", host.load)
    for lease in leases:
        with contextlib.suppress(Exception):
            await lease.drain()
    deadline = time.monotonic() + args.drain_timeout_s
    while host.load and time.monotonic() < deadline:  # noqa: ASYNC110 - the load lives on other threads
        await asyncio.sleep(0.1)
    await _close(host, redis, leases)
    return 0


async def _close(host: Any, redis: Redis, leases: list[ReplicaLease]) -> None:
    for lease in leases:
        with contextlib.suppress(Exception):
            await lease.stop(deregister=True)
    await asyncio.to_thread(host.close)
    await redis.aclose()
