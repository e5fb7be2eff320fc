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
    llm: str | None = None  # the responder's LM (None: the pipeline's; voice-cascade: SmolLM2)
    responder: str | None = None  # "llm" | "echo" (None: the pipeline's)
    llm_engine: str = "transformers"  # "transformers" | "vllm"
    redis_url: str | None = None  # None: an embedded redis-server in data_dir
    data_dir: str = "./.omniduplex"
    api_keys: str = ""  # "key:tenant,..."; empty: open, loopback only
    cors_origins: str | None = None  # browser origins allowed (web/edge/cors.py); None: loopback when open
    admin_key: str | None = None
    insecure: bool = False
    advertise_url: str | None = None
    # scale-out (web/deploy/replica.py): registry lease, drain
    replica_id: str | None = None  # None: random per process
    replica_lease_s: float = 5.0
    replica_refresh_s: float = 2.0
    drain_timeout_s: float = 600.0
    worker: bool = False  # one of `serve --workers N`'s processes (web/deploy/workers.py)
    max_sessions: int = 64
    max_message_bytes: int = 2 * 1024 * 1024  # a frame over this closes with 1009
    session_max_duration_s: float = 3600.0  # kept for compatibility; see `max_lifetime`
    # sessions (session/voice/hosting.py): retention, admission, event log
    idle_ttl_s: float = 600.0  # no client input and no server event for this long: deleted
    max_lifetime_s: float = 3600.0  # then `session_expired`, close 1001, deleted
    disconnect_grace_s: float = 30.0  # a dropped session runs on this long, then is parked
    tenant_max_sessions: int | None = None  # per-tenant slots (None: max_sessions)
    admission_queue_s: float = 10.0  # how long an open may wait in the queue for a slot
    admission_queue_max: int = 64  # waiters per replica; beyond it, 429 at once
    event_log_maxlen: int = 4096  # events kept per session for replay (XADD MAXLEN ~)
    audio_retention_s: float = 10.0  # item audio a conversation keeps (newest items; older: transcripts)
    audio_spool: bool = True  # retained audio no prompt needs goes to files under data_dir, off the heap
    # turns (session/voice/turn_gate.py): responses generating at once, and a short queue beyond
    max_generating: int | None = None  # None: the pipeline's capacity
    turn_queue_s: float = 2.0  # a turn waits this long for a slot, then fails
    turn_queue_max: int = 64  # turns waiting at once; beyond it a turn fails at once
    ephemeral_ttl_s: float = 600.0
    # Abuse limits (docs/sessions.md "Limits"): what one client can make the server keep.
    max_conversation_bytes: int = 8 * 1024 * 1024  # text of a session's items (conversation_too_large)
    max_instructions_bytes: int = 512 * 1024  # instructions (string_above_max_length)
    max_input_audio_s: float = 300.0  # uncommitted input audio (input_audio_buffer_too_large)
    # Unsent events per connection, then close 1008: room for a 1.9 MB item's events several
    # times over, or ~2 minutes of output audio ahead of its client (issue 33: was 16 MiB).
    outbox_max_bytes: int = 8 * 1024 * 1024
    # Event JSON kept per session for replay (audio deltas are held in the process, below): a
    # resume needs the events since the client's last ack, seconds of them; one from before the
    # trimmed ones gets a snapshot. 4 MiB holds a 1.9 MB item's added + done (issue 33: was 16).
    event_log_max_bytes: int = 4 * 1024 * 1024
    # Audio deltas each session's process keeps for a resume there (not logged in Redis), as
    # PCM: none older than a dead socket can go unnoticed while connected (ping interval + ping
    # timeout + send timeout, 55 s), plus what is made in the disconnect grace (30 s): 85 s of
    # 24 kHz PCM16 is ~3.9 MB as counted (issue 33: was 6 MiB, sized for base64 JSON).
    audio_replay_max_bytes: int = 4 * 1024 * 1024
    # Connections (web/edge/uvicorn_guards.py): half-open and silent peers are dropped.
    http_timeout_s: float = 10.0  # request headers (and a body) must arrive within this
    keep_alive_s: float = 5.0  # an idle keep-alive HTTP connection is closed after this
    ws_ping_interval_s: float = 20.0  # WebSocket ping every ...
    ws_ping_timeout_s: float = 20.0  # ... and close when its pong is this late
    ws_send_timeout_s: float = 15.0  # a WebSocket whose send buffer stays full this long: closed
    vad: bool = True  # server_vad: sessions open a live request on the pipeline's VAD stage (off: no turns)
    stun: list[str] = field(default_factory=list)
    turn: list[str] = field(default_factory=list)
    edge_modes: dict[str, str] = field(default_factory=dict)  # "from->to" → mode, for every request
    # robot policy sessions (web/transports/robot.py): the policy pipeline, and openpi's bare port
    robot_pipeline: str = "robot-pi0-tiny"
    openpi_port: int | None = None  # serve the openpi endpoint at ws://host:PORT/ too
    # stages on other hosts (web/deploy/stages.py): these stages run on `omniduplex stage` hosts only
    remote_stages: tuple[str, ...] = ()
    stage_transfer_host: str = "127.0.0.1"  # this server's transfer engine address (private network)
    stage_pool_mb: int = 256  # its registered pool (what local stages hand to remote ones)

    @property
    def max_lifetime(self) -> float:
        """A session's maximum lifetime: the tighter of `max_lifetime_s` and the older
        `session_max_duration_s`."""
        return min(self.max_lifetime_s, self.session_max_duration_s)

    @classmethod
    def from_args(cls, args: object) -> ServerSettings:
        def get(name: str, default: Any = None) -> Any:
            return getattr(args, name, default)

        return cls(
            host=get("host", "127.0.0.1"),
            port=get("port", 8000),
            pipeline=get("pipeline", "voice-cascade"),
            llm=get("llm"),
            responder=get("responder"),
            llm_engine=get("llm_engine") or "transformers",
            redis_url=get("redis_url"),
            data_dir=get("data_dir", "./.omniduplex"),
            api_keys=get("api_keys") or os.environ.get("OMNIDUPLEX_API_KEYS", ""),
            cors_origins=get("cors_origins"),
            admin_key=get("admin_key") or os.environ.get("OMNIDUPLEX_ADMIN_KEY"),
            insecure=bool(get("insecure", False)),
            advertise_url=get("advertise_url"),
            replica_id=get("replica_id"),
            replica_lease_s=float(get("replica_lease_s", 5.0) or 5.0),
            replica_refresh_s=float(get("replica_refresh_s", 2.0) or 2.0),
            drain_timeout_s=float(get("drain_timeout_s", 600.0) or 600.0),
            worker=bool(get("worker", False)),
            max_sessions=get("max_sessions", 64),
            idle_ttl_s=float(get("idle_ttl_s", 600.0) or 600.0),
            max_lifetime_s=float(get("max_lifetime_s", 3600.0) or 3600.0),
            disconnect_grace_s=float(get("disconnect_grace_s", 30.0)),
            tenant_max_sessions=get("tenant_max_sessions"),
            admission_queue_s=float(get("admission_queue_s", 10.0) or 10.0),
            event_log_maxlen=int(get("event_log_maxlen", 4096) or 4096),
            audio_retention_s=float(get("audio_retention_s", 10.0)),
            audio_spool=bool(get("audio_spool", True)),
            max_generating=get("max_generating"),
            turn_queue_s=float(get("turn_queue_s", 2.0)),
            max_conversation_bytes=int(get("max_conversation_bytes", 8 * 1024 * 1024)),
            max_instructions_bytes=int(get("max_instructions_bytes", 512 * 1024)),
            max_input_audio_s=float(get("max_input_audio_s", 300.0)),
            outbox_max_bytes=int(get("outbox_max_bytes", 8 * 1024 * 1024)),
            event_log_max_bytes=int(get("event_log_max_bytes", 4 * 1024 * 1024)),
            audio_replay_max_bytes=int(get("audio_replay_max_bytes", 4 * 1024 * 1024)),
            http_timeout_s=float(get("http_timeout_s", 10.0)),
            keep_alive_s=float(get("keep_alive_s", 5.0)),
            ws_ping_interval_s=float(get("ws_ping_interval_s", 20.0)),
            ws_ping_timeout_s=float(get("ws_ping_timeout_s", 20.0)),
            ws_send_timeout_s=float(get("ws_send_timeout_s", 15.0)),
            stun=list(get("stun", []) or []),
            turn=list(get("turn", []) or []),
            edge_modes=parse_edge_modes(get("edge_mode", []) or []),
            robot_pipeline=get("robot_pipeline", "robot-pi0-tiny") or "robot-pi0-tiny",
            openpi_port=get("openpi_port"),
            remote_stages=tuple(get("remote_stage", []) or []),
            stage_transfer_host=get("stage_transfer_host") or "127.0.0.1",
            stage_pool_mb=int(get("stage_pool_mb", 256) or 256),
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
