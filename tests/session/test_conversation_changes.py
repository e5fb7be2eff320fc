"""`Conversation.take_changes`: the changed items in conversation order, each with the id of
the item before it, whatever the order and place of the changes (it looks from the newest item
back only as far as the oldest changed one)."""

from __future__ import annotations

import random

import pytest

from session.realtime.conversation import Content, Conversation, Item

pytestmark = pytest.mark.unit


def _item(item_id: str, text: str = "hi") -> Item:
    return Item(id=item_id, type="message", role="user", content=[Content(type="input_text", text=text)])


def _expected(conversation: Conversation, changed: set[str]) -> list[tuple[str, str]]:
    """What a walk over the whole conversation gives (the definition)."""
    items = conversation.items
    return [(item.id, items[i - 1].id if i else "root") for i, item in enumerate(items) if item.id in changed]


def test_changes_come_in_conversation_order_with_their_previous_ids() -> None:
    conversation = Conversation()
    for n in range(6):
        conversation.insert(_item(f"item_{n}"))
    conversation.insert(_item("first"), "root")
    conversation.insert(_item("middle"), "item_2")
    conversation.take_changes()

    conversation.mark_changed("item_5")
    conversation.mark_changed("first")
    conversation.mark_changed("middle")
    conversation.delete("item_0")
    deleted, upserts = conversation.take_changes() or ([], [])

    assert deleted == ["item_0"]
    assert [(item.id, previous) for item, previous in upserts] == [
        ("first", "root"),
        ("middle", "item_2"),
        ("item_5", "item_4"),
    ]
    assert conversation.take_changes() is None


def test_a_change_to_a_deleted_item_is_not_looked_for() -> None:
    conversation = Conversation()
    for n in range(4):
        conversation.insert(_item(f"item_{n}"))
    conversation.take_changes()
    conversation.mark_changed("item_1")
    conversation.delete("item_1")
    conversation.mark_changed("item_3")
    assert conversation.take_changes() == (["item_1"], [(conversation.get("item_3"), "item_2")])


def test_random_edits_match_a_walk_over_the_whole_conversation() -> None:
    rng = random.Random(7)
    conversation = Conversation()
    ids: list[str] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not ids:
            item_id = f"item_{step}"
            previous = rng.choice([None, None, "root", *ids[-3:]]) if ids else None
            conversation.insert(_item(item_id), previous)
            ids.append(item_id)
        elif op < 0.8:
            conversation.mark_changed(rng.choice(ids))
        else:
            victim = rng.choice(ids)
            conversation.delete(victim)
            ids.remove(victim)
        if step % 7 == 0:
            changed = set(conversation._changed)
            expected = _expected(conversation, changed)
            taken = conversation.take_changes()
            got = [] if taken is None else [(item.id, previous) for item, previous in taken[1]]
            assert got == expected
