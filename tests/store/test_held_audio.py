"""HeldEvents keeps audio deltas as PCM bytes and rebuilds each event's text on a replay, byte
for byte the text that was sent; what it counts is what it keeps."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest

from session.store.event_ids import parse_event_id
from session.store.held_events import HeldEvents

pytestmark = pytest.mark.unit

FRAME = 1920  # 40 ms of 24 kHz PCM16, the server's default output frame


def delta(response: str, pcm: bytes, *, index: int = 0) -> dict[str, Any]:
    """As the realtime core makes it: ``event_id`` second (a placeholder the writer stamps)."""
    return {
        "type": "response.output_audio.delta",
        "event_id": None,
        "response_id": response,
        "item_id": "item_" + response,
        "output_index": 0,
        "content_index": index,
        "delta": base64.b64encode(pcm).decode(),
    }


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def replay_all(held: HeldEvents) -> list[dict[str, Any]]:
    return held.merge([], (0, 0), 10**9, lambda e: 0)


def shape_bytes(sent: dict[str, Any]) -> int:
    position = str(sent["event_id"]).rpartition("_")[2]
    return len(sent.wire) - len(sent["delta"]) - len(position)  # type: ignore[attr-defined]


def test_a_replayed_delta_is_byte_for_byte_the_event_sent() -> None:
    held = HeldEvents(max_bytes=10 * 2**20, window_s=60.0)
    sent = []
    for r, response in enumerate(("resp_a", "resp_b")):
        for i in range(30):
            pcm = os.urandom(FRAME - 2 * i)  # frames of any length, a final short one included
            sent.append(held.hold(delta(response, pcm), tag="abcd1234", epoch=3, seq=7 + r))
    replayed = replay_all(held)
    assert [e.wire for e in replayed] == [e.wire for e in sent]  # type: ignore[attr-defined]
    assert replayed == sent
    assert [parse_event_id(str(e["event_id"])).position for e in replayed] == [  # type: ignore[union-attr]
        (7 + n // 30, n + 1) for n in range(60)
    ]
    # What is counted is what is kept: the PCM, and each response's JSON around it once.
    pcm = sum(len(base64.b64decode(e["delta"])) for e in sent)
    assert held.nbytes == pcm + shape_bytes(sent[0]) + shape_bytes(sent[30])
    assert held.nbytes < 0.76 * sum(len(e.wire) for e in sent)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "odd",
    [
        "AAE=\n",  # a newline: not canonical
        "AB==",  # padding bits set: decodes, re-encodes to "AA=="
        "not base64!",
        "",
        "é",
    ],
)
def test_a_delta_that_is_not_canonical_base64_is_kept_as_its_text(odd: str) -> None:
    held = HeldEvents()
    event = delta("resp_a", b"\x00\x01")
    event["delta"] = odd
    sent = held.hold(event, tag="abcd1234", epoch=0, seq=1)
    good = held.hold(delta("resp_a", b"\x02\x03"), tag="abcd1234", epoch=0, seq=1)
    assert held.nbytes == len(sent.wire) + shape_bytes(good) + 2  # type: ignore[attr-defined]
    replayed = replay_all(held)
    assert replayed == [sent, good]
    assert [e.wire for e in replayed] == [sent.wire, good.wire]  # type: ignore[attr-defined]


def test_the_byte_bound_counts_pcm_and_frees_a_shape_with_its_last_event() -> None:
    held = HeldEvents(max_bytes=20 * FRAME)
    first = [held.hold(delta("resp_a", os.urandom(FRAME)), tag="t", epoch=0, seq=1) for _ in range(10)]
    second = [held.hold(delta("resp_b", os.urandom(FRAME)), tag="t", epoch=0, seq=2) for _ in range(15)]
    assert held.nbytes <= 20 * FRAME
    kept = len(held)
    assert held.dropped == 25 - kept and held.dropped >= 6
    assert held.dropped_position == (1 if held.dropped <= 10 else 2, held.dropped)
    expected = kept * FRAME + shape_bytes(second[0]) + (shape_bytes(first[0]) if kept > 15 else 0)
    assert held.nbytes == expected
    assert replay_all(held) == (first + second)[-kept:]


def test_the_age_bound_runs_from_the_detach_while_detached() -> None:
    clock = Clock()
    held = HeldEvents(window_s=5.0, clock=clock)
    early = held.hold(delta("resp_a", b"\x01\x02\x03"), tag="t", epoch=0, seq=1)
    held.set_detached(True)
    clock.now += 30.0
    late = held.hold(delta("resp_a", b"\x04\x05\x06"), tag="t", epoch=0, seq=1)
    assert held.dropped == 0 and replay_all(held) == [early, late]
    held.set_detached(False)
    clock.now += 0.1
    last = held.hold(delta("resp_a", b"\x07\x08\x09"), tag="t", epoch=0, seq=1)
    assert held.dropped == 1 and replay_all(held) == [late, last]  # late is 0.1 s old
    clock.now += 5.5
    newest = held.hold(delta("resp_a", b"\x0a\x0b\x0c"), tag="t", epoch=0, seq=1)
    assert held.dropped == 3 and replay_all(held) == [newest]
    assert held.nbytes == 3 + shape_bytes(newest)


def test_merge_puts_held_events_after_the_logged_event_they_follow() -> None:
    held = HeldEvents()
    a = held.hold(delta("resp_a", b"\x01\x02\x03"), tag="t", epoch=0, seq=1)
    b = held.hold(delta("resp_a", b"\x04\x05\x06"), tag="t", epoch=0, seq=2)
    logged = [{"event_id": "event_t_0_2", "type": "x"}, {"event_id": "event_t_0_3", "type": "y"}]

    def seq(event: Any) -> int:
        return int(str(event["event_id"]).rpartition("_")[2])

    assert held.merge(logged, (1, 0), 3, seq) == [a, logged[0], b, logged[1]]
    assert held.merge(logged, (1, 1), 3, seq) == [logged[0], b, logged[1]]
    assert held.merge(logged[:1], (1, 1), 1, seq) == [logged[0]]  # b follows seq 2 > through
