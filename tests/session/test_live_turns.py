"""The core's side of a pipeline that detects turns itself (`SpeechStarted` / `SpeechStopped` /
`Transcript` from the live request): the same Realtime events server VAD gives, the user item
holding exactly the audio between the two positions. Sans-I/O, strict SDK schema checks."""

from __future__ import annotations

import numpy as np

from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import LiveAudio, StartResponse
from session.realtime.ids import SequentialIds
from tests.session.realtime_harness import assert_valid_server_event, pcm16_b64

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
