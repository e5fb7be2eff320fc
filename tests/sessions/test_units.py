"""No-network units: stored records round-trip, a core restored from them, the transport link
(held release with skip, slow client closed with 1008), resume ids."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session.link import DIRECT_MAX_BYTES, ConnectionInfo, LinkEnd, TransportLink
from session.realtime import CoreOptions, RealtimeSessionCore
from session.realtime.config import SessionConfig, SessionIn
from session.realtime.effects import StartResponse
from session.realtime.ids import SequentialIds
from session.realtime.records import config_from_record, item_from_record, item_to_record
from session.resume import connection_event, event_position, logged_event_id, replayed_through
from session.store.event_ids import EventRef, parse_event_id, split_events
from session.voice.turn_gate import TurnGate, TurnRejected

pytestmark = pytest.mark.unit


def text_item(text: str) -> dict[str, Any]:
    return {
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]},
    }


def started_core() -> RealtimeSessionCore:
    core = RealtimeSessionCore(CoreOptions(session_id="sess_unit", new_id=SequentialIds()))
    core.start(0.0, 1_800_000_000.0)
    return core


def restored_core(records: list[dict[str, Any]], **kwargs: Any) -> RealtimeSessionCore:
    """A core rebuilt at t=100 s from `records`, 30 s of its 60 s lifetime left."""
    options = CoreOptions(session_id="sess_unit", new_id=SequentialIds(), max_duration_s=60)
    return RealtimeSessionCore.restore(
        options, records, now=100.0, epoch=1_800_000_010.0, expires_at=1_800_000_040.0, **kwargs
    )


def test_config_round_trips_through_its_record() -> None:
    config = SessionConfig(model="m").apply_update(
        SessionIn.model_validate(
            {
                "type": "realtime",
                "instructions": "be brief",
                "output_modalities": ["text"],
                "audio": {
                    "input": {
                        "transcription": {"model": "whisper-1"},
                        "turn_detection": {"type": "server_vad", "silence_duration_ms": 700},
                    },
                    "output": {"voice": "verse", "format": {"type": "audio/pcmu"}},
                },
            }
        )
    )
    core = RealtimeSessionCore(CoreOptions(config=config, session_id="sess_unit", new_id=SequentialIds()))
    core.start(0.0, 1_800_000_000.0)
    changes = core.take_state_changes()
    assert changes is not None and changes.config is not None
    assert config_from_record(changes.config, default_model="other") == config
    assert core.take_state_changes() is None  # nothing new


def test_state_changes_follow_item_boundaries_not_deltas() -> None:
    core = started_core()
    core.take_state_changes()
    core.handle_client_event(text_item("hi"), 1.0)
    changes = core.take_state_changes()
    assert changes is not None and [r["content"][0]["text"] for r, _ in changes.upserts] == ["hi"]
    assert changes.upserts[0][1] == "root"
    out = core.handle_client_event({"type": "response.create"}, 1.1)
    start = next(e for e in out.effects if isinstance(e, StartResponse))
    core.on_response_text(start.response_id, "hello", 1.2)
    opened = core.take_state_changes()  # the assistant item, opened in progress
    assert opened is not None and opened.upserts[0][0]["status"] == "in_progress"
    core.on_response_text(start.response_id, " there", 1.3)
    assert core.take_state_changes() is None  # a delta persists nothing
    core.on_response_done(start.response_id, "completed", now=1.4)
    done = core.take_state_changes()
    assert done is not None
    record, previous = done.upserts[0]
    assert record["status"] == "completed" and record["content"][0]["transcript"] == "hello there"
    assert previous == changes.upserts[0][0]["id"]


def test_restored_core_has_the_history_and_ends_orphans() -> None:
    core = started_core()
    core.handle_client_event(text_item("first"), 1.0)
    out = core.handle_client_event({"type": "response.create"}, 1.1)
    start = next(e for e in out.effects if isinstance(e, StartResponse))
    core.on_response_text(start.response_id, "reply", 1.2)  # cut here: the item stays in progress
    records = [item_to_record(item) for item in core.conversation.items]
    assert item_from_record(records[0]).text_for_history() == "first"

    restored = restored_core(records, conversation_id=core.conversation_id)
    assert restored.started and restored.next_deadline() == 130.0
    ended = restored.close_orphaned_responses(100.0)
    done = ended.events[-1]
    assert done["type"] == "response.done" and done["response"]["id"] == start.response_id
    assert done["response"]["status"] == "failed"
    assert restored.conversation.items[-1].status == "incomplete"
    restored.handle_client_event(text_item("second"), 101.0)
    out = restored.handle_client_event({"type": "response.create"}, 101.1)
    params = next(e for e in out.effects if isinstance(e, StartResponse)).params
    assert params["text"] == "second"
    assert params["history"] == [{"role": "user", "text": "first"}, {"role": "assistant", "text": "reply"}]


class FakeTransport:
    def __init__(self, *, stuck: bool = False) -> None:
        self.info = ConnectionInfo()
        self.sent: list[dict[str, Any]] = []
        self.closed: tuple[int, str] | None = None
        self.stuck = stuck
        self.frames: asyncio.Queue[str | None] = asyncio.Queue()

    async def send(self, event: dict[str, Any]) -> None:
        if self.stuck:
            await asyncio.Event().wait()
        self.sent.append(event)

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)

    async def receive(self) -> str | None:
        return await self.frames.get()


def ev(seq: int) -> dict[str, Any]:
    return {"type": "x", "event_id": f"event_abcdefgh_0_{seq}"}


async def test_held_link_sends_preamble_then_skips_what_the_replay_had() -> None:
    transport = FakeTransport()
    link = TransportLink(transport, lambda _: None, limit=16, held=True)
    for s in (3, 4, 5):
        link.push(ev(s))
    await asyncio.sleep(0.01)
    assert transport.sent == []  # held
    link.release(
        [{"type": "omni.session.resumed", "event_id": "r"}, ev(2), ev(3), ev(4)],
        skip=replayed_through((4, 0)),
    )
    link.push(ev(6))
    await asyncio.sleep(0.01)
    assert [e["event_id"] for e in transport.sent] == ["r"] + [ev(s)["event_id"] for s in (2, 3, 4, 5, 6)]
    await link.aclose()


async def test_slow_client_link_closes_1008_and_drops_its_outbox() -> None:
    transport = FakeTransport(stuck=True)
    link = TransportLink(transport, lambda _: None, limit=8, name="slow")
    pushed = [link.push(ev(s)) for s in range(1, 20)]
    assert pushed.count(True) == 8 and not link.open
    assert await asyncio.wait_for(link.wait(), 2) is LinkEnd.SLOW_CLIENT
    assert transport.closed is not None and transport.closed[0] == 1008
    assert link.queued == 0


async def test_client_frames_reach_the_driver_and_end_on_none() -> None:
    transport = FakeTransport()
    got: list[str] = []
    link = TransportLink(transport, got.append, limit=8)
    transport.frames.put_nowait("a")
    transport.frames.put_nowait(None)
    assert await asyncio.wait_for(link.wait(), 2) is LinkEnd.CLIENT_GONE
    assert got == ["a"] and transport.closed is None


def test_connection_event_ids_map_to_the_logged_event_before_them() -> None:
    event = connection_event("omni.session.resumable", "event_abcdefgh_0_7", session_id="s")
    assert event["event_id"].startswith("event_abcdefgh_0_7:omni:")
    assert logged_event_id(event["event_id"]) == "event_abcdefgh_0_7"
    assert event_position(logged_event_id(event["event_id"])) == (7, 0)
    assert logged_event_id(None) is None and event_position("nope") == (0, 0)
    # A held event (kept in process) sits after the logged event it follows, before the next.
    held = connection_event("omni.session.resumed", "event_abcdefgh_0_7.3")
    assert logged_event_id(held["event_id"]) == "event_abcdefgh_0_7.3"
    assert (7, 0) < event_position("event_abcdefgh_0_7.3") < event_position("event_abcdefgh_0_8")
    skip = replayed_through(event_position("event_abcdefgh_0_7.3"))
    assert skip({"event_id": "event_abcdefgh_0_7.2"}) and skip({"event_id": "event_abcdefgh_0_7"})
    assert not skip({"event_id": "event_abcdefgh_0_7.4"}) and not skip({"event_id": "event_abcdefgh_0_8"})


def test_event_ids_that_are_not_ours_parse_to_none() -> None:
    """Hostile `last_event_id`s: no exception, just not an id of ours (a resume then resyncs)."""
    for text in (
        "event_abcdefgh_0_²",
        "event_abcdefgh_٣_7",  # an Arabic-Indic digit
        "event_abcdefgh_0_7.",
        "event_abcdefgh_0_7.0",
        "event_abcdefgh_0_7.x",
        "event_abcdefgh_0_0",
        "event_abcdefgh_0_7.3.1",
        "event__0_7",
    ):
        assert parse_event_id(text) is None, text
    assert parse_event_id("event_abcdefgh_2_0.5") == EventRef("abcdefgh", 2, 0, 5)


async def test_turn_gate_queues_briefly_then_refuses() -> None:
    gate = TurnGate(1, queue_limit=1, wait_s=0.05)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    with pytest.raises(TurnRejected, match="waiting"):  # the queue (1) is full
        await gate.acquire()
    gate.release()
    await waiter  # the queued turn got the freed slot
    with pytest.raises(TurnRejected, match="within"):
        await gate.acquire()
    gate.release()
    assert (gate.generating, gate.waiting, gate.rejected) == (0, 0, 2)


def test_split_events_keeps_each_stored_text() -> None:
    texts = [
        '{"type":"a","event_id":"e1","delta":"[x], {y}"}',
        '{"type":"b","event_id":"e2","n":[1,{"k":"]"}]}',
    ]
    events = split_events("[" + ",".join(texts) + "]")
    assert [e.wire for e in events] == texts
    assert events[1]["n"] == [1, {"k": "]"}] and split_events("[]") == []


def test_the_open_response_is_a_state_change_from_created_to_done() -> None:
    core = started_core()
    core.take_state_changes()
    core.handle_client_event(text_item("hi"), 1.0)
    core.take_state_changes()
    out = core.handle_client_event({"type": "response.create"}, 1.1)
    start = next(e for e in out.effects if isinstance(e, StartResponse))
    opened = core.take_state_changes()  # before any output: no item yet, but the response
    assert opened is not None and opened.open_response_changed and not opened.upserts
    assert opened.open_response == {"id": start.response_id, "audio": True}
    core.on_response_text(start.response_id, "hello", 1.2)
    assert not core.take_state_changes().open_response_changed  # type: ignore[union-attr]
    core.on_response_done(start.response_id, "completed", now=1.3)
    done = core.take_state_changes()
    assert done is not None and done.open_response_changed and done.open_response is None


def test_a_restored_open_response_without_output_is_ended_once() -> None:
    restored = restored_core([], conversation_id="conv_1", open_response={"id": "resp_lost", "audio": True})
    assert restored.take_state_changes() is None  # still open in the store until it is ended
    ended = restored.close_orphaned_responses(100.0, lost_replica="r1")
    done = [e for e in ended.events if e["type"] == "response.done"]
    assert len(done) == 1 and done[0]["response"]["id"] == "resp_lost"
    assert done[0]["response"]["status"] == "failed" and done[0]["response"]["output"] == []
    assert done[0]["response"]["status_details"]["error"]["code"] == "replica_lost"
    cleared = restored.take_state_changes()
    assert cleared is not None and cleared.open_response_changed and cleared.open_response is None
    assert restored.close_orphaned_responses(101.0).events == []


def test_a_restored_open_response_whose_item_was_truncated_is_still_ended() -> None:
    core = started_core()
    core.handle_client_event(text_item("first"), 1.0)
    out = core.handle_client_event({"type": "response.create"}, 1.1)
    start = next(e for e in out.effects if isinstance(e, StartResponse))
    core.on_response_audio(start.response_id, [0.1] * 4800, 24000, 1.2)
    item_id = core.conversation.items[-1].id
    core.handle_client_event(
        {"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0, "audio_end_ms": 50},
        1.3,
    )  # the item is no longer in progress, but its response still runs when the process dies
    records = [item_to_record(item) for item in core.conversation.items]
    restored = restored_core(
        records, conversation_id=core.conversation_id, open_response={"id": start.response_id, "audio": True}
    )
    done = [e for e in restored.close_orphaned_responses(100.0).events if e["type"] == "response.done"]
    assert [d["response"]["id"] for d in done] == [start.response_id]
    assert done[0]["response"]["status"] == "failed"


class NowaitTransport(FakeTransport):
    """A transport with a synchronous send: it writes while its buffer has `room`."""

    def __init__(self) -> None:
        super().__init__()
        self._room = asyncio.Event()
        self._room.set()
        self.direct: list[str] = []  # event ids written by send_nowait

    @property
    def room(self) -> bool:
        return self._room.is_set()

    @room.setter
    def room(self, value: bool) -> None:
        if value:
            self._room.set()
        else:
            self._room.clear()

    def send_nowait(self, event: dict[str, Any]) -> bool:
        if not self.room:
            return False
        self.sent.append(event)
        self.direct.append(event["event_id"])
        return True

    async def send(self, event: dict[str, Any]) -> None:
        await self._room.wait()  # no room: the ASGI send waits
        self.sent.append(event)


async def test_an_event_pushed_to_an_idle_link_leaves_in_the_same_step() -> None:
    transport = NowaitTransport()
    link = TransportLink(transport, lambda _: None, limit=8, send_nowait=transport.send_nowait)
    await asyncio.sleep(0.01)  # the sender waits for events
    assert link.push(ev(1))
    assert transport.direct == [ev(1)["event_id"]]  # written before any await
    await link.aclose()


async def test_events_behind_a_full_send_buffer_keep_their_order() -> None:
    transport = NowaitTransport()
    link = TransportLink(transport, lambda _: None, limit=8, send_nowait=transport.send_nowait)
    await asyncio.sleep(0.01)
    transport.room = False
    link.push(ev(1))  # refused by send_nowait: queued; the sender waits in send
    await asyncio.sleep(0.01)
    transport.room = True
    link.push(ev(2))  # the sender is still busy with 1: 2 must wait behind it
    link.push(ev(3))
    await asyncio.sleep(0.02)
    assert [e["event_id"] for e in transport.sent] == [ev(s)["event_id"] for s in (1, 2, 3)]
    assert transport.direct == []
    link.push(ev(4))  # idle again: the fast path
    assert transport.direct == [ev(4)["event_id"]]
    await link.aclose()


async def test_a_resumed_link_checks_events_against_the_replay_before_any_fast_send() -> None:
    transport = NowaitTransport()
    link = TransportLink(transport, lambda _: None, limit=16, held=True, send_nowait=transport.send_nowait)
    link.push(ev(3))  # held: queued
    assert transport.direct == []
    link.release([ev(2), ev(3), ev(4)], skip=replayed_through((4, 0)))
    await asyncio.sleep(0.01)  # preamble sent, 3 skipped; the replay check is still pending
    link.push(ev(4))  # the replay had it: dropped, not written past the check
    link.push(ev(5))
    await asyncio.sleep(0.01)
    assert [e["event_id"] for e in transport.sent] == [ev(s)["event_id"] for s in (2, 3, 4, 5)]
    link.push(ev(6))  # the check is done: the fast path
    assert transport.direct == [ev(6)["event_id"]]
    await link.aclose()


async def test_a_fast_send_that_raises_ends_the_link_as_a_failed_send() -> None:
    transport = NowaitTransport()

    def broken(event: dict[str, Any]) -> bool:
        raise ConnectionResetError("peer gone")

    link = TransportLink(transport, lambda _: None, limit=8, send_nowait=broken)
    await asyncio.sleep(0.01)
    assert not link.push(ev(1))
    assert await asyncio.wait_for(link.wait(), 2) is LinkEnd.SEND_FAILED


class PushTransport(FakeTransport):
    """A connection that hands frames over as they are parsed (``deliver``)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_text: Any = None
        self.gone = asyncio.Event()

    async def deliver(self, on_text: Any) -> None:
        self.on_text = on_text
        await self.gone.wait()


