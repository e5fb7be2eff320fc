"""`omniduplex serve`: checks the bind against the credentials, then runs uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from web.app import create_app
from web.auth import is_loopback_host
from web.replica import DrainingServer
from web.robot import RobotFrameLimit
from web.settings import ServerSettings

log = logging.getLogger("omniduplex")


def check_bind(settings: ServerSettings) -> str | None:
    """Why this bind must not start, or None."""
    if settings.api_keys or is_loopback_host(settings.host) or settings.insecure:
        return None
    return (
        f"refusing to serve on {settings.host} without API keys: set OMNIDUPLEX_API_KEYS=key:tenant,... "
        "(or --api-keys), or pass --insecure"
    )


def uvicorn_config(settings: ServerSettings, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        ws=RobotFrameLimit,  # websockets-sansio, with the robot route's 64 MiB frame limit
        ws_max_size=settings.max_message_bytes,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )


def serve(args: argparse.Namespace) -> int:
    settings = ServerSettings.from_args(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO))
    problem = check_bind(settings)
    if problem:
        print(f"omniduplex: {problem}", file=sys.stderr)
        return 2
    if not settings.api_keys:
        log.warning(
            "no API keys configured: the server is OPEN to anyone who can reach %s (loopback)", settings.host
        )
    workers = int(getattr(args, "workers", 1) or 1)
    if workers < 1:
        print(f"omniduplex: --workers must be at least 1, got {workers}", file=sys.stderr)
        return 2
    if workers > 1 and not settings.worker:
        from web.workers import run_workers

        return run_workers(args, settings)
    # DrainingServer: a replica's first SIGTERM drains its sessions first (web/replica.py);
    # standalone it is plain uvicorn.
    server = DrainingServer(uvicorn_config(settings, log_level=str(args.log_level)))
    if settings.worker:  # one of `--workers N`: the shared public port + its private one
        from web.workers import worker_sockets

        server.run(sockets=worker_sockets(settings))
    else:
        server.run()
    return 0
