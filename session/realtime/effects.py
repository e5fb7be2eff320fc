"""Effects: what the realtime core asks its driver to do (the core itself does no I/O).

The driver performs them in order, off the event loop where they are heavy, and feeds the
results back into the core (`feed_vad`, `on_response_*`, `on_input_transcript`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class StartResponse:
    """Submit a pipeline request. `params` follow the pipeline submit params of CONTRACTS.md:
    `text` (str) or `audio` (float32 mono 16 kHz), plus `history`, `instructions`,
    `modalities`, and `max_tokens` when limited. Progress comes back through
    `on_response_text / on_response_audio / on_input_transcript / on_response_done`."""

    response_id: str
    params: dict[str, Any]
    # Set when `params["audio"]` is exactly the audio of an earlier `PrepareTranscript` with
    # this key: the driver may hand the pipeline that transcript as `text` instead (and
    # report it with `on_input_transcript(response_id, text)`).
    transcript_key: tuple[str, int] | None = None


@dataclass(slots=True)
class PrepareTranscript:
    """Server VAD heard a pause that may end the turn: transcribe `audio` (float32 16 kHz,
    the turn so far) now, while the silence runs, so a response that starts when the turn
    ends does not wait for ASR. Only for pipelines that transcribe their audio input first.
    A later `StartResponse` with the same `key` may use the result; otherwise drop it."""

    key: tuple[str, int]  # (item id, timeline sample where the pause began)
    audio: np.ndarray
    start_sample: int = 0  # timeline sample where `audio` begins (it ends at key[1])
    # An end-of-turn decision waits for these words (semantic_vad): a live ASR makes them before
    # transcripts only a response will read.
    decides: bool = False


@dataclass(slots=True)
class RespondAhead:
    """The pause of an earlier `PrepareTranscript` with this `key` has lasted long enough
    that the turn will probably end there: the driver may start the response now, on the
    prepared transcript (`params` are those of the response the turn's end would start,
    with `audio` to be replaced by that transcript as `text`), holding its output unread. A
    later `StartResponse` with this key whose params (audio replaced the same way) are equal
    takes that request over; any other outcome drops it (`DropAhead`)."""

    key: tuple[str, int]
    params: dict[str, Any]


@dataclass(slots=True)
class DropAhead:
    """The speaker went on (or the turn ended without a response): cancel the request a
    `RespondAhead` with this `key` started, if any. Nothing of it reached the client."""

    key: tuple[str, int]


@dataclass(slots=True)
class DropTranscript:
    """The words of the pause of an earlier `PrepareTranscript` with this `key` are not needed:
    the end-of-turn model's score there is below every bar words could lower it to, so the
    pause does not end the turn on its decision. The driver gives the transcription up (a live
    ASR that has not made it yet never does); a response that starts at that pause anyway (the
    maximum pause) transcribes its audio as a response without a prepared transcript does."""

    key: tuple[str, int]


@dataclass(slots=True)
class NeedTranscript:
    """The end-of-turn model's score of the pause of an earlier `PrepareTranscript` with this
    `key` ends the turn if its words allow it (the decision waits for them): a live ASR with a
    backlog makes them before the words of pauses whose score it does not know yet."""

    key: tuple[str, int]


@dataclass(slots=True)
class CancelResponse:
    """Cancel the pipeline request of `response_id` (the core already told the client)."""

    response_id: str


@dataclass(slots=True)
class TranscribeInput:
    """Transcribe a committed user audio item outside any response; answer with
    `on_input_transcript(item_id, text)` or `on_input_transcript_failed(item_id, message)`."""

    item_id: str
    audio: np.ndarray  # float32 mono 16 kHz


@dataclass(slots=True)
class DetectSpeech:
    """Score `samples` (float32 16 kHz, a whole number of 512-sample / 32 ms frames) with the
    VAD and answer with `feed_vad(probabilities, now, start_sample=start_sample)`.
    `reset`: the audio does not continue the previous frames (reset the VAD model state)."""

    start_sample: int
    samples: np.ndarray
    reset: bool = False

    @property
    def num_frames(self) -> int:
        return len(self.samples) // 512


@dataclass(slots=True)
class PlayAudio:
    """Track transport only (`audio_out_via_track`): queue model audio on the outgoing track.
    Report playout back with `on_playout(response_id, played_ms, now)` and
    `on_playout_finished(response_id, now)`."""

    response_id: str
    item_id: str
    samples: np.ndarray  # float32 mono
    sample_rate: int


@dataclass(slots=True)
class ClearAudioOutput:
    """Track transport only: drop the audio of `response_id` still queued on the track."""

    response_id: str


@dataclass(slots=True)
class Close:
    """Close the connection (WebSocket close code; 1001 when the session expired)."""

    code: int
    reason: str = ""


@dataclass(slots=True)
class LiveAudio:
    """Input audio for the session's live request (pipelines that take their own turns, e.g.
    a full-duplex model): the samples of one append, decoded from the wire (float32 mono at
    `rate`, the wire's or the track's rate). The driver resamples once, to the pipeline's
    input rate, and appends them to the live request."""

    samples: np.ndarray
    rate: int


@dataclass(slots=True)
class LiveUpdate:
    """`session.update` changes that reach a model taking its own turns: give them to the
    live request as `update(Conditioning(values))` (only the keys that changed among
    `instructions`, `voice`, `output_modalities`, `tools`)."""

    values: dict[str, Any]


@dataclass(slots=True)
class LiveControl:
    """Turn control for the session's live request, in order with its audio (the pipeline's
    `TurnControl`, docs/CONTRACTS.md "Live voice requests"). For a model that takes its own
    turns: the client's "commit", "clear", "cancel" (`response_id`). For a live ASR stage:
    "speech_started" (`params`: `ref` the item being spoken, `start` its timeline sample,
    `partials`: stream transcription deltas) and "speech_stopped" (`ref`; `end` where the VAD
    ended the turn). Timeline positions (`start`, `end`) are the core's 16 kHz samples; the
    driver maps them onto the request's."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    response_id: str | None = None


Effect = (
    StartResponse
    | PrepareTranscript
    | RespondAhead
    | DropAhead
    | DropTranscript
    | NeedTranscript
    | CancelResponse
    | TranscribeInput
    | DetectSpeech
    | PlayAudio
    | ClearAudioOutput
    | Close
    | LiveAudio
    | LiveUpdate
    | LiveControl
)


@dataclass(slots=True)
class CoreOutput:
    """What one call into the core produced: server events (JSON-ready dicts, each with a
    unique `event_id`, in send order) and effects for the driver (in order)."""

    events: list[dict[str, Any]] = field(default_factory=list)
    effects: list[Effect] = field(default_factory=list)

    def extend(self, other: CoreOutput) -> None:
        self.events.extend(other.events)
        self.effects.extend(other.effects)

