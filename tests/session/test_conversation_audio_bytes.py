"""`Conversation.audio_bytes_in_memory` (what /metrics sums every second for every session)
counts what a walk over the whole conversation counts, though it stops where `retain_audio`
does: at the oldest item that may still hold audio."""

from __future__ import annotations

import random

import numpy as np
import pytest

from media.audio import PCM24K
from session.realtime.audio_store import MemoryAudioStore
from session.realtime.conversation import Content, Conversation, Item

pytestmark = pytest.mark.unit


def _whole_walk(conversation: Conversation) -> int:
    parts = [part for item in conversation.items for part in item.content]
    in_arrays = sum(p.input_audio.nbytes for p in parts if p.input_audio is not None)
    in_bytearrays = sum(len(p.output_audio) for p in parts if p.output_audio is not None)
    pending_spills = sum(p.spilled.resident_bytes for p in parts if p.spilled is not None)
    return in_arrays + in_bytearrays + pending_spills


def _user(item_id: str, ms: int) -> Item:
    part = Content(type="input_audio", input_audio=np.ones(16 * ms, dtype=np.int16))
    return Item(id=item_id, type="message", role="user", content=[part])


def _assistant(item_id: str, ms: int, status: str = "completed") -> Item:
    part = Content(type="output_audio", transcript="hi", output_format=PCM24K)
    part.output_audio = bytearray(PCM24K.bytes_for_ms(ms))
    return Item(id=item_id, type="message", role="assistant", status=status, content=[part])  # type: ignore[arg-type]


def _text(item_id: str) -> Item:
    return Item(id=item_id, type="message", role="user", content=[Content(type="input_text", text="typed")])


def test_counts_what_a_whole_walk_counts_as_turns_go_by() -> None:
    for store in (None, MemoryAudioStore()):
        rng = random.Random(3)
        conversation = Conversation(store)
        for turn in range(150):
            conversation.insert(_user(f"user_{turn}", rng.choice([0, 400, 2000])))
            if rng.random() < 0.2:
                conversation.insert(_text(f"text_{turn}"))
            conversation.retain_audio(6.0)
            answer = _assistant(f"answer_{turn}", rng.choice([200, 2000]), status="in_progress")
            conversation.insert(answer)
            assert conversation.audio_bytes_in_memory() == _whole_walk(conversation)
            answer.status = "completed"
            conversation.retain_audio(6.0)
            assert conversation.audio_bytes_in_memory() == _whole_walk(conversation)
        assert _whole_walk(conversation) > 0  # the newest turns still hold audio
