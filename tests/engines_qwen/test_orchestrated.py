"""The qwen3-omni-tiny pipeline through the runtime orchestrator (async_chunk and full edges)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pytest

from engines.qwen3_omni.stages import TalkerEngine, ThinkerEngine
from runtime.engine import EngineRequest, StepInput, StepOutput
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioChunk, CodecCodes, TextDelta
from runtime.progress import RequestStatus
from runtime.registry import register_engine, unregister_engine
from runtime.spec import PipelineSpec, load_pipeline
from tests.engines_qwen.conftest import speech_like
from tests.engines_qwen.driver import Engines, run_pipeline

pytestmark = pytest.mark.system

FULL_EDGES = {"thinker->talker": "full", "talker->code2wav": "full"}
GAIN = 100_000.0  # what the tiny pipeline YAML sets
LONG = {
    "text": "Tell me a story.",
    "greedy": True,
    "seed": 0,
    "max_tokens": 20,
    "min_tokens": 20,
    "max_frames": 60,
    "min_frames": 60,
}


class TapTalker(TalkerEngine):
    """The real talker, recording the codes it sends downstream (they are not client-visible)."""

    codes: ClassVar[dict[str, list[np.ndarray]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = super().step(batch)
        with self._lock:
            for item, out in zip(batch, outputs, strict=True):
                frames = [p.codes for p in out.downstream if isinstance(p, CodecCodes)]
                self.codes.setdefault(item.state.request_id, []).extend(frames)
        return outputs


class TapThinker(ThinkerEngine):
    """The real thinker, recording its prefill counters per request."""

    prefill: ClassVar[dict[str, dict[str, int]]] = {}

    def start(self, request: EngineRequest) -> Any:
        state = super().start(request)
        self.prefill[request.request_id] = dict(self.stats)
        return state


TAPS = {"thinker": ("test.qwen_tap_thinker", TapThinker), "talker": ("test.qwen_tap_talker", TapTalker)}


def tapped_spec() -> PipelineSpec:
    spec = load_pipeline("qwen3-omni-tiny")
    stages = tuple(
        s.model_copy(update={"engine": TAPS[s.name][0]}) if s.name in TAPS else s for s in spec.stages
    )
    return spec.model_copy(update={"stages": stages})


@dataclass
class Result:
    text: str = ""
    audio: list[np.ndarray] = field(default_factory=list)
    status: RequestStatus | None = None
    codes: np.ndarray | None = None

    @property
    def samples(self) -> np.ndarray:
        return np.concatenate(self.audio) if self.audio else np.zeros(0, dtype=np.float32)


@pytest.fixture
async def orch() -> AsyncIterator[Orchestrator]:
    for name, cls in TAPS.values():
        register_engine(name, cls)
    TapTalker.codes.clear()
    TapThinker.prefill.clear()
    orchestrator = Orchestrator.from_spec(tapped_spec())
    await orchestrator.start()
    try:
        yield orchestrator
    finally:
        await orchestrator.close()
        for name, _cls in TAPS.values():
            unregister_engine(name)


async def collect(
    orch: Orchestrator,
    params: Mapping[str, Any],
    *,
    edge_modes: Mapping[str, str] | None = None,
    session_key: str | None = None,
    request_id: str | None = None,
) -> Result:
    handle = await orch.submit(params, edge_modes=edge_modes, session_key=session_key, request_id=request_id)
    result = Result()
    async for out in handle:
        if isinstance(out, TextDelta):
            result.text += out.text
        elif isinstance(out, AudioChunk):
            assert out.sample_rate == 24_000 and out.samples.dtype == np.float32
            result.audio.append(out.samples)
        elif isinstance(out, RequestStatus):
            result.status = out
    assert result.status is not None and result.status.status == "completed", result.status
    frames = TapTalker.codes.get(handle.request_id, [])
    result.codes = np.concatenate(frames) if frames else np.zeros((0, 16), dtype=np.int64)
    return result


def rel_rms(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref**2)))


async def test_async_and_full_edges_give_the_same_text_codes_and_audio(
    orch: Orchestrator, engines: Engines
) -> None:
    """Greedy, same seed. Text and the 60×16 codes are identical. Audio: the async run's
    chunks (4, 25, 25, 6 frames) concatenate to exactly the full decode's 1920·60 − 555
    samples; chunks 0–1 (context back to frame 0) match to float rounding, later chunks (25
    frames of context < the tiny model's ~149-frame receptive field) within 3 % relative RMS
    each and 2 % overall (measured ~0.35–0.9 %; see test_engines for the derivation)."""
    chunked = await collect(orch, LONG, request_id="async")
    full = await collect(orch, LONG, edge_modes=FULL_EDGES, request_id="full")
    assert chunked.text and chunked.text == full.text
    assert chunked.codes is not None and full.codes is not None
    assert chunked.codes.shape == (60, 16)
    np.testing.assert_array_equal(chunked.codes, full.codes)
    assert len(full.audio) == 1
    assert [a.size for a in chunked.audio] == [4 * 1920 - 555, 25 * 1920, 25 * 1920, 6 * 1920]
    a, f = chunked.samples, full.samples
    assert a.size == f.size == 60 * 1920 - 555
    assert 0.01 < np.abs(f).max() <= 1.0  # gain makes the random-weight waveform measurable
    bounds = np.cumsum([0] + [c.size for c in chunked.audio])
    for i in range(len(chunked.audio)):
        err = rel_rms(a[bounds[i] : bounds[i + 1]], f[bounds[i] : bounds[i + 1]])
        assert err < (1e-5 if i < 2 else 0.03), (i, err)
    assert rel_rms(a, f) < 0.02

    # And the orchestrated run is the engines' own loop (tokens and codes bit-exact).
    direct = run_pipeline(engines, LONG)
    assert direct.text == chunked.text
    np.testing.assert_array_equal(direct.code_matrix, chunked.codes)
    np.testing.assert_allclose(direct.samples * GAIN, chunked.samples, rtol=1e-5, atol=1e-6)


async def test_concurrent_requests_match_their_sequential_runs(orch: Orchestrator) -> None:
    prompts = [
        {"text": "Hello", "greedy": True, "seed": 0, "max_tokens": 8, "min_tokens": 8, "max_frames": 16},
        {"text": "What time is it?", "greedy": True, "seed": 0, "max_tokens": 6, "max_frames": 15},
        {"audio": speech_like(1.0), "greedy": True, "seed": 0, "max_tokens": 6, "max_frames": 16},
    ]
    sequential = [await collect(orch, p, request_id=f"seq{i}") for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(collect(orch, p, request_id=f"par{i}") for i, p in enumerate(prompts)))
    for ref, got in zip(sequential, together, strict=True):
        assert got.text == ref.text
        assert got.codes is not None and ref.codes is not None
        np.testing.assert_array_equal(got.codes, ref.codes)
        np.testing.assert_allclose(got.samples, ref.samples, rtol=0, atol=1e-5)


async def test_session_turns_reuse_the_thinker_cache(orch: Orchestrator) -> None:
    turn1 = {"text": "Hi, who are you?", "greedy": True, "seed": 0, "max_tokens": 6, "max_frames": 8}
    first = await collect(orch, turn1, session_key="sess", request_id="t1")
    assert TapThinker.prefill["t1"]["reused_tokens"] == 0
    turn2 = {
        **turn1,
        "text": "Go on.",
        "history": [{"role": "user", "text": "Hi, who are you?"}, {"role": "assistant", "text": first.text}],
    }
    warm = await collect(orch, turn2, session_key="sess", request_id="t2")
    cold = await collect(orch, turn2, request_id="t3")  # no session: full prefill
    t1, t2, t3 = (TapThinker.prefill[k] for k in ("t1", "t2", "t3"))
    assert t3["reused_tokens"] == 0
    prompt2_len = t3["prefill_tokens"]
    assert t2["reused_tokens"] > t1["prefill_tokens"]  # all of turn 1's prompt and part of its reply
    assert t2["prefill_tokens"] == prompt2_len - t2["reused_tokens"]
    assert warm.text == cold.text


async def test_cancel_mid_stream_stops_the_request(orch: Orchestrator) -> None:
    handle = await orch.submit({**LONG, "max_frames": 250, "min_frames": 250})
    seen_audio = False
    status = None
    async for out in handle:
        if isinstance(out, AudioChunk) and not seen_audio:
            seen_audio = True
            assert await orch.cancel(handle.request_id)
        elif isinstance(out, RequestStatus):
            status = out
    assert seen_audio and status is not None and status.status == "cancelled"
    assert not await orch.cancel(handle.request_id)
    assert orch.live_requests == []
