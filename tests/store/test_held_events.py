"""Held events: audio deltas are stamped and sent like any event but kept by the writer's
process, not in Redis; a resume there gets them back in place, a resume elsewhere is told."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest
import redis.asyncio

from session.store import SessionStore, SessionWriter
from session.store.errors import ReplayUnavailable
from session.store.event_ids import parse_event_id

pytestmark = pytest.mark.system


@pytest.fixture
async def store(redis_client: redis.asyncio.Redis) -> SessionStore:
    s = SessionStore(redis_client)
    await s.load_scripts()
    return s


async def writer_on(redis_client: redis.asyncio.Redis, **bounds: Any) -> SessionWriter:
    """A new session's writer on a store with these held-event bounds."""
    bounded = SessionStore(redis_client, **bounds)
    record, _ = await bounded.create_session("t")
    return SessionWriter(bounded, record)


def audio(i: int, size: int = 8) -> dict[str, Any]:
    return {"type": "response.output_audio.delta", "response_id": "resp_1", "delta": f"{i:0{size}d}"}


def text(i: int) -> dict[str, Any]:
    return {"type": "response.output_audio_transcript.delta", "response_id": "resp_1", "delta": f"w{i}"}


def stream(writer: SessionWriter, n: int, *, size: int = 8) -> list[dict[str, Any]]:
    """A response: created, then audio deltas with a transcript delta every fourth."""
    sent = [writer.append({"type": "response.created", "response": {"id": "resp_1"}})]
    for i in range(n):
        sent.append(writer.append(audio(i, size)))
        if i % 4 == 3:
            sent.append(writer.append(text(i)))
    sent.append(writer.append({"type": "response.done", "response": {"id": "resp_1"}}))
    return sent


def held_size(events: list[dict[str, Any]]) -> int:
    """What holding these deltas (one response's, one shape) counts: their PCM, and once the
    JSON text around it less the event id's position."""
    first = events[0]
    position = str(first["event_id"]).rpartition("_")[2]
    shape = len(first.wire) - len(first["delta"]) - len(position)  # type: ignore[attr-defined]
    return shape + sum(len(base64.b64decode(e["delta"])) for e in events)


