"""`speech.live_asr`'s audio holding, stepped directly on scored audio (no orchestrator, no
Whisper pass): how far back the stage holds audio for turns the session has not marked yet."""

from __future__ import annotations

import numpy as np
import pytest

from engines.speech.live_asr import LiveAsrEngine, LiveAsrState
from engines.speech.vad import FRAME_SAMPLES
from runtime.edges import Chunk
from runtime.engine import EngineRequest, StepInput
from runtime.payloads import AudioInput, TurnControl, VoiceActivity

pytestmark = pytest.mark.unit


def _feed(engine: LiveAsrEngine, state: LiveAsrState, *items: object) -> None:
    """One step of the stage on what the VAD stage hands on (no utterance asks for Whisper)."""
    engine.step([StepInput(state, chunks=[Chunk(list(items))])])  # type: ignore[arg-type]


def _scored(start_s: float, seconds: float, prob: float) -> list[object]:
    """`seconds` of scored 16 kHz audio from timeline second `start_s`, every frame at `prob`,
    as the VAD stage hands it on: pieces of 8 frames (PIECE samples), each with its scores."""
    out: list[object] = []
    start = int(start_s * 16000) // FRAME_SAMPLES * FRAME_SAMPLES
    for at in range(start, start + int(seconds * 16000) // PIECE * PIECE, PIECE):
        audio = AudioInput(np.zeros(PIECE, dtype=np.float32), 16000, start_sample=at)
        out += [audio, VoiceActivity(at, [prob] * 8)]
    return out


PIECE = 8 * FRAME_SAMPLES


def test_voice_not_marked_yet_is_held_however_far_the_audio_runs_ahead() -> None:
    """A client streaming a file outruns the session's marks: the speech_started for voice at
    3 s comes once the stage holds audio to 10 s. Counting the idle window back from the newest
    audio would have dropped the utterance's first words (a spoken turn's transcript began at
    its fourth word on a loaded CI machine); the stage holds from the idle window before the
    first voiced frame no turn has claimed, and only the idle window once one has."""
    engine = LiveAsrEngine({"idle_audio_s": 1, "max_audio_s": 20})
    state = engine.start(EngineRequest(request_id="r1", params={}))
    s = 16000
    _feed(engine, state, *_scored(0, 3, 0.0))
    assert state.end - PIECE - s <= state.held_from() <= state.end - s  # silence: the idle window
    voice = state.end  # ~3 s
    _feed(engine, state, *_scored(voice / s, 2, 0.9))
    _feed(engine, state, *_scored(state.end / s, 5, 0.0))
    assert state.end - voice > 6 * s and state.held_from() <= voice - s
    # The session's marks arrive: the utterance holds from its start; once it has ended, no
    # voice is unclaimed and the idle window is all that is held.
    mark = voice - 5 * FRAME_SAMPLES  # its prefix padding
    _feed(engine, state, TurnControl("speech_started", params={"ref": "i1", "start": mark}))
    assert mark - PIECE < state.held_from() <= mark
    assert state.span(mark, voice + 2 * s).size == voice + 2 * s - mark
    _feed(engine, state, TurnControl("speech_stopped", params={"ref": "i1", "end": voice + 2 * s + 8000}))
    assert state.end - PIECE - s <= state.held_from() <= state.end - s
    # Voice past the turn's end is the next turn's: held until that turn is marked.
    voice = state.end
    _feed(engine, state, *_scored(voice / s, 1, 0.9))
    _feed(engine, state, *_scored(state.end / s, 3, 0.0))
    assert state.held_from() <= voice - s
    # Never more than max_audio_s, marked or not.
    _feed(engine, state, *_scored(state.end / s, 25, 0.0))
    assert state.end - 20 * s - PIECE <= state.held_from() <= state.end - 20 * s
