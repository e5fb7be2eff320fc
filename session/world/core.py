"""The sans-I/O core of one ``/v1/realtime/video`` connection.

It takes client text frames (or typed events) and runtime facts (generation started, a chunk
encoded, generation ended, the client stalled) with the time they happened, and returns server
events plus *effects* for the driver to carry out. It never touches sockets, tasks or clocks.

Interactions are applied at chunk boundaries the core chooses itself: the driver asks it for
the next chunk *demand* (:meth:`VideoSessionCore.take_demand`) and sends the pending prompt and
coalesced key events right before that demand, so ``applies_at_chunk`` is exact: the first
chunk not yet demanded. The driver keeps at most one chunk demanded and not yet delivered.

Phases: ``idle`` → (session.start) ``starting`` → (runtime admitted it) ``streaming`` →
(done, failed, stopped) ``idle`` again; ``closed`` after a stall or a transport close.
"""

from __future__ import annotations

import enum
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from media.video import EncodedChunk
from session.world.config import VideoConfig, VideoLimits, WorldModel
from session.world.events import (
    ChunkMetadata,
    ClientEvent,
    ErrorCode,
    ErrorEvent,
    InteractionApplied,
    InteractionQueued,
    KeyEvent,
    ProtocolError,
    ServerEvent,
    SessionDone,
    SessionInteraction,
    SessionPing,
    SessionPong,
    SessionResumed,
    SessionStart,
    SessionStop,
    VideoStart,
    parse_client_event,
)
from session.world.keys import HeldKeys, KeyFlush, normalize_key


class Phase(enum.Enum):
    IDLE = "idle"
    STARTING = "starting"
    STREAMING = "streaming"
    CLOSED = "closed"


# ---------------------------------------------------------------------------------- effects


@dataclass(slots=True, frozen=True)
class StartGeneration:
    request_id: str
    pipeline: str
    params: dict[str, Any]
    format: str
    width: int
    height: int
    fps: float
    jpeg_quality: int = 80


@dataclass(slots=True, frozen=True)
class CancelGeneration:
    request_id: str


@dataclass(slots=True, frozen=True)
class CloseConnection:
    code: int
    reason: str


Effect = StartGeneration | CancelGeneration | CloseConnection
Output = ServerEvent | Effect


@dataclass(slots=True, frozen=True)
class Demand:
    """Ask the runtime for chunk ``chunk_index``, after sending ``prompt`` and ``keys.before``."""

    request_id: str
    chunk_index: int
    prompt: str | None
    keys: KeyFlush


@dataclass(slots=True)
class _Request:
    request_id: str
    model: WorldModel
    start: StartGeneration
    chunk_frames: int
    num_frames: int | None
    demanded: int = 0  # chunks demanded so far = index of the next chunk to demand
    chunks_sent: int = 0
    frames_sent: int = 0
    stop_requested: bool = False
    keys: HeldKeys = field(default_factory=HeldKeys)
    pending_prompt: str | None = None
    pending: list[tuple[str, float]] = field(default_factory=list)  # (event_id, queued_at)
    pending_count: int = 0
    in_flight: dict[int, tuple[list[str], float]] = field(default_factory=dict)  # chunk → ids, oldest
    last_chunk_index: int = -1  # of the last chunk handed to the transport
    wire_config: dict[str, Any] | None = None  # video.start's config (for a resumed connection)


