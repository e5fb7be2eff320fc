"""Typed payloads that move between stages and out to clients.

The control plane carries only these small dataclasses; large arrays inside them move
through a connector (in-process: by reference; shared memory: copied once into a segment).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Payload:
    """Base class of everything a stage can emit."""


@dataclass(slots=True)
class TextDelta(Payload):
    """A piece of generated text (client-visible when a stage emits it to the client)."""

    text: str


@dataclass(slots=True)
class TokenIds(Payload):
    ids: np.ndarray  # int64 [N]


@dataclass(slots=True)
class HiddenStates(Payload):
    tensor: Any  # torch.Tensor or np.ndarray [..., hidden]
    layer: int = -1


@dataclass(slots=True)
class Embeddings(Payload):
    tensor: Any  # torch.Tensor or np.ndarray [..., hidden]
    role: str = ""  # what the embedding stands for (e.g. "talker_prefill", "text_token", "tts_eos")


@dataclass(slots=True)
class CodecCodes(Payload):
    codes: np.ndarray  # int64 [T, num_code_groups]


@dataclass(slots=True)
class KVBlocks(Payload):
    blocks: Any
    num_tokens: int = 0


@dataclass(slots=True)
class Latents(Payload):
    tensor: Any


@dataclass(slots=True)
class AudioChunk(Payload):
    samples: np.ndarray  # float32 mono in [-1, 1]
    sample_rate: int


@dataclass(slots=True)
class Frames(Payload):
    frames: np.ndarray  # uint8 [N, H, W, 3]
    fps: float = 0.0
    chunk_index: int = 0


@dataclass(slots=True)
class Action(Payload):
    """Streaming control input (key events, robot commands)."""

    name: str
    value: Any = None
    t_ms: float | None = None


@dataclass(slots=True)
class Conditioning(Payload):
    """A prompt/conditioning update for a live request (`Orchestrator.update`)."""

    values: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class AudioInput(Payload):
    """Streaming input audio appended to a live request."""

    samples: np.ndarray  # float32 mono
    sample_rate: int
    final: bool = False
    # Where its first sample lies on the request's input timeline, when a stage hands audio on
    # downstream (the VAD stage to a live ASR stage); None for audio a session appends.
    start_sample: int | None = None


@dataclass(slots=True)
class Transcript(Payload):
    """Transcription of the user's input audio (client-visible as input transcription)."""

    text: str
    final: bool = True
    # What it transcribes, when the session asked by name (a live ASR stage's `TurnControl`
    # "speech_started" / "transcribe" `ref`): a user item id or a key of the session's. None:
    # the audio of the request it came from.
    ref: str | None = None


# --- live voice requests (docs/CONTRACTS.md, "Live voice requests") -------------------------
# A voice session keeps one live request open on its pipeline; these are the progress events
# its stages stream back (client-visible) and the control input the session appends to it.
# Positions are in milliseconds / samples of the request's input timeline: every sample the
# session appended with `AudioInput`, counted from the request's start.


@dataclass(slots=True)
class VoiceActivity(Payload):
    """Speech probabilities of consecutive 32 ms frames (512 samples at 16 kHz) of the input,
    from a VAD stage. The session's server VAD turns them into turns (threshold, silence)."""

    start_sample: int  # 16 kHz input-timeline sample of the first frame
    probs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class TurnScore(Payload):
    """An end-of-turn model's answer to a `TurnControl("score_turn")`: the probability that
    the user's speech in [start, end) of that control ends a finished turn (`ref`: the
    control's); to a "score_words": that the user's message ends after its text. The session
    decides from it whether the turn ends now (semantic_vad)."""

    ref: str
    probability: float
    end_sample: int = 0  # where the scored audio ended on the request's input timeline


@dataclass(slots=True)
class SpeechStarted(Payload):
    """The pipeline (owning turn-taking) heard the user start speaking at `audio_ms`."""

    audio_ms: int


@dataclass(slots=True)
class SpeechStopped(Payload):
    """The pipeline heard the user stop speaking at `audio_ms` (the user's turn is over)."""

    audio_ms: int


@dataclass(slots=True)
class ResponseStarted(Payload):
    """The pipeline began a stretch of model output on its own (a duplex model deciding to
    speak). The `TextDelta`/`AudioChunk` payloads that follow belong to it until
    `ResponseDone`."""

    modalities: tuple[str, ...] = ("text", "audio")


@dataclass(slots=True)
class ResponseDone(Payload):
    """The stretch of model output begun by the last `ResponseStarted` ended."""

    status: str = "completed"  # completed | cancelled | failed | incomplete
    error: str | None = None


@dataclass(slots=True)
class Delegate(Payload):
    """The live model hands work off (GPT-Live delegation): a session on the duplex-native
    protocol passes it to its delegation target (the client, or the pipeline's text model) and
    the answer comes back to the model as `Conditioning`. `task`: what it asks, in its words
    (may be empty: the task is then whatever the conversation says)."""

    task: str = ""


@dataclass(slots=True)
class TurnControl(Payload):
    """Turn control appended to a live request (`append_input`), in order with its audio.

    The client's manual turn control: "commit" (`input_audio_buffer.commit`), "clear"
    (`.clear`: the pipeline forgets the audio it holds), "respond" (`response.create`; `params`
    are the response's submit params), "cancel" (`response.cancel`, or a barge-in the session
    decided). The session's turns, for a live ASR stage (positions: samples of the request's
    input timeline): "speech_started" (`params`: `ref` the user item being spoken, `start`,
    `partials`: stream transcription deltas while it is spoken), "speech_stopped" (`ref`),
    "transcribe" (`ref`, `start`, `end`: one final `Transcript` of that stretch, e.g. the turn
    so far at a pause), "spoken_past" (`start`, `end`: the user went on after the pause at `end`
    of the utterance that began at `start`; a "transcribe" of it not made yet is answered with
    no words). For an end-of-turn stage: "score_turn" (`ref`, `start`, `end`: one
    `TurnScore` of that stretch); "score_words" (`ref`, `text`: one `TurnScore` whose
    probability is that the user's message ends after `text`, from a stage that provides
    "end_of_turn_words"). A stage ignores the kinds it has no use for."""

    kind: str
    response_id: str | None = None
    params: dict[str, Any] = field(default_factory=dict)


# --- robot policies (session/robot/, engines/policy/) ------------------------------------------


@dataclass(slots=True)
class Observation(Payload):
    """One robot observation for a policy (streaming input of a robot session's live request):
    camera images by key (uint8 ``[H, W, 3]``) and the proprioceptive state (float32)."""

    images: dict[str, np.ndarray]
    state: np.ndarray
    seq: int = 0  # the session's observation number, echoed in the ActionChunk that answers it


@dataclass(slots=True)
class ActionChunk(Payload):
    """A policy's answer to one observation (client-visible)."""

    actions: np.ndarray  # float32 [horizon, action_dim]
    seq: int = 0  # the Observation.seq it answers
    infer_ms: float = 0.0  # the engine step that made it (the whole batch), in ms
    batch: int = 1  # observations in that step
