"""Stages on other hosts, the web side: the `omniduplex stage` command and `serve --remote-stage`.

Both sides find each other through Redis (:mod:`session.stage_registry`). A stage host
registers each replica with ``url = tcp://host:port/index``; the server's
:class:`~runtime.remote.stages.RemoteStages` reads them. The models themselves run in
``runtime.remote.host`` (never here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from runtime.remote.auth import CurveKeys, StageKeyError, check_listen, is_loopback, stage_key
from runtime.remote.orchestrator import RemoteOrchestrator
from runtime.remote.stages import RemoteStages
from runtime.spec import PipelineSpec, load_pipeline
from session.affinity import ReplicaInfo, ReplicaLease
from session.stage_registry import registry_lister, stage_registry
from web.deploy.replica import admin_denial
from web.settings import ServerSettings

log = logging.getLogger(__name__)

REDIS_OPTIONS: dict[str, Any] = {"socket_timeout": 2.0, "socket_connect_timeout": 1.0}


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
        spec,
        args.stage,
        listen=bind,
        advertise=advertise,
        keys=keys,
        replicas=args.replicas,
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
    await _serve_until(stop, host, leases)
    exported = await asyncio.to_thread(host.export_kv)
    log.info("stage host: draining (%d request(s) held, %d sessions' KV handed on)", host.load, exported)
    for lease in leases:
        with contextlib.suppress(Exception):
            await lease.drain()
    deadline = time.monotonic() + args.drain_timeout_s
    # what it holds, and the session KV it handed on until the replicas taking it have pulled it
    while (host.load or host.exports_pending()) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    await _close(host, redis, leases)
    return 0


async def _serve_until(stop: asyncio.Event, host: Any, leases: list[ReplicaLease]) -> None:
    """Until ``stop``: once a second, each replica's load to its lease, and the host's reaping."""
    while not stop.is_set():
        # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that lands as the
        # stop arrives, and the host would drain and close as if nothing had cancelled it
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await stop.wait()
        for lease, replica in zip(leases, host.replicas, strict=True):
            lease.set_load(replica.load)
        await asyncio.to_thread(host.reap)


async def _close(host: Any, redis: Redis, leases: list[ReplicaLease]) -> None:
    for lease in leases:
        with contextlib.suppress(Exception):
            await lease.stop(deregister=True)
    await asyncio.to_thread(host.close)
    await redis.aclose()


# -- observability: GET /v1/stages, /metrics -----------------------------------------------------


def stage_rows(orchestrator: Any) -> dict[str, Any]:
    """Every stage replica the orchestrator uses: remote ones as the registry and the control
    plane see them, local ones as ``address: "local"``."""
    rows: list[dict[str, Any]] = []
    remote = getattr(orchestrator, "remote", None)
    remote_names = set(remote.stages) if isinstance(remote, RemoteStages) else set()
    for name, stage in orchestrator.stages.items():
        if name in remote_names:
            continue
        for replica in stage.replicas:
            rows.append(
                {
                    "stage": name,
                    "replica_id": f"{name}.{replica.index}",
                    "address": "local",
                    "state": "SERVING" if replica.ready else "RESTARTING",
                    "in_flight": replica.load,
                    "lease_expires_in_s": None,
                }
            )
    body: dict[str, Any] = {"object": "list", "data": rows}
    if isinstance(remote, RemoteStages):
        rows.extend(remote.snapshot())
        body["registry_error"] = remote.registry_error
        body["refused"] = [
            {"replica_id": rid, "reason": why, "retry_in_s": round(max(0.0, until - remote.clock()), 1)}
            for rid, (until, why) in remote.refused.items()
        ]
    return body


async def stages_endpoint(request: Request) -> Response:
    """`GET /v1/stages`: the admin key; with none configured, open to loopback clients of a
    server without API keys (as a single-machine setup runs), else 403."""
    ctx = request.app.state.ctx
    admin_key = ctx.settings.admin_key
    if admin_key or not (ctx.open_mode and is_loopback(request.client.host if request.client else "")):
        denied = admin_denial(request.headers.get("authorization"), admin_key)
        if denied is not None:
            status, code, message = denied
            kind = "invalid_request_error" if status < 500 else "server_error"
            return JSONResponse(
                {"error": {"type": kind, "code": code, "message": message}}, status_code=status
            )
    return JSONResponse(stage_rows(ctx.orchestrator))


def stage_routes() -> list[BaseRoute]:
    return [Route("/v1/stages", stages_endpoint)]


class RemoteStagesCollector(Collector):
    """Per remote replica, read at scrape time: calls, failures, in flight, call round-trip
    histogram; per stage host: bytes pulled from it and the pull latency histogram."""

    def __init__(self, remote: RemoteStages) -> None:
        self.remote = remote

    def collect(self) -> Iterator[Metric]:
        labels = ["stage", "replica_id", "host"]
        calls = CounterMetricFamily(
            "omniduplex_remote_stage_calls", "Work calls sent to a remote replica", labels=labels
        )
        failures = CounterMetricFamily(
            "omniduplex_remote_stage_failures",
            "Work calls to a remote replica that failed (error or host lost)",
            labels=labels,
        )
        in_flight = GaugeMetricFamily(
            "omniduplex_remote_stage_in_flight", "Requests on a remote replica", labels=labels
        )
        seconds = HistogramMetricFamily(
            "omniduplex_remote_stage_call_seconds", "Work call round trip to a remote replica", labels=labels
        )
        for stage in list(self.remote.stages.values()):
            for rid, member in list(stage.members.items()):
                worker = member.worker
                values = [stage.name, rid, worker.endpoint]
                calls.add_metric(values, worker.calls)
                failures.add_metric(values, worker.failures)
                in_flight.add_metric(values, member.replica.load)
                buckets, total, _count = worker.call_seconds.snapshot()
                seconds.add_metric(values, buckets, total)
        moved = CounterMetricFamily(
            "omniduplex_stage_transfer_bytes",
            "Bytes pulled through the transfer engine, by owner",
            labels=["owner"],
        )
        pulls = HistogramMetricFamily(
            "omniduplex_stage_transfer_seconds", "Transfer engine pulls, by owner", labels=["owner"]
        )
        pull_failures = CounterMetricFamily(
            "omniduplex_stage_transfer_failures", "Pulls that failed (owner gone)", labels=["owner"]
        )
        connector = self.remote.connector
        if connector is not None:
            for owner, (latency, counts) in list(connector.pulls.items()):
                moved.add_metric([owner], counts[0])
                pull_failures.add_metric([owner], counts[1])
                buckets, total, _count = latency.snapshot()
                pulls.add_metric([owner], buckets, total)
        yield from (calls, failures, in_flight, seconds, moved, pulls, pull_failures)


def bind_stage_metrics(registry: CollectorRegistry, orchestrator: Any) -> None:
    remote = getattr(orchestrator, "remote", None)
    if isinstance(remote, RemoteStages):
        registry.register(RemoteStagesCollector(remote))
