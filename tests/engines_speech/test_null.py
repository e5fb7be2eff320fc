"""The null benchmark engines (no model): timing on a virtual clock, and output."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engines.null.stages import NULL_REPLY, NULL_TRANSCRIPT, NullAudioEngine, PassthroughEngine, tone
from runtime.engine import EdgeChunk, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, TextDelta, Transcript
from tests.timing import FakeClock

pytestmark = pytest.mark.unit


def _engine(clock: FakeClock, **options: object) -> NullAudioEngine:
    return NullAudioEngine({"clock": clock, **options})


def _step(engine: NullAudioEngine, *states: object) -> list[StepOutput]:
    return engine.step([StepInput(state=s) for s in states])


def test_null_says_when_it_is_due_instead_of_sleeping() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=200)
    state = engine.start(EngineRequest(request_id="a", params={}))
    out = _step(engine, state)[0]
    assert not out.client and not out.done and not out.wait_for_input
    assert out.not_before == pytest.approx(100.2)  # step me again then
    clock.now = 100.1
    assert _step(engine, state)[0].not_before == pytest.approx(100.2)  # early: same answer
    clock.now = out.not_before
    out = _step(engine, state)[0]
    assert out.client[:2] == [Transcript(NULL_TRANSCRIPT), TextDelta(NULL_REPLY)]
    assert isinstance(out.client[2], AudioChunk)


def test_null_output_audio() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=0, audio_ms=1000, chunk_ms=100)
    state = engine.start(EngineRequest(request_id="a", params={}))
    outs = [_step(engine, state)[0]]
    while not outs[-1].done:
        assert outs[-1].not_before is not None and outs[-1].not_before <= clock.now  # not paced
        outs.append(_step(engine, state)[0])
    chunks = [p for o in outs for p in o.client if isinstance(p, AudioChunk)]
    assert len(outs) == len(chunks) == 10  # one 100 ms chunk per step
    assert all(c.sample_rate == 24000 and c.samples.size == 2400 for c in chunks)
    audio = np.concatenate([c.samples for c in chunks])
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 24000 / audio.size - 440) < 2
    assert outs[-1].not_before is None
    assert all(not o.downstream for o in outs)


def _run_paced(
    engine: NullAudioEngine, clock: FakeClock, states: dict[str, object]
) -> dict[str, list[float]]:
    """Step like a stage does: only requests whose `not_before` has come, at that time."""
    emitted: dict[str, list[float]] = {k: [] for k in states}
    due = dict.fromkeys(states, clock.now)
    while due:
        clock.now = min(due.values())
        batch = [k for k, t in due.items() if t <= clock.now]
        for key, out in zip(batch, _step(engine, *(states[k] for k in batch)), strict=True):
            emitted[key] += [clock.now] * len(out.client)
            if out.done:
                del due[key]
            else:
                assert out.not_before is not None and out.not_before > clock.now - 1e-9
                due[key] = out.not_before
    return emitted


def test_null_realtime_pacing_and_batching() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=100, audio_ms=300, chunk_ms=100, realtime=True)
    early = engine.start(EngineRequest(request_id="a", params={}))
    clock.now += 0.05
    late = engine.start(EngineRequest(request_id="b", params={"modalities": ["text"]}))
    emitted = _run_paced(engine, clock, {"a": early, "b": late})
    # a: reply at 100.1 with chunk 0, chunks 1 and 2 at 100.2 and 100.3
    np.testing.assert_allclose(emitted["a"], [100.1, 100.1, 100.1, 100.2, 100.3], atol=1e-6)
    np.testing.assert_allclose(emitted["b"], [100.15, 100.15], atol=1e-6)  # text only


def test_null_tick_grid_batches_requests_and_keeps_chunk_spacing_exact() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=200, audio_ms=200, chunk_ms=40, realtime=True, tick_ms=10)
    states = {}
    for i in range(8):  # admitted 1.3 ms apart: due times spread over one tick
        clock.now = 100.0 + i * 0.0013
        states[str(i)] = engine.start(EngineRequest(request_id=str(i), params={}))
    emitted = _run_paced(engine, clock, states)
    times = {t for ts in emitted.values() for t in ts}
    assert all(abs(t * 100 - round(t * 100)) < 1e-6 for t in times)  # on the 10 ms grid
    for key, ts in emitted.items():
        started = 100.0 + int(key) * 0.0013
        assert 0 <= ts[0] - (started + 0.2) < 0.01  # late by less than a tick
        np.testing.assert_allclose(np.diff(ts[2:]), 0.04, atol=1e-6)  # chunks exactly 40 ms apart
    assert len(times) <= 2 * 6  # 8 requests share steps: at most 2 grid points per release


def test_null_real_clock_delay() -> None:
    engine = NullAudioEngine({"delay_ms": 50, "audio_ms": 100})
    t0 = time.monotonic()
    state = engine.start(EngineRequest(request_id="a", params={}))
    out = engine.step([StepInput(state=state)])[0]
    assert out.not_before is not None and 0.045 <= out.not_before - t0 <= 0.055
    time.sleep(max(0.0, out.not_before - time.monotonic()))
    out = engine.step([StepInput(state=state)])[0]
    assert out.client and 0.045 <= time.monotonic() - t0 < 0.5


def test_tone() -> None:
    t = tone(100, 24000)
    assert t.dtype == np.float32 and t.size == 2400 and t[0] == 0.0 and np.max(np.abs(t)) <= 0.3


def test_passthrough_forwards_unchanged() -> None:
    engine = PassthroughEngine({})
    state = engine.start(EngineRequest(request_id="p", params={"text": "hi"}))
    item = TextDelta("x")
    out = engine.step([StepInput(state=state, chunks=[EdgeChunk(items=[item])])])[0]
    assert out.downstream == [TextDelta("hi"), item] and out.client == out.downstream
    assert out.downstream[1] is item and out.wait_for_input and not out.done
    audio = AudioInput(np.zeros(10, dtype=np.float32), 16000, final=True)
    out = engine.step([StepInput(state=state, inputs=[audio])])[0]
    assert out.downstream == [audio] and out.done


def test_passthrough_ends_with_upstream_and_can_hide_from_client() -> None:
    engine = PassthroughEngine({"client": False})
    state = engine.start(EngineRequest(request_id="p", params={}))
    out = engine.step(
        [StepInput(state=state, chunks=[EdgeChunk(items=[], finished=True)], upstream_finished=True)]
    )[0]
    assert out.done and out.client == [] and out.downstream == []
