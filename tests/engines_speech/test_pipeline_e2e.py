"""The voice-cascade and null pipelines end to end through the orchestrator."""

from __future__ import annotations

import time

import numpy as np
import pytest

from runtime.payloads import AudioChunk, Payload, TextDelta, Transcript
from runtime.spec import load_pipeline
from tests.engines_speech.conftest import SENTENCE, words
from tests.timing import slack

pytestmark = pytest.mark.system

orchestrator = pytest.importorskip("runtime.orchestrator")
pytest.importorskip("piper")
pytest.importorskip("faster_whisper")


def echo_cascade() -> orchestrator.Orchestrator:
    """voice-cascade with the echo responder ("You said: ..."), for exact answers."""
    spec = load_pipeline("voice-cascade").with_stage("speech.responder", options={"responder": "echo"})
    return orchestrator.Orchestrator.from_spec(spec)


def _of(outputs: list[Payload], kind: type) -> list[Payload]:
    return [p for p in outputs if isinstance(p, kind)]


async def test_voice_cascade_audio_in_audio_out(sentence16k: np.ndarray) -> None:
    async with echo_cascade() as orch:
        t0 = time.monotonic()
        handle = await orch.submit({"audio": sentence16k}, session_key="s1")
        outputs: list[Payload] = []
        first_audio_s = None
        async for out in handle:
            if isinstance(out, AudioChunk) and first_audio_s is None:
                first_audio_s = time.monotonic() - t0
            outputs.append(out)
    status = outputs.pop()
    assert status.status == "completed", status.error
    # Whisper's casing of the first word varies with the onnxruntime/ctranslate2 build: compare words.
    (transcript,) = _of(outputs, Transcript)
    assert words(transcript.text) == words(SENTENCE)
    assert "".join(d.text for d in _of(outputs, TextDelta)) == f"You said: {transcript.text}"
    chunks = _of(outputs, AudioChunk)
    assert len(chunks) >= 2 and all(c.sample_rate == 22050 for c in chunks)
    audio = np.concatenate([c.samples for c in chunks])
    assert 2.5 < audio.size / 22050 < 7.0
    assert float(np.sqrt(np.mean(audio**2))) > 0.05
    assert set(status.timings) == {"asr", "responder", "tts"}
    print(f"voice-cascade: audio submitted -> first audio chunk {first_audio_s * 1000:.0f} ms")


async def test_voice_cascade_text_only(sentence16k: np.ndarray) -> None:
    async with echo_cascade() as orch:
        handle = await orch.submit({"text": "hello there", "modalities": ["text"]})
        outputs, status = await handle.collect()
    assert status.status == "completed", status.error
    assert _of(outputs, AudioChunk) == [] and _of(outputs, Transcript) == []
    assert "".join(d.text for d in _of(outputs, TextDelta)) == "You said: hello there"


async def test_voice_cascade_cancel_mid_reply() -> None:
    text = ", ".join(["one more clause to speak"] * 20) + "."
    async with echo_cascade() as orch:
        handle = await orch.submit({"text": text})
        got_audio = 0
        async for out in handle:
            if isinstance(out, AudioChunk):
                got_audio += 1
                if got_audio == 1:
                    assert await orch.cancel(handle.request_id)
        status = handle.status
    assert status is not None and status.status == "cancelled"
    assert got_audio < 20  # it stopped long before all clauses were spoken


@pytest.mark.timing
async def test_null_pipeline() -> None:
    async with orchestrator.Orchestrator.from_pipeline("null") as orch:
        t0 = time.monotonic()
        handles = [await orch.submit({}, session_key=f"s{i}") for i in range(20)]
        results = [await h.collect() for h in handles]
        elapsed = time.monotonic() - t0
    for outputs, status in results:
        assert status.status == "completed", status.error
        assert len(_of(outputs, Transcript)) == 1 and len(_of(outputs, TextDelta)) == 1
        chunks = _of(outputs, AudioChunk)
        assert len(chunks) == 50 and all(c.samples.size == 960 and c.sample_rate == 24000 for c in chunks)
    # 200 ms delay, then 2 s of audio released in real time (40 ms chunks); concurrent requests
    # do not queue behind each other.
    assert 2.1 <= elapsed < slack(3.5)