def plan_generation(
    event: SessionStart, model: WorldModel, limits: VideoLimits, request_id: str
) -> StartGeneration:
    """Validate a ``session.start`` against the model and limits → the generation to start."""
    lim = limits
    if event.format not in lim.formats:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_FORMAT,
            f"format {event.format!r} is not supported (use one of {', '.join(lim.formats)})",
        )
    width = lim.default_width if event.width is None else event.width
    height = lim.default_height if event.height is None else event.height
    if width <= 0 or height <= 0:
        raise ProtocolError(
            ErrorCode.INVALID_PARAMETER, f"width and height must be positive, got {width}x{height}"
        )
    if width > lim.max_width or height > lim.max_height:
        raise ProtocolError(
            ErrorCode.SIZE_TOO_LARGE,
            f"{width}x{height} is over the maximum {lim.max_width}x{lim.max_height}",
        )
    if event.format == "m4s" and (width % 2 or height % 2):
        raise ProtocolError(
            ErrorCode.INVALID_PARAMETER,
            f"m4s (H.264) needs an even width and height, got {width}x{height}",
        )
    fps = lim.default_fps if event.fps is None else event.fps
    if not 0 < fps <= lim.max_fps:
        raise ProtocolError(ErrorCode.INVALID_PARAMETER, f"fps must lie in (0, {lim.max_fps}], got {fps}")
    if event.num_frames is not None and not 0 < event.num_frames <= lim.max_num_frames:
        raise ProtocolError(ErrorCode.INVALID_PARAMETER, f"num_frames must lie in 1..{lim.max_num_frames}")
    if len(event.prompt) > lim.max_prompt_chars:
        raise ProtocolError(
            ErrorCode.INVALID_PARAMETER, f"prompt is limited to {lim.max_prompt_chars} characters"
        )
    extra = dict(event.extra_params)
    default_chunk = model.chunk_frames or max(1, int(fps * lim.target_chunk_ms / 1000.0))
    chunk_frames = extra.pop("chunk_frames", default_chunk)
    if (
        isinstance(chunk_frames, bool)
        or not isinstance(chunk_frames, int)
        or not 1 <= chunk_frames <= lim.max_chunk_frames
    ):
        raise ProtocolError(
            ErrorCode.INVALID_PARAMETER,
            f"extra_params.chunk_frames must be an integer in 1..{lim.max_chunk_frames}",
        )
    quality = extra.pop("jpeg_quality", 80)
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 95:
        raise ProtocolError(
            ErrorCode.INVALID_PARAMETER, "extra_params.jpeg_quality must be an integer in 1..95"
        )
    for key, value in extra.items():
        if not isinstance(value, str | int | float | bool) and value is not None:
            raise ProtocolError(
                ErrorCode.INVALID_PARAMETER, f"extra_params.{key} must be a string, number or boolean"
            )
    params: dict[str, Any] = {
        **extra,
        "prompt": event.prompt,
        "seed": 0 if event.seed is None else event.seed,
        "width": width,
        "height": height,
        "fps": fps,
        "chunk_frames": chunk_frames,
        "flow": "demand",  # the session paces generation to playback
    }
    if event.num_frames is not None:
        params["num_frames"] = event.num_frames
    return StartGeneration(request_id, model.pipeline, params, event.format, width, height, fps, quality)


