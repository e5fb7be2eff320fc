"""How this server builds realtime session cores and drivers (WebSocket and WebRTC alike).

Also builds the process's :class:`~session.voice.hosting.SessionHost` (store, admission, retention)
from the settings; `web.context` calls :func:`build_host` once in the lifespan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from session.identity import new_session_id
from session.realtime.config import SessionConfig
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.voice.driver import DriverOptions, RealtimeDriver, SessionLog
from session.voice.live_request import LiveEntry

if TYPE_CHECKING:
    from session.store import SessionStore
    from session.voice.hosting import SessionHost
    from web.context import ServerContext
    from web.settings import ServerSettings


def core_options(
    ctx: ServerContext,
    config: SessionConfig,
    session_id: str,
    *,
    audio_out_via_track: bool = False,
    logged: bool = False,
) -> CoreOptions:
    """``logged``: the session's events go through a :class:`SessionLog`, which stamps their ids."""
    return CoreOptions(
        stamp_event_ids=not logged,
        config=config,
        max_duration_s=ctx.settings.max_lifetime,
        audio_retention_s=ctx.settings.audio_retention_s,
        audio_store=getattr(ctx, "audio_spool", None),  # contexts built by hand may lack one
        audio_out_via_track=audio_out_via_track,
        pipeline_transcribes_input=ctx.pipeline_transcribes_input,
        session_id=session_id,
        live_responses=ctx.capabilities.live_responses or ctx.capabilities.turn_detection,
        live_transcribes_input=_live_asr(ctx),
        max_conversation_bytes=ctx.settings.max_conversation_bytes,
        max_instructions_bytes=ctx.settings.max_instructions_bytes,
        max_input_audio_s=ctx.settings.max_input_audio_s,
    )


def live_entry(ctx: ServerContext) -> LiveEntry | None:
    """Where sessions open their live request: a pipeline that takes its own turns (its live
    entry provides "responses": a full-duplex model) gets every append; one whose live entry
    scores speech ("voice_activity": the VAD stage) gets the core's VAD frames, unless server
    VAD is turned off. None: no live request."""
    caps = ctx.capabilities
    if caps.live_entry is None:
        return None
    if caps.live_responses or caps.turn_detection:
        return LiveEntry(caps.live_entry, caps.input_rate)
    if caps.voice_activity and ctx.settings.vad:
        return LiveEntry(caps.live_entry, 16000, frames=True, transcribes=_live_asr(ctx))
    return None


def _live_asr(ctx: ServerContext) -> bool:
    """The live request's VAD frames go on to an ASR stage: the user is transcribed as they
    speak, on the live request (a pipeline taking its own turns transcribes by itself)."""
    caps = ctx.capabilities
    own_turns = caps.live_responses or caps.turn_detection
    return caps.voice_activity and caps.live_transcribes_input and ctx.settings.vad and not own_turns


def build_driver(
    ctx: ServerContext,
    config: SessionConfig,
    *,
    session_id: str | None = None,
    audio_out_via_track: bool = False,
    audio_sink: Any = None,
    core: RealtimeSessionCore | None = None,
    log: SessionLog | None = None,
) -> RealtimeDriver:
    """A driver on a new core for `config`, or on `core` (hosted sessions pass their own
    core and event log)."""
    if core is None:
        session_id = session_id or new_session_id()
        core = RealtimeSessionCore(
            core_options(
                ctx, config, session_id, audio_out_via_track=audio_out_via_track, logged=log is not None
            )
        )
    return RealtimeDriver(
        core,
        ctx.orchestrator,
        audio_sink=audio_sink,
        log=log,
        options=DriverOptions(
            session_key=core.session_id,
            observer=ctx.metrics,
            turn_gate=ctx.turn_gate,
            capabilities=ctx.capabilities,
            live=live_entry(ctx),
            outbox_max_bytes=ctx.settings.outbox_max_bytes,
        ),
    )


def build_store(redis: Any, s: ServerSettings) -> SessionStore:
    """The session store on ``redis`` with the retention and replay bounds of ``s``."""
    from session.retention import RetentionPolicy
    from session.store import SessionStore

    policy = RetentionPolicy(
        idle_ttl_s=s.idle_ttl_s, max_lifetime_s=s.max_lifetime, disconnect_grace_s=s.disconnect_grace_s
    )
    return SessionStore(
        redis,
        policy=policy,
        stream_maxlen=s.event_log_maxlen,
        log_max_bytes=s.event_log_max_bytes,
        held_max_bytes=s.audio_replay_max_bytes,
        # how long a dead socket can go unnoticed: a ping interval, its timeout, a full send buffer
        held_window_s=s.ws_ping_interval_s + s.ws_ping_timeout_s + s.ws_send_timeout_s,
    )


def build_host(ctx: ServerContext, replica_id: str) -> SessionHost:
    """The session host of this process (not started)."""
    from session.admission import AdmissionController
    from session.affinity import SessionBinding
    from session.voice.hosting import HostSettings, SessionHost

    s = ctx.settings
    store = build_store(ctx.redis, s)
    policy = store.policy
    tenant_limit = s.tenant_max_sessions if s.tenant_max_sessions is not None else s.max_sessions
    admission = AdmissionController(
        ctx.redis,
        replica_id=replica_id,
        replica_limit=s.max_sessions,
        tenant_limit=tenant_limit,
        max_queue=s.admission_queue_max,
    )
    return SessionHost(
        store,
        admission,
        binding=SessionBinding(ctx.redis, default_ttl_s=s.idle_ttl_s),
        core_options=lambda config, sid: core_options(ctx, config, sid, logged=True),
        new_driver=lambda core, log: build_driver(ctx, core.config, core=core, log=log),
        settings=HostSettings(policy=policy, queue_deadline_s=s.admission_queue_s),
        registry=ctx.sessions,
    )
