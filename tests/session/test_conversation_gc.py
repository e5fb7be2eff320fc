"""Conversation items leave the cyclic GC's scans (a full collection stops the event loop for
as long as it takes to scan every tracked object, and every turn adds items that live as long
as the session), and reference counting alone still frees them."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest

from session.realtime.conversation import Content, Conversation, Item
from session.realtime.gc_untrack import untrack
from tests.session.realtime_harness import Harness, tone

pytestmark = pytest.mark.unit


def _conversation_objects(conversation: Conversation) -> Iterator[object]:
    for item in conversation.items:
        yield item
        yield item.content
        yield from item.content


def _turns(h: Harness, n: int) -> None:
    h.push_to_talk()
    for _ in range(n):
        h.append(tone(0.3))
        h.send({"type": "input_audio_buffer.commit"})
        h.send({"type": "response.create"})
        h.respond()


def test_a_sessions_items_and_their_parts_are_not_scanned() -> None:
    h = Harness()
    _turns(h, 3)
    conversation = h.core.conversation
    assert len(conversation) == 6  # three user turns, three answers (parts added after insert)
    assert all(len(item.content) == 1 for item in conversation.items)
    assert not any(gc.is_tracked(obj) for obj in _conversation_objects(conversation))


def test_reference_counting_frees_a_conversation_without_the_gc() -> None:
    audio = np.ones(1600, np.int16)
    alive = weakref.ref(audio)
    gc.disable()
    try:
        conversation = Conversation()
        part = Content(type="input_audio", input_audio=audio)
        conversation.insert(Item("item_1", "message", role="user", content=[part]))
        del audio, part
        assert alive() is not None
        del conversation
        assert alive() is None  # freed at once: no collection needed
    finally:
        gc.enable()


def test_no_cycle_runs_through_a_sessions_items() -> None:
    """A whole core after turns: once it is gone (its own cycles collected), so is every
    array its items held. An item caught in a cycle would keep its array alive forever."""
    h = Harness()
    _turns(h, 3)
    arrays = [
        weakref.ref(part.input_audio)
        for item in h.core.conversation.items
        for part in item.content
        if part.input_audio is not None
    ]
    assert arrays and all(ref() is not None for ref in arrays)
    del h
    gc.collect()
    assert all(ref() is None for ref in arrays)


def test_untrack_leaves_untracked_objects_and_atoms_alone() -> None:
    items: list[object] = [1, "text", (1, 2)]
    untrack(items)
    assert not gc.is_tracked(items)
    for atom in (1, "text"):
        untrack(atom)  # never tracked: nothing happens
        assert not gc.is_tracked(atom)
