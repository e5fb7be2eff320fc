"""Mutated realtime client events (issue 13's fuzzer): well-formed events with fields dropped,
retyped, nested deep, made huge, given lone surrogates or unknown keys, and frames cut short or
broken. Shared by ``tests/sessions/test_fuzz.py`` (no crash, no broken session) and
``loadtest/bench_fuzz.py`` (what a fuzzing session costs in server + Redis RSS)."""

from __future__ import annotations

import base64
import json
import random
from typing import Any


def base_events(rng: random.Random) -> list[dict[str, Any]]:
    audio = base64.b64encode(rng.randbytes(960)).decode()
    text_item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fuzz me"}]}
    return [
        {
            "type": "session.update",
            "session": {"type": "realtime", "instructions": "be brief", "output_modalities": ["text"]},
        },
        {
            "type": "session.update",
            "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
        },
        {
            "type": "session.update",
            "session": {
                "type": "realtime",
                "tools": [
                    {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
                ],
                "tool_choice": "auto",
            },
        },
        {"type": "input_audio_buffer.append", "audio": audio},
        {"type": "input_audio_buffer.commit"},
        {"type": "input_audio_buffer.clear"},
        {"type": "output_audio_buffer.clear"},
        {"type": "conversation.item.create", "item": text_item},
        {
            "type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        },
        {"type": "conversation.item.retrieve", "item_id": "item_x"},
        {"type": "conversation.item.truncate", "item_id": "item_x", "content_index": 0, "audio_end_ms": 10},
        {"type": "conversation.item.delete", "item_id": "item_x"},
        {"type": "response.create", "response": {"output_modalities": ["text"], "instructions": "short"}},
        {"type": "response.cancel"},
    ]


def weird_value(rng: random.Random) -> Any:
    choice = rng.randrange(12)
    if choice == 0:
        return "\ud800" + "x" * rng.randrange(5)  # a lone surrogate
    if choice == 1:
        value: Any = "deep"
        for _ in range(rng.choice([70, 300, 900])):
            value = [value] if rng.random() < 0.5 else {"k": value}
        return value
    if choice == 2:
        return "h" * rng.choice([1_000, 50_000, 400_000])  # the 1.9 MB cases: test_abuse_sessions.py
    if choice == 3:
        return rng.choice([-1, 0, 2**63, -(2**70), 1e308, float("nan"), float("inf")])
    if choice == 4:
        return rng.choice([None, True, [], {}, [1, 2], {"type": None}])
    if choice == 5:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
    if choice == 6:
        return base64.b64encode(rng.randbytes(rng.randrange(1, 5000))).decode()
    if choice == 7:
        return {"type": rng.choice(["server_vad", "semantic_vad", "nope"]), "threshold": rng.random() * 3}
    if choice == 8:
        return rng.choice(["item_x", "root", "", "item_" + "z" * 300])
    if choice == 9:
        return [weird_value(rng) for _ in range(rng.randrange(0, 4))]
    if choice == 10:
        return {"\udfff": 1} if rng.random() < 0.5 else {"unknown_field": weird_value(rng)}
    return rng.randrange(-5, 100_000)


def mutate(event: Any, rng: random.Random, depth: int = 0) -> Any:
    """A copy of `event` with a few random changes at random places."""
    if isinstance(event, dict):
        out = dict(event)
        for key in list(out):
            roll = rng.random()
            if roll < 0.08:
                del out[key]
            elif roll < 0.25:
                out[key] = weird_value(rng)
            elif roll < 0.6 and depth < 6:
                out[key] = mutate(out[key], rng, depth + 1)
        if rng.random() < 0.1:
            out[rng.choice(["event_id", "extra", "\ud83dkey", "item", "session"])] = weird_value(rng)
        return out
    if isinstance(event, list):
        return [mutate(v, rng, depth + 1) for v in event] + ([weird_value(rng)] if rng.random() < 0.2 else [])
    return weird_value(rng) if rng.random() < 0.3 else event


def frame(event: Any, rng: random.Random) -> str:
    text = json.dumps(event)  # ensure_ascii: surrogates travel as \\u escapes, legal JSON
    roll = rng.random()
    if roll < 0.05:
        return text[: rng.randrange(1, max(2, len(text)))]  # cut short
    if roll < 0.08:
        return text.replace(":", "::", 1)
    if roll < 0.1:
        return rng.choice(["null", "[]", "42", '"x"', ""])
    return text
