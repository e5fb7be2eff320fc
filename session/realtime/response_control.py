"""The session's responses, as the core sees them: the one active response, the audio items
of each one's prompt (for their transcripts), a track transport's playout, the voice lock, the
open response the store has, and a dead process's response a restore ends."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

import numpy as np

from session.realtime import errors as E
from session.realtime.conversation import Content, Item
from session.realtime.core_state import CoreState, IdleTimeout, check_instructions
from session.realtime.effects import CancelResponse, ClearAudioOutput, StartResponse
from session.realtime.errors import ProtocolError
from session.realtime.events import ResponseCancel, ResponseCreate
from session.realtime.prompt import build_submit_params
from session.realtime.response_request import ResponseRequest, resolve_response_request
from session.realtime.responses import (
    CancelReason,
    Outcome,
    PromptStats,
    ResponseRun,
    ResponseSettings,
    ResponseStatus,
    end_orphaned_responses,
)
from session.realtime.transcripts import Transcripts

PROMPT_ITEMS_KEPT = 16  # responses whose prompt's audio items are remembered (their transcripts)


class ResponseControl:
    """Starts, ends and cancels the session's responses (see the module docstring)."""

    def __init__(self, state: CoreState, transcripts: Transcripts, idle: IdleTimeout) -> None:
        self.state = state
        self.transcripts = transcripts
        self.idle = idle
        self.active: ResponseRun | None = None
        self.prompt_items: OrderedDict[str, list[str]] = OrderedDict()  # response → audio items
        self.playing: ResponseRun | None = None  # track transport: audio still playing out
        self.played_ms = 0.0
        self.voice_locked = False  # once a response spoke, the voice cannot change
        self.stored_response: str | None = None  # the open response id the store has
        self.orphan_response: dict[str, Any] | None = None  # restored: a dead process's

    @property
    def open_id(self) -> str | None:
        run = self.active
        return run.id if run is not None and run.active else None

    def audio_item_of(self, target_id: str) -> str:
        """A transcript's item: `target_id` itself, or a response's last prompt audio item."""
        if target_id in self.prompt_items:
            ids = self.prompt_items[target_id]
            return ids[-1] if ids else ""
        return target_id

    def start(
        self,
        event: ResponseCreate | None,
        now: float,
        *,
        transcript_key: tuple[str, int] | None = None,
        prepared: tuple[str, int] | None = None,
        live: bool = False,
    ) -> None:
        """Open a response (`transcript_key`: the turn transcribed ahead as `prepared`)."""
        state = self.state
        if self.active is not None:
            raise ProtocolError(
                E.ACTIVE_RESPONSE,
                f"Conversation already has an active response in progress: {self.active.id}. "
                "Wait until the response is finished before creating a new one.",
            )
        if event is not None and event.response is not None:
            limit = state.options.max_instructions_bytes
            check_instructions(event.response.instructions, limit, "response.instructions")
        request = self._request(event)
        params, stats = self._submit_params(request, request.items)
        response_id = state.new_id("resp")
        run = ResponseRun(
            response_id,
            request.settings,
            outbox=state.out,
            conversation=state.conversation,
            item_id=state.new_id("item"),
            conversation_id=state.conversation_id,
            prompt=stats,
        )
        self.active = run
        self.idle.deadline = None
        self.prompt_items[response_id] = stats.audio_item_ids
        while len(self.prompt_items) > PROMPT_ITEMS_KEPT:
            self.prompt_items.popitem(last=False)
        run.start()
        if transcript_key is not None and (
            transcript_key != prepared or stats.audio_item_ids != [transcript_key[0]]
        ):
            transcript_key = None  # the prompt's audio is not (only) what was transcribed ahead
        if not live:  # a live response is already being made by the live request
            state.out.effect(StartResponse(response_id, params, transcript_key=transcript_key))

    def _request(self, event: ResponseCreate | None) -> ResponseRequest:
        state = self.state
        return resolve_response_request(
            event.response if event is not None else None,
            config=state.config,
            conversation=state.conversation,
            new_id=state.new_id,
            frame_ms=state.options.output_frame_ms,
            via_track=state.options.audio_out_via_track,
        )

    def _submit_params(
        self, request: ResponseRequest, items: list[Item]
    ) -> tuple[dict[str, Any], PromptStats]:
        return build_submit_params(
            items,
            instructions=request.instructions,
            modalities=request.settings.modalities,
            max_output_tokens=request.settings.max_output_tokens,
            truncation=self.state.config.truncation,
            words_for_audio=self.state.options.pipeline_transcribes_input,
        )

    def params_ahead(self, item_id: str) -> dict[str, Any]:
        """The submit params of the response that server VAD would start if the turn being
        spoken (`item_id`) ended now: the conversation plus that turn as a user audio item (a
        one-sample stand-in: the driver puts the prepared transcript in place of `audio`)."""
        request = self._request(None)
        audio = Content(type="input_audio", input_audio=np.zeros(1, np.int16))
        stand_in = Item(item_id, "message", role="user", content=[audio])
        return self._submit_params(request, [*request.items, stand_in])[0]

    def cancel_requested(self, event: ResponseCancel, now: float) -> str:
        """`response.cancel`: the cancelled response's id."""
        run = self.active
        if run is None or (event.response_id is not None and event.response_id != run.id):
            raise ProtocolError(
                E.CANCEL_NOT_ACTIVE,
                "Cancellation failed: no active response found.",
                param="response_id" if event.response_id is not None else None,
            )
        self.cancel_active("client_cancelled", now)
        return run.id

    def cancel_active(self, reason: CancelReason, now: float) -> None:
        run = self.active
        assert run is not None
        self.end(Outcome("cancelled", reason=reason), now)
        self.state.out.effect(CancelResponse(run.id))

    def end(self, outcome: Outcome, now: float, *, usage: dict[str, Any] | None = None) -> None:
        state = self.state
        run = self.active
        assert run is not None
        run.finish(outcome, now=now, reported_usage=usage)
        self.active = None
        if run.audio_started_at is not None:
            self.voice_locked = True
        if state.options.pipeline_transcribes_input:
            for item_id in self.prompt_items.get(run.id, []):
                if item_id in state.conversation and item_id not in self.transcripts.transcribed:
                    self.transcripts.request(state.conversation.get(item_id))
        state.conversation.retain_audio(state.options.audio_retention_s)
        if state.options.audio_out_via_track:
            if run.audio_started_at is None:
                self.idle.arm(now, 0.0)
        else:
            started = run.audio_started_at
            remaining = 0.0 if started is None else max(0.0, run.audio_ms / 1000.0 - (now - started))
            self.idle.arm(now, remaining)

    def on_text(self, response_id: str, text: str) -> None:
        if self.active is not None and self.active.id == response_id:
            self.active.on_text(text)

    def on_audio(self, response_id: str, samples: np.ndarray, rate: int, now: float) -> None:
        run = self.active
        if run is not None and run.id == response_id:
            run.on_audio(np.asarray(samples, dtype=np.float32), rate, now)
            if (
                self.state.options.audio_out_via_track
                and run.audio_started_at is not None
                and self.playing is not run
            ):
                self.playing, self.played_ms = run, 0.0

    def on_done(
        self,
        response_id: str,
        status: Literal["completed", "failed", "cancelled", "incomplete"],
        error: str | None,
        *,
        now: float,
        usage: dict[str, Any] | None,
    ) -> None:
        run = self.active
        if run is None or run.id != response_id:
            return
        final: ResponseStatus = "cancelled" if status == "cancelled" else status
        code = "pipeline_failed"
        if final == "failed" and error and E.CONTEXT_LENGTH_EXCEEDED in error:
            # The prompt does not fit the model even after `truncation` did what it may:
            # the client's request is at fault, so it hears of it as an `error` event too.
            code = E.CONTEXT_LENGTH_EXCEEDED
            message = error[error.index(code) :].removeprefix(f"{code}: ")
            self.state.out.error(ProtocolError(code, f"Context length exceeded: {message}"))
        self.end(Outcome(final, "client_cancelled", error, code), now, usage=usage)

    def on_playout(self, response_id: str, played_ms: float) -> None:
        if self.playing is not None and self.playing.id == response_id:
            self.played_ms = max(self.played_ms, played_ms)

    def on_playout_finished(self, response_id: str, now: float) -> None:
        run = self.playing
        if run is not None and run.id == response_id and not run.active:
            self.playing = None
            self.state.out.event("output_audio_buffer.stopped", response_id=response_id)
            if self.active is None:
                self.idle.arm(now, 0.0)

    def stop_playout(self) -> None:
        """Track transport: cut the audio still playing, truncate its item where it stopped."""
        run = self.playing
        if run is None:
            return
        state = self.state
        self.playing = None
        state.out.effect(ClearAudioOutput(run.id))
        state.out.event("output_audio_buffer.cleared", response_id=run.id)
        if run.item is not None and run.item.id in state.conversation:
            played = int(min(self.played_ms, run.audio_ms))
            state.conversation.truncate(run.item.id, 0, played)
            state.out.event(
                "conversation.item.truncated", item_id=run.item.id, content_index=0, audio_end_ms=played
            )

    def close_orphaned(self, now: float, failure: dict[str, str]) -> None:
        """After a restore: end the responses a dead process left in progress (`failure`: the
        error code and message when its replica was lost)."""
        state = self.state
        config, options = state.config, state.options
        orphan, self.orphan_response = self.orphan_response, None
        if orphan is not None:
            self.stored_response = str(orphan["id"])  # cleared in the store with its response.done
        end_orphaned_responses(
            state.conversation,
            lambda audio: ResponseSettings(
                modalities=["audio"] if audio else ["text"],
                output_format=config.output_format,
                voice=config.voice,
                max_output_tokens=config.max_output_tokens,
                frame_ms=options.output_frame_ms,
                via_track=options.audio_out_via_track,
            ),
            outbox=state.out,
            conversation_id=state.conversation_id,
            now=now,
            open_response=orphan,
            **failure,
        )
