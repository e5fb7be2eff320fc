"""The voice-cascade engines driven directly through start/step with the contract types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import soxr

from engines.speech.stages import AsrEngine, ResponderEngine, TtsEngine
from runtime.engine import EdgeChunk, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, TextDelta, Transcript
from tests.engines_speech.conftest import DETERMINISTIC_VOICE, SENTENCE, run_engine, text_chunks, words

pytestmark = pytest.mark.system

pytest.importorskip("piper")
pytest.importorskip("faster_whisper")


@pytest.fixture(scope="module")
def asr_engine() -> AsrEngine:
    engine = AsrEngine({})
    engine.load()
    return engine


@pytest.fixture(scope="module")
def responder_engine() -> ResponderEngine:
    engine = ResponderEngine({"responder": "echo", "deltas_per_step": 3})
    engine.load()
    return engine


@pytest.fixture(scope="module")
def tts_engine() -> TtsEngine:
    engine = TtsEngine(DETERMINISTIC_VOICE)
    engine.load()
    return engine


def _collect(steps: list[tuple[int, StepOutput]], kind: type, where: str = "client") -> list[Any]:
    return [p for _, out in steps for p in getattr(out, where) if isinstance(p, kind)]


def test_asr_engine_transcribes_audio(asr_engine: AsrEngine, sentence16k: np.ndarray) -> None:
    steps = run_engine(asr_engine, {"audio": sentence16k})
    assert len(steps) == 1
    out = steps[0][1]
    # Whisper's casing of the first word varies with the onnxruntime/ctranslate2 build: compare words.
    assert [type(p) for p in out.client] == [Transcript] and words(out.client[0].text) == words(SENTENCE)
    assert [type(p) for p in out.downstream] == [TextDelta]
    assert out.downstream[0].text == out.client[0].text


def test_asr_engine_passes_text_through(asr_engine: AsrEngine) -> None:
    out = run_engine(asr_engine, {"text": "typed words"})[0][1]
    assert out.client == [] and out.downstream == [TextDelta("typed words")] and out.done


def test_asr_engine_streamed_audio_input(asr_engine: AsrEngine, sentence16k: np.ndarray) -> None:
    state = asr_engine.start(EngineRequest(request_id="s", params={}))
    assert asr_engine.step([StepInput(state=state)])[0].wait_for_input
    audio24k = np.asarray(soxr.resample(sentence16k, 16000, 24000), dtype=np.float32)
    half = audio24k.size // 2
    out = asr_engine.step([StepInput(state=state, inputs=[AudioInput(audio24k[:half], 24000)])])[0]
    assert out.wait_for_input and not out.done
    out = asr_engine.step([StepInput(state=state, inputs=[AudioInput(audio24k[half:], 24000, final=True)])])[
        0
    ]
    assert out.done and [type(p) for p in out.client] == [Transcript]
    assert words(out.client[0].text) == words(SENTENCE)


def test_responder_waits_then_echoes(responder_engine: ResponderEngine) -> None:
    state = responder_engine.start(EngineRequest(request_id="r", params={}))
    assert responder_engine.step([StepInput(state=state)])[0].wait_for_input
    chunk = EdgeChunk(items=[TextDelta("hello there")], finished=True, source="asr")
    outs = [responder_engine.step([StepInput(state=state, chunks=[chunk], upstream_finished=True)])[0]]
    while not outs[-1].done:
        outs.append(responder_engine.step([StepInput(state=state, upstream_finished=True)])[0])
    client = [p.text for o in outs for p in o.client]
    assert client == ["You", " said:", " hello", " there"]
    assert [p.text for o in outs for p in o.downstream] == client
    assert all(len(o.client) <= 3 for o in outs)
    assert "".join(client) == "You said: hello there"


def test_responder_empty_input(responder_engine: ResponderEngine) -> None:
    chunk = EdgeChunk(items=[TextDelta("")], finished=True)
    steps = run_engine(responder_engine, {}, [chunk])
    assert "".join(p.text for p in _collect(steps, TextDelta)) == "I did not hear anything."


def test_tts_engine_streams_clauses(tts_engine: TtsEngine) -> None:
    deltas = [
        "You",
        " said:",
        " the",
        " quick",
        " brown",
        " fox",
        " jumps",
        " over",
        " the",
        " lazy",
        " dog.",
    ]
    steps = run_engine(tts_engine, {}, text_chunks(deltas))
    audio_steps = [(n, out) for n, out in steps if out.client]
    # "You said:", then the rest in pieces (one delta per step keeps the lead short: see
    # test_tts_pacing.py for how the pieces grow).
    assert len(audio_steps) >= 2
    first_delivered = audio_steps[0][0]
    assert first_delivered == 2  # first audio as soon as "said:" arrived, long before the end
    chunks = _collect(steps, AudioChunk)
    assert all(c.sample_rate == 22050 and c.samples.dtype == np.float32 for c in chunks)
    audio = np.concatenate([c.samples for c in chunks])
    assert 2.0 < audio.size / 22050 < 6.0
    assert float(np.sqrt(np.mean(audio**2))) > 0.05
    assert all(not out.downstream for _, out in steps)


def test_tts_engine_text_only_modality(tts_engine: TtsEngine) -> None:
    steps = run_engine(tts_engine, {"modalities": ["text"]}, text_chunks(["Hello", " world."]))
    assert _collect(steps, AudioChunk) == []
    assert steps[-1][1].done


def test_tts_engine_nothing_to_say(tts_engine: TtsEngine) -> None:
    steps = run_engine(tts_engine, {}, text_chunks([]))
    assert _collect(steps, AudioChunk) == [] and steps[-1][1].done


def test_cascade_by_hand_round_trip(
    asr_engine: AsrEngine,
    responder_engine: ResponderEngine,
    tts_engine: TtsEngine,
    sentence16k: np.ndarray,
    asr: Any,
    speak16k: Callable[[str], np.ndarray],
) -> None:
    """audio → ASR → responder → TTS, then the reply audio back through ASR."""
    asr_steps = run_engine(asr_engine, {"audio": sentence16k})
    asr_items = [p for _, o in asr_steps for p in o.downstream]
    resp_steps = run_engine(responder_engine, {}, [EdgeChunk(items=asr_items, finished=True, source="asr")])
    reply = [p.text for _, o in resp_steps for p in o.downstream]
    tts_steps = run_engine(tts_engine, {}, text_chunks(reply, "responder"))
    audio = np.concatenate([c.samples for c in _collect(tts_steps, AudioChunk)])
    heard = asr.transcribe(np.asarray(soxr.resample(audio, 22050, 16000), dtype=np.float32))
    assert words(heard) == words("You said: " + SENTENCE)
