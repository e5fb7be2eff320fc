"""`RequestHandle.listen`: a consumer that does its work at once takes each payload in the
stage step that produced it (no task wake-up per payload); the iterator then yields the status,
or raises what the listener raised, in the consumer's own task."""

from __future__ import annotations

import asyncio

import pytest

from runtime.payloads import Payload, TextDelta
from runtime.progress import RequestHandle, RequestStatus

pytestmark = pytest.mark.unit


def delta(text: str) -> TextDelta:
    return TextDelta(text)


async def test_a_listener_gets_buffered_payloads_at_once_then_each_as_it_is_pushed() -> None:
    handle = RequestHandle("r1", bound=8)
    handle._push(delta("a"))
    handle._push(delta("b"))
    got: list[Payload] = []
    handle.listen(got.append)
    assert [p.text for p in got] == ["a", "b"] and handle.buffered == 0  # type: ignore[attr-defined]
    handle._push(delta("c"))
    assert [p.text for p in got] == ["a", "b", "c"]  # type: ignore[attr-defined]
    handle._close(RequestStatus("completed"))
    outs = [out async for out in handle]
    assert len(outs) == 1 and isinstance(outs[0], RequestStatus) and outs[0].status == "completed"


async def test_a_listener_that_raises_fails_the_consumer_not_the_producer() -> None:
    handle = RequestHandle("r1", bound=8)

    def listener(payload: Payload) -> None:
        if getattr(payload, "text", "") == "bad":
            raise ValueError("cannot handle this payload")

    handle.listen(listener)
    handle._push(delta("ok"))
    handle._push(delta("bad"))  # the stage step that pushed it goes on
    handle._push(delta("later"))  # buffered: the listener was dropped
    with pytest.raises(ValueError, match="cannot handle"):
        await asyncio.wait_for(handle.__anext__(), 1)
    later = await asyncio.wait_for(handle.__anext__(), 1)
    assert isinstance(later, TextDelta) and later.text == "later"


async def test_listen_none_goes_back_to_buffering() -> None:
    handle = RequestHandle("r1", bound=8)
    got: list[Payload] = []
    handle.listen(got.append)
    handle._push(delta("a"))
    handle.listen(None)
    handle._push(delta("b"))
    assert len(got) == 1 and handle.buffered == 1
    first = await asyncio.wait_for(handle.__anext__(), 1)
    assert isinstance(first, TextDelta) and first.text == "b"


async def test_listening_drains_a_full_buffer_and_lets_the_request_step_again() -> None:
    drained: list[bool] = []
    handle = RequestHandle("r1", bound=2, on_drain=lambda: drained.append(True))
    handle._push(delta("a"))
    handle._push(delta("b"))
    assert handle.full
    handle.listen(lambda _: None)
    assert not handle.full and drained == [True]
