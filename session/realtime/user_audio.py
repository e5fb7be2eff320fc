"""The user's input audio: the buffer (`input_audio_buffer.*` and a media track), its byte
budget, the VAD frames it hands out, and commits into user items.

`input_audio_buffer.append` reaches :meth:`UserAudio.append` without a model being built
(`events.append_audio`): at 25 appends a second per session it is the server's hottest path.
"""

from __future__ import annotations

import numpy as np

from media.audio import AudioFormatError, b64decode_audio, float32_to_int16_exact
from session.realtime import errors as E
from session.realtime.conversation import Content, Item
from session.realtime.core_state import MIN_COMMIT_MS, CoreState
from session.realtime.errors import ProtocolError
from session.realtime.input_audio import InputAudio
from session.realtime.transcripts import Transcripts


class UserAudio:
    """The input buffer and what becomes of it (see the module docstring)."""

    def __init__(self, state: CoreState, transcripts: Transcripts, *, track_limit_s: float) -> None:
        self.state = state
        self.transcripts = transcripts
        self.input = InputAudio(state.config.input_format)
        # A media track's audio past this many uncommitted seconds is dropped (0: never; a
        # pipeline that takes its own turns commits by itself).
        self.track_limit_s = track_limit_s
        self.track_overflow = False  # track audio past the budget is being dropped
        self.last_user_item_id: str | None = None  # of the last committed user audio item

    def append(self, audio: str) -> np.ndarray:
        """`input_audio_buffer.append` (base64): the input budget is checked here, where every
        append arrives, whatever buffers the audio afterwards. The appended PCM16 samples."""
        try:
            data = b64decode_audio(audio)
            self._check_budget(len(data))
            return self.input.append_wire(data)
        except AudioFormatError as exc:
            raise ProtocolError(
                E.INVALID_VALUE, f"Invalid value for 'audio': {exc}.", param="audio"
            ) from None

    def _check_budget(self, size: int) -> None:
        limit_s = self.state.options.max_input_audio_s
        if not limit_s:
            return
        fmt = self.input.format
        incoming_ms = size / fmt.bytes_per_sample * 1000 / fmt.rate
        if self.input.buffered_ms + incoming_ms > limit_s * 1000:
            raise ProtocolError(
                E.INPUT_AUDIO_TOO_LARGE,
                f"The input audio buffer would hold more than {limit_s:g} s of uncommitted audio: "
                "commit or clear it (this append was not added).",
                param="audio",
            )

    def feed_track(self, samples: np.ndarray, rate: int) -> bool:
        """Mic audio from a media track; False when it was dropped (past the input budget:
        push-to-talk never committed), with one `error` per overflow."""
        limit_s = self.track_limit_s
        over = bool(limit_s) and self.input.buffered_ms > limit_s * 1000
        if over and not self.track_overflow:
            self.state.out.error(
                ProtocolError(
                    E.INPUT_AUDIO_TOO_LARGE,
                    f"The input audio buffer holds {limit_s:g} s of uncommitted audio: track audio is "
                    "dropped until it is committed or cleared.",
                )
            )
        self.track_overflow = over
        if over:
            return False
        self.input.append_samples(samples, rate)
        return True

    def request_vad(self) -> None:
        frames = self.input.next_frames()
        if frames is not None:
            self.state.out.effect(frames)

    def check_commit(self) -> None:
        """`input_audio_buffer.commit` needs `MIN_COMMIT_MS` of audio (refused before anything changes)."""
        self.input.flush()
        if self.input.duration_ms < MIN_COMMIT_MS:
            raise ProtocolError(
                E.COMMIT_EMPTY,
                f"Error committing input audio buffer: buffer too small. Expected at least {MIN_COMMIT_MS}ms "
                f"of audio, but buffer only has {self.input.duration_ms}ms of audio.",
            )

    def commit_buffer(self, item_id: str) -> None:
        """The whole buffer becomes user item `item_id` (no response: the caller decides)."""
        audio = self.input.take(self.input.start, self.input.end)
        self.input.clear()
        self.commit(item_id, audio, respond=False)

    def commit_if_any(self) -> None:
        """The buffer, if it holds `MIN_COMMIT_MS`, becomes a new user item."""
        self.input.flush()
        if self.input.duration_ms >= MIN_COMMIT_MS:
            self.commit_buffer(self.state.new_id("item"))

    def commit(self, item_id: str, audio: np.ndarray, *, respond: bool) -> Item:
        state = self.state
        stored = float32_to_int16_exact(audio)  # PCM16: half the memory of float32
        item = Item(
            item_id, "message", role="user", content=[Content(type="input_audio", input_audio=stored)]
        )
        previous = state.conversation.insert(item)
        self.last_user_item_id = item_id
        state.out.event("input_audio_buffer.committed", item_id=item_id, previous_item_id=previous)
        wire = item.to_wire()
        state.out.event("conversation.item.added", previous_item_id=previous, item=wire)
        state.out.event("conversation.item.done", previous_item_id=previous, item=wire)
        if not (respond and state.options.pipeline_transcribes_input):
            self.transcripts.request(item)
        state.conversation.retain_audio(state.options.audio_retention_s)
        return item
