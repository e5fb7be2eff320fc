"""`speech.end_of_turn` (Smart Turn v3.2) as a stage after the VAD stage on a live request:
its features are Whisper's, sessions scored in one step get what each would get alone, a
finished sentence scores as finished and its first words cut mid-clause do not, and the scores
are the quantized graph's own on a CPU without VNNI too."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engines.speech.smart_turn import (
    LICENSE,
    PRECISE_AVX2,
    SmartTurn,
    log_mel,
    smart_turn_model_path,
    window,
)
from loadtest.turn_set import SENTENCES, finished_clip, paused_clip
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioInput, TurnControl, TurnScore
from runtime.spec import parse_pipeline

pytestmark = pytest.mark.system

PIPELINE = """
name: turns
entry: respond
entries: {live: vad}
stages:
  - {name: respond, engine: null.audio}
  - name: vad
    engine: "engines.speech.vad_stage:VadEngine"
    budget: {max_concurrency: 64, max_batch: 64}
  - name: end_of_turn
    engine: "engines.speech.turn_stage:EndOfTurnEngine"
    budget: {max_concurrency: 64, max_batch: 16, gather_ms: 10}
edges:
  - {from: vad, to: end_of_turn, mode: async_chunk, connector: inproc,
     chunk: {first: 1, steady: 1, left_context: 0}}
"""
SENTENCE, CUT = "The doctor said that I should drink more water every day.", 4
QUIET = 3200  # 200 ms of silence after the speech, as the session asks at a candidate pause


def test_features_are_whisper_log_mel() -> None:
    from transformers import WhisperFeatureExtractor

    rng = np.random.default_rng(1)
    audio = (0.1 * rng.standard_normal(40_000)).astype(np.float32)
    extractor = WhisperFeatureExtractor(chunk_length=8)
    expected = extractor(
        window(audio), sampling_rate=16000, padding="max_length", max_length=128000,
        truncation=True, do_normalize=True, return_tensors="np",
    ).input_features  # fmt: skip
    np.testing.assert_allclose(log_mel([audio]), expected, atol=1e-4)
    assert smart_turn_model_path().name == "smart-turn-v3.2-cpu.onnx" and "BSD-2" in LICENSE


def _with_silence(audio: np.ndarray, quiet: int = QUIET) -> np.ndarray:
    """Silence, `audio`, `quiet` samples of silence (200 ms by default); whole VAD frames (what
    the VAD stage hands on), on the int16 grid (what a client sends and the stage holds)."""
    audio = np.concatenate([np.zeros(4800, np.float32), audio, np.zeros(quiet, np.float32)])
    audio = audio[: len(audio) // 512 * 512]
    return (np.round(audio * 32768).clip(-32768, 32767) / 32768).astype(np.float32)


def test_scores_are_the_quantized_graphs_own_without_vnni_too() -> None:
    """Two finished sentences of the evaluation set (s05, s11) against the quantized graph run
    as written (no fused integer kernels: the reference). On an AVX2-only CPU onnxruntime's
    default u8s8 kernel saturates and scored these 0.07 and 0.02 against the reference's 0.67
    and 0.70 (docs/benchmarks.md, issue 30, tenth round); the precise kernel stays within 0.2
    of it and calls both finished, as the reference does. Elsewhere the setting is unused, and
    the fused integer kernels round differently from the reference too: with AVX-512 VNNI (AMD
    Zen 4) 0.68 and 0.52 against 0.64 and 0.78 (issue 30, twelfth round). Within 0.3 and both
    finished: saturation is 0.6 off."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    reference = ort.InferenceSession(str(smart_turn_model_path()), opts, providers=["CPUExecutionProvider"])
    model = SmartTurn()
    assert model._session.get_session_options().get_session_config_entry(PRECISE_AVX2) == "1"
    for k in (5, 11):
        audio = _with_silence(finished_clip(SENTENCES[k][0]).audio, 512)
        (ref,) = reference.run(None, {"input_features": log_mel([audio])})
        expected = float(np.asarray(ref).reshape(-1)[0])
        (got,) = model.scores([audio])
        assert abs(got - expected) < 0.3 and min(got, expected) >= 0.5, (k, got, expected)


async def test_sessions_scored_together_get_their_own_answers() -> None:
    finished = _with_silence(finished_clip(SENTENCE).audio)
    clip = paused_clip(SENTENCE, CUT, pause_s=1.0)
    unfinished = _with_silence(clip.audio[: clip.pause_at])
    model = SmartTurn()
    expected = dict(zip(("finished", "unfinished"), model.scores([finished, unfinished]), strict=True))
    assert expected["finished"] >= 0.5 > expected["unfinished"], expected

    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE, known_engines={"null.audio"}))
    await orch.start()
    try:
        assert orch.capabilities().end_of_turn
        audios = {"finished": finished, "unfinished": unfinished}
        handles = {name: await orch.submit({"live": True}, session_key=name, entry="vad") for name in audios}
        for name, audio in audios.items():
            whole = len(audio)
            rid = handles[name].request_id
            for start in range(0, whole, 1600):
                assert await orch.append_input(
                    rid, AudioInput(audio[start : min(start + 1600, whole)], 16000)
                )
            ask = TurnControl("score_turn", params={"ref": name, "start": 0, "end": whole})
            assert await orch.append_input(rid, ask)
        got: dict[str, float] = {}
        for name, handle in handles.items():
            async with asyncio.timeout(60):
                async for out in handle:
                    if isinstance(out, TurnScore):
                        assert out.ref == name
                        got[name] = out.probability
                        break
        for name in audios:
            assert abs(got[name] - expected[name]) < 1e-4, (got, expected)
        decisions = orch.metrics.stages["end_of_turn"].counters["decisions"]
        assert decisions == 2
    finally:
        await orch.close()


def test_audio_that_does_not_continue_what_is_held_replaces_it() -> None:
    from engines.speech.turn_stage import TurnState

    state = TurnState()
    state.add(0, np.full(512, 0.25, np.float32), limit=16_000)
    state.add(512, np.full(512, 0.5, np.float32), limit=16_000)
    assert state.held == 1024 and state.end == 1024
    np.testing.assert_allclose(state.span(0, 1024)[[0, 600]], [0.25, 0.5])
    # The gated edge was closed for a while (the session left semantic_vad and came back):
    # what comes next is another stretch of the timeline, and only it is held.
    state.add(8192, np.full(512, -0.5, np.float32), limit=16_000)
    assert state.held == 512 and state.end == 8704
    np.testing.assert_allclose(state.span(8192, 8704), -0.5)
