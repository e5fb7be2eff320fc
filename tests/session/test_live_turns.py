"""The core's side of a pipeline that detects turns itself (`SpeechStarted` / `SpeechStopped` /
`Transcript` from the live request): the same Realtime events server VAD gives, the user item
holding exactly the audio between the two positions. Sans-I/O, strict SDK schema checks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput, Conditioning
from runtime.registry import register_engine, unregister_engine
from runtime.spec import parse_pipeline
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import LiveAudio, LiveUpdate, StartResponse
from session.realtime.ids import SequentialIds
from session.voice.live_request import LiveEntry, LiveRequest
from tests.session.realtime_harness import assert_valid_server_event, pcm16_b64

pytestmark = pytest.mark.system

RATE = 24_000


def test_pipeline_turns_become_realtime_events() -> None:
    core = RealtimeSessionCore(CoreOptions(live_responses=True, new_id=SequentialIds()))
    core.start(0.0, 1_700_000_000)
    core.config.transcription = None
    # 1 s of silence, 1 s of "speech" (a tone), 0.5 s of silence: 24 kHz PCM16 appends.
    audio = np.concatenate(
        [np.zeros(RATE), 0.3 * np.sin(np.arange(RATE) / 5.0), np.zeros(RATE // 2)]
    ).astype(np.float32)
    effects = []
    for k in range(0, audio.size, RATE // 25):
        out = core.handle_client_event(
            {"type": "input_audio_buffer.append", "audio": pcm16_b64(audio[k : k + RATE // 25])}, 0.1
        )
        effects += out.effects
    assert sum(e.samples.size for e in effects if isinstance(e, LiveAudio)) == audio.size

    events = core.on_live_speech_started(16_000, 1.0).events  # the pipeline: speech at 1000 ms
    events += core.on_live_speech_stopped(32_000, 2.0).events  # ... until 2000 ms
    for event in events:
        assert_valid_server_event(event)
    types = [e["type"] for e in events]
    assert types == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
        "conversation.item.added",
        "conversation.item.done",
    ]
    assert events[0]["audio_start_ms"] == 1000 and events[1]["audio_end_ms"] == 2000
    item_id = events[0]["item_id"]
    assert events[1]["item_id"] == events[2]["item_id"] == item_id
    item = core.conversation.get(item_id)
    samples = item.audio_16k
    assert samples is not None and abs(samples.size - 16_000) <= 16  # exactly the speech second
    assert float(np.abs(samples).max()) > 0.2  # the tone, not the silence around it
    assert core.last_user_item_id == item_id
    # The pipeline's transcript of the user's turn, and no response of the session's own.
    out = core.on_input_transcript(item_id, "hello", final=True, now=2.1)
    assert not any(isinstance(e, StartResponse) for e in out.effects)
    assert core.conversation.get(item_id).content[0].heard == "hello"


class RecordingLive(Engine):
    """A live entry that records what reaches it (test double for a duplex model's stage)."""

    provides = frozenset({"responses"})
    seen: ClassVar[list[Any]] = []
    three: ClassVar[threading.Event] = threading.Event()  # set once three inputs arrived

    def start(self, request: EngineRequest) -> dict[str, Any]:
        return {}

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        for item in batch:
            RecordingLive.seen.extend([*item.inputs, *item.updates])
        if len(RecordingLive.seen) >= 3:
            RecordingLive.three.set()
        return [StepOutput(wait_for_input=True) for _ in batch]


async def test_session_update_reaches_the_live_request_as_conditioning() -> None:
    register_engine("test.recording_live", RecordingLive)
    spec = parse_pipeline(
        "name: rec\nentry: live\nentries: {live: live}\ninput_rate: 24000\n"
        "stages:\n  - {name: live, engine: test.recording_live}\n",
    )
    orch = Orchestrator.from_spec(spec)
    await orch.start()
    core = RealtimeSessionCore(CoreOptions(live_responses=True, new_id=SequentialIds()))
    core.start(0.0, 1_700_000_000)
    live = LiveRequest(orch, LiveEntry("live", RATE), core, lambda out: None, lambda: 0.0, session_key="s")
    task = asyncio.create_task(live.run())
    try:
        tone = pcm16_b64(np.full(RATE // 10, 0.1, np.float32))
        for raw in (
            {"type": "input_audio_buffer.append", "audio": tone},
            {"type": "session.update", "session": {"type": "realtime", "instructions": "Be brief."}},
            {"type": "input_audio_buffer.append", "audio": tone},
        ):
            for effect in core.handle_client_event(raw, 0.1).effects:
                if isinstance(effect, LiveAudio):
                    live.push(effect)
                elif isinstance(effect, LiveUpdate):
                    live.update(effect.values)
        assert await asyncio.to_thread(RecordingLive.three.wait, 10)
        # (A step gets its inputs and its updates as two lists: within one step the runtime
        # does not say which came first, so only what arrived is checked.)
        audio = [x for x in RecordingLive.seen if isinstance(x, AudioInput)]
        updates = [x.values for x in RecordingLive.seen if isinstance(x, Conditioning)]
        assert sum(a.samples.size for a in audio) == 2 * (RATE // 10) and audio[0].sample_rate == RATE
        assert updates == [{"instructions": "Be brief."}]  # only what changed
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await orch.close()
        unregister_engine("test.recording_live")
