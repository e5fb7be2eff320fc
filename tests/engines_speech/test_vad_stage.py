"""`speech.vad` as a pipeline stage: a session's live request appends its audio, the stage
answers with `VoiceActivity`; sessions stepped together are scored in shared ONNX calls and
get exactly the probabilities each would get alone."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engines.speech.vad import FRAME_SAMPLES, SileroVad
from engines.speech.vad_stage import VadEngine
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput, TurnControl, VoiceActivity
from runtime.spec import parse_pipeline

pytestmark = pytest.mark.system

PIPELINE = """
name: vad-only
entry: respond
entries: {live: vad}
stages:
  - {name: respond, engine: null.audio}
  - name: vad
    engine: "engines.speech.vad_stage:VadEngine"
    budget: {max_concurrency: 64, max_batch: 64}
"""


async def test_sessions_in_one_step_get_their_own_probabilities(sentence16k: np.ndarray) -> None:
    n = sentence16k.size // FRAME_SAMPLES * FRAME_SAMPLES
    speech = sentence16k[:n]
    quiet = np.zeros(n, dtype=np.float32)
    expected = {
        "speech": SileroVad().new_stream().speech_probs(speech),
        "quiet": SileroVad().new_stream().speech_probs(quiet),
    }
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        assert orch.capabilities().voice_activity
        handles = {
            name: await orch.submit({"live": True}, session_key=name, entry="vad") for name in expected
        }
        # Uneven pieces (not whole frames): the stage carries the remainder to the next step.
        for start in range(0, n, 1000):
            for name, audio in (("speech", speech), ("quiet", quiet)):
                piece = audio[start : start + 1000]
                assert await orch.append_input(handles[name].request_id, AudioInput(piece, 16000))
        got: dict[str, list[float]] = {name: [] for name in expected}
        for name, handle in handles.items():
            async with asyncio.timeout(60):
                async for out in handle:
                    assert isinstance(out, VoiceActivity)
                    assert out.start_sample == len(got[name]) * FRAME_SAMPLES  # contiguous, in order
                    got[name].extend(out.probs)
                    if len(got[name]) == len(expected[name]):
                        break
        for name in expected:
            np.testing.assert_allclose(got[name], expected[name], atol=1e-5)
        stats = orch.metrics.snapshot()["stages"]["vad"]["batch"]
        assert stats["max"] >= 2  # both sessions went through in shared steps
    finally:
        await orch.close()


async def test_clear_resets_the_stream_state(sentence16k: np.ndarray) -> None:
    frames = sentence16k[: 40 * FRAME_SAMPLES]
    fresh = SileroVad().new_stream().speech_probs(frames[: 10 * FRAME_SAMPLES])
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        handle = await orch.submit({"live": True}, entry="vad")
        rid = handle.request_id
        assert await orch.append_input(rid, AudioInput(frames, 16000))
        assert await orch.append_input(rid, TurnControl("clear"))
        assert await orch.append_input(rid, AudioInput(frames[: 10 * FRAME_SAMPLES], 16000))
        # Frames not yet scored when the clear came are forgotten with it (as the buffer is);
        # what follows is scored from a fresh state, at its place on the request's timeline.
        after: list[float] = []
        async with asyncio.timeout(60):
            async for out in handle:
                assert isinstance(out, VoiceActivity)
                if out.start_sample >= 40 * FRAME_SAMPLES:
                    assert out.start_sample == (40 + len(after)) * FRAME_SAMPLES
                    after.extend(out.probs)
                if len(after) == 10:
                    break
        np.testing.assert_allclose(after, fresh, atol=1e-5)  # as if the stream were new
        assert await orch.cancel(rid)
    finally:
        await orch.close()


def test_wrong_rate_is_refused_before_any_state_changes() -> None:
    engine = VadEngine({})
    engine.load()
    from runtime.engine import EngineRequest, StepInput

    good, bad = engine.start(EngineRequest("a", {})), engine.start(EngineRequest("b", {}))
    with pytest.raises(ValueError, match="takes 16000 Hz audio, got 24000"):
        engine.step(
            [
                StepInput(good, inputs=[AudioInput(np.zeros(512, np.float32), 16000)]),
                StepInput(bad, inputs=[AudioInput(np.zeros(512, np.float32), 24000)]),
            ]
        )
    assert good.next_sample == 0 and not good.pending  # the batch's other request untouched
