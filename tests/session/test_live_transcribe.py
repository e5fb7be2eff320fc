"""A pause transcript on the live request: a draft the live ASR sends before the final words
goes to whoever reads drafts (the end-of-turn decision), the final words are the answer; one
the decision awaits is marked so (`transcribe_needed`: made before others); one the session
gives up (`DropTranscript`: the end-of-turn model's score leaves the pause open
whatever its words) is cancelled on the live ASR too (`transcribe_cancel`: never made). Real
Silero VAD stage on the live request; the stage after it records the turn controls that reach
it and answers a `transcribe` with a draft and the final words when told to."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest

from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.orchestrator import Orchestrator
from runtime.payloads import Payload, Transcript, TurnControl
from runtime.registry import register_engine, unregister_engine
from runtime.spec import parse_pipeline
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.effects import CoreOutput
from session.realtime.ids import SequentialIds
from session.voice.live_request import LiveEntry, LiveRequest

pytestmark = pytest.mark.system

PIPELINE = """
name: asks
entry: vad
entries: {live: vad}
stages:
  - {name: vad, engine: "engines.speech.vad_stage:VadEngine"}
  - {name: live_asr, engine: test.control_recorder}
edges:
  - {from: vad, to: live_asr}
"""


class ControlRecorder(Engine):
    """A live ASR stage that answers nothing and records the turn controls reaching it."""

    provides = frozenset({"input_transcription"})
    seen: ClassVar[list[tuple[str, str]]] = []
    answer = False  # answer a `transcribe`: a draft, then the final words
    lock = threading.Lock()

    def start(self, request: EngineRequest) -> dict[str, Any]:
        return {}

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs = []
        for item in batch:
            out: list[Payload] = []
            for chunk in item.chunks:
                for payload in chunk.items:
                    if isinstance(payload, TurnControl):
                        ref = str(payload.params.get("ref"))
                        with ControlRecorder.lock:
                            ControlRecorder.seen.append((payload.kind, ref))
                        if payload.kind == "transcribe" and ControlRecorder.answer:
                            out += [Transcript("book a fight", final=False, ref=ref)]
                            out += [Transcript("book a flight", final=True, ref=ref)]
            outputs.append(StepOutput(client=out, wait_for_input=True))
        return outputs


@pytest.fixture(autouse=True)
def recorder() -> Iterator[None]:
    register_engine("test.control_recorder", ControlRecorder)
    ControlRecorder.seen.clear()
    ControlRecorder.answer = False
    yield
    unregister_engine("test.control_recorder")


async def reached(kind: str) -> str:
    """The ref of the first `kind` control that reached the stage (waits up to 20 s)."""
    for _ in range(1000):
        with ControlRecorder.lock:
            refs = [ref for k, ref in ControlRecorder.seen if k == kind]
        if refs:
            return refs[0]
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {kind} reached the stage: {ControlRecorder.seen}")


async def live_request() -> tuple[Orchestrator, LiveRequest]:
    orch = Orchestrator.from_spec(parse_pipeline(PIPELINE))
    await orch.start()
    core = RealtimeSessionCore(CoreOptions(new_id=SequentialIds()))
    core.start(0.0, 1_700_000_000)

    def apply(out: CoreOutput) -> None:
        """Nothing to drive: only the transcript is asked here."""

    live = LiveRequest(
        orch,
        LiveEntry("vad", 16_000, frames=True, transcribes=True),
        core,
        apply,
        time.monotonic,
        session_key="s",
    )
    return orch, live


async def test_a_draft_goes_to_its_reader_and_the_final_words_are_the_answer() -> None:
    ControlRecorder.answer = True
    orch, live = await live_request()
    task = asyncio.create_task(live.run())
    drafts: list[str] = []
    try:
        text = await live.transcribe(0, 16_000, first=True, draft=drafts.append)
        assert (drafts, text) == (["book a fight"], "book a flight")
        assert await live.transcribe(0, 16_000) == "book a flight"  # no reader: the final alone
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await orch.close()


async def test_a_transcript_awaited_is_marked_needed_and_one_given_up_is_cancelled() -> None:
    orch, live = await live_request()
    task = asyncio.create_task(live.run())
    try:
        ask = asyncio.create_task(live.transcribe(0, 16_000, first=True))
        ref = await reached("transcribe")
        live.need(16_000)  # its decision's score is back and awaits the words: made first
        assert await reached("transcribe_needed") == ref
        ask.cancel()  # the driver gives the words up
        assert await reached("transcribe_cancel") == ref
        with pytest.raises(asyncio.CancelledError):
            await ask
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await orch.close()
