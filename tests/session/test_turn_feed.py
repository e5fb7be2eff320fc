"""The end-of-turn stage gets a session's audio only while the session uses semantic_vad
(`session.voice.turn_feed`: the live request opens the pipeline's gated edge into it). Real
Silero VAD stage on the live request; the end-of-turn stage is a recorder (what reaches it is
what is checked, not a model's answer)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput
from runtime.registry import register_engine, unregister_engine
from runtime.spec import parse_pipeline
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import CoreOutput, DetectSpeech, LiveControl
from session.realtime.ids import SequentialIds
from session.voice.live_request import LiveEntry, LiveRequest
from tests.session.realtime_harness import pcm16_b64

pytestmark = pytest.mark.system

RATE = 24_000
PIPELINE = """
name: feed
entry: vad
entries: {live: vad}
stages:
  - {name: vad, engine: "engines.speech.vad_stage:VadEngine"}
  - {name: end_of_turn, engine: test.turn_recorder}
edges:
  - {from: vad, to: end_of_turn, gated: true}
"""


class TurnRecorder(Engine):
    """An end-of-turn stage that records the audio reaching it (samples per step)."""

    provides = frozenset({"end_of_turn"})
    samples: ClassVar[list[int]] = []
    lock = threading.Lock()

    def start(self, request: EngineRequest) -> dict[str, Any]:
        return {}

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        for item in batch:
            for chunk in item.chunks:
                for payload in chunk.items:
                    if isinstance(payload, AudioInput):
                        with TurnRecorder.lock:
                            TurnRecorder.samples.append(len(payload.samples))
        return [StepOutput(wait_for_input=True) for _ in batch]


@pytest.fixture(autouse=True)
def recorder() -> Iterator[None]:
    register_engine("test.turn_recorder", TurnRecorder)
    TurnRecorder.samples.clear()
    yield
    unregister_engine("test.turn_recorder")


def received() -> int:
    with TurnRecorder.lock:
        return sum(TurnRecorder.samples)


async def test_only_a_semantic_vad_session_feeds_the_end_of_turn_stage() -> None:
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE))
    await orch.start()
    gate = orch.capabilities().end_of_turn_gate
    assert gate == ("vad", "end_of_turn")
    core = RealtimeSessionCore(CoreOptions(scores_turn_ends=True, new_id=SequentialIds()))
    core.start(0.0, 1_700_000_000)

    def apply(out: CoreOutput) -> None:
        for effect in out.effects:
            if isinstance(effect, DetectSpeech):
                live.push_frames(effect)
            elif isinstance(effect, LiveControl):
                live.control(effect)

    live = LiveRequest(
        orch,
        LiveEntry("vad", 16_000, frames=True, turn_gate=gate),
        core,
        apply,
        time.monotonic,
        session_key="s",
    )
    task = asyncio.create_task(live.run())

    async def speak(seconds: float) -> None:
        """Noise-like audio in 40 ms appends, then wait until the VAD has scored all of it."""
        rng = np.random.default_rng(0)
        for _ in range(round(seconds * 25)):
            chunk = (0.05 * rng.standard_normal(RATE // 25)).astype(np.float32)
            apply(
                core.handle_client_event(
                    {"type": "input_audio_buffer.append", "audio": pcm16_b64(chunk)}, 0.1
                )
            )
        for _ in range(1000):  # up to 20 s, until the VAD has scored it (VoiceActivity came back)
            if not live.queued_bytes:
                break
            await asyncio.sleep(0.02)
        assert live.queued_bytes == 0
        await asyncio.sleep(0.2)  # what the VAD handed on has reached the next stage

    def turn_detection(td: dict[str, Any]) -> None:
        update = {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": td}}},
        }
        apply(core.handle_client_event(update, 0.1))

    try:
        await speak(1.0)  # server_vad (the default)
        assert received() == 0
        assert live.turn_feed is not None and live.turn_feed.open_for is None
        turn_detection({"type": "semantic_vad", "eagerness": "high"})
        await speak(1.0)
        fed = received()
        assert 14_000 <= fed <= 16_000 + 512  # the second second, whole VAD frames
        assert live.turn_feed.open_for == live.request_id
        turn_detection({"type": "server_vad"})
        await speak(1.0)
        assert received() == fed  # closed again: nothing more
        assert live.turn_feed.switches == 2
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await orch.close()
