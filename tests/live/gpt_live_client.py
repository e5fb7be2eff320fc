"""Drives a server with LiveKit Agents' unmodified ``GPTLiveModel`` (run by the livekit venv's
interpreter: tests/live/conftest.py) and prints one JSON report on stdout.

No LiveKit room exists here: the script does what ``AgentSession`` does with a duplex model:
opens ``model.session()``, configures it (``_update_session``: instructions, an empty chat
context, no tools: that releases the connection, whose first event is ``session.start``),
pushes microphone frames in real time with ``push_audio``, reads ``audio_stream``, and closes
with ``aclose()`` (``session.close``, then it waits for ``session.closed``). Along the way it
mutes and unmutes the input and appends instructions, as an application would.

The report holds what the application saw: the server events by type (the plugin's
``openai_server_event_received``), the ``error`` events the plugin emitted to the app, the
model's transcript deltas, the output audio (seconds, peak) and the bursts the plugin's own
gate (``model.audio_gate()``) finds in it, and every log record of the plugin at WARNING or
above (an event it failed to handle, an error it reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from collections import Counter
from typing import Any

import numpy as np
from livekit import rtc
from livekit.agents import llm
from livekit.agents.llm._realtime.gpt_live import GPTLiveModel

RATE = 24_000
FRAME = RATE // 10  # the plugin sends 100 ms appends


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    records = Records()
    logging.getLogger("livekit").addHandler(records)
    logging.getLogger("livekit.agents").addHandler(records)
    model = GPTLiveModel(
        api_key=args.api_key, base_url=args.base_url, model=args.model, voice="marin", delegation="client"
    )
    session = model.session()
    types: Counter[str] = Counter()
    errors: list[str] = []
    transcript: list[list[Any]] = []
    started: list[dict[str, Any]] = []
    closed: list[dict[str, Any]] = []

    def on_server(event: dict[str, Any]) -> None:
        types[event.get("type", "")] += 1
        if event.get("type") == "session.started":
            started.append(event)
        if event.get("type") == "session.closed":
            closed.append(event)

    session.on("openai_server_event_received", on_server)
    session.on("error", lambda e: errors.append(f"{e.error!r} recoverable={e.recoverable}"))
    session.on("transcript_delta", lambda d: transcript.append([d.text, d.start_ms, d.end_ms]))

    gate = model.audio_gate()
    assert gate is not None
    audio = {"seconds": 0.0, "peak": 0, "bursts": 0, "first_at": None}

    async def read_audio() -> None:
        was_open = False
        async for out in session.audio_stream:
            frame = out.frame
            data = np.frombuffer(frame.data, dtype=np.int16)
            audio["seconds"] += frame.duration
            audio["peak"] = max(int(audio["peak"]), int(np.abs(data).max()) if data.size else 0)
            if audio["first_at"] is None:
                audio["first_at"] = time.monotonic() - t0
            is_open = gate.update(frame)
            if is_open and not was_open:
                audio["bursts"] += 1
            was_open = is_open

    t0 = time.monotonic()
    await session._update_session(instructions=args.instructions, chat_ctx=llm.ChatContext.empty(), tools=[])
    reader = asyncio.create_task(read_audio())
    rng = np.random.default_rng(args.seed)
    frames = int(args.seconds * 10)
    for i in range(frames):
        if i == args.mute_at:
            session.mute_input()
        if i == args.unmute_at:
            session.unmute_input()
        if i == args.append_at:
            session.append_instructions("Answer in one short sentence.")
        pcm = (rng.standard_normal(FRAME) * 3000).clip(-32768, 32767).astype(np.int16)
        session.push_audio(rtc.AudioFrame(pcm.tobytes(), RATE, 1, FRAME))
        # real time: frame i is due at t0 + i / 10
        await asyncio.sleep(max(0.0, t0 + (i + 1) / 10 - time.monotonic()))
    await asyncio.sleep(args.tail)
    await session.aclose()
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await model.aclose()
    return {
        "types": dict(types),
        "errors": errors,
        "transcript": transcript,
        "audio": audio,
        "started": started,
        "closed": closed,
        "session_id": session.session_id,
        "log": records.lines,
        "elapsed_s": time.monotonic() - t0,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--model", default="gpt-live-1")
    p.add_argument("--instructions", default="You are a helpful voice assistant.")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--tail", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mute-at", type=int, default=30)  # frame numbers (100 ms each)
    p.add_argument("--unmute-at", type=int, default=45)
    p.add_argument("--append-at", type=int, default=20)
    args = p.parse_args()
    report = asyncio.run(run(args))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
