"""What a gateway holds: its settings and its stateless collaborators (the replica registry,
the session bindings, the router, the HTTP forwarder, the API keys), shared by its HTTP routes
(:mod:`web.gateway.app`) and its WebSocket relay (:mod:`web.gateway.ws_endpoint`)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from redis.asyncio import Redis

from session.affinity import ReplicaRegistry, SessionBinding
from session.identity import ApiKeyMap, EphemeralKeys, api_key_from_request, authenticate
from web.gateway.http_forward import HttpForwarder
from web.gateway.routing import Router


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    redis_url: str
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: str = ""  # when set, the gateway also refuses unauthenticated requests itself
    admin_key: str | None = None
    insecure: bool = False
    cors_origins: str | None = None  # browser origins allowed (web/edge/cors.py); None: loopback when open
    connect_timeout_s: float = 2.0  # replica WebSocket handshake / HTTP connect
    lapse_wait_s: float = 6.0  # an unreachable owner: wait this long for its lease to lapse
    max_message_bytes: int = 2 * 1024 * 1024

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewaySettings:
        return cls(
            redis_url=args.redis_url,
            host=args.host,
            port=args.port,
            api_keys=args.api_keys or os.environ.get("OMNIDUPLEX_API_KEYS", ""),
            admin_key=getattr(args, "admin_key", None) or os.environ.get("OMNIDUPLEX_ADMIN_KEY"),
            insecure=bool(args.insecure),
            cors_origins=getattr(args, "cors_origins", None),
        )


class Gateway:
    """The gateway's collaborators (all stateless apart from connection pools)."""

    def __init__(self, settings: GatewaySettings, redis: Redis) -> None:
        self.settings = settings
        self.redis = redis
        self.registry = ReplicaRegistry(redis)
        self.binding = SessionBinding(redis)
        self.router = Router(self.registry, self.binding)
        self.http = HttpForwarder(connect_timeout_s=settings.connect_timeout_s)
        self.api_keys = ApiKeyMap.parse(settings.api_keys) if settings.api_keys else ApiKeyMap()
        self.ephemeral = EphemeralKeys(redis)

    async def close(self) -> None:
        await self.http.close()

    async def authorized(self, authorization: str | None, subprotocols: list[str]) -> bool:
        """With API keys configured, the gateway refuses strangers before touching a replica."""
        if len(self.api_keys) == 0:
            return True
        key = api_key_from_request(authorization, subprotocols)
        return await authenticate(key, self.api_keys, self.ephemeral) is not None

    @staticmethod
    def call_key(call_id: str) -> str:
        return f"omni:gw:call:{call_id}"
