"""How this server builds realtime session cores and drivers (WebSocket and WebRTC alike).

:class:`CoreFactory` turns the server's settings and the pipeline's capabilities into a core's
options; :class:`DriverFactory` puts a driver on a core; :func:`build_host` builds the process's
:class:`~session.voice.hosting.SessionHost` (store, admission, retention) from them. `web.server.context`
composes them once in the lifespan; nothing here reads the server context.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from runtime.capabilities import PipelineCapabilities
from runtime.orchestrator import Orchestrator
from session.admission import AdmissionController
from session.affinity import SessionBinding
from session.realtime.audio_store import SpoolAudioStore
from session.realtime.config import SessionConfig
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.retention import RetentionPolicy
from session.store import SessionStore
from session.voice.driver import DriverOptions, RealtimeDriver
from session.voice.driver_hooks import SessionLog
from session.voice.hosting import HostSettings, SessionHost
from session.voice.live_request import LiveEntry
from session.voice.turn_gate import TurnGate
from web.server.metrics import ServerMetrics
from web.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class CoreFactory:
    """A realtime core's options from the server's settings and the pipeline's capabilities."""

    settings: ServerSettings
    capabilities: PipelineCapabilities
    audio_spool: SpoolAudioStore | None = None  # conversations' spilled audio (None: in memory)

    def core_options(
        self,
        config: SessionConfig,
        session_id: str,
        *,
        audio_out_via_track: bool = False,
        logged: bool = False,
    ) -> CoreOptions:
        """``logged``: the session's events go through a :class:`SessionLog`, which stamps their ids."""
        s, caps = self.settings, self.capabilities
        return CoreOptions(
            stamp_event_ids=not logged,
            config=config,
            max_duration_s=s.max_lifetime,
            audio_retention_s=s.audio_retention_s,
            audio_store=self.audio_spool,
            audio_out_via_track=audio_out_via_track,
            pipeline_transcribes_input=caps.response_transcribes_input,
            session_id=session_id,
            live_responses=caps.live_responses or caps.turn_detection,
            live_transcribes_input=self.live_asr(),
            scores_turn_ends=self.live_turn_model(),
            scores_turn_words=self.live_turn_model() and caps.end_of_turn_words,
            max_conversation_bytes=s.max_conversation_bytes,
            max_instructions_bytes=s.max_instructions_bytes,
            max_input_audio_s=s.max_input_audio_s,
        )

    def live_entry(self) -> LiveEntry | None:
        """Where sessions open their live request: a pipeline that takes its own turns (its live
        entry provides "responses": a full-duplex model) gets every append; one whose live entry
        scores speech ("voice_activity": the VAD stage) gets the core's VAD frames, unless server
        VAD is turned off. None: no live request."""
        caps = self.capabilities
        if caps.live_entry is None:
            return None
        if caps.live_responses or caps.turn_detection:
            return LiveEntry(caps.live_entry, caps.input_rate)
        if caps.voice_activity and self.settings.vad:
            gate = caps.end_of_turn_gate if self.live_turn_model() else None
            return LiveEntry(caps.live_entry, 16000, frames=True, transcribes=self.live_asr(), turn_gate=gate)
        return None

    def live_asr(self) -> bool:
        """The live request's VAD frames go on to an ASR stage: the user is transcribed as they
        speak, on the live request (a pipeline taking its own turns transcribes by itself)."""
        caps = self.capabilities
        own_turns = caps.live_responses or caps.turn_detection
        return caps.voice_activity and caps.live_transcribes_input and self.settings.vad and not own_turns

    def live_turn_model(self) -> bool:
        """The live request's VAD frames go on to an end-of-turn model: semantic_vad ends turns
        on its answers (without one, semantic_vad is server VAD with an eagerness-based silence)."""
        caps = self.capabilities
        own_turns = caps.live_responses or caps.turn_detection
        return caps.voice_activity and caps.end_of_turn and self.settings.vad and not own_turns


@dataclass(frozen=True, slots=True)
class DriverFactory:
    """A driver on a hosted session's core: the orchestrator, the replica's turn gate, metrics."""

    cores: CoreFactory
    orchestrator: Orchestrator
    metrics: ServerMetrics
    turn_gate: TurnGate

    def driver(self, core: RealtimeSessionCore, log: SessionLog) -> RealtimeDriver:
        return RealtimeDriver(
            core,
            self.orchestrator,
            log=log,
            options=DriverOptions(
                session_key=core.session_id,
                observer=self.metrics,
                turn_gate=self.turn_gate,
                capabilities=self.cores.capabilities,
                live=self.cores.live_entry(),
                outbox_max_bytes=self.cores.settings.outbox_max_bytes,
            ),
        )


def build_store(redis: Redis, s: ServerSettings) -> SessionStore:
    """The session store on ``redis`` with the retention and replay bounds of ``s``."""
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


def build_host(
    drivers: DriverFactory, redis: Redis, registry: dict[str, RealtimeDriver], replica_id: str
) -> SessionHost:
    """The session host of this process (not started); ``registry`` gets its live drivers."""
    s = drivers.cores.settings
    store = build_store(redis, s)
    tenant_limit = s.tenant_max_sessions if s.tenant_max_sessions is not None else s.max_sessions
    admission = AdmissionController(
        redis,
        replica_id=replica_id,
        replica_limit=s.max_sessions,
        tenant_limit=tenant_limit,
        max_queue=s.admission_queue_max,
    )
    return SessionHost(
        store,
        admission,
        binding=SessionBinding(redis, default_ttl_s=s.idle_ttl_s),
        core_options=lambda config, sid: drivers.cores.core_options(config, sid, logged=True),
        new_driver=drivers.driver,
        settings=HostSettings(policy=store.policy, queue_deadline_s=s.admission_queue_s),
        registry=registry,
    )
