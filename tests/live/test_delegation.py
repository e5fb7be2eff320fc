"""GPT-Live delegation end to end, on a pipeline whose live model hands work off (a test engine
standing in for one: tests/live/delegating_engine.py) and that has a text model (the voice
cascade's ``speech.responder``, echo) as its ``responses`` entry:

* ``client``: ``session.delegation.created`` reaches the client, which answers with
  ``response.item.create`` + ``response.create`` (or a commentary naming the delegation); the
  answer reaches the model, which speaks it;
* ``responses``: the delegation runs on the text model; its Responses events stream in
  ``response.event`` envelopes and its answer reaches the model, which speaks it;
* an instructions append reaches the model as conditioning.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live.wire import append, connect
from tests.live_server import LiveServer, live_server

pytestmark = pytest.mark.system

PIPELINE = Path(__file__).with_name("delegating.yaml")
TASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def delegating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline=str(PIPELINE), vad=False) as live:
        yield live


async def _spoken(client: object, within_s: float = 10.0) -> str:
    """The next text the model speaks (its output transcript)."""
    event = await client.wait_for("session.output_transcript.delta", within_s)  # type: ignore[attr-defined]
    return str(event["delta"])


async def test_client_delegation_is_answered_with_items(delegating: LiveServer) -> None:
    client = await connect(delegating, None)
    async with client.ws:
        session = (await client.start())["session"]
        assert session["delegation"] == {"type": "client"}
        for i in range(6):  # the model delegates after 0.5 s of audio
            await client.send(append(0.1, seed=i))
        created = await client.wait_for("session.delegation.created")
        delegation = created["delegation"]
        assert delegation["target"] == "client" and delegation["id"].startswith("dlg_")
        item = {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 24 degrees."}
        await client.send({"type": "response.item.create", "item": item})
        await client.wait_for("response.item.created")
        await client.send({"type": "response.create"})
        for kind in ("response.created", "response.completed"):
            event = await client.wait_for("response.event")
            assert event["delegation_id"] == delegation["id"] and event["event"]["type"] == kind
        assert await _spoken(client) == "Sunny, 24 degrees."
        # a commentary naming the delegation continues it
        await client.send(
            {"type": "session.commentary.append", "delegation_id": delegation["id"], "content": "And windy."}
        )
        await client.wait_for("session.commentary.appended")
        assert await _spoken(client) == "And windy."
        await client.send({"type": "session.close"})
        await client.wait_for("session.closed")


async def test_responses_delegation_runs_on_the_text_model(delegating: LiveServer) -> None:
    client = await connect(delegating, None)
    async with client.ws:
        session = (await client.start(delegation={"type": "responses"}))["session"]
        assert session["delegation"] == {"type": "responses"}
        for i in range(6):
            await client.send(append(0.1, seed=i))
        created = await client.wait_for("session.delegation.created")
        did = created["delegation"]["id"]
        assert created["delegation"]["target"] == "responses"
        events = []
        while True:
            envelope = await client.wait_for("response.event")
            assert envelope["delegation_id"] == did
            events.append(envelope["event"])
            if envelope["event"]["type"] in ("response.completed", "response.failed"):
                break
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == f"You said: {TASK}"  # the echo responder
        done = next(e for e in events if e["type"] == "response.output_item.done")
        assert done["item"]["content"][0]["text"] == text
        assert await _spoken(client) == text  # the voice model got the answer to speak
        await client.send({"type": "session.close"})
        await client.wait_for("session.closed")


async def test_an_instructions_append_reaches_the_model(delegating: LiveServer) -> None:
    client = await connect(delegating, None)
    async with client.ws:
        await client.start()
        await client.send(
            {"type": "session.instructions.append", "delegation_id": None, "content": "Be brief."}
        )
        await client.wait_for("session.instructions.appended")
        assert await _spoken(client) == "instructions: Be brief."
        await client.send({"type": "session.close"})
        await client.wait_for("session.closed")
