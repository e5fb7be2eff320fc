"""`omniduplex serve`: checks the bind against the credentials, then runs uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from runtime.heap_trim import HeapTrimmer
from session.identity import ApiKeyMap
from web.app import create_app
from web.deploy.allocator import fix_mmap_threshold
from web.deploy.replica import DrainingServer
from web.edge.auth import is_loopback_host
from web.edge.uvicorn_guards import install
from web.settings import ServerSettings
from web.transports.robot import RobotFrameLimit

log = logging.getLogger("omniduplex")


def key_count(spec: str) -> int:
    """How many API keys `spec` (``key:tenant,...``) configures: ``","`` or ``" "`` is none,
    so it must not pass for a keyed server. Raises ValueError for a malformed entry."""
    return len(ApiKeyMap.parse(spec)) if spec.strip() else 0


def check_bind(settings: ServerSettings) -> str | None:
    """Why this bind must not start, or None."""
    try:
        keys = key_count(settings.api_keys)
    except ValueError as exc:
        return f"bad API keys (OMNIDUPLEX_API_KEYS / --api-keys): {exc}"
    if keys or is_loopback_host(settings.host) or settings.insecure:
        return None
    return (
        f"refusing to serve on {settings.host} without API keys: set OMNIDUPLEX_API_KEYS=key:tenant,... "
        "(or --api-keys), or pass --insecure"
    )


def uvicorn_config(settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    """uvicorn with the connection deadlines of `settings` (web/edge/uvicorn_guards.py): request
    headers and bodies in time, idle keep-alive closed, WebSocket pings, and a WebSocket
    whose send buffer stays full closed with 1008."""
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        ws=RobotFrameLimit,  # websockets-sansio, with the robot route's 64 MiB frame limit
        ws_max_size=settings.max_message_bytes,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        timeout_keep_alive=settings.keep_alive_s,  # type: ignore[arg-type]  # a float works
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    return install(
        config, http_timeout_s=settings.http_timeout_s, ws_send_timeout_s=settings.ws_send_timeout_s
    )


def serve(args: argparse.Namespace) -> int:
    settings = ServerSettings.from_args(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    problem = check_bind(settings)
    if problem:
        print(f"omniduplex: {problem}", file=sys.stderr)
        return 2
    if not key_count(settings.api_keys):
        log.warning(
            "no API keys configured: the server is OPEN to anyone who can reach %s (loopback)", settings.host
        )
    try:
        fix_mmap_threshold(int(getattr(args, "malloc_mmap_threshold", 0)))
    except ValueError as exc:
        print(f"omniduplex: --malloc-mmap-threshold: {exc}", file=sys.stderr)
        return 2
    workers = int(getattr(args, "workers", 1) or 1)
    if workers < 1:
        print(f"omniduplex: --workers must be at least 1, got {workers}", file=sys.stderr)
        return 2
    if workers > 1 and not settings.worker:
        from web.deploy.workers import run_workers

        return run_workers(args, settings)
    # What sessions freed goes back to the system while the server runs (runtime/heap_trim.py).
    trimmer = HeapTrimmer(interval_s=float(getattr(args, "malloc_trim_interval_s", 0.0) or 0.0))
    trimmer.start()
    try:
        # DrainingServer: a replica's first SIGTERM drains its sessions first
        # (web/deploy/replica.py); standalone it is plain uvicorn.
        server = DrainingServer(uvicorn_config(settings, log_level=str(args.log_level)))
        if settings.worker:  # one of `--workers N`: the shared public port + its private one
            from web.deploy.workers import worker_sockets

            server.run(sockets=worker_sockets(settings))
        else:
            server.run()
    finally:
        trimmer.stop()
    return 0