class VideoSessionCore:
    """Protocol state of one video connection (see the module docstring)."""

    def __init__(
        self,
        config: VideoConfig | None = None,
        *,
        session_id: str | None = None,
        new_id: Callable[[str], str] | None = None,
    ) -> None:
        self.config = config or VideoConfig()
        self.limits = self.config.limits
        self._new_id = new_id or (lambda prefix: f"{prefix}_{uuid.uuid4().hex[:20]}")
        self.session_id = session_id or self._new_id("vsess")
        self.phase = Phase.IDLE
        self._request: _Request | None = None
        self._event_ids = itertools.count(1)

    @property
    def request_id(self) -> str | None:
        return None if self._request is None else self._request.request_id

    @property
    def streaming(self) -> bool:
        return self.phase is Phase.STREAMING

    @property
    def generating(self) -> bool:
        """A world is running (starting or streaming) and no ``session.stop`` is pending:
        what a hosted session keeps through a dropped connection."""
        req = self._request
        return req is not None and self.phase in (Phase.STARTING, Phase.STREAMING) and not req.stop_requested

    def resumed(self) -> SessionResumed:
        """Where the world is, for a connection that resumes this session: it gets the chunk
        after the last one handed out first (the driver hands a chunk out only to a
        connection that is there to send it)."""
        req = self._request
        if req is None or self.phase is Phase.CLOSED:
            return SessionResumed(self.session_id, self.phase.value, 0, 0)
        return SessionResumed(
            self.session_id,
            self.phase.value,
            req.last_chunk_index + 1,
            req.chunks_sent,
            request_id=req.request_id,
            format=req.start.format,
            config=req.wire_config,
        )

    # -- client input -------------------------------------------------------------------------

    def handle_text(self, text: str, now: float) -> list[Output]:
        if self.phase is Phase.CLOSED:
            return []
        if len(text) > self.limits.max_message_bytes:
            return [
                ErrorEvent(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"text frames are limited to {self.limits.max_message_bytes} bytes",
                )
            ]
        try:
            event = parse_client_event(text, max_actions=self.limits.max_actions)
        except ProtocolError as exc:
            return [self._error(exc)]
        return self.handle_event(event, now)

    def handle_binary(self, size: int) -> list[Output]:
        return [
            ErrorEvent(
                ErrorCode.INVALID_EVENT, f"the client sends JSON text frames only (got {size} binary bytes)"
            )
        ]

    def handle_event(self, event: ClientEvent, now: float) -> list[Output]:
        if self.phase is Phase.CLOSED:
            return []
        try:
            if isinstance(event, SessionPing):
                return [SessionPong()]
            if isinstance(event, SessionStart):
                return self._start(event)
            if isinstance(event, SessionInteraction):
                return self._interact(event, now)
            if isinstance(event, SessionStop):
                return self._stop()
            raise ProtocolError(ErrorCode.INVALID_EVENT, f"unhandled event {type(event).__name__}")
        except ProtocolError as exc:
            return [self._error(exc)]

    def _error(self, exc: ProtocolError) -> ErrorEvent:
        return ErrorEvent(exc.code, exc.message, event_id=exc.event_id, request_id=self.request_id)

    def _start(self, event: SessionStart) -> list[Output]:
        if self.phase is not Phase.IDLE:
            raise ProtocolError(
                ErrorCode.SESSION_ALREADY_ACTIVE,
                f"request {self.request_id} is still running; send session.stop first",
            )
        model = self.config.models.get(event.model)
        if model is None:
            raise ProtocolError(
                ErrorCode.UNKNOWN_MODEL,
                f"unknown model {event.model!r} (available: {', '.join(sorted(self.config.models))})",
            )
        start = plan_generation(event, model, self.limits, self._new_id("vreq"))
        self._request = _Request(
            start.request_id, model, start, int(start.params["chunk_frames"]), event.num_frames
        )
        self.phase = Phase.STARTING
        return [start]

    def _interact(self, event: SessionInteraction, now: float) -> list[Output]:
        req = self._request
        event_id = event.event_id or f"evt_{next(self._event_ids)}"
        if req is None or self.phase not in (Phase.STARTING, Phase.STREAMING) or req.stop_requested:
            raise ProtocolError(
                ErrorCode.NO_ACTIVE_SESSION,
                "no video is streaming; send session.start first",
                event_id=event_id,
            )
        if event.prompt is not None:
            if not req.model.prompts:
                raise ProtocolError(
                    ErrorCode.PROMPT_NOT_SUPPORTED,
                    f"model {req.model.name} takes no prompt updates",
                    event_id=event_id,
                )
            if len(event.prompt) > self.limits.max_prompt_chars:
                raise ProtocolError(
                    ErrorCode.INVALID_PARAMETER,
                    f"prompt is limited to {self.limits.max_prompt_chars} characters",
                    event_id=event_id,
                )
        keys = []
        for action in event.actions:
            key = normalize_key(action.key)
            if key not in req.model.keys:
                allowed = ", ".join(sorted(req.model.keys)) or "none"
                raise ProtocolError(
                    ErrorCode.INVALID_ACTION,
                    f"model {req.model.name} does not act on key {action.key!r} (keys: {allowed})",
                    event_id=event_id,
                )
            keys.append(KeyEvent(action.event, key, action.t_ms))
        # validated: now apply (an invalid interaction changes nothing)
        if event.prompt is not None:
            req.pending_prompt = event.prompt
        for key_event in keys:
            req.keys.apply(key_event)
        req.pending_count += 1
        if len(req.pending) < self.limits.max_applied_ids:
            req.pending.append((event_id, now))
        return [InteractionQueued(req.request_id, event_id, applies_at_chunk=req.demanded)]

    def _stop(self) -> list[Output]:
        req = self._request
        if req is None or self.phase is Phase.IDLE:
            raise ProtocolError(ErrorCode.NO_ACTIVE_SESSION, "no video is streaming")
        if req.stop_requested:
            return []
        req.stop_requested = True
        return [CancelGeneration(req.request_id)]

    # -- runtime facts ------------------------------------------------------------------------

    def on_started(self) -> list[Output]:
        """The runtime admitted the request: confirm it to the client."""
        req = self._request
        if req is None or self.phase is not Phase.STARTING:
            return []
        self.phase = Phase.STREAMING
        start = req.start
        config = {
            "model": req.model.name,
            "width": start.width,
            "height": start.height,
            "fps": start.fps,
            "chunk_frames": req.chunk_frames,
            "num_frames": req.num_frames,
            "seed": start.params["seed"],
            "prompt": start.params["prompt"],
            "keys": sorted(req.model.keys),
            "prompt_updates": req.model.prompts,
        }
        req.wire_config = config
        out: list[Output] = [VideoStart(req.request_id, self.session_id, start.format, config)]
        if req.stop_requested:  # session.stop arrived while the runtime was admitting it
            out.append(CancelGeneration(req.request_id))
        return out

    def on_start_failed(self, code: str, message: str) -> list[Output]:
        req, self._request = self._request, None
        self.phase = Phase.IDLE if self.phase is not Phase.CLOSED else Phase.CLOSED
        return [ErrorEvent(code, message, request_id=None if req is None else req.request_id)]

    def take_demand(self) -> Demand | None:
        """The next chunk to ask for, with the interactions to send right before it."""
        req = self._request
        if req is None or self.phase is not Phase.STREAMING or req.stop_requested:
            return None
        if req.num_frames is not None and req.demanded * req.chunk_frames >= req.num_frames:
            return None
        index = req.demanded
        req.demanded += 1
        prompt, req.pending_prompt = req.pending_prompt, None
        if req.pending:
            req.in_flight[index] = ([eid for eid, _ in req.pending], min(t for _, t in req.pending))
            req.pending = []
        req.pending_count = 0
        return Demand(req.request_id, index, prompt, req.keys.flush())

    def on_chunk(
        self,
        chunk_index: int,
        encoded: EncodedChunk,
        mime_type: str,
        fps: float,
        now: float,
        *,
        kind: str = "media",
        queue_depth: int | None = None,
    ) -> list[ServerEvent]:
        """A chunk is about to go out: the events to send before its binary frame."""
        req = self._request
        if req is None or self.phase is not Phase.STREAMING:
            return []
        out: list[ServerEvent] = []
        applied = req.in_flight.pop(chunk_index, None)
        ids: list[str] = []
        if applied is not None:
            ids, oldest = applied
            out.append(InteractionApplied(req.request_id, chunk_index, ids, round((now - oldest) * 1e3, 3)))
        out.append(
            ChunkMetadata(
                request_id=req.request_id,
                chunk_index=chunk_index,
                transport_chunk_index=req.chunks_sent,
                frame_count=encoded.frame_count,
                byte_length=len(encoded.data),
                format=req.start.format,
                fps=fps,
                pts_ms=round(req.frames_sent * 1e3 / fps, 3),
                mime_type=mime_type,
                kind=kind,
                frame_byte_lengths=encoded.frame_byte_lengths or None,
                init_byte_length=encoded.init_byte_length or None,
                queue_depth=queue_depth,
                started_event_ids=list(ids),
                completed_event_ids=list(ids),
            )
        )
        req.chunks_sent += 1
        req.frames_sent += encoded.frame_count
        req.last_chunk_index = chunk_index
        return out

    def on_generation_end(self, status: str, error: str | None) -> list[Output]:
        """The runtime request ended (completed, failed or cancelled)."""
        req, self._request = self._request, None
        if req is None or self.phase is Phase.CLOSED:
            return []
        self.phase = Phase.IDLE
        out: list[Output] = []
        if status == "failed":
            out.append(
                ErrorEvent(
                    ErrorCode.GENERATION_FAILED, error or "generation failed", request_id=req.request_id
                )
            )
        reason = "stopped" if req.stop_requested else ("completed" if status == "completed" else status)
        out.append(SessionDone(req.request_id, req.chunks_sent, req.frames_sent, req.stop_requested, reason))
        return out

    def on_stalled(self, waited_s: float) -> list[Output]:
        """A send to the client blocked for ``waited_s``: end the session, say why, close."""
        if self.phase is Phase.CLOSED:
            return []
        req, self._request = self._request, None
        self.phase = Phase.CLOSED
        reason = f"client stopped reading for {waited_s:.1f} s"
        out: list[Output] = []
        if req is not None:
            out.append(CancelGeneration(req.request_id))
        out.append(
            ErrorEvent(ErrorCode.CLIENT_STALLED, reason, request_id=None if req is None else req.request_id)
        )
        out.append(CloseConnection(1008, f"{ErrorCode.CLIENT_STALLED}: {reason}"))
        return out

    def on_ended(self, code: int, reason: str, error: tuple[str, str] | None = None) -> list[Output]:
        """The session ends from outside (expired, deleted, server shutdown): cancel what
        runs, say why (``error``: code and message), close with ``code``."""
        if self.phase is Phase.CLOSED:
            return []
        req, self._request = self._request, None
        self.phase = Phase.CLOSED
        out: list[Output] = []
        if req is not None:
            out.append(CancelGeneration(req.request_id))
        if error is not None:
            out.append(ErrorEvent(error[0], error[1], request_id=None if req is None else req.request_id))
        out.append(CloseConnection(code, reason))
        return out

    def on_closed(self) -> list[Output]:
        """The transport went away: cancel what runs."""
        req, self._request = self._request, None
        self.phase = Phase.CLOSED
        return [] if req is None else [CancelGeneration(req.request_id)]
