"""session/voice/retrieved.py without a network: what the log keeps of a retrieve, and the
event a replay makes of it again (lazily, from the conversation as it is then)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from session.realtime import CoreOptions, RealtimeSessionCore
from session.realtime.ids import SequentialIds
from session.voice.retrieved import is_reference, logged_form, rebuilt

pytestmark = pytest.mark.unit


def core_with_item(text: str) -> tuple[RealtimeSessionCore, dict[str, Any]]:
    core = RealtimeSessionCore(CoreOptions(session_id="sess_unit", new_id=SequentialIds()))
    core.start(0.0, 1_800_000_000.0)
    create = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    core.handle_client_event({"type": "conversation.item.create", "item": create}, 0.1)
    item_id = core.conversation.items[-1].id
    out = core.handle_client_event({"type": "conversation.item.retrieve", "item_id": item_id}, 0.2)
    (retrieved,) = [e for e in out.events if e["type"] == "conversation.item.retrieved"]
    return core, retrieved


def test_the_log_keeps_a_reference_and_other_events_as_they_are() -> None:
    _core, retrieved = core_with_item("x" * 100_000)
    ref = logged_form(retrieved)
    assert ref == {"type": "conversation.item.retrieved", "item_ref": retrieved["item"]["id"]}
    assert len(json.dumps(ref)) < 100 and is_reference({**ref, "event_id": "event_a_0_3"})
    assert not is_reference(retrieved)
    for other in ({"type": "response.output_audio.delta", "delta": "AA=="}, {"type": "error", "error": {}}):
        assert logged_form(other) is None


def test_a_replay_rebuilds_the_event_sent_and_an_error_for_an_item_deleted_since() -> None:
    core, retrieved = core_with_item("hello " * 1000)
    sent = {**retrieved, "event_id": "event_abc_0_4"}
    ref = {**logged_form(retrieved), "event_id": "event_abc_0_4"}  # type: ignore[dict-item]
    other = {"type": "conversation.item.done", "event_id": "event_abc_0_5", "item": {}}
    replay = rebuilt([ref, other], core)
    assert next(replay) == sent
    assert next(replay) is other
    core.handle_client_event({"type": "conversation.item.delete", "item_id": retrieved["item"]["id"]}, 0.3)
    (gone,) = rebuilt([ref], core)
    assert gone["type"] == "error" and gone["event_id"] == "event_abc_0_4"
    assert gone["error"]["code"] == "item_not_found" and gone["error"]["param"] == "item_id"


def test_the_replay_is_made_as_it_is_read() -> None:
    core, retrieved = core_with_item("a")
    refs = [{**logged_form(retrieved), "event_id": f"event_abc_0_{i}"} for i in range(1, 4)]  # type: ignore[dict-item]
    replay = rebuilt(refs, core)
    first = next(replay)  # made now: a change after it shows in the next one
    core.handle_client_event({"type": "conversation.item.delete", "item_id": retrieved["item"]["id"]}, 0.3)
    assert first["type"] == "conversation.item.retrieved"
    assert [e["type"] for e in replay] == ["error", "error"]
