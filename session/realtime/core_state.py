"""What the realtime core's parts share: the session's options, its config, conversation and
outbox (:class:`CoreState`), and the server VAD's idle timeout (:class:`IdleTimeout`).

The core (:mod:`session.realtime.core`) holds its parts (the user's audio, the transcripts, the
responses, the turn-taking of its pipeline's kind); each part holds this state and the parts it
calls, never the core.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from session.realtime import errors as E
from session.realtime.audio_store import AudioStore
from session.realtime.config import SessionConfig
from session.realtime.conversation import Conversation
from session.realtime.errors import ProtocolError
from session.realtime.ids import IdFactory, random_id
from session.realtime.server_events import Outbox

MIN_COMMIT_MS = 100


@dataclass(slots=True)
class CoreOptions:
    """Server-side settings of a session (not visible to or changeable by the client)."""

    config: SessionConfig = field(default_factory=SessionConfig)  # initial session config
    max_duration_s: float = 3600.0
    output_frame_ms: int = 40  # size of response.output_audio.delta payloads (20–100)
    audio_out_via_track: bool = False  # WebRTC: audio out as PlayAudio effects, not deltas
    # The pipeline's `Transcript` output transcribes the audio of StartResponse; if False,
    # every committed item is transcribed with a TranscribeInput effect (when configured).
    pipeline_transcribes_input: bool = True
    # With such a pipeline and server VAD, once a pause in speech has lasted this long
    # (capped at the silence duration) the turn so far is transcribed ahead of the turn's
    # end (`PrepareTranscript`), hiding ASR time inside the silence. 0: never.
    prepare_transcript_after_ms: int = 64
    # ... and once it has lasted this long (capped likewise), the response that the turn's end
    # would start is started ahead on that transcript (`RespondAhead`), its output held back
    # until the turn does end (then the client gets it at once) or dropped if the speaker goes
    # on. Hides the responder's and TTS's time to first audio inside the silence. 0: never.
    respond_ahead_after_ms: int = 200
    # Seconds of audio the conversation keeps, newest items first (the newest item with audio
    # always keeps its own): older items keep transcripts and text, and are retrieved without
    # `audio`. Bounds a session's memory (at most ~0.5 MB at 10 s; far less with an
    # `audio_store`); pipelines only take the trailing user turn's audio (see
    # `Conversation.retain_audio`).
    audio_retention_s: float = 10.0
    # Where retained audio that no prompt needs any more goes (the server's: a disk spool
    # shared by its sessions). None: it stays in memory.
    audio_store: AudioStore | None = None
    session_id: str | None = None
    new_id: IdFactory = random_id
    # Whether the core stamps its events' `event_id`s. False when a session log stamps them as it
    # logs them (hosted sessions: `SessionLog.append`), so every event is stamped once.
    stamp_event_ids: bool = True
    # The pipeline takes its own turns (a native full-duplex model): input audio goes out as
    # `LiveAudio` effects for its live request, responses open when it starts speaking
    # (`on_live_response_started`), the user's audio is committed as user items then; no
    # server VAD, and `response.create` is refused.
    live_responses: bool = False
    # The live request transcribes the user while they speak (a live ASR stage after the VAD
    # stage): the core marks its turns there (`LiveControl` "speech_started" / "speech_stopped")
    # and the driver transcribes pauses on it (`PrepareTranscript`).
    live_transcribes_input: bool = False
    # The live request scores pauses with an end-of-turn model (`TurnScore`): `semantic_vad`
    # ends a turn on its answer (session.realtime.semantic_turn). False: semantic_vad is server
    # VAD with an eagerness-based silence.
    scores_turn_ends: bool = False
    # ... and it scores the words of a turn too (`LiveControl` "score_words"): a sentence the
    # model left open ends when a language model reads its end (session.realtime.words_turn).
    scores_turn_words: bool = False
    # Per-session budgets (docs/sessions.md "Limits"): what one client can make the server
    # keep. Text of all conversation items (UTF-8 bytes; a create past it is refused with
    # `conversation_too_large`), the instructions (`string_above_max_length`), and the
    # uncommitted input audio (`input_audio_buffer_too_large`; commit or clear it). 0: none.
    max_conversation_bytes: int = 8 * 1024 * 1024
    max_instructions_bytes: int = 512 * 1024
    max_input_audio_s: float = 300.0


def check_instructions(text: str | None, limit: int, param: str) -> None:
    """Refuse instructions over `limit` UTF-8 bytes (0: no limit) before anything changes."""
    if text and limit and len(text) > limit // 4 and len(text.encode("utf-8", "surrogatepass")) > limit:
        raise ProtocolError(
            E.STRING_TOO_LONG,
            f"Invalid '{param}': string too long. Expected a string with maximum length {limit} bytes.",
            param=param,
        )


@dataclass(slots=True)
class CoreState:
    """The session's options, its current config (replaced by each `session.update`), its
    conversation and the outbox its events and effects go to."""

    options: CoreOptions
    config: SessionConfig
    conversation: Conversation
    conversation_id: str
    out: Outbox
    new_id: IdFactory


class IdleTimeout:
    """Server VAD's `idle_timeout_ms`: armed when a response ends (after its audio has played),
    cleared when the user speaks or a response starts; `tick` fires it."""

    __slots__ = ("deadline", "state")

    def __init__(self, state: CoreState) -> None:
        self.state = state
        self.deadline: float | None = None

    def arm(self, now: float, remaining_s: float) -> None:
        """From `now` plus the `remaining_s` of audio still playing (callers know no response
        is active)."""
        td = self.state.config.turn_detection
        if td is not None and td.idle_timeout_ms:
            self.deadline = now + remaining_s + td.idle_timeout_ms / 1000.0