async def test_a_delivering_connection_hands_frames_to_the_driver_without_a_task_hop() -> None:
    transport = PushTransport()
    got: list[str] = []
    link = TransportLink(transport, got.append, limit=8, deliver=transport.deliver)
    await asyncio.sleep(0.01)
    transport.on_text("a")
    assert got == ["a"]  # handled inside the call: no task in between
    transport.gone.set()
    assert await asyncio.wait_for(link.wait(), 2) is LinkEnd.CLIENT_GONE
    assert transport.closed is None


async def test_a_delivered_frame_that_fails_ends_the_link_1011() -> None:
    transport = PushTransport()

    def broken(raw: str) -> None:
        raise ValueError("a bug in the handler")

    link = TransportLink(transport, broken, limit=8, deliver=transport.deliver)
    await asyncio.sleep(0.01)
    transport.on_text("x")  # does not raise into the connection
    assert await asyncio.wait_for(link.wait(), 2) is LinkEnd.RECEIVE_ERROR
    assert transport.closed == (1011, "internal error")
    transport.on_text("y")  # the link stopped reading: not handled


async def test_a_large_event_always_goes_through_the_outbox() -> None:
    transport = NowaitTransport()
    link = TransportLink(transport, lambda _: None, limit=8, send_nowait=transport.send_nowait)
    await asyncio.sleep(0.01)
    big = {**ev(1), "item": "x" * (DIRECT_MAX_BYTES + 1)}  # a retrieved item of MBs, say
    link.push(big)
    assert transport.direct == [] and link.queued == 1  # counted against the outbox's bytes
    await asyncio.sleep(0.01)
    assert transport.sent == [big]
    await link.aclose()
