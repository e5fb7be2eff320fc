"""The null benchmark engines (no model): timing on a virtual clock, and output."""

from __future__ import annotations

import time

import numpy as np

from engines.null.stages import NULL_REPLY, NULL_TRANSCRIPT, NullAudioEngine, PassthroughEngine, tone
from runtime.engine import EdgeChunk, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, TextDelta, Transcript


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _engine(clock: FakeClock, **options: object) -> NullAudioEngine:
    return NullAudioEngine({"clock": clock, "sleep": clock.sleep, **options})


def _step(engine: NullAudioEngine, *states: object) -> list[StepOutput]:
    return engine.step([StepInput(state=s) for s in states])


def test_null_waits_for_delay_without_blocking() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=200)
    state = engine.start(EngineRequest(request_id="a", params={}))
    out = _step(engine, state)[0]
    assert out == StepOutput()  # nothing yet, not done, not waiting for input: step again
    assert clock.slept == [0.002]  # a short nap, never the whole delay
    while not (out := _step(engine, state)[0]).client:
        pass
    assert max(clock.slept) <= 0.002 + 1e-12
    assert abs(clock.now - 100.2) < 1e-6  # released right at the due time
    assert out.client[:2] == [Transcript(NULL_TRANSCRIPT), TextDelta(NULL_REPLY)]
    assert isinstance(out.client[2], AudioChunk)


def test_null_output_audio() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=0, audio_ms=1000, chunk_ms=100)
    state = engine.start(EngineRequest(request_id="a", params={}))
    outs = [_step(engine, state)[0]]
    while not outs[-1].done:
        outs.append(_step(engine, state)[0])
    chunks = [p for o in outs for p in o.client if isinstance(p, AudioChunk)]
    assert len(outs) == len(chunks) == 10  # one 100 ms chunk per step
    assert all(c.sample_rate == 24000 and c.samples.size == 2400 for c in chunks)
    audio = np.concatenate([c.samples for c in chunks])
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 24000 / audio.size - 440) < 2
    assert clock.slept == []  # nothing was ever waiting
    assert all(not o.downstream for o in outs)


def test_null_realtime_pacing_and_batching() -> None:
    clock = FakeClock()
    engine = _engine(clock, delay_ms=100, audio_ms=300, chunk_ms=100, realtime=True)
    early = engine.start(EngineRequest(request_id="a", params={}))
    clock.now += 0.05
    late = engine.start(EngineRequest(request_id="b", params={"modalities": ["text"]}))
    emitted: dict[str, list[float]] = {"a": [], "b": []}
    done = {"a": False, "b": False}
    for _ in range(10_000):
        live = [(k, s) for k, s in (("a", early), ("b", late)) if not done[k]]
        if not live:
            break
        for (key, _), out in zip(live, _step(engine, *(s for _, s in live)), strict=True):
            emitted[key] += [clock.now] * len(out.client)
            done[key] = out.done
    # a: reply at 100.1 with chunk 0, chunks 1 and 2 at 100.2 and 100.3
    np.testing.assert_allclose(emitted["a"], [100.1, 100.1, 100.1, 100.2, 100.3], atol=0.0025)
    np.testing.assert_allclose(emitted["b"], [100.15, 100.15], atol=0.0025)  # text only


def test_null_real_clock_delay() -> None:
    engine = NullAudioEngine({"delay_ms": 50, "audio_ms": 100})
    t0 = time.monotonic()
    state = engine.start(EngineRequest(request_id="a", params={}))
    steps = 0
    while True:
        steps += 1
        out = engine.step([StepInput(state=state)])[0]
        if out.client:
            break
    assert 0.045 <= time.monotonic() - t0 < 0.5
    assert steps > 5  # it came back to the worker many times instead of sleeping 50 ms


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
