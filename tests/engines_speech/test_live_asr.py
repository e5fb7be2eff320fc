"""`speech.live_asr` after `speech.vad` on a live request: the user's words while they speak
(deltas two passes agree on), and a final transcript of a stretch the session names, all from
the audio appended to the one live request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from engines.speech.live_asr import agreed_words
from engines.speech.vad import FRAME_SAMPLES
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput, Transcript, TurnControl, VoiceActivity
from runtime.spec import parse_pipeline
from tests.engines_speech.test_vad_stage import PIPELINE as VAD_ONLY
from tests.speech_audio import words

pytestmark = pytest.mark.system

# The VAD-only pipeline of the VAD stage's tests, with the live ASR after its vad stage.
PIPELINE = VAD_ONLY.replace("name: vad-only", "name: live-asr") + """\
  - name: live_asr
    engine: "engines.speech.live_asr:LiveAsrEngine"
    options: {partial_interval_ms: 500}
    budget: {max_concurrency: 64, max_batch: 1, workers: 1}
edges:
  - {from: vad, to: live_asr, mode: async_chunk, chunk: {first: 1, steady: 1, left_context: 0}}
"""

LONG = "The quick brown fox jumps over the lazy dog, then the five boxing wizards jump quickly."


def test_agreed_words_ignore_case_and_punctuation() -> None:
    got = agreed_words(["The", "quick", "brown,"], ["the", "quick", "Brown", "fox"])
    assert got == ["the", "quick", "Brown"]
    assert agreed_words(["a", "b"], ["a", "c", "b"]) == ["a"]
    assert agreed_words([], ["a"]) == []


async def _live(orch: Orchestrator) -> tuple[str, asyncio.Queue[object]]:
    handle = await orch.submit({"live": True}, session_key="s1", entry="vad")
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def read() -> None:
        async for out in handle:
            await queue.put(out)

    asyncio.get_running_loop().create_task(read())
    return handle.request_id, queue


async def _next_transcript(queue: asyncio.Queue[object]) -> Transcript:
    async with asyncio.timeout(60):
        while True:
            out = await queue.get()
            if isinstance(out, Transcript):
                return out
            assert isinstance(out, VoiceActivity), out


async def test_partials_stream_while_speaking_then_a_final_of_the_named_stretch(
    speak16k: Callable[[str], np.ndarray],
) -> None:
    speech = speak16k(LONG)
    lead = np.zeros(8 * FRAME_SAMPLES, dtype=np.float32)
    audio = np.concatenate([lead, speech, np.zeros(16 * FRAME_SAMPLES, dtype=np.float32)])
    audio = audio[: audio.size // FRAME_SAMPLES * FRAME_SAMPLES]
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        caps = orch.capabilities()
        assert caps.voice_activity and caps.live_transcribes_input
        rid, queue = await _live(orch)
        start = 0
        marks = TurnControl("speech_started", params={"ref": "item_1", "start": start, "partials": True})
        assert await orch.append_input(rid, marks)
        # Real time in 100 ms pieces (partials are made while the speaker is still speaking).
        step = 1600
        deltas: list[str] = []
        for at in range(0, audio.size, step):
            assert await orch.append_input(rid, AudioInput(audio[at : at + step], 16000))
            await asyncio.sleep(0.1)
            while not queue.empty():
                out = queue.get_nowait()
                if isinstance(out, Transcript):
                    assert out.ref == "item_1" and not out.final
                    deltas.append(out.text)
        end = audio.size
        assert await orch.append_input(
            rid, TurnControl("transcribe", params={"ref": "item_1@end", "start": start, "end": end})
        )
        while True:
            final = await _next_transcript(queue)
            if final.final:
                break
            deltas.append(final.text)
        assert final.ref == "item_1@end"
        assert words(final.text) == words(LONG)
        # Several deltas arrived during speech, and they are the final's leading words.
        assert len(deltas) >= 2, deltas
        streamed = words("".join(deltas))
        assert len(streamed) >= 4 and streamed == words(final.text)[: len(streamed)], (deltas, final.text)
    finally:
        await orch.close()


async def test_a_stretch_named_before_its_audio_arrives_waits_for_it(
    sentence16k: np.ndarray,
) -> None:
    audio = sentence16k[: sentence16k.size // FRAME_SAMPLES * FRAME_SAMPLES]
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        rid, queue = await _live(orch)
        half = audio.size // 2 // FRAME_SAMPLES * FRAME_SAMPLES
        assert await orch.append_input(rid, AudioInput(audio[:half], 16000))
        ask = TurnControl("transcribe", params={"ref": "k", "start": 0, "end": audio.size})
        assert await orch.append_input(rid, ask)
        await asyncio.sleep(0.5)
        assert all(not isinstance(out, Transcript) for out in list(queue._queue))  # type: ignore[attr-defined]
        assert await orch.append_input(rid, AudioInput(audio[half:], 16000))
        final = await _next_transcript(queue)
        assert final.ref == "k" and final.final
        assert words(final.text) == words("The quick brown fox jumps over the lazy dog.")
    finally:
        await orch.close()


async def test_clear_forgets_the_utterance_and_its_audio(sentence16k: np.ndarray) -> None:
    audio = sentence16k[: sentence16k.size // FRAME_SAMPLES * FRAME_SAMPLES]
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        rid, queue = await _live(orch)
        assert await orch.append_input(rid, AudioInput(audio, 16000))
        assert await orch.append_input(rid, TurnControl("clear"))
        # Nothing before the clear is held: the stretch transcribes as nothing.
        ask = TurnControl("transcribe", params={"ref": "k", "start": 0, "end": audio.size})
        assert await orch.append_input(rid, ask)
        final = await _next_transcript(queue)
        assert final.ref == "k" and final.text == ""
    finally:
        await orch.close()


async def test_a_turn_marked_after_its_audio_went_by_is_transcribed_whole(
    sentence16k: np.ndarray,
) -> None:
    """The session marks a turn only once the VAD's scores came back, so a client faster than
    real time has appended seconds more by then (4 s of silence here, more than the 3 s idle
    window): the final transcript still has every word from the turn's start."""
    tail = np.zeros(4 * 16000, dtype=np.float32)
    audio = np.concatenate([np.zeros(8 * FRAME_SAMPLES, dtype=np.float32), sentence16k, tail])
    audio = audio[: audio.size // FRAME_SAMPLES * FRAME_SAMPLES]
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        rid, queue = await _live(orch)
        for at in range(0, audio.size, 8000):
            assert await orch.append_input(rid, AudioInput(audio[at : at + 8000], 16000))
            await asyncio.sleep(0.05)  # 10x real time: the stages step on pieces of it
        scored = 0
        async with asyncio.timeout(60):  # every frame went through both stages before the marks
            while scored < audio.size // FRAME_SAMPLES:
                out = await queue.get()
                assert isinstance(out, VoiceActivity)
                scored += len(out.probs)
        await asyncio.sleep(0.2)
        started = TurnControl("speech_started", params={"ref": "i1", "start": 0, "partials": False})
        assert await orch.append_input(rid, started)
        ask = TurnControl("transcribe", params={"ref": "i1@end", "start": 0, "end": audio.size})
        assert await orch.append_input(rid, ask)
        final = await _next_transcript(queue)
        assert final.ref == "i1@end" and final.final
        assert words(final.text) == words("The quick brown fox jumps over the lazy dog.")
    finally:
        await orch.close()
