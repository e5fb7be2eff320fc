"""semantic_vad with the official `openai` SDK against a real server (voice-cascade on CPU: Silero
VAD, Smart Turn v3.2 and SmolLM2's words cue on the live request, whisper tiny.en, the echo
responder, Piper).

The user's side is Piper (deterministic voice) through the evaluation set's own recipe
(`loadtest.turn_set`: the whole sentence synthesised, a pause cut in at a word boundary). Turn
ends are checked on the audio timeline, not on wall-clock time: how much silence the client
had sent when the turn ended (a loaded host delays events, never the timeline).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loadtest.turn_set import RATE, VOICES, finished_clip, paused_clip
from media.audio import resample
from tests.live_server import LiveServer, live_server
from tests.realtime.wire import WIRE_RATE, ServerEvents, sdk_session, silence, stream_realtime
from tests.speech_audio import words

pytestmark = pytest.mark.system
pytest.importorskip("piper")
pytest.importorskip("faster_whisper")

# "The doctor said that | I should ...": the model calls the first half unfinished (< 0.06 at
# any 150-400 ms of silence after it), the whole finished (> 0.98).
PAUSED = ("The doctor said that I should drink more water every day.", 4)
FINISHED = "I think the best restaurant in town is the little Italian place on Main Street."
# "Tell me a short story about | a dragon ...", the faster voice: the model calls the first half
# finished (0.96 with 32 ms of the pause) and Whisper tiny completes it ("... about it.").
COMPLETED = ("Tell me a short story about a dragon who is afraid of the dark.", 7)
# Smart Turn calls this one unfinished 30 ms into the pause (0.02-0.12 with each voice), its
# words end a sentence and SmolLM2 reads the message as ended there (log P -6.7: the words cue).
LEFT_OPEN = "The meeting with the marketing team has been moved to Thursday afternoon."
# An answer long enough to be under way when a barge-in is detected (the echo repeats it).
LONG_REQUEST = (
    "Please describe the coast, the hills, the old town, the new harbour, the long beaches, the "
    "quiet bays, the fishing boats, the lighthouses, the markets, the museums, the parks, the "
    "churches, the bridges and the trains that run along the river to the mountains."
)
TRANSCRIPTION = {"model": "whisper-1", "language": "en"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv"))) as live:
        yield live


def wire(audio16k: np.ndarray) -> np.ndarray:
    return resample(audio16k, RATE, WIRE_RATE)


async def configure(conn: Any, events: ServerEvents, turn_detection: dict[str, Any]) -> None:
    audio_input = {"turn_detection": turn_detection, "transcription": TRANSCRIPTION}
    await conn.session.update(session={"type": "realtime", "audio": {"input": audio_input}})
    await events.wait_for("session.updated")


async def no_event(events: ServerEvents, kind: str, within_s: float) -> None:
    """`kind` does not come within `within_s` (other events are skipped)."""
    with pytest.raises(TimeoutError):
        await events.wait_for(kind, within_s=within_s)


def of_type(events: ServerEvents, kind: str) -> list[Any]:
    return [r.event for r in events.log if r.type == kind]


def server_session(server: LiveServer, events: ServerEvents) -> Any:
    return server.ctx.sessions[events.log[0].raw["session"]["id"]]


async def test_a_paused_sentence_gets_one_response_that_heard_both_halves(server: LiveServer) -> None:
    clip = paused_clip(*PAUSED, pause_s=1.2)
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": "auto"})
        audio = np.concatenate([silence(0.3), wire(clip.audio), silence(1.5)])
        await stream_realtime(conn, audio)
        done = await events.wait_for("response.done", within_s=60)
        assert done.event.response.status == "completed"
        await no_event(events, "input_audio_buffer.speech_stopped", 1.0)

        assert len(of_type(events, "input_audio_buffer.speech_stopped")) == 1  # not cut at the pause
        assert len(of_type(events, "response.created")) == 1
        stopped = of_type(events, "input_audio_buffer.speech_stopped")[0]
        speech_end_ms = 300 + len(clip.audio) * 1000 // RATE
        assert abs(stopped.audio_end_ms - speech_end_ms) < 400
        # The answer (the echo responder: "You said: ...") heard both halves.
        said = words(done.event.response.output[0].content[0].transcript)
        first, second = words(PAUSED[0])[:2], words(PAUSED[0])[-2:]
        assert said[2:4] == first and said[-2:] == second, said
        # The model was asked at the pause (and said "unfinished") and at the end.
        assert server.ctx.orchestrator.metrics.stages["end_of_turn"].counters.get("decisions", 0) >= 2


async def test_a_finished_sentence_is_answered_before_server_vad_would_end_it(server: LiveServer) -> None:
    """Only 450 ms of silence follow the sentence: less than server_vad's 500 ms, so server_vad
    never ends the turn; semantic_vad ends it on the model's "finished" (from 256 ms of it)."""
    speech = wire(finished_clip(FINISHED).audio)
    audio = np.concatenate([silence(0.3), speech, silence(0.45)])
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "server_vad", "silence_duration_ms": 500})
        await stream_realtime(conn, audio)
        await no_event(events, "input_audio_buffer.speech_stopped", 3.0)
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": "low"})
        await stream_realtime(conn, audio)
        stopped = await events.wait_for("input_audio_buffer.speech_stopped", within_s=10)
        created = await events.wait_for("response.created", within_s=10)
        assert stopped.event.item_id == of_type(events, "input_audio_buffer.committed")[0].item_id
        assert abs(stopped.event.audio_end_ms - (300 + len(speech) * 1000 // WIRE_RATE)) < 300
        assert created.event.response.status == "in_progress"
        await events.wait_for("response.done", within_s=60)
        # The turn so far was transcribed during the pause and the response used it.
        assert server_session(server, events).stats.transcripts_prepared_used == 1


async def test_a_sentence_the_model_left_open_ends_on_its_words(server: LiveServer) -> None:
    """The end-of-turn model says "unfinished"; the words end a sentence and the stage's
    language model reads the message as ended: the turn ends at the sentence's end with 1 s of
    silence after it, not at auto's 4 s maximum pause (counted in audio)."""
    stage = server.ctx.orchestrator.metrics.stages["end_of_turn"]
    before = stage.counters.get("word_decisions", 0)
    speech = wire(finished_clip(LEFT_OPEN).audio)
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": "auto"})
        await stream_realtime(conn, np.concatenate([silence(0.3), speech, silence(1.0)]))
        stopped = await events.wait_for("input_audio_buffer.speech_stopped", within_s=10)
        assert abs(stopped.event.audio_end_ms - (300 + len(speech) * 1000 // WIRE_RATE)) < 300
        await events.wait_for("response.created", within_s=10)
        done = await events.wait_for("response.done", within_s=60)
        said = words(done.event.response.output[0].content[0].transcript)
        assert said[-2:] == words(LEFT_OPEN)[-2:], said
    assert stage.counters.get("word_decisions", 0) == before + 1  # the words were asked about


async def test_a_first_half_the_asr_completes_with_a_pronoun_is_not_cut(server: LiveServer) -> None:
    """Eagerness high: the model's "finished" is enough on words without a sentence end, and
    on these it says so; the words ("... a short story about it.") end on a preposition and a
    pronoun, read as mid-clause: one turn, both halves. The whole sentence's own end may score
    low (0.01-0.14 on some CPUs: the model's numbers move with the host's kernels), so the
    silence after it outlasts high's maximum pause (2 s) and the turn ends there at the latest."""
    clip = paused_clip(*COMPLETED, pause_s=1.2, voice=VOICES[0])
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": "high"})
        await stream_realtime(conn, np.concatenate([silence(0.3), wire(clip.audio), silence(2.4)]))
        done = await events.wait_for("response.done", within_s=60)
        await no_event(events, "input_audio_buffer.speech_stopped", 1.0)
        assert len(of_type(events, "input_audio_buffer.speech_stopped")) == 1
        said = words(done.event.response.output[0].content[0].transcript)
        assert said[-2:] == words(COMPLETED[0])[-2:], said


@pytest.mark.parametrize(("eagerness", "max_s"), [("high", 2.0), ("medium", 4.0)])
async def test_eagerness_sets_the_longest_wait_in_an_unfinished_pause(
    server: LiveServer, eagerness: str, max_s: float
) -> None:
    """The first half alone, then silence: the model says "unfinished", so the turn ends only
    after the eagerness's maximum pause (2 s high, 4 s medium), counted in audio."""
    clip = paused_clip(*PAUSED, pause_s=1.0)
    first = wire(clip.audio[: clip.pause_at])
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": eagerness})
        await stream_realtime(conn, np.concatenate([silence(0.3), first, silence(max_s - 0.4)]))
        await no_event(events, "input_audio_buffer.speech_stopped", 1.5)  # 0.4 s short of it
        await stream_realtime(conn, silence(0.8))
        stopped = await events.wait_for("input_audio_buffer.speech_stopped", within_s=10)
        pause_ms = 300 + len(first) * 1000 // WIRE_RATE
        assert abs(stopped.event.audio_end_ms - pause_ms) < 300
        await events.wait_for("response.created", within_s=10)


async def test_barge_in_still_ends_the_answer(server: LiveServer) -> None:
    """Speech during an answer interrupts it under semantic_vad as under server_vad. The answer
    is a long one (the echo of a long request), so it is still being made when the barge-in's
    speech is detected: a short answer's audio is made faster than real time and can be out
    whole (response.done) before a barge-in starts, which is then the client's truncate."""
    speech = wire(finished_clip(FINISHED).audio)
    async with sdk_session(server) as (conn, events):
        await configure(conn, events, {"type": "semantic_vad", "eagerness": "auto"})
        request = [{"type": "input_text", "text": LONG_REQUEST}]
        await conn.conversation.item.create(item={"type": "message", "role": "user", "content": request})
        await conn.response.create()
        created = await events.wait_for("response.created", within_s=20)
        await events.wait_for("response.output_audio.delta", within_s=60)
        talking = asyncio.create_task(stream_realtime(conn, np.concatenate([speech, silence(0.5)])))
        await events.wait_for("input_audio_buffer.speech_started", within_s=10)
        done = await events.wait_for("response.done", within_s=10)
        await talking
        assert done.event.response.id == created.event.response.id
        assert done.event.response.status == "cancelled", "the answer had finished before the barge-in"
        assert done.event.response.status_details.reason == "turn_detected"
