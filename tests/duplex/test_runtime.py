"""duplex-tiny through the orchestrator and the Engine contract: frames of several sessions per
step, state per session, cancellation, bad input, the silence clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engines.duplex.stages import DuplexEngine, DuplexState
from runtime.engine import EngineRequest, StepInput
from runtime.orchestrator import Orchestrator
from runtime.payloads import AudioChunk, AudioInput, Payload, ResponseDone, ResponseStarted, TextDelta
from runtime.progress import RequestHandle, RequestStatus
from runtime.spec import load_pipeline

pytestmark = pytest.mark.system

FRAME = 1920
RATE = 24000


def user_audio(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(FRAME * frames) * 0.1).astype(np.float32)


@pytest.fixture
async def orch() -> AsyncIterator[Orchestrator]:
    spec = load_pipeline("duplex-tiny")
    o = Orchestrator.from_spec(spec)
    await o.start()
    try:
        yield o
    finally:
        await o.close()


async def drain(handle: RequestHandle) -> tuple[list[Payload], RequestStatus]:
    return await handle.collect()


async def test_pipeline_yaml_names_the_engine() -> None:
    spec = load_pipeline("duplex-tiny")
    assert [s.engine for s in spec.stages] == ["duplex.moshi"]
    assert spec.stages[0].options["model"] == "tiny"
    assert spec.input_rate == 24000


async def test_capabilities_say_the_live_request_makes_responses(orch: Orchestrator) -> None:
    caps = orch.capabilities()
    assert caps.live_entry == "duplex" and caps.input_rate == 24000
    assert caps.live_responses and not caps.voice_activity and not caps.turn_detection


async def test_frames_of_several_sessions_run_in_one_step(orch: Orchestrator) -> None:
    handles = [await orch.submit({"seed": i}, session_key=f"s{i}") for i in range(4)]
    readers = [asyncio.create_task(drain(h)) for h in handles]
    frames = 12
    audio = [user_audio(i, frames) for i in range(4)]
    for f in range(frames):
        for h, a in zip(handles, audio, strict=True):  # every session's frame f, then the next f
            await orch.append_input(h.request_id, AudioInput(a[f * FRAME : (f + 1) * FRAME], RATE))
        await asyncio.sleep(0.02)
    for h in handles:
        await orch.append_input(h.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
    results = await asyncio.wait_for(asyncio.gather(*readers), 60)
    stage = orch.metrics.snapshot()["stages"]["duplex"]
    assert stage["batch"]["max"] >= 2, stage["batch"]  # frames of several sessions in one step
    for payloads, status in results:
        assert status.status == "completed", status.error
        chunks = [p for p in payloads if isinstance(p, AudioChunk)]
        assert all(c.sample_rate == RATE and c.samples.shape == (FRAME,) for c in chunks)
        turns = [type(p).__name__ for p in payloads if isinstance(p, (ResponseStarted, ResponseDone))]
        # every stretch that started is done (at the latest when the request ends), in order
        assert turns and turns == ["ResponseStarted", "ResponseDone"] * (len(turns) // 2)
        assert status.timings["duplex"].steps >= frames


def collect_turn_text(payloads: list[Payload]) -> list[str]:
    texts: list[str] = []
    for p in payloads:
        if isinstance(p, ResponseStarted):
            texts.append("")
        elif isinstance(p, TextDelta):
            texts[-1] += p.text
    return texts


async def test_a_session_stream_does_not_depend_on_its_neighbours() -> None:
    """The same seed and audio give the same text and audio alone and beside other sessions."""

    async def run(neighbours: int) -> list[Payload]:
        o = Orchestrator.from_spec(load_pipeline("duplex-tiny"))
        await o.start()
        try:
            mine = await o.submit({"seed": 5})
            others = [await o.submit({"seed": 100 + i}) for i in range(neighbours)]
            readers = [asyncio.create_task(drain(h)) for h in [mine, *others]]
            audio = user_audio(5, 10)
            for f in range(10):
                await o.append_input(mine.request_id, AudioInput(audio[f * FRAME : (f + 1) * FRAME], RATE))
                for i, h in enumerate(others):
                    await o.append_input(h.request_id, AudioInput(user_audio(50 + i + f, 1), RATE))
            for h in [mine, *others]:
                await o.append_input(h.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
            results = await asyncio.wait_for(asyncio.gather(*readers), 60)
            return results[0][0]
        finally:
            await o.close()

    alone, crowded = await run(0), await run(3)
    assert collect_turn_text(alone) == collect_turn_text(crowded)
    a = np.concatenate([p.samples for p in alone if isinstance(p, AudioChunk)] or [np.zeros(0)])
    b = np.concatenate([p.samples for p in crowded if isinstance(p, AudioChunk)] or [np.zeros(0)])
    assert a.size > 0 and np.allclose(a, b, atol=1e-4)


async def test_cancel_ends_one_session_and_frees_its_slot(orch: Orchestrator) -> None:
    a = await orch.submit({"seed": 1})
    b = await orch.submit({"seed": 2})
    reader_a, reader_b = asyncio.create_task(drain(a)), asyncio.create_task(drain(b))
    for f in range(4):
        for h in (a, b):
            await orch.append_input(h.request_id, AudioInput(user_audio(f, 1), RATE))
    assert await orch.cancel(a.request_id)
    _, status_a = await asyncio.wait_for(reader_a, 10)
    assert status_a.status == "cancelled"
    for f in range(4):
        await orch.append_input(b.request_id, AudioInput(user_audio(10 + f, 1), RATE))
    await orch.append_input(b.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
    _, status_b = await asyncio.wait_for(reader_b, 30)
    assert status_b.status == "completed"
    assert status_b.timings["duplex"].steps >= 8
    # 64 slots, both released: a new session still gets one, and a cancelled id is gone
    assert not await orch.cancel(a.request_id)
    c = await orch.submit({})
    await orch.append_input(c.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
    assert (await asyncio.wait_for(c.wait(), 10)).status == "completed"


async def test_wrong_rate_fails_only_that_session(orch: Orchestrator) -> None:
    bad = await orch.submit({})
    good = await orch.submit({})
    reader = asyncio.create_task(drain(good))
    await orch.append_input(bad.request_id, AudioInput(np.zeros(320, np.float32), 16000))
    status = await asyncio.wait_for(bad.wait(), 10)
    assert status.status == "failed"
    assert "24000 Hz" in (status.error or "")
    for f in range(3):
        await orch.append_input(good.request_id, AudioInput(user_audio(f, 1), RATE))
    await orch.append_input(good.request_id, AudioInput(np.zeros(0, np.float32), RATE, final=True))
    _, ok = await asyncio.wait_for(reader, 30)
    assert ok.status == "completed"


def engine_with_clock(**options: object) -> tuple[DuplexEngine, list[float]]:
    now = [100.0]
    engine = DuplexEngine({"model": "tiny", "max_sessions": 4, "clock": lambda: now[0], **options})
    engine.load()
    return engine, now


def test_input_far_ahead_of_the_model_is_a_clear_error() -> None:
    engine, _ = engine_with_clock(max_buffer_s=1)
    state = engine.start(EngineRequest("r", {}))
    with pytest.raises(ValueError, match="ahead of the model"):
        engine.step([StepInput(state, inputs=[AudioInput(np.zeros(RATE * 2, np.float32), RATE)])])


def test_bad_input_in_a_batch_changes_nothing_before_it_raises() -> None:
    """The stage re-steps each request alone after a batched step raised: the good request's
    audio must still be there exactly once."""
    engine, _ = engine_with_clock()
    good = engine.start(EngineRequest("good", {}))
    bad = engine.start(EngineRequest("bad", {}))
    frame = AudioInput(user_audio(1, 1), RATE)
    with pytest.raises(ValueError, match="24000 Hz"):
        wrong_rate = AudioInput(np.zeros(320, np.float32), 16000)
        engine.step([StepInput(good, inputs=[frame]), StepInput(bad, inputs=[wrong_rate])])
    assert good.buffered_samples == 0 and good.frames == 0
    engine.step([StepInput(good, inputs=[frame])])  # the stage's retry, alone
    assert good.frames == 1 and good.buffered_samples == 0


def test_quiet_user_steps_the_model_on_silence_every_frame() -> None:
    engine, now = engine_with_clock(idle_grace_ms=120, stream_silence=True)
    state: DuplexState = engine.start(EngineRequest("r", {}))
    out = engine.step([StepInput(state)])[0]
    assert state.frames == 0 and out.not_before == pytest.approx(100.2)  # one frame + grace
    for i in range(5):
        now[0] = out.not_before or now[0]
        out = engine.step([StepInput(state)])[0]
        assert state.frames == i + 1
        assert out.not_before == pytest.approx(now[0] + 0.08)  # then every frame while quiet
    chunks = [p for p in out.client if isinstance(p, AudioChunk)]
    assert len(chunks) == 1  # stream_silence: every frame's audio goes out


def test_a_long_silent_user_pauses_the_model_until_audio_comes() -> None:
    engine, now = engine_with_clock(idle_grace_ms=120, idle_stop_s=1)
    state: DuplexState = engine.start(EngineRequest("r", {}))
    out = engine.step([StepInput(state)])[0]
    while out.not_before is not None:
        now[0] = out.not_before
        out = engine.step([StepInput(state)])[0]
    assert out.wait_for_input and 8 <= state.frames <= 12  # ~1 s of silence frames, then paused
    frames = state.frames
    now[0] += 60
    engine.step([StepInput(state)])
    assert state.frames == frames  # a minute later, still paused
    out = engine.step([StepInput(state, inputs=[AudioInput(np.zeros(FRAME, np.float32), RATE)])])[0]
    assert state.frames == frames + 1 and out.not_before is not None  # audio wakes it


def test_full_engine_refuses_a_session_past_its_slots() -> None:
    engine, _ = engine_with_clock()
    states = [engine.start(EngineRequest(f"r{i}", {})) for i in range(4)]
    with pytest.raises(RuntimeError, match="all 4 session slots"):
        engine.start(EngineRequest("r5", {}))
    engine.finish(states[0], cancelled=True)
    engine.finish(states[0], cancelled=True)  # twice: released once
    engine.start(EngineRequest("r6", {}))
    with pytest.raises(RuntimeError):
        engine.start(EngineRequest("r7", {}))
