"""A raw GPT-Live client for the protocol tests: a `websockets` connection to
``/v1/live/sessions`` with JSON events in and out."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import websockets
from websockets.asyncio.client import ClientConnection

from tests.live_server import LiveServer

RATE = 24_000


def start_event(**session: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "gpt-live-1",
        "instructions": "You are a test.",
        "audio": {"format": {"type": "audio/pcm", "rate": RATE}, "output": {"voice": "marin"}},
        "delegation": {"type": "client"},
    }
    body.update(session)
    return {"type": "session.start", "event_id": "evt_start", "session": body}


def pcm_b64(seconds: float, seed: int = 0, amplitude: float = 3000.0) -> str:
    samples = (np.random.default_rng(seed).standard_normal(int(seconds * RATE)) * amplitude).astype("<i2")
    return base64.b64encode(samples.tobytes()).decode()


def append(seconds: float = 0.1, seed: int = 0) -> dict[str, Any]:
    return {"type": "session.input_audio.append", "audio": pcm_b64(seconds, seed)}


@dataclass
class LiveClient:
    ws: ClientConnection
    seen: list[dict[str, Any]] = field(default_factory=list)

    async def send(self, event: dict[str, Any] | str) -> None:
        await self.ws.send(event if isinstance(event, str) else json.dumps(event))

    async def event(self, within_s: float = 10.0) -> dict[str, Any]:
        async with asyncio.timeout(within_s):
            event: dict[str, Any] = json.loads(await self.ws.recv())
        self.seen.append(event)
        return event

    async def wait_for(self, kind: str, within_s: float = 10.0, *, skip_audio: bool = True) -> dict[str, Any]:
        """The next event of type ``kind`` (audio and transcript deltas skipped on the way; any
        other event met first fails the test unless it is a usage update)."""
        async with asyncio.timeout(within_s):
            while True:
                event = await self.event(within_s)
                if event["type"] == kind:
                    return event
                passing = {
                    "session.output_audio.delta",
                    "session.output_transcript.delta",
                    "session.usage.updated",
                }
                if not (skip_audio and event["type"] in passing):
                    raise AssertionError(f"expected {kind}, got {event}")

    async def closed(self, within_s: float = 10.0) -> tuple[int | None, str]:
        """Read to the end; the close code and reason the server sent."""
        async with asyncio.timeout(within_s):
            try:
                while True:
                    self.seen.append(json.loads(await self.ws.recv()))
            except websockets.ConnectionClosed:
                pass
        rcvd = self.ws.protocol.close_rcvd
        return (rcvd.code, rcvd.reason) if rcvd is not None else (None, "")

    async def start(self, **session: Any) -> dict[str, Any]:
        await self.send(start_event(**session))
        return await self.wait_for("session.started")


async def connect(
    server: LiveServer,
    key: str | None = "sk-live-a",
    *,
    query: str = "",
    headers: dict[str, str] | None = None,
) -> LiveClient:
    extra = dict(headers or {})
    if key is not None:
        extra["Authorization"] = f"Bearer {key}"
    url = f"{server.ws_url}/v1/live/sessions{query}"
    ws = await websockets.connect(url, additional_headers=extra, max_size=None)
    return LiveClient(ws)
