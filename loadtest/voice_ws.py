"""Scenario ``voice-ws``: one full-duplex voice session over the realtime WebSocket protocol.

A raw ``websockets`` client (no SDK, no compression) with three owned tasks:

* the *microphone* sends one pre-encoded ``input_audio_buffer.append`` every ``append_ms`` on
  an absolute schedule, for the whole session: speech while a turn speaks, silence otherwise
  (so audio flows both ways while the reply plays);
* the *reader* timestamps server events; output audio deltas take a fast path that measures
  the payload from its base64 length without decoding JSON or audio;
* the *conversation* runs the turns: speak, (manual turns: commit + ``response.create``), wait
  for the reply, optionally interrupt it, wait until it has played out, pause, repeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from loadtest.playout import PlayoutBuffer
from loadtest.speech import EncodedUtterance, SpeechBank
from loadtest.turns import TurnRecord
from loadtest.workload import Workload

DELTA_PREFIX = b'{"type":"response.output_audio.delta"'
DELTA_FIELD = b'"delta":"'
PCM16_24K_BYTES_PER_MS = 48.0


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


def delta_audio_ms(raw: bytes) -> float | None:
    """Audio carried by a ``response.output_audio.delta`` text frame, from its base64 length.

    Needs the server's field order (``delta`` last); None when the frame is shaped otherwise.
    """
    if not raw.endswith(b'"}'):
        return None
    i = raw.rfind(DELTA_FIELD)
    if i < 0:
        return None
    b64 = len(raw) - i - len(DELTA_FIELD) - 2
    padding = 2 if raw.endswith(b'=="}') else 1 if raw.endswith(b'="}') else 0
    return (b64 * 3 // 4 - padding) / PCM16_24K_BYTES_PER_MS


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


class VoiceWsSession:
    def __init__(
        self,
        index: int,
        url: str,
        workload: Workload,
        bank: SpeechBank,
        counters: LiveCounters,
        *,
        clock: Callable[[], float] = time.monotonic,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.index = index
        self.url = url
        self.w = workload
        self.bank = bank
        self.counters = counters
        self.clock = clock
        self.headers = headers or {}
        self.result = SessionResult(index)
        self._rng = random.Random(workload.seed * 100_003 + index)
        self._ws: ClientConnection | None = None
        self._mic: deque[bytes] = deque()
        self._speech_end: tuple[asyncio.Future[float], float] | None = None
        self._awaiting: deque[TurnRecord] = deque()  # spoken turns waiting for response.created
        self._by_response: dict[str, TurnRecord] = {}
        self._receiving: TurnRecord | None = None  # the turn whose reply audio is arriving
        self._item_of: dict[str, str] = {}  # response id → assistant item id
        self._changed = asyncio.Event()
        self._barge_watch: TurnRecord | None = None  # the reply a barge-in waits on
        self._closed = False
        self._updated = False

    # --- lifecycle -----------------------------------------------------------------------

    async def run(self, end_at: float) -> SessionResult:
        try:
            self._ws = await connect(
                self.url,
                compression=None,
                max_size=8 * 2**20,
                open_timeout=30,
                ping_interval=None,
                additional_headers=self.headers,
            )
        except InvalidStatus as exc:
            self.result.admission = refusal_code(exc)
            self.counters.refused += 1
            return self.result
        except (OSError, TimeoutError) as exc:
            self.result.admission = "connect_failed"
            self._count_error(f"connect_failed:{type(exc).__name__}")
            self.counters.refused += 1
            return self.result
        self.result.admission = "admitted"
        self.counters.admitted += 1
        self.counters.live += 1
        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(self._read(), name=f"s{self.index}:reader")
                mic = tg.create_task(self._pace(), name=f"s{self.index}:mic")
                try:
                    await self._conversation(end_at)
                finally:
                    mic.cancel()
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(self._ws.close(), 5.0)
                    reader.cancel()
        except* ConnectionClosed as group:
            if not self._closed:
                self._on_close(group.exceptions[0])
        finally:
            self.counters.live -= 1
        return self.result

    def _on_close(self, exc: BaseException) -> None:
        self._closed = True
        if isinstance(exc, ConnectionClosed) and exc.rcvd is not None:
            self.result.close = f"{exc.rcvd.code} {exc.rcvd.reason}"
        else:
            self.result.close = type(exc).__name__
        self._count_error("connection_closed")
        self._changed.set()

    def _count_error(self, code: str, turn: TurnRecord | None = None) -> None:
        target = turn.errors if turn is not None else self.result.errors
        target[code] = target.get(code, 0) + 1
        self.counters.errors += 1

    async def _send_json(self, event: dict[str, Any]) -> None:
        assert self._ws is not None
        await self._ws.send(json.dumps(event, separators=(",", ":")))

    # --- microphone ----------------------------------------------------------------------

    def _speak(self, utterance: EncodedUtterance) -> asyncio.Future[float]:
        """Queue an utterance; the future gets its end-of-speech time once it has been sent."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._mic.extend(utterance.frames)
        self._speech_end = (fut, utterance.pad_ms / 1000.0)
        return fut

    async def _pace(self) -> None:
        ws = self._ws
        assert ws is not None
        dt = self.bank.append_ms / 1000.0
        silence = self.bank.silence
        start = self.clock()
        k = 0
        while True:
            k += 1
            delay = start + k * dt - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.02:
                self.result.late_sends += 1
                self.result.max_send_lag_ms = max(self.result.max_send_lag_ms, -delay * 1000.0)
            frame = self._mic.popleft() if self._mic else silence
            await ws.send(frame, text=True)
            if not self._mic and self._speech_end is not None:
                fut, pad_s = self._speech_end
                self._speech_end = None
                if not fut.done():
                    fut.set_result(self.clock() - pad_s)

    # --- server events -------------------------------------------------------------------

    async def _read(self) -> None:
        ws = self._ws
        assert ws is not None
        try:
            while True:
                raw = await ws.recv(decode=False)
                now = self.clock()
                if raw.startswith(DELTA_PREFIX):
                    audio_ms = delta_audio_ms(raw)
                    if audio_ms is not None:
                        self._on_audio(now, audio_ms)
                        continue
                self._on_event(json.loads(raw), now)
        except ConnectionClosed as exc:
            if not self._closed and not (exc.rcvd is not None and exc.rcvd.code == 1000):
                self._on_close(exc)
            self._closed = True
            self._changed.set()

    def _on_audio(self, now: float, audio_ms: float) -> None:
        turn = self._receiving
        if turn is not None:
            turn.on_audio(now, audio_ms)
            if turn is self._barge_watch and turn.audio_ms >= self.w.barge_in_after_ms:
                self._changed.set()

    def _on_event(self, event: dict[str, Any], now: float) -> None:
        kind = event.get("type")
        if kind == "response.output_audio.delta":
            self._on_audio(now, len(event.get("delta", "")) * 3 / 4 / PCM16_24K_BYTES_PER_MS)
            return
        if kind == "response.created":
            rid = str(event["response"]["id"])
            turn = self._awaiting.popleft() if self._awaiting else None
            if turn is None:
                self._count_error("unexpected_response")
                return
            turn.response_id, turn.created_at = rid, now
            self._by_response[rid] = turn
            self._receiving = turn
        elif kind == "response.output_item.added":
            rid = str(event.get("response_id", ""))
            self._item_of[rid] = str(event.get("item", {}).get("id", ""))
        elif kind == "response.done":
            self._on_done(event["response"], now)
        elif kind == "error":
            code = str(event.get("error", {}).get("code"))
            self._count_error(code, self._receiving)
        elif kind == "session.updated":
            self._updated = True
        else:
            return
        self._changed.set()

    def _on_done(self, response: dict[str, Any], now: float) -> None:
        rid = str(response.get("id"))
        turn = self._by_response.pop(rid, None)
        if turn is None:
            return
        if self._receiving is turn:
            self._receiving = None
        status = str(response.get("status"))
        if status == "cancelled" and turn.barge_in_at is None:
            # The server VAD heard a pause inside our utterance: the reply to its first part was
            # cut by the rest of it. The turn waits for the reply to the whole utterance.
            self.result.vad_splits += 1
            self._awaiting.appendleft(reset_response(turn))
            return
        turn.status, turn.done_at = status, now
        if turn.barge_in_at is not None:
            turn.barge_in_done_at = now

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

    async def _wait_done(self, turn: TurnRecord, deadline: float) -> bool:
        return await self._wait(lambda: turn.done_at is not None, deadline)

    def _new_turn(self, number: int) -> tuple[TurnRecord, EncodedUtterance]:
        utterance = self._rng.choice(self.bank.utterances)
        turn = TurnRecord(self.index, number, spoke_at=self.clock(), speech_ms=utterance.speech_ms)
        turn.playout = PlayoutBuffer(float(self.w.prebuffer_ms))
        return turn, utterance

    async def _conversation(self, end_at: float) -> None:
        await self._send_json(session_update(self.w))
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
                    await self._send_json({"type": "input_audio_buffer.clear"})
                turn, utterance = self._new_turn(number)
                carried = (turn, self._speak(utterance))
            turn, spoken = carried
            carried = None
            self._awaiting.append(turn)
            turn.speech_end = await spoken
            if manual:
                await self._send_json({"type": "input_audio_buffer.commit"})
                create: dict[str, Any] = {"type": "response.create"}
                if self.w.max_output_tokens:
                    create["response"] = {"max_output_tokens": self.w.max_output_tokens}
                await self._send_json(create)
                turn.speech_end = self.clock()
            number += 1
            if self._rng.random() < self.w.barge_in:
                carried = await self._barge_in(turn, number)
            await self._wait_done(turn, turn.speech_end + self.w.response_timeout_s)
            self._close_turn(turn)
            if carried is None:
                finish = turn.playout.finished_at() or self.clock()
                await asyncio.sleep(max(0.0, finish - self.clock()) + self.w.pause_s)

    async def _barge_in(
        self, turn: TurnRecord, number: int
    ) -> tuple[TurnRecord, asyncio.Future[float]] | None:
        """Interrupt ``turn``'s reply once ``barge_in_after_ms`` of it has arrived."""
        deadline = (turn.speech_end or self.clock()) + self.w.response_timeout_s
        enough = self.w.barge_in_after_ms

        def ready() -> bool:
            return turn.done_at is not None or turn.audio_ms >= enough

        self._barge_watch = turn
        try:
            await self._wait(ready, deadline)
        finally:
            self._barge_watch = None
        if turn.done_at is not None or turn.audio_ms < enough or turn.response_id is None:
            return None
        turn.barge_in_at = self.clock()
        if self.w.turn_detection == "manual":
            await self._send_json({"type": "response.cancel"})
            await self._wait_done(turn, self.clock() + self.w.response_timeout_s)
            item_id = self._item_of.get(turn.response_id)
            if item_id:
                played = int(turn.playout.played_ms(turn.barge_in_at))
                await self._send_json(
                    {
                        "type": "conversation.item.truncate",
                        "item_id": item_id,
                        "content_index": 0,
                        "audio_end_ms": played,
                    }
                )
            return None
        # Server VAD: speaking *is* the interruption, and it starts the next turn.
        nxt, utterance = self._new_turn(number)
        return nxt, self._speak(utterance)

    def _close_turn(self, turn: TurnRecord) -> None:
        if turn.done_at is None:
            turn.status = "timeout" if turn.response_id is not None else "no_response"
            self._count_error(turn.status, turn)
            with contextlib.suppress(ValueError):
                self._awaiting.remove(turn)
            if turn.response_id is not None:
                self._by_response.pop(turn.response_id, None)
            if self._receiving is turn:
                self._receiving = None
        self.result.turns.append(turn)
        self.counters.turns += 1


def reset_response(turn: TurnRecord) -> TurnRecord:
    """Forget the reply a turn got so far (it is waiting for another one)."""
    turn.response_id = turn.created_at = turn.first_audio_at = turn.last_audio_at = None
    turn.audio_ms, turn.deltas, turn.max_gap_s = 0.0, 0, 0.0
    turn.gaps_s.clear()
    turn.playout = PlayoutBuffer(turn.playout.prebuffer_ms)
    return turn


def refusal_code(exc: InvalidStatus) -> str:
    """The error code of a refused WebSocket upgrade (``server_busy``, ``invalid_api_key``...)."""
    try:
        body = json.loads(exc.response.body or b"{}")
        return str(body["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{exc.response.status_code}"
