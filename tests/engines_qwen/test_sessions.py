"""Session KV retention in the thinker, seeded weights across processes, threads sharing a model."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.qwen3_omni.prompt import build_prompt
from engines.qwen3_omni.session_kv import common_prefix
from engines.qwen3_omni.stages import ThinkerEngine
from runtime.engine import EngineRequest, StepInput
from tests.engines_qwen.conftest import speech_like
from tests.engines_qwen.driver import TINY, make_engines, run_pipeline

pytestmark = pytest.mark.system

GREEDY = {"greedy": True, "seed": 0}
ROOT = Path(__file__).resolve().parents[2]


def think(engine: ThinkerEngine, params: Mapping[str, Any], session_key: str | None = None) -> list[int]:
    """Run the thinker alone to the end; return its generated tokens."""
    state = engine.start(EngineRequest("t", dict(params), session_key=session_key))
    for _ in range(10_000):
        out = engine.step([StepInput(state=state)])[0]
        if out.done:
            break
    engine.finish(state, cancelled=False)
    return list(state.generated)


PRIVATE = {**TINY, "session_kv_bytes": 64 << 20}  # a store of its own, not the process default


def test_follow_up_turn_prefills_only_new_tokens() -> None:
    warm = ThinkerEngine(PRIVATE)
    turn1 = {"text": "Hi, who are you?", "instructions": "Be brief.", **GREEDY, "max_tokens": 8}
    reply = think(warm, turn1, session_key="s1")
    prompt1 = build_prompt(warm.loaded, turn1).ids
    assert warm.stats["prefill_tokens"] == len(prompt1) and warm.stats["reused_tokens"] == 0
    assert len(warm.sessions) == 1

    reply_text = warm.loaded.tokenizer.decode(reply, skip_special_tokens=True)
    turn2 = {
        "text": "Tell me more.",
        "instructions": "Be brief.",
        "history": [{"role": "user", "text": "Hi, who are you?"}, {"role": "assistant", "text": reply_text}],
        **GREEDY,
        "max_tokens": 8,
    }
    prompt2 = build_prompt(warm.loaded, turn2).ids
    # What the cache held after turn 1: the prompt and every reply token fed back (not the last).
    retained = prompt1 + reply[:-1]
    expected_reuse = common_prefix(retained, prompt2)
    assert expected_reuse > len(prompt1)

    tokens_warm = think(warm, turn2, session_key="s1")
    assert warm.stats["reused_tokens"] == expected_reuse
    assert warm.stats["prefill_tokens"] == len(prompt2) - expected_reuse

    cold = ThinkerEngine(PRIVATE)
    tokens_cold = think(cold, turn2)
    assert cold.stats["prefill_tokens"] == len(prompt2)
    assert tokens_warm == tokens_cold


def test_unrelated_prompt_in_a_session_is_still_correct() -> None:
    engine = ThinkerEngine(PRIVATE)
    think(engine, {"text": "First question", **GREEDY, "max_tokens": 4}, session_key="s")
    other = {"text": "Something else entirely", "instructions": "Pirate voice.", **GREEDY, "max_tokens": 6}
    warm = think(engine, other, session_key="s")
    assert engine.stats["reused_tokens"] <= 2  # at most '<|im_start|>' + role
    assert warm == think(ThinkerEngine(TINY), other)


def test_different_audio_of_equal_length_is_not_reused() -> None:
    engine = ThinkerEngine(PRIVATE)
    a = {"audio": speech_like(1.0, seed=1), **GREEDY, "max_tokens": 3}
    b = {"audio": speech_like(1.0, seed=2), **GREEDY, "max_tokens": 3}
    think(engine, a, session_key="s")
    tokens = think(engine, b, session_key="s")
    prompt_b = build_prompt(engine.loaded, b)
    first_pad = prompt_b.ids.index(engine.loaded.ids.audio_pad)
    assert engine.stats["reused_tokens"] <= first_pad
    assert tokens == think(ThinkerEngine(TINY), b)
    # The same clip again is reused through the audio.
    think(engine, b, session_key="s2")
    think(engine, b, session_key="s2")
    assert engine.stats["reused_tokens"] == len(prompt_b.ids) - 1


def test_session_store_respects_its_byte_budget() -> None:
    tiny_budget = ThinkerEngine({**TINY, "session_kv_bytes": 1024})
    think(tiny_budget, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="s")
    assert len(tiny_budget.sessions) == 0  # one entry is larger than the budget: not kept

    probe = ThinkerEngine(PRIVATE)
    think(probe, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="p")
    one_entry = probe.sessions.used_bytes
    lru = ThinkerEngine({**TINY, "session_kv_bytes": int(one_entry * 1.5)})
    think(lru, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="a")
    think(lru, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="b")
    assert len(lru.sessions) == 1 and "b" in lru.sessions
    think(lru, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="a")
    assert lru.stats["reused_tokens"] == 0  # 'a' was evicted by 'b'


def test_without_a_private_budget_the_replica_store_is_used() -> None:
    from runtime.kv import SessionKVStore, bind_thread_store

    store = SessionKVStore(64 << 20)
    bind_thread_store(store)
    try:
        engine = ThinkerEngine(TINY)
        think(engine, {"text": "Hello", **GREEDY, "max_tokens": 4}, session_key="bound")
        assert "bound" in store and store.used_bytes > 0
    finally:
        bind_thread_store(None)


_FINGERPRINT = """
import torch
from engines.qwen3_omni.model import load_model
m = load_model({"model": "tiny", "seed": 0}).model
print(sum(float(p.double().abs().sum()) for p in m.parameters()))
"""


def test_two_processes_build_identical_weights() -> None:
    from engines.qwen3_omni.model import load_model

    model = load_model(TINY).model
    here = sum(float(p.double().abs().sum()) for p in model.parameters())
    out = subprocess.run(
        [sys.executable, "-c", _FINGERPRINT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert float(out.stdout.strip().splitlines()[-1]) == here
    other_seed = load_model({"model": "tiny", "seed": 1}).model
    assert sum(float(p.double().abs().sum()) for p in other_seed.parameters()) != here


def test_concurrent_pipelines_on_threads_share_one_model() -> None:
    """Three requests on three threads at once (each with its own engines, one shared model)
    give exactly what they give one at a time: no per-request state lives on the module."""
    prompts = [
        {"text": "Hello", **GREEDY, "max_tokens": 8, "max_frames": 12},
        {"audio": speech_like(1.0), **GREEDY, "max_tokens": 6, "max_frames": 10},
        {"text": "A longer prompt about the weather today", **GREEDY, "max_tokens": 10, "max_frames": 14},
    ]
    sequential = [run_pipeline(make_engines(), p) for p in prompts]
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = run_pipeline(make_engines(), prompts[i])
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for i, ref in enumerate(sequential):
        assert results[i].tokens == ref.tokens
        np.testing.assert_array_equal(results[i].code_matrix, ref.code_matrix)
        np.testing.assert_allclose(results[i].samples, ref.samples, rtol=0, atol=1e-12)
