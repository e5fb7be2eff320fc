"""A response that fails in the driver (its handling of a payload raised) ends its pipeline
request too: the stages stop and the request leaves the orchestrator at once, instead of
running to its end with nobody reading it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from runtime.orchestrator import Orchestrator
from runtime.spec import parse_pipeline
from session.realtime.core import CoreOptions, RealtimeSessionCore
from session.realtime.ids import SequentialIds
from session.voice.driver import RealtimeDriver
from tests.sessions.client import until

pytestmark = pytest.mark.system

# The null responder: 10 s of a tone in real time, so a request left running would still be live.
SPEC = (
    "name: t\nentry: respond\nstages:\n"
    "  - {name: respond, engine: null.audio, options: {delay_ms: 0, audio_ms: 10000, chunk_ms: 40,"
    " sample_rate: 24000, realtime: true, tick_ms: 10}}\n"
)


def record_events(driver: RealtimeDriver) -> list[dict[str, Any]]:
    """Every event the driver applies, in order (its ``apply`` wrapped)."""
    events: list[dict[str, Any]] = []
    apply = driver.apply

    def recording_apply(out: Any) -> None:
        events.extend(out.events)
        apply(out)

    driver.apply = recording_apply  # type: ignore[method-assign]
    return events


@pytest.mark.parametrize("fault", ["audio", "none"])
async def test_a_response_failing_in_the_driver_cancels_its_request(fault: str) -> None:
    orch = Orchestrator.from_spec(parse_pipeline(SPEC, source="t.yaml"))
    await orch.start()
    core = RealtimeSessionCore(CoreOptions(new_id=SequentialIds()))
    driver = RealtimeDriver(core, orch)
    driver.start()
    chunks = 0
    real = core.on_response_audio

    def on_response_audio(*args: Any, **kwargs: Any) -> Any:
        nonlocal chunks
        chunks += 1
        if fault == "audio" and chunks == 3:
            raise RuntimeError("the driver's handling of a payload failed")
        return real(*args, **kwargs)

    core.on_response_audio = on_response_audio  # type: ignore[method-assign]
    events = record_events(driver)
    try:
        driver._on_client_text(json.dumps({"type": "response.create"}))
        await until(lambda: chunks >= 3)
        if fault == "audio":
            # The response failed and its request is gone from the pipeline.
            await until(lambda: driver.active_responses == 0)
            assert orch.health()["live"] == 0
            done = [e for e in events if e["type"] == "response.done"]
            assert [d["response"]["status"] for d in done] == ["failed"]
            seen = chunks
            await asyncio.sleep(0.2)
            assert chunks == seen  # no payload reaches the session after the failure
        else:
            # Control: the healthy response is still streaming, its request live.
            assert driver.active_responses == 1 and orch.health()["live"] == 1
    finally:
        await driver.shutdown()
        await orch.close()


async def test_a_response_cancelled_before_it_began_submits_nothing() -> None:
    """response.create and response.cancel handled before the loop ran the response's task
    (one read of a client's socket holds both): its prompt goes with the cancel and no
    pipeline request is made for it; one made after it runs as usual."""
    orch = Orchestrator.from_spec(parse_pipeline(SPEC, source="t.yaml"))
    await orch.start()
    core = RealtimeSessionCore(CoreOptions(new_id=SequentialIds()))
    driver = RealtimeDriver(core, orch)
    driver.start()
    submitted: list[dict[str, Any]] = []
    real_submit = orch.submit

    async def counting_submit(params: Any, **kwargs: Any) -> Any:
        submitted.append(dict(params))
        return await real_submit(params, **kwargs)

    orch.submit = counting_submit  # type: ignore[method-assign]
    events = record_events(driver)
    try:
        for _ in range(50):  # no await between: none of the responses' tasks has run
            driver._on_client_text(json.dumps({"type": "response.create"}))
            driver._on_client_text(json.dumps({"type": "response.cancel"}))
        assert driver.active_responses == 50
        assert all(r.params is None for r in driver._responses.values())  # the prompts went
        await until(lambda: driver.active_responses == 0)
        assert submitted == [] and orch.health()["live"] == 0
        done = [e["response"]["status"] for e in events if e["type"] == "response.done"]
        assert done == ["cancelled"] * 50
        driver._on_client_text(json.dumps({"type": "response.create"}))
        await until(lambda: orch.health()["live"] == 1)
        assert len(submitted) == 1
    finally:
        await driver.shutdown()
        await orch.close()
