"""A response started ahead of the turn's end, on the transcript made during the pause.

Server VAD ends a turn only after `silence_duration_ms` of silence (500 ms by default); the
response then needs the responder's first words and the TTS's first piece before any audio
goes out. The session core says when a pause has lasted long enough that the turn will
probably end there (`RespondAhead`, with the params that turn's response would get); this
starts that request at once on the pause's prepared transcript and holds its output unread
(the runtime's request buffer is bounded: a request nobody reads stalls itself, never
memory). When the turn does end, a `StartResponse` whose key and params (audio replaced by
the same transcript) match takes the request over and the client gets its output from the
first payload on; anything else (the speaker went on: `DropAhead`; another turn; a changed
conversation or session config) cancels it. Nothing of a dropped request reached the client.

A request started ahead takes a generation slot of the replica's `TurnGate` only if one is
free at once (it never queues ahead of real turns) and hands it to the response that takes it
over.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from runtime.orchestrator import Orchestrator
from runtime.progress import RequestHandle
from session.voice.turn_gate import TurnGate

log = logging.getLogger(__name__)

Key = tuple[str, int]


def with_transcript(params: dict[str, Any], text: str) -> dict[str, Any]:
    """`params` with the user turn's `audio` replaced by its transcript as `text`."""
    return {**{k: v for k, v in params.items() if k != "audio"}, "text": text}


@dataclass(slots=True)
class Taken:
    """A request started ahead, handed to the response that the turn's end started."""

    handle: RequestHandle
    slot: TurnGate | None


@dataclass(slots=True)
class _Ahead:
    key: Key
    task: asyncio.Task[tuple[dict[str, Any], Taken] | None]


class ResponseAhead:
    """At most one request started ahead per session (see the module docstring)."""

    def __init__(
        self,
        orchestrator: Orchestrator,
        *,
        gate: TurnGate | None,
        session_key: str | None,
        spawn: Callable[[Awaitable[Any], str], asyncio.Task[Any]],
    ) -> None:
        self._orch = orchestrator
        self._gate = gate
        self._session_key = session_key
        self._spawn = spawn
        self._ahead: _Ahead | None = None
        self.started = 0  # requests started ahead
        self.used = 0  # ... that a response took over
        self.dropped = 0  # ... cancelled unread

    @property
    def key(self) -> Key | None:
        return self._ahead.key if self._ahead is not None else None

    def start(self, key: Key, params: dict[str, Any], transcript: Awaitable[str | None]) -> None:
        """Submit the response of `key` once `transcript` (the pause's prepared one) is ready."""
        self.drop()
        task = self._spawn(self._submit(params, transcript), f"ahead:{key[0]}")
        self._ahead = _Ahead(key, task)

    async def _submit(
        self, params: dict[str, Any], transcript: Awaitable[str | None]
    ) -> tuple[dict[str, Any], Taken] | None:
        text = await transcript
        if text is None:
            return None
        gate = self._gate
        if gate is not None and not await gate.try_acquire():
            return None  # every slot generating: real turns first
        try:
            params = with_transcript(params, text)
            handle = await self._orch.submit(params, session_key=self._session_key)
        except BaseException:
            if gate is not None:
                gate.release()
            raise
        self.started += 1
        return params, Taken(handle, gate)

    async def take(self, key: Key, params: dict[str, Any]) -> Taken | None:
        """The request started ahead for `key` if its params equal `params` (the response's,
        transcript in place of audio); else None (and whatever was started is cancelled)."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if ahead.key != key:
            self._cancel(ahead)
            return None
        try:
            started = await asyncio.shield(ahead.task)
        except asyncio.CancelledError:
            self._cancel(ahead)  # the response was cancelled while the request was starting
            raise
        except Exception as exc:  # the response is then submitted as usual
            log.warning("response started ahead failed to start: %s", exc)
            return None
        if started is None:
            return None
        sent, taken = started
        if sent != params:
            self._cancel(ahead)
            return None
        self.used += 1
        return taken

    def drop(self, key: Key | None = None) -> None:
        """Cancel the request started ahead (only if it is `key`'s, when given)."""
        ahead = self._ahead
        if ahead is None or (key is not None and ahead.key != key):
            return
        self._ahead = None
        self._cancel(ahead)

    def _cancel(self, ahead: _Ahead) -> None:
        # Never task.cancel(): a cancel landing just as `submit` returns would leak the
        # request. The task runs on (it waits for a transcription that runs anyway) and
        # whatever it started is cancelled when it ends.
        self.dropped += 1
        ahead.task.add_done_callback(self._release_result)

    def _release_result(self, task: asyncio.Task[tuple[dict[str, Any], Taken] | None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        started = task.result()
        if started is not None:
            self._release(started[1])

    def _release(self, taken: Taken) -> None:
        self._spawn(self._orch.cancel(taken.handle.request_id), f"ahead-cancel:{taken.handle.request_id}")
        if taken.slot is not None:
            taken.slot.release()
