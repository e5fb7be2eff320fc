"""Turn-taking by server VAD (`turn_detection` set), or by the client's commits (none): the
pipeline scores speech and the session decides where turns begin and end.

The VAD frames the input buffer hands out come back scored (`feed_vad`); a turn starts an
item (`speech_started`), its end commits it and starts a response; a pause long enough that the
turn may end there is transcribed ahead (`PrepareTranscript`) and answered ahead
(`RespondAhead`); the idle timeout answers a silence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from session.realtime.config import TurnDetection
from session.realtime.core_state import CoreState, IdleTimeout
from session.realtime.effects import (
    DropAhead,
    DropTranscript,
    LiveControl,
    NeedTranscript,
    PrepareTranscript,
    RespondAhead,
)
from session.realtime.input_audio import FRAME, SAMPLES_PER_MS, ms_of
from session.realtime.response_control import ResponseControl
from session.realtime.semantic_turn import EndTurn, SemanticTurn, WordsAwaited, WordsUnneeded, max_pause_ms
from session.realtime.turn_live import TurnParts
from session.realtime.turns import SpeechDetector, SpeechStarted, SpeechStopped
from session.realtime.user_audio import UserAudio
from session.realtime.words_turn import ScoreWords, WordsCue


class VadTurns(TurnParts):
    """Server VAD's turns over the user's audio (see the module docstring)."""

    def __init__(
        self, state: CoreState, user: UserAudio, responses: ResponseControl, idle: IdleTimeout
    ) -> None:
        super().__init__(state, user, responses, idle)
        self.vad = SpeechDetector()
        self.prepared: tuple[str, int] | None = None  # key of the last PrepareTranscript
        self.spoken_past: tuple[str, int] | None = None  # ... once the user went on after it
        self.ahead: tuple[str, int] | None = None  # key of a RespondAhead not yet settled
        # semantic_vad's decisions, with an end-of-turn model (and its words cue, if it has one)
        self.semantic = SemanticTurn(words=WordsCue() if state.options.scores_turn_words else None)

    @property
    def speaking(self) -> bool:
        return self.vad.speaking

    # --- what every kind of turn-taking answers (session.realtime.turn_live.TurnTaking) ---

    def configure(self) -> None:
        """The session's `turn_detection` (at the start and after each `session.update`)."""
        td = self.state.config.turn_detection
        self.user.input.set_vad(td is not None)
        if td is None:
            self.vad.reset()
            self.end_speech()
            self.idle.deadline = None
        else:
            self.vad.configure(td.threshold, self.silence_ms(td))
            self.semantic.configure(td.eagerness)

    def on_audio(self, samples: np.ndarray | None, pcm: np.ndarray | None, rate: int) -> None:
        """Appended audio is scored through the VAD frames the buffer hands out."""

    def take_speech_item(self) -> str | None:
        """`input_audio_buffer.commit`: the item being spoken (its id names the commit) ends."""
        item_id = self.speech_item_id
        self.vad.reset()
        self.end_speech()
        return item_id

    def committed(self) -> None:
        """After a client's commit."""

    def on_clear(self) -> None:
        """`input_audio_buffer.clear`: the turn being spoken goes with the audio."""
        self.vad.reset()
        self.end_speech()
        self.drop_ahead()

    def cleared(self) -> None:
        """After a client's clear."""

    def check_response_create(self) -> None:
        """`response.create` is the client's to send."""

    def cancelled(self, response_id: str) -> None:
        """After a client's `response.cancel`."""

    def config_changed(self, before: object) -> None:
        """After a `session.update`: server VAD reads the config as it goes."""

    def on_live_speech_started(self, sample: int, now: float) -> None:
        """Server VAD marks this session's turns: a live request's marks do not."""

    def on_live_speech_stopped(self, sample: int, now: float) -> None:
        """See :meth:`on_live_speech_started`."""

    def on_live_response_started(self, now: float) -> None:
        """Responses start at turn ends: a live request's own are not this kind's."""

    # --- semantic_vad: an end-of-turn model's answers (session.realtime.semantic_turn) ---------

    def semantic_turns(self, td: TurnDetection) -> bool:
        return td.type == "semantic_vad" and self.state.options.scores_turn_ends

    def silence_ms(self, td: TurnDetection) -> int:
        """The VAD silence that ends a turn: semantic_vad with a model waits up to its maximum
        pause (the model ends finished turns sooner)."""
        return max_pause_ms(td.eagerness) if self.semantic_turns(td) else td.effective_silence_ms()

    def on_turn_score(self, ref: str, probability: float, now: float) -> None:
        """The model's answer to a `score_turn`: a finished turn ends now, at the pause that was
        scored, as server VAD would end it there."""
        td = self.state.config.turn_detection
        if td is None or not self.semantic_turns(td):
            return
        at = self.user.input.first_unscored
        end = self.semantic.on_score(ref, probability, self.speech_item_id, self.vad.silence_start, at)
        if isinstance(end, WordsUnneeded | WordsAwaited):
            # The words decide (a live ASR with a backlog makes them first) or cannot (given
            # up: a response at the maximum pause transcribes its audio).
            if self.prepared == end.key:
                verdict = NeedTranscript if isinstance(end, WordsAwaited) else DropTranscript
                self.state.out.effect(verdict(end.key))
            return
        self._end_turn(end, td, now)

    def on_turn_transcript(self, key: tuple[str, int], text: str | None, now: float) -> None:
        """The words of the turn up to the pause `key`, transcribed ahead (`PrepareTranscript`):
        the end-of-turn decision's second cue (a score waiting for them is decided now)."""
        td = self.state.config.turn_detection
        if td is None or not self.semantic_turns(td):
            return
        at = self.user.input.first_unscored
        end = self.semantic.on_transcript(key, text, self.speech_item_id, self.vad.silence_start, at)
        self._end_turn(end, td, now)

    def _end_turn(self, end: EndTurn | ScoreWords | None, td: TurnDetection, now: float) -> None:
        if isinstance(end, ScoreWords):  # the words decide: the stage scores them too
            self.state.out.effect(LiveControl("score_words", {"ref": end.ref, "text": end.text}))
        elif end is not None:
            buffer = self.user.input
            self.vad.reset()
            self._on_speech_stopped(SpeechStopped(end.pause, buffer.first_unscored), td, now)
            buffer.drop_before(buffer.first_unscored - td.prefix_padding_ms * SAMPLES_PER_MS)

    def _maybe_score_turn(self, frame_end: int, td: TurnDetection, now: float) -> bool:
        """Ask the model at a candidate pause; True when a turn decided finished ended now
        (its silence became long enough)."""
        pause, item_id = self.vad.silence_start, self.speech_item_id
        coming = item_id is not None and pause is not None and self.prepared == (item_id, pause)
        ask = self.semantic.on_frame(item_id, self.speech_start, pause, frame_end, transcript_coming=coming)
        if isinstance(ask, EndTurn):
            self._end_turn(ask, td, now)
            return True
        if ask is not None:
            params = {"ref": ask.ref, "start": ask.start, "end": ask.end}
            self.state.out.effect(LiveControl("score_turn", params))
        return False

    def tick(self, now: float) -> None:
        """The idle timeout: a silence this long after a response is a turn of its own."""
        state = self.state
        td = state.config.turn_detection
        if (
            self.idle.deadline is not None
            and now >= self.idle.deadline
            and td is not None
            and td.idle_timeout_ms
            and self.responses.active is None
            and not self.vad.speaking
        ):
            self.idle.deadline = None
            item_id = state.new_id("item")
            buffer = self.user.input
            a, b = buffer.start, buffer.end
            state.out.event(
                "input_audio_buffer.timeout_triggered",
                item_id=item_id,
                audio_start_ms=ms_of(a),
                audio_end_ms=ms_of(b),
            )
            self.user.commit(item_id, buffer.take(a, b), respond=True)
            self.responses.start(None, now, prepared=self.prepared)

    # --- scored speech ---------------------------------------------------------------------

    def feed_vad(self, probabilities: Sequence[float], now: float, start_sample: int | None) -> None:
        """Speech probabilities for frames handed out by `DetectSpeech`, in order; scores that
        went stale (clear, VAD reconfigured) are dropped by their `start_sample`."""
        td = self.state.config.turn_detection
        if td is None:
            return
        buffer = self.user.input
        starts = buffer.claim_scored(len(probabilities), start_sample)
        for frame_start, p in zip(starts, probabilities, strict=False):
            change = self.vad.feed(frame_start, float(p))
            if isinstance(change, SpeechStarted):
                self._on_speech_started(change, td, now)
            elif isinstance(change, SpeechStopped):
                self._on_speech_stopped(change, td, now)
            else:
                self._maybe_spoken_past()
                self._maybe_prepare_transcript(frame_start + FRAME, td)
                self._maybe_respond_ahead(frame_start + FRAME, td)
                if self.semantic_turns(td):
                    self._maybe_score_turn(frame_start + FRAME, td, now)
        if not self.vad.speaking:
            buffer.drop_before(buffer.first_unscored - td.prefix_padding_ms * SAMPLES_PER_MS)

    def _on_speech_started(self, change: SpeechStarted, td: TurnDetection, now: float) -> None:
        state = self.state
        self.idle.deadline = None
        self.speech_item_id = state.new_id("item")
        padded = change.start_sample - td.prefix_padding_ms * SAMPLES_PER_MS
        self.speech_start = max(self.user.input.start, padded)
        state.out.event(
            "input_audio_buffer.speech_started",
            item_id=self.speech_item_id,
            audio_start_ms=ms_of(self.speech_start),
        )
        if state.options.live_transcribes_input:
            partials = state.config.transcription is not None
            params = {"ref": self.speech_item_id, "start": self.speech_start, "partials": partials}
            state.out.effect(LiveControl("speech_started", params))
        if td.interrupt_response:
            if self.responses.active is not None:
                self.responses.cancel_active("turn_detected", now)
            self.responses.stop_playout()

    def _on_speech_stopped(self, change: SpeechStopped, td: TurnDetection, now: float) -> None:
        item_id = self.speech_item_id or self.state.new_id("item")
        self.end_speech(change.commit_end)
        self.state.out.event(
            "input_audio_buffer.speech_stopped", item_id=item_id, audio_end_ms=ms_of(change.end_sample)
        )
        respond = td.create_response and self.responses.active is None
        if not respond or self.ahead != (item_id, change.end_sample):
            self.drop_ahead()  # else StartResponse below settles it
        self.ahead = None
        audio = self.user.input.take(self.speech_start, change.commit_end)
        self.user.commit(item_id, audio, respond=respond)
        if respond:
            key = (item_id, change.end_sample)
            self.responses.start(None, now, transcript_key=key, prepared=self.prepared)

    def end_speech(self, end: int | None = None) -> None:
        """The item being spoken ends (committed, cleared): a live ASR stops its deltas. `end`:
        where the turn's audio ended on the timeline, when the VAD ended it (voice after it is
        the next turn's, which the live ASR keeps until that turn is marked)."""
        item_id, self.speech_item_id = self.speech_item_id, None
        if item_id is not None and self.state.options.live_transcribes_input:
            params: dict[str, object] = {"ref": item_id}
            if end is not None:
                params["end"] = end
            self.state.out.effect(LiveControl("speech_stopped", params))

    def _maybe_prepare_transcript(self, frame_end: int, td: TurnDetection) -> None:
        """A pause long enough that the turn may end here: transcribe it ahead (once)."""
        options = self.state.options
        pause = self.vad.silence_start
        item_id = self.speech_item_id
        after_ms = min(options.prepare_transcript_after_ms, td.effective_silence_ms())
        if after_ms > 0 and self.semantic_turns(td):
            # The end-of-turn decision waits for these words (they may veto the model's
            # "finished"): ask for them with the model, at its candidate pause.
            after_ms = min(after_ms, self.semantic.ask_ms)
        if (
            pause is None
            or item_id is None
            or after_ms <= 0
            or not (td.create_response and options.pipeline_transcribes_input)
            or frame_end - pause < after_ms * SAMPLES_PER_MS
            or self.prepared == (item_id, pause)
        ):
            return
        self.prepared = (item_id, pause)
        audio = self.user.input.slice(self.speech_start, pause)
        decides = self.semantic_turns(td)
        self.state.out.effect(
            PrepareTranscript((item_id, pause), audio, start_sample=self.speech_start, decides=decides)
        )

    def _maybe_spoken_past(self) -> None:
        """The user went on speaking after the pause transcribed ahead (the same item, its
        silence over): that pause did not end the turn, and a live ASR that has not made its
        transcript yet need not (`LiveControl("spoken_past")`: it answers with no words)."""
        prepared, item_id = self.prepared, self.speech_item_id
        if (
            prepared is None
            or prepared == self.spoken_past
            or prepared[0] != item_id
            or self.vad.silence_start == prepared[1]
            or not self.state.options.live_transcribes_input
        ):
            return
        self.spoken_past = prepared
        params = {"start": self.speech_start, "end": prepared[1]}
        self.state.out.effect(LiveControl("spoken_past", params))

    def _maybe_respond_ahead(self, frame_end: int, td: TurnDetection) -> None:
        """The pause transcribed ahead has lasted `respond_ahead_after_ms`: start the response
        the turn's end would start (`RespondAhead`); the speaker going on drops it."""
        pause = self.vad.silence_start
        item_id = self.speech_item_id
        key = (item_id, pause) if item_id is not None and pause is not None else None
        if self.ahead is not None and self.ahead != key:
            self.drop_ahead()  # speech resumed after the pause the response was started in
        after_ms = min(self.state.options.respond_ahead_after_ms, td.effective_silence_ms())
        if self.semantic_turns(td):
            after_ms = 0  # the model's "finished" ends the turn and starts the response at once
        if (
            key is None
            or pause is None
            or after_ms <= 0
            or self.prepared != key
            or self.ahead == key
            or self.responses.active is not None
            or frame_end - pause < after_ms * SAMPLES_PER_MS
        ):
            return
        self.ahead = key
        self.state.out.effect(RespondAhead(key, self.responses.params_ahead(key[0])))

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            self.state.out.effect(DropAhead(self.ahead))
            self.ahead = None
