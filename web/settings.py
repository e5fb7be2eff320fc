"""Server settings, from the command line or from tests."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    pipeline: str = "voice-cascade"
    llm: str | None = None
    redis_url: str | None = None  # None: an embedded redis-server in data_dir
    data_dir: str = "./.omniduplex"
    api_keys: str = ""  # "key:tenant,..."; empty: open, loopback only
    admin_key: str | None = None
    insecure: bool = False
    advertise_url: str | None = None
    max_sessions: int = 64
    max_message_bytes: int = 2 * 1024 * 1024  # a frame over this closes with 1009
    session_max_duration_s: float = 3600.0
    ephemeral_ttl_s: float = 600.0
    vad: bool = True  # load Silero for server_vad (tests of pure protocol paths may turn it off)
    stun: list[str] = field(default_factory=list)
    turn: list[str] = field(default_factory=list)
    edge_modes: dict[str, str] = field(default_factory=dict)  # "from->to" → mode, for every request

    @classmethod
    def from_args(cls, args: object) -> ServerSettings:
        def get(name: str, default: Any = None) -> Any:
            return getattr(args, name, default)

        return cls(
            host=get("host", "127.0.0.1"),
            port=get("port", 8000),
            pipeline=get("pipeline", "voice-cascade"),
            llm=get("llm"),
            redis_url=get("redis_url"),
            data_dir=get("data_dir", "./.omniduplex"),
            api_keys=get("api_keys") or os.environ.get("OMNIDUPLEX_API_KEYS", ""),
            admin_key=get("admin_key") or os.environ.get("OMNIDUPLEX_ADMIN_KEY"),
            insecure=bool(get("insecure", False)),
            advertise_url=get("advertise_url"),
            max_sessions=get("max_sessions", 64),
            stun=list(get("stun", []) or []),
            turn=list(get("turn", []) or []),
            edge_modes=parse_edge_modes(get("edge_mode", []) or []),
        )


def parse_edge_modes(items: list[str]) -> dict[str, str]:
    """``["talker->code2wav=full"]`` → ``{"talker->code2wav": "full"}``."""
    modes: dict[str, str] = {}
    for item in items:
        edge, sep, mode = item.partition("=")
        if not sep or "->" not in edge:
            raise ValueError(f"--edge-mode {item!r}: expected FROM->TO=MODE")
        modes[edge.strip()] = mode.strip()
    return modes
