"""The OpenAI Agents SDK (`openai-agents`, Python) drives the server unmodified.

`RealtimeRunner` with `model_config={"url": "ws://…/v1/realtime?model=…", "api_key": …}` is
how people build voice agents on it. It validates every server event against the `openai`
SDK's event union and hands the application a `RealtimeError` (and logs at ERROR) for any it
cannot parse, so an `omni.*` event sent unasked would break every connect (issue 13). Here:
a text turn, a spoken turn (Piper speaks the user's side; the server runs Silero VAD →
whisper tiny.en → the echo responder → Piper), and an agent with a function tool; no `error`
reaches the application and nothing is logged at ERROR by the SDK.

The server's pipelines never decide to call a tool (the echo responder, or a small local LM
with no tool format), so the tool test checks what the server owns: the SDK's tool
definition is accepted, kept in the session and answered with a normal turn.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from agents import function_tool
from agents.realtime import RealtimeAgent, RealtimeRunner, RealtimeSession

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import WIRE_RATE, chunks, silence
from tests.speech_audio import SENTENCE, speak, words

pytestmark = pytest.mark.system

pytest.importorskip("piper")
pytest.importorskip("faster_whisper")

KEY = "sk-agents"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), api_keys=f"{KEY}:agents") as live:
        yield live


@function_tool
def get_weather(city: str) -> str:
    """Today's weather in a city."""
    return f"It is sunny in {city}."


@dataclass
class Seen:
    """What the application received from the SDK's session iterator."""

    types: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    raw: list[dict[str, Any]] = field(default_factory=list)  # the server events, as the SDK saw them
    assistant: list[str] = field(default_factory=list)  # transcripts of completed assistant turns
    user: list[str] = field(default_factory=list)  # transcripts/text of user items
    audio_bytes: int = 0
    turns_ended: int = 0


def _text_of(item: Any) -> str:
    parts = []
    for part in getattr(item, "content", []) or []:
        parts.append(getattr(part, "transcript", None) or getattr(part, "text", None) or "")
    return "".join(parts)


async def _pump(session: RealtimeSession, seen: Seen) -> None:
    async for event in session:
        seen.types.append(event.type)
        if event.type == "error":
            seen.errors.append(event.error)
        elif event.type == "raw_model_event":
            data = event.data
            if data.type == "raw_server_event":
                seen.raw.append(data.data)
            elif data.type in ("error", "exception"):
                seen.errors.append(data)
        elif event.type == "audio":
            seen.audio_bytes += len(event.audio.data)
        elif event.type == "agent_end":
            seen.turns_ended += 1
        elif event.type == "history_updated":
            seen.assistant = [
                _text_of(i) for i in event.history if getattr(i, "role", None) == "assistant" and _text_of(i)
            ]
            seen.user = [_text_of(i) for i in event.history if getattr(i, "role", None) == "user"]


@asynccontextmanager
async def agent_session(
    server: LiveServer, agent: RealtimeAgent[Any], settings: dict[str, Any] | None = None
) -> AsyncIterator[tuple[RealtimeSession, Seen]]:
    runner = RealtimeRunner(agent)
    model_config: dict[str, Any] = {
        "url": f"{server.ws_url}/v1/realtime?model=gpt-realtime",
        "api_key": KEY,
    }
    if settings is not None:
        model_config["initial_model_settings"] = settings
    session = await runner.run(model_config=model_config)  # type: ignore[arg-type]
    seen = Seen()
    async with session:
        pump = asyncio.create_task(_pump(session, seen), name="agents-sdk-pump")
        try:
            yield session, seen
        finally:
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)


async def until(check: Any, seen: Seen, within_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"not reached in {within_s} s; types {seen.types[-30:]}, errors {seen.errors}"
            )
        await asyncio.sleep(0.05)


def assert_clean(seen: Seen) -> None:
    assert seen.errors == [], seen.errors
    assert "error" not in seen.types
    assert not [e for e in seen.raw if str(e.get("type", "")).startswith("omni.")]
    assert not [e for e in seen.raw if e.get("type") == "error"], seen.raw


async def test_text_turn(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai.agents")
    agent: RealtimeAgent[Any] = RealtimeAgent(name="assistant", instructions="Answer briefly.")
    async with agent_session(server, agent, {"output_modalities": ["text"]}) as (session, seen):
        await until(lambda: "session.updated" in [e.get("type") for e in seen.raw], seen, 20)
        await session.send_message("hello from the agents sdk")
        await until(lambda: seen.turns_ended >= 1 and seen.assistant, seen, 30)
        assert_clean(seen)
        assert seen.assistant[-1] == "You said: hello from the agents sdk", seen.assistant
        assert seen.raw[0]["type"] == "session.created"
    errors = [r for r in caplog.records if r.name.startswith("openai.agents") and r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_spoken_turn(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai.agents")
    agent: RealtimeAgent[Any] = RealtimeAgent(name="assistant", instructions="Answer briefly.")
    settings = {
        "turn_detection": {"type": "server_vad", "silence_duration_ms": 500},
        "input_audio_transcription": {"model": "whisper-1", "language": "en"},
    }
    async with agent_session(server, agent, settings) as (session, seen):
        await until(lambda: "session.updated" in [e.get("type") for e in seen.raw], seen, 20)
        speech = np.concatenate([silence(0.5), speak(SENTENCE, WIRE_RATE), silence(1.5)])
        for chunk in chunks(speech, 40):
            pcm = np.rint(np.clip(chunk, -1, 1) * 32767).astype("<i2").tobytes()
            await session.send_audio(pcm)
            await asyncio.sleep(0.01)  # faster than real time, paced enough for the VAD's frames
        await until(lambda: seen.turns_ended >= 1 and seen.assistant, seen, 90)
        await until(lambda: seen.user and seen.user[-1], seen, 30)  # the input transcription
        assert_clean(seen)
        assert words(seen.user[-1]) == words(SENTENCE), seen.user
        assert words(seen.assistant[-1]) == words("You said: " + SENTENCE), seen.assistant
        assert seen.audio_bytes > 2 * WIRE_RATE  # more than a second of PCM16 answer audio
        kinds = [e.get("type") for e in seen.raw]
        assert "input_audio_buffer.speech_started" in kinds and "input_audio_buffer.committed" in kinds
    errors = [r for r in caplog.records if r.name.startswith("openai.agents") and r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_session_with_a_function_tool(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="openai.agents")
    agent: RealtimeAgent[Any] = RealtimeAgent(
        name="assistant", instructions="Use tools when asked.", tools=[get_weather]
    )
    async with agent_session(server, agent, {"output_modalities": ["text"]}) as (session, seen):
        await until(lambda: "session.updated" in [e.get("type") for e in seen.raw], seen, 20)
        updated = [e for e in seen.raw if e.get("type") == "session.updated"][-1]
        tools = updated["session"]["tools"]
        assert [t["name"] for t in tools] == ["get_weather"], tools
        assert tools[0]["type"] == "function"
        assert tools[0]["parameters"]["properties"]["city"]["type"] == "string"
        await session.send_message("what is the weather in Paris?")
        await until(lambda: seen.turns_ended >= 1 and seen.assistant, seen, 30)
        assert_clean(seen)
        assert seen.assistant[-1] == "You said: what is the weather in Paris?", seen.assistant
    errors = [r for r in caplog.records if r.name.startswith("openai.agents") and r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
