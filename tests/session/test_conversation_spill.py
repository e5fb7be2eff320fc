"""Conversation audio off the heap: what a prompt can still need stays in memory, the rest is
spilled to the session's audio store and reads back identical (retrieve, truncate, records)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from session.realtime.audio_store import AudioStore, MemoryAudioStore, SpoolAudioStore
from session.realtime.records import item_to_record
from session.voice.driver import RealtimeDriver
from tests.session.realtime_harness import Harness, pcm16_b64, tone, types
from web.server.metrics import conversation_audio_bytes

pytestmark = pytest.mark.unit


@pytest.fixture(params=["memory", "spool"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AudioStore]:
    if request.param == "memory":
        yield MemoryAudioStore()
        return
    spool = SpoolAudioStore.open(tmp_path)
    try:
        yield spool
    finally:
        spool.close()


def settle(store: AudioStore) -> None:
    if isinstance(store, SpoolAudioStore):
        assert store.wait_idle()


def turn(h: Harness, seconds: float, *, reply_s: float = 0.5, freq: float = 300.0) -> str:
    """A push-to-talk turn answered with `reply_s` of audio; the user item id."""
    h.append(tone(seconds, freq=freq), chunk_s=0.04)
    item_id = str(h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"])
    h.send({"type": "response.create"})
    h.respond("one two three four", audio_s=reply_s, rate=24_000)
    return item_id


def retrieved(h: Harness, item_id: str) -> dict[str, Any]:
    out = h.send({"type": "conversation.item.retrieve", "item_id": item_id})
    assert types(out) == ["conversation.item.retrieved"], types(out)
    item: dict[str, Any] = out.events[0]["item"]
    return item


def audio_of(item: dict[str, Any]) -> bytes:
    return base64.b64decode(item["content"][0]["audio"])


def play_turns(h: Harness) -> list[str]:
    h.push_to_talk()
    return [turn(h, 0.6, freq=200.0 + 50 * k) for k in range(3)]


def test_answered_turns_are_spilled_and_retrieve_returns_identical_audio(store: AudioStore) -> None:
    spilled = Harness(audio_store=store, audio_retention_s=30.0)
    plain = Harness(audio_retention_s=30.0)  # the same session, audio kept in memory
    users = play_turns(spilled)
    assert play_turns(plain) == users
    settle(store)
    items = spilled.core.conversation.items
    assert len(items) == 6
    for item in items:  # every turn was answered: nothing left for a prompt
        part = item.content[0]
        assert part.spilled is not None and part.input_audio is None and part.output_audio is None
    for item_id in [i.id for i in items]:
        assert retrieved(spilled, item_id) == retrieved(plain, item_id)
        assert audio_of(retrieved(spilled, item_id))  # audio, not just transcripts
    # durations are known without reading back: the stored records say the same
    for a, b in zip(items, plain.core.conversation.items, strict=True):
        assert a.content[0].audio_ms() == pytest.approx(b.content[0].audio_ms())
        assert item_to_record(a) == item_to_record(b)
    # what /metrics counts as conversation audio in memory: nothing once the writes landed
    driver = RealtimeDriver(spilled.core, None)
    in_memory = conversation_audio_bytes([driver])
    assert in_memory == (
        0 if isinstance(store, SpoolAudioStore) else sum(i.content[0].spilled_len for i in items)
    )
    if isinstance(store, SpoolAudioStore):
        assert store.spooled_bytes == sum(i.content[0].spilled_len for i in items) > 0


def test_a_prompts_audio_stays_in_memory_until_its_response_ends(store: AudioStore) -> None:
    h = Harness(audio_store=store)
    h.push_to_talk()
    h.append(tone(0.4), chunk_s=0.04)
    first = str(h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"])
    h.append(tone(0.3), chunk_s=0.04)
    second = str(h.send({"type": "input_audio_buffer.commit"}).events[0]["item_id"])
    conversation = h.core.conversation
    # two trailing user turns: both are the next prompt
    assert all(conversation.get(i).content[0].input_audio is not None for i in (first, second))
    h.send({"type": "response.create"})
    assert len(h.started().params["audio"]) == pytest.approx(0.7 * 16_000, abs=4)
    rid = h.started().response_id
    h.take(h.core.on_response_audio(rid, tone(0.2), 24_000, h.now))
    assistant = conversation.items[-1]
    assert assistant.status == "in_progress" and assistant.content[0].output_audio is not None
    h.take(h.core.on_response_done(rid, "completed", now=h.now))
    assert all(conversation.get(i).content[0].spilled is not None for i in (first, second, assistant.id))


def test_truncate_of_spilled_assistant_audio(store: AudioStore) -> None:
    spilled = Harness(audio_store=store)
    plain = Harness()
    for h in (spilled, plain):
        h.push_to_talk()
        turn(h, 0.3, reply_s=1.0)
    assistant = spilled.core.conversation.items[1]
    assert assistant.content[0].spilled is not None
    full = audio_of(retrieved(spilled, assistant.id))
    for h in (spilled, plain):
        event = {"type": "conversation.item.truncate", "item_id": assistant.id, "content_index": 0}
        out = h.send({**event, "audio_end_ms": 1100})
        assert types(out) == ["error"]  # it still knows the audio lasted 1000 ms
        out = h.send({**event, "audio_end_ms": 400})
        assert types(out) == ["conversation.item.truncated"]
    settle(store)
    cut = retrieved(spilled, assistant.id)
    assert cut == retrieved(plain, assistant.id)
    assert audio_of(cut) == full[: 24 * 2 * 400]
    assert assistant.content[0].output_audio_ms() == 400
    assert item_to_record(assistant)["content"][0]["audio_ms"] == 400


def test_retention_and_delete_discard_spilled_audio(tmp_path: Path) -> None:
    spool = SpoolAudioStore.open(tmp_path)
    try:
        h = Harness(audio_store=spool, audio_retention_s=1.0)
        h.push_to_talk()
        users = [turn(h, 0.3, reply_s=0.2) for _ in range(4)]
        assert spool.wait_idle()
        holders = [i for i in h.core.conversation.items if any(p.has_audio for p in i.content)]
        assert 0 < len(holders) < 8  # the oldest turns' audio was dropped ...
        assert len(list(spool.directory.iterdir())) == len(holders)  # ... and its files removed
        assert "audio" not in retrieved(h, users[0])["content"][0]
        h.send({"type": "conversation.item.delete", "item_id": users[-1]})
        assert spool.wait_idle()
        assert len(list(spool.directory.iterdir())) == len(holders) - 1
        h.core.release_audio()  # the session ended
        assert spool.wait_idle()
        assert list(spool.directory.iterdir()) == [] and spool.spooled_bytes == 0
    finally:
        spool.close()


def test_a_response_over_an_older_spilled_item_gets_its_audio(store: AudioStore) -> None:
    h = Harness(audio_store=store)
    h.push_to_talk()
    first = turn(h, 0.5)
    turn(h, 0.3)
    assert h.core.conversation.get(first).content[0].spilled is not None
    settle(store)
    h.send({"type": "response.create", "response": {"input": [{"type": "item_reference", "id": first}]}})
    audio = h.started().params["audio"]
    assert len(audio) == pytest.approx(0.5 * 16_000, abs=4)
    plain = Harness()
    plain.push_to_talk()
    turn(plain, 0.5)
    np.testing.assert_array_equal(audio, plain.core.conversation.get(first).audio_16k)


def test_client_created_audio_items_spill_once_followed(store: AudioStore) -> None:
    h = Harness(audio_store=store)
    content = [{"type": "input_audio", "audio": pcm16_b64(tone(0.5))}]
    h.send(
        {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": content}}
    )
    user = h.core.conversation.items[-1]
    assert user.content[0].input_audio is not None  # trailing: a prompt may need it
    text = [{"type": "input_text", "text": "and what about this?"}]
    h.send(
        {"type": "conversation.item.create", "item": {"type": "message", "role": "system", "content": text}}
    )
    assert user.content[0].spilled is not None and user.content[0].input_audio is None
    settle(store)
    back = np.frombuffer(audio_of(retrieved(h, user.id)), "<i2")
    assert len(back) == pytest.approx(0.5 * 24_000, abs=3)
