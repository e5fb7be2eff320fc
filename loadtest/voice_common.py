"""What the ``voice-ws`` and ``voice-webrtc`` scenarios share: results, the turn loop, barge-in.

Both scenarios run the same conversation (speak an utterance, in manual mode commit and ask for
a reply, optionally interrupt it, wait for it to finish, pause, repeat) and book-keep replies
the same way (``response.created`` → the oldest spoken turn, VAD splits, timeouts). Only the
transport differs: how an utterance is spoken, how events are sent, when a reply counts as
over, and what a manual interruption sends. :class:`VoiceSession` keeps the shared logic in one
place; the scenarios fill in those few hooks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from loadtest.playout import PlayoutBuffer
from loadtest.speech import SpeechBank
from loadtest.turns import TurnRecord
from loadtest.workload import Workload

Speech = TypeVar("Speech")  # what the transport speaks: encoded append events, or samples


@dataclass(slots=True)
class LiveCounters:
    """Shared by all sessions of a run, read by the progress bar."""

    live: int = 0
    admitted: int = 0
    refused: int = 0
    turns: int = 0
    errors: int = 0


@dataclass(slots=True)
class SessionResult:
    index: int
    admission: str = "not_attempted"  # admitted | the refusal's error code | connect_failed
    turns: list[TurnRecord] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)  # error events outside turns, transport errors
    close: str | None = None  # an unexpected close: "code reason"
    late_sends: int = 0  # appends sent > 20 ms behind schedule (the load generator fell behind)
    max_send_lag_ms: float = 0.0
    vad_splits: int = 0  # replies the server VAD cut short because one utterance had a pause


def count_error(
    result: SessionResult, counters: LiveCounters, code: str, turn: TurnRecord | None = None
) -> None:
    """Book an error on its turn (or on the session when it is outside turns) and the run."""
    target = turn.errors if turn is not None else result.errors
    target[code] = target.get(code, 0) + 1
    counters.errors += 1


def book_refusal(result: SessionResult, counters: LiveCounters, code: str) -> SessionResult:
    """The session was not admitted (``code``: the refusal's error code, or connect_failed)."""
    result.admission = code
    counters.refused += 1
    return result


def book_connect_failure(result: SessionResult, counters: LiveCounters, exc: BaseException) -> SessionResult:
    """The connection could not be made at all: a refusal, and an error naming why."""
    count_error(result, counters, f"connect_failed:{type(exc).__name__}")
    return book_refusal(result, counters, "connect_failed")


def session_update(w: Workload) -> dict[str, Any]:
    td: dict[str, Any] | None = None
    if w.turn_detection == "server_vad":
        td = {
            "type": "server_vad",
            "threshold": w.vad_threshold,
            "prefix_padding_ms": 300,
            "silence_duration_ms": w.silence_ms,
            "create_response": True,
            "interrupt_response": True,
        }
    pcm = {"type": "audio/pcm", "rate": 24000}
    return {
        "type": "session.update",
        "session": {
            "type": "realtime",
            "output_modalities": ["audio"],
            "audio": {"input": {"format": pcm, "turn_detection": td}, "output": {"format": pcm}},
        },
    }


def reset_response(turn: TurnRecord) -> TurnRecord:
    """Forget the reply a turn got so far (it is waiting for another one)."""
    turn.response_id = turn.created_at = turn.first_audio_at = turn.last_audio_at = None
    turn.audio_ms, turn.deltas, turn.max_gap_s = 0.0, 0, 0.0
    turn.gaps_s.clear()
    turn.playout = PlayoutBuffer(turn.playout.prebuffer_ms)
    return turn


class VoiceSession(ABC, Generic[Speech]):
    """One voice session's conversation and reply book-keeping, over an abstract transport.

    Subclasses provide ``run`` (connect, call :meth:`_conversation`, close) and the hooks
    below; events they receive go through :meth:`_on_response_event`.
    """

    def __init__(
        self,
        index: int,
        workload: Workload,
        bank: SpeechBank,
        counters: LiveCounters,
        clock: Callable[[], float],
    ) -> None:
        self.index = index
        self.w = workload
        self.bank = bank
        self.counters = counters
        self.clock = clock
        self.result = SessionResult(index)
        self._rng = random.Random(workload.seed * 100_003 + index)
        self._awaiting: deque[TurnRecord] = deque()  # spoken turns waiting for response.created
        self._by_response: dict[str, TurnRecord] = {}
        self._receiving: TurnRecord | None = None  # the turn whose response runs
        self._changed = asyncio.Event()
        self._barge_watch: TurnRecord | None = None  # the reply a barge-in waits on
        self._closed = False
        self._updated = False

    # --- transport hooks -----------------------------------------------------------------

    @abstractmethod
    async def _send_event(self, event: dict[str, Any]) -> None:
        ...

    def _session_update(self) -> dict[str, Any]:
        return session_update(self.w)

    @abstractmethod
    def _new_turn(self, number: int) -> tuple[TurnRecord, Speech]:
        ...

    @abstractmethod
    def _speak(self, speech: Speech) -> asyncio.Future[float]:
        """Queue an utterance; the future gets its end-of-speech time once it has been sent."""
        ...

    def _on_spoken(self, turn: TurnRecord) -> None:
        """The turn's utterance has been spoken (its reply may start now)."""

    def _reply_over(self, turn: TurnRecord) -> bool:
        """Nothing more will arrive for the turn's reply (a barge-in would come too late)."""
        return turn.done_at is not None

    @abstractmethod
    async def _await_reply(self, turn: TurnRecord) -> None:
        """Wait until the turn's reply is over, or it timed out."""
        ...

    async def _pause(self, turn: TurnRecord) -> None:
        """The pause between a reply and the next utterance."""
        await asyncio.sleep(self.w.pause_s)

    def _on_barge_in(self, turn: TurnRecord) -> None:
        """The interruption of ``turn``'s reply starts now (``turn.barge_in_at``)."""

    @abstractmethod
    async def _interrupt_manual(self, turn: TurnRecord) -> None:
        """Interrupt a reply in manual turn mode (speaking interrupts with server VAD)."""
        ...

    @abstractmethod
    def _close_turn(self, turn: TurnRecord) -> None:
        ...

    # --- admission -----------------------------------------------------------------------

    def _refused(self, code: str) -> SessionResult:
        return book_refusal(self.result, self.counters, code)

    def _connect_failed(self, exc: BaseException) -> SessionResult:
        return book_connect_failure(self.result, self.counters, exc)

    def _admitted(self) -> None:
        self.result.admission = "admitted"
        self.counters.admitted += 1
        self.counters.live += 1

    def _count_error(self, code: str, turn: TurnRecord | None = None) -> None:
        count_error(self.result, self.counters, code, turn)

    # --- server events -------------------------------------------------------------------

    def _on_response_event(self, kind: Any, event: dict[str, Any], now: float) -> bool:
        """Handle the events both transports see alike; False when ``kind`` is not one of them."""
        if kind == "response.created":
            rid = str(event["response"]["id"])
            turn = self._awaiting.popleft() if self._awaiting else None
            if turn is None:
                self._count_error("unexpected_response")
                return True
            turn.response_id, turn.created_at = rid, now
            self._by_response[rid] = turn
            self._receiving = turn
        elif kind == "response.done":
            self._on_done(event["response"], now)
        elif kind == "error":
            code = str((event.get("error") or {}).get("code"))
            self._count_error(code, self._receiving)
        elif kind == "session.updated":
            self._updated = True
        else:
            return False
        self._changed.set()
        return True

    def _on_done(self, response: dict[str, Any], now: float) -> None:
        rid = str(response.get("id"))
        turn = self._by_response.get(rid)
        if turn is None:
            return
        if self._receiving is turn:
            self._receiving = None
        status = str(response.get("status"))
        if status == "cancelled" and turn.barge_in_at is None:
            # The server VAD heard a pause inside our utterance: the reply to its first part was
            # cut by the rest of it. The turn waits for the reply to the whole utterance.
            self._by_response.pop(rid, None)
            self.result.vad_splits += 1
            self._awaiting.appendleft(reset_response(turn))
            return
        turn.status, turn.done_at = status, now
        self._on_turn_done(turn, rid, now)

    def _on_turn_done(self, turn: TurnRecord, rid: str, now: float) -> None:
        """The turn's reply ended (``response.done``, not a VAD split)."""

    # --- turns ---------------------------------------------------------------------------

    async def _wait(self, predicate: Callable[[], bool], deadline: float) -> bool:
        while not predicate():
            remaining = deadline - self.clock()
            if remaining <= 0 or self._closed:
                return predicate()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
        return True

    def _turn_record(self, number: int, speech_ms: float) -> TurnRecord:
        turn = TurnRecord(self.index, number, spoke_at=self.clock(), speech_ms=speech_ms)
        turn.playout = PlayoutBuffer(float(self.w.prebuffer_ms))
        return turn

    async def _conversation(self, end_at: float) -> None:
        await self._send_event(self._session_update())
        if not await self._wait(lambda: self._updated, self.clock() + 30):
            self._count_error("no_session_updated")
            return
        manual = self.w.turn_detection == "manual"
        carried: tuple[TurnRecord, asyncio.Future[float]] | None = None
        number = 0
        while not self._closed:
            if carried is None:
                if self.clock() >= end_at or (self.w.max_turns and number >= self.w.max_turns):
                    break
                if manual:
                    await self._send_event({"type": "input_audio_buffer.clear"})
                turn, speech = self._new_turn(number)
                carried = (turn, self._speak(speech))
            turn, spoken = carried
            carried = None
            self._awaiting.append(turn)
            turn.speech_end = await spoken
            self._on_spoken(turn)
            if manual:
                await self._send_event({"type": "input_audio_buffer.commit"})
                create: dict[str, Any] = {"type": "response.create"}
                if self.w.max_output_tokens:
                    create["response"] = {"max_output_tokens": self.w.max_output_tokens}
                await self._send_event(create)
                turn.speech_end = self.clock()
            number += 1
            if self._rng.random() < self.w.barge_in:
                carried = await self._barge_in(turn, number)
            await self._await_reply(turn)
            self._close_turn(turn)
            if carried is None:
                await self._pause(turn)

    async def _barge_in(
        self, turn: TurnRecord, number: int
    ) -> tuple[TurnRecord, asyncio.Future[float]] | None:
        """Interrupt ``turn``'s reply once ``barge_in_after_ms`` of it has arrived."""
        deadline = (turn.speech_end or self.clock()) + self.w.response_timeout_s
        enough = self.w.barge_in_after_ms

        def ready() -> bool:
            return self._reply_over(turn) or turn.audio_ms >= enough

        self._barge_watch = turn
        try:
            await self._wait(ready, deadline)
        finally:
            self._barge_watch = None
        if self._reply_over(turn) or turn.audio_ms < enough or turn.response_id is None:
            return None
        turn.barge_in_at = self.clock()
        self._on_barge_in(turn)
        if self.w.turn_detection == "manual":
            await self._interrupt_manual(turn)
            return None
        # Server VAD: speaking *is* the interruption, and it starts the next turn.
        nxt, speech = self._new_turn(number)
        return nxt, self._speak(speech)

    def _expire_turn(self, turn: TurnRecord) -> bool:
        """Book a turn whose reply never finished as an error; False when it did finish."""
        if turn.done_at is not None:
            return False
        turn.status = "timeout" if turn.response_id is not None else "no_response"
        self._count_error(turn.status, turn)
        with contextlib.suppress(ValueError):
            self._awaiting.remove(turn)
        if turn.response_id is not None:
            self._by_response.pop(turn.response_id, None)
        if self._receiving is turn:
            self._receiving = None
        return True

    def _record_turn(self, turn: TurnRecord) -> None:
        self.result.turns.append(turn)
        self.counters.turns += 1
