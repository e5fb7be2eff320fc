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
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from loadtest.speech import EncodedUtterance, SpeechBank
from loadtest.turns import TurnRecord
from loadtest.voice_common import LiveCounters, SessionResult, VoiceSession
from loadtest.workload import Workload

DELTA_PREFIX = b'{"type":"response.output_audio.delta"'
DELTA_FIELD = b'"delta":"'
PCM16_24K_BYTES_PER_MS = 48.0


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


class VoiceWsSession(VoiceSession[EncodedUtterance]):
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
        super().__init__(index, workload, bank, counters, clock)
        self.url = url
        self.headers = headers or {}
        self._ws: ClientConnection | None = None
        self._mic: deque[bytes] = deque()
        self._speech_end: tuple[asyncio.Future[float], float] | None = None
        self._item_of: dict[str, str] = {}  # response id → assistant item id

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
            return self._refused(refusal_code(exc))
        except (OSError, TimeoutError) as exc:
            return self._connect_failed(exc)
        self._admitted()
        try:
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(self._read(), name=f"s{self.index}:reader")
                mic = tg.create_task(self._pace(), name=f"s{self.index}:mic")
                try:
                    await self._conversation(end_at)
                finally:
                    mic.cancel()
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(5.0):
                            await self._ws.close()
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

    async def _send_event(self, event: dict[str, Any]) -> None:
        assert self._ws is not None
        await self._ws.send(json.dumps(event, separators=(",", ":")))

    # --- microphone ----------------------------------------------------------------------

    def _speak(self, speech: EncodedUtterance) -> asyncio.Future[float]:
        """Queue an utterance; the future gets its end-of-speech time once it has been sent."""
        fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._mic.extend(speech.frames)
        self._speech_end = (fut, speech.pad_ms / 1000.0)
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
        if kind == "response.output_item.added":
            rid = str(event.get("response_id", ""))
            self._item_of[rid] = str(event.get("item", {}).get("id", ""))
            self._changed.set()
            return
        self._on_response_event(kind, event, now)

    def _on_turn_done(self, turn: TurnRecord, rid: str, now: float) -> None:
        self._by_response.pop(rid, None)
        if turn.barge_in_at is not None:
            turn.barge_in_done_at = now

    # --- turns ---------------------------------------------------------------------------

    async def _wait_done(self, turn: TurnRecord, deadline: float) -> bool:
        return await self._wait(lambda: turn.done_at is not None, deadline)

    def _new_turn(self, number: int) -> tuple[TurnRecord, EncodedUtterance]:
        utterance = self._rng.choice(self.bank.utterances)
        return self._turn_record(number, utterance.speech_ms), utterance

    async def _await_reply(self, turn: TurnRecord) -> None:
        assert turn.speech_end is not None
        await self._wait_done(turn, turn.speech_end + self.w.response_timeout_s)

    async def _pause(self, turn: TurnRecord) -> None:
        """Until the reply has played out at the client, then the workload's pause."""
        finish = turn.playout.finished_at() or self.clock()
        await asyncio.sleep(max(0.0, finish - self.clock()) + self.w.pause_s)

    async def _interrupt_manual(self, turn: TurnRecord) -> None:
        """``response.cancel``, then truncate the item to what the client has played of it."""
        assert turn.response_id is not None and turn.barge_in_at is not None
        await self._send_event({"type": "response.cancel"})
        await self._wait_done(turn, self.clock() + self.w.response_timeout_s)
        item_id = self._item_of.get(turn.response_id)
        if item_id:
            played = int(turn.playout.played_ms(turn.barge_in_at))
            await self._send_event(
                {
                    "type": "conversation.item.truncate",
                    "item_id": item_id,
                    "content_index": 0,
                    "audio_end_ms": played,
                }
            )

    def _close_turn(self, turn: TurnRecord) -> None:
        self._expire_turn(turn)
        self._record_turn(turn)


def refusal_code(exc: InvalidStatus) -> str:
    """The error code of a refused WebSocket upgrade (``server_busy``, ``invalid_api_key``...)."""
    try:
        body = json.loads(exc.response.body or b"{}")
        return str(body["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return f"http_{exc.response.status_code}"
