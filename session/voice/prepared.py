"""A turn's words made ahead of its end (``PrepareTranscript``), for one session's driver.

At a pause the session core asks for the words spoken so far: ``semantic_vad`` decides on them
(``on_turn_transcript``), and the response that the pause starts (ahead of the turn's end, or at
it) reads them instead of transcribing its audio again. They are made on the live request, whose
ASR stage holds that audio already (made while the user spoke), or else on the pipeline's
transcribe entry. One at a time: the latest pause's; an earlier one (the speaker went on after
it) is left to finish unread. ``DropTranscript`` gives the words up, ``NeedTranscript`` asks the
live ASR to make them first.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from session.realtime.core import RealtimeSessionCore
from session.realtime.effects import CoreOutput, PrepareTranscript
from session.voice.live_request import LiveRequest

log = logging.getLogger(__name__)

Key = tuple[str, int]  # (item id, end sample of the pause) as the core names a pause


class PreparedTranscript:
    """The latest pause's transcription task, keyed by its pause."""

    def __init__(
        self,
        core: RealtimeSessionCore,
        apply: Callable[[CoreOutput], None],
        now: Callable[[], float],
        spawn: Callable[[Coroutine[Any, Any, Any], str], asyncio.Task[Any]],
        transcribe_audio: Callable[[np.ndarray], Awaitable[str]],
    ) -> None:
        self._core = core
        self._apply = apply
        self._now = now
        self._spawn = spawn
        self._transcribe_audio = transcribe_audio
        # The latest PrepareTranscript: its key and the transcription (None if it failed).
        self._current: tuple[Key, asyncio.Task[str | None]] | None = None

    def prepare(self, effect: PrepareTranscript, live: LiveRequest | None) -> None:
        """Transcribe the turn so far at the pause `effect.key`: on `live` (a live request that
        transcribes) if given, else on the transcribe entry (`transcribe_audio`)."""
        drafted = False

        def decide(text: str | None) -> None:  # semantic_vad decides on these words too
            nonlocal drafted
            if not drafted:
                drafted = True
                self._apply(self._core.on_turn_transcript(effect.key, text, self._now()))

        async def transcribe() -> str | None:
            try:
                if live is not None:
                    # A decision reads the live ASR's draft where one comes first (the words
                    # where they stop); a response reads the final words.
                    draft = (lambda text: decide(text or None)) if effect.decides else None
                    start, end = effect.start_sample, effect.key[1]
                    text = await live.transcribe(start, end, first=effect.decides, draft=draft)
                    return text or None  # None: not transcribed (the response's ASR then does)
                return await self._transcribe_audio(effect.audio)
            except Exception as exc:  # the response then transcribes in the pipeline as usual
                log.warning("transcription ahead of the turn's end failed: %s", exc)
                return None

        async def prepare() -> str | None:
            text = await transcribe()
            decide(text)
            return text

        self._current = (effect.key, self._spawn(prepare(), f"prepare:{effect.key[0]}"))

    def drop(self, key: Key) -> None:
        """The words of the pause `key` are not needed (`DropTranscript`): give them up (the
        live ASR never makes them if it has not yet); a response at that pause transcribes
        its audio in the pipeline."""
        current = self._current
        if current is not None and current[0] == key:
            self._current = None
            current[1].cancel()

    def need(self, key: Key, live: LiveRequest | None) -> None:
        """A decision waits on the words of the pause `key` (`NeedTranscript`): the live ASR
        makes them before those of pauses whose score is not back."""
        current = self._current
        if live is not None and current is not None and current[0] == key:
            live.need(key[1])

    def pending(self, key: Key) -> asyncio.Task[str | None] | None:
        """The transcription of the pause `key`, left in place (a response started ahead reads
        it through a shield)."""
        current = self._current
        return current[1] if current is not None and current[0] == key else None

    async def take(self, key: Key) -> str | None:
        """The words of the pause `key` for the response it started (None: none were made, or
        the latest pause is another one); the transcription is handed over either way."""
        current, self._current = self._current, None
        if current is None or current[0] != key:
            return None
        return await current[1]