def positions(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    refs = [parse_event_id(str(e["event_id"])) for e in events]
    assert all(r is not None for r in refs)
    return [r.position for r in refs if r is not None]


async def test_audio_deltas_are_not_logged_and_replay_puts_them_back_in_order(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    sent = stream(writer, 40)
    assert sorted(positions(sent)) == positions(sent) and len(set(positions(sent))) == len(sent)
    await writer.flush()
    logged = await store.events_after(record.session_id, None)
    assert logged == [e for e in sent if e["type"] != "response.output_audio.delta"]
    # Redis' seqs stay contiguous: the deltas take no seq of their own.
    assert [p for p, _ in positions(logged)] == list(range(1, len(logged) + 1))
    # Held as PCM (3/4 of the base64) and the JSON around it once, not as each event's text.
    held = [e for e in sent if e["type"] == "response.output_audio.delta"]
    assert writer.held_bytes == held_size(held) < sum(len(e.wire) for e in held)

    whole = await writer.replay(None)
    assert whole.held == "complete" and whole.events == sent
    for cut in (0, 1, 2, 5, 7, len(sent) - 2, len(sent) - 1):  # after a logged or a held event
        replay = await writer.replay(str(sent[cut]["event_id"]))
        assert replay.held == "complete"
        assert replay.events == sent[cut + 1 :], cut
        assert [e.wire for e in replay.events] == [e.wire for e in sent[cut + 1 :]]  # sent as stored


async def test_the_held_bound_drops_the_oldest_and_a_replay_across_them_says_trimmed(
    redis_client: redis.asyncio.Redis,
) -> None:
    writer = await writer_on(redis_client, held_max_bytes=1_000)
    sent = stream(writer, 60, size=40)
    assert writer.held_bytes <= 1_000 and writer.held_dropped > 0
    held = [e for e in sent if e["type"] == "response.output_audio.delta"]
    kept = held[writer.held_dropped :]
    # From before the dropped ones: every logged event, the kept deltas, and "trimmed".
    early = await writer.replay(str(sent[0]["event_id"]))
    assert early.held == "trimmed"
    assert early.events == [e for e in sent[1:] if e["type"] != "response.output_audio.delta" or e in kept]
    # From after them: complete.
    late = await writer.replay(str(kept[0]["event_id"]))
    assert late.held == "complete" and late.events == sent[sent.index(kept[0]) + 1 :]


async def test_held_events_older_than_the_window_are_dropped(
    redis_client: redis.asyncio.Redis,
) -> None:
    writer = await writer_on(redis_client, held_window_s=0.05)
    first = stream(writer, 4)
    await asyncio.sleep(0.1)
    second = writer.append(audio(99))
    assert writer.held_dropped == 4 and writer.held_bytes == held_size([second])
    replay = await writer.replay(str(first[0]["event_id"]))
    assert replay.held == "trimmed" and replay.events == [
        e for e in first[1:] if "audio." not in e["type"]
    ] + [second]


async def test_a_detached_session_keeps_what_it_held_when_the_connection_went(
    redis_client: redis.asyncio.Redis,
) -> None:
    """While connected, the window runs from now; once detached, from when the connection
    went: what was sent just before it (maybe lost with the socket) and what was made while
    detached stay however long the resume takes; reattached, the window runs from now again."""
    writer = await writer_on(redis_client, held_window_s=0.2)
    before = stream(writer, 2)
    writer.set_state("detached")
    await asyncio.sleep(0.3)
    while_away = writer.append(audio(50))
    assert writer.held_dropped == 0  # the first deltas are older than 0.2 s, not than the detach
    replay = await writer.replay(str(before[0]["event_id"]))
    assert replay.held == "complete" and replay.events == [*before[1:], while_away]
    writer.set_state("active")  # the resume replayed them
    await asyncio.sleep(0.3)
    later = writer.append(audio(51))
    assert writer.held_dropped == 3 and writer.held_bytes == held_size([later])


async def test_a_restored_writer_replays_every_logged_event_and_says_the_audio_is_not_kept(
    store: SessionStore,
) -> None:
    record, _ = await store.create_session("t")
    before = SessionWriter(store, record)
    sent = stream(before, 12)
    await before.close()  # the process goes (a restart, a failover, a session parked)
    reloaded = await store.get_session("t", record.session_id)
    after = SessionWriter(store, reloaded)
    replay = await after.replay(str(sent[3]["event_id"]))
    assert replay.held == "not_kept"
    assert replay.events == [e for e in sent[4:] if e["type"] != "response.output_audio.delta"]
    # A delta before this writer logged anything of its own is logged (its held id would
    # follow the old process's last logged event and could repeat one that process sent).
    orphan = after.append(audio(500))
    assert parse_event_id(str(orphan["event_id"])).held == 0  # type: ignore[union-attr]
    # After that, deltas are held again.
    again = stream(after, 3)
    assert [parse_event_id(str(e["event_id"])).held > 0 for e in again[1:4]] == [True] * 3  # type: ignore[union-attr]
    # From an event this writer made, the replay is complete and carries its deltas.
    mine = await after.replay(str(again[0]["event_id"]))
    assert mine.held == "complete" and mine.events == again[1:]
    assert not set(positions(again)) & set(positions(sent))


async def test_a_held_id_the_writer_never_made_is_unknown(store: SessionStore) -> None:
    record, _ = await store.create_session("t")
    writer = SessionWriter(store, record)
    sent = stream(writer, 4)
    base = str(sent[0]["event_id"])
    with pytest.raises(ReplayUnavailable) as unknown:
        await writer.replay(base + ".999")
    assert unknown.value.reason == "unknown_event_id"
    with pytest.raises(ReplayUnavailable) as foreign:
        await writer.replay(base.replace(base.split("_")[1], "ZZZZZZZZ") + ".1")
    assert foreign.value.reason == "unknown_event_id"
