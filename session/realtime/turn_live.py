"""Turn-taking by the pipeline itself (a native full-duplex model, or one that detects turns):
the session streams the user's audio to its live request and follows the turns it reports.

Input audio goes out as `LiveAudio` effects; a response opens when the model starts speaking
(`on_live_response_started`), and the user's audio so far becomes a user item then (and at the
latest every `LIVE_COMMIT_MAX_MS`); speech marks the pipeline reports (`on_live_speech_started` /
`_stopped`) make the user's items. No server VAD, and `response.create` is refused. The client's
commit, clear and cancel reach the live request as `LiveControl`, a change of what conditions
the model as `LiveUpdate`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from media.audio import int16_to_float32
from session.realtime import errors as E
from session.realtime.config import SessionConfig
from session.realtime.core_state import CoreState, IdleTimeout
from session.realtime.effects import LiveAudio, LiveControl, LiveUpdate
from session.realtime.errors import ProtocolError
from session.realtime.input_audio import ms_of
from session.realtime.response_control import ResponseControl
from session.realtime.user_audio import UserAudio

# User audio is committed when the model starts speaking, and at the latest every this many
# ms (items and the buffer stay bounded).
LIVE_COMMIT_MAX_MS = 30_000

# Session settings a model that takes its own turns is conditioned on (`LiveUpdate`).
LIVE_CONDITIONING = ("instructions", "voice", "output_modalities", "tools")


class TurnTaking(Protocol):
    """Who decides where the user's turns begin and end: server VAD or the client's commits
    (:class:`~session.realtime.turn_vad.VadTurns`), or the pipeline (:class:`LiveTurns`). The
    core holds one, chosen by its pipeline's kind, and calls it at these points."""

    speech_item_id: str | None

    @property
    def speaking(self) -> bool: ...

    def configure(self) -> None: ...

    def on_audio(self, samples: np.ndarray | None, pcm: np.ndarray | None, rate: int) -> None: ...

    def take_speech_item(self) -> str | None: ...

    def committed(self) -> None: ...

    def on_clear(self) -> None: ...

    def cleared(self) -> None: ...

    def check_response_create(self) -> None: ...

    def cancelled(self, response_id: str) -> None: ...

    def config_changed(self, before: SessionConfig) -> None: ...

    def feed_vad(self, probabilities: Sequence[float], now: float, start_sample: int | None) -> None: ...

    def on_live_speech_started(self, sample: int, now: float) -> None: ...

    def on_live_speech_stopped(self, sample: int, now: float) -> None: ...

    def on_live_response_started(self, now: float) -> None: ...

    def on_turn_score(self, ref: str, probability: float, now: float) -> None: ...

    def on_turn_transcript(self, key: tuple[str, int], text: str | None, now: float) -> None: ...

    def tick(self, now: float) -> None: ...


@dataclass(eq=False)
class TurnParts:
    """What each kind of turn-taking works on: the core's state, the user's audio, the
    responses and the idle timeout; and the item being spoken (None between turns), from
    which sample of the input on."""

    state: CoreState
    user: UserAudio
    responses: ResponseControl
    idle: IdleTimeout
    speech_item_id: str | None = None
    speech_start: int = 0


class LiveTurns(TurnParts):
    """The pipeline's turns (see the module docstring)."""

    speaking = False  # no server VAD

    def configure(self) -> None:
        self.state.config.turn_detection = None  # the model takes the turns: no server VAD
        self.user.input.set_vad(False)
        self.end_speech()
        self.idle.deadline = None

    def on_audio(self, samples: np.ndarray | None, pcm: np.ndarray | None, rate: int) -> None:
        """Appended audio (`samples` float32 from a track, or the wire's `pcm`) goes to the
        live request."""
        if samples is None:
            if pcm is None or not len(pcm):
                return
            samples = int16_to_float32(pcm)
        self.state.out.effect(LiveAudio(samples, rate))
        if self.user.input.duration_ms >= LIVE_COMMIT_MAX_MS:
            self.user.commit_if_any()  # a user who talks on and on: bounded items, bounded buffer

    def take_speech_item(self) -> str | None:
        item_id = self.speech_item_id
        self.end_speech()
        return item_id

    def committed(self) -> None:
        self.state.out.effect(LiveControl("commit"))

    def on_clear(self) -> None:
        self.end_speech()

    def cleared(self) -> None:
        self.state.out.effect(LiveControl("clear"))

    def check_response_create(self) -> None:
        raise ProtocolError(
            E.INVALID_EVENT,
            "This session's model decides when to speak (a full-duplex pipeline): "
            "response.create is not supported.",
            param="type",
        )

    def cancelled(self, response_id: str) -> None:
        self.state.out.effect(LiveControl("cancel", response_id=response_id))

    def config_changed(self, before: SessionConfig) -> None:
        config = self.state.config
        changed = {
            key: getattr(config, key)
            for key in LIVE_CONDITIONING
            if getattr(config, key) != getattr(before, key)
        }
        if changed:
            self.state.out.effect(LiveUpdate(changed))

    def feed_vad(self, probabilities: Sequence[float], now: float, start_sample: int | None) -> None:
        """No server VAD: the pipeline's own marks make the turns."""

    def tick(self, now: float) -> None:
        """No idle timeout without server VAD."""

    def end_speech(self) -> None:
        item_id, self.speech_item_id = self.speech_item_id, None
        if item_id is not None and self.state.options.live_transcribes_input:
            self.state.out.effect(LiveControl("speech_stopped", {"ref": item_id}))

    def on_live_speech_started(self, sample: int, now: float) -> None:
        """The live request heard the user start speaking at timeline `sample` (16 kHz)."""
        if self.speech_item_id is not None:
            return
        self.speech_item_id = self.state.new_id("item")
        self.speech_start = max(self.user.input.start, sample)
        self.state.out.event(
            "input_audio_buffer.speech_started",
            item_id=self.speech_item_id,
            audio_start_ms=ms_of(self.speech_start),
        )

    def on_live_speech_stopped(self, sample: int, now: float) -> None:
        """The live request heard the user stop at timeline `sample`: the audio since the start
        becomes the user item (the pipeline decides whether to answer)."""
        item_id = self.speech_item_id
        if item_id is None:
            return
        self.speech_item_id = None
        end = max(sample, self.speech_start)
        self.state.out.event("input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms_of(end))
        buffer = self.user.input
        buffer.drop_before(self.speech_start)
        self.user.commit(item_id, buffer.take(self.speech_start, end), respond=False)

    def on_turn_score(self, ref: str, probability: float, now: float) -> None:
        """The pipeline takes the turns: an end-of-turn model's answer is not this kind's."""

    def on_turn_transcript(self, key: tuple[str, int], text: str | None, now: float) -> None:
        """See :meth:`on_turn_score`."""

    def on_live_response_started(self, now: float) -> None:
        """The model began speaking: the user's audio since the last commit becomes a user item
        (as server VAD would commit it), then a response opens whose output the live request
        streams (no StartResponse). Ignored while a response is active."""
        if self.responses.active is not None:
            return
        self.user.commit_if_any()
        self.responses.start(None, now, live=True)
