"""KV affinity: time to first audio of the next turn with the session's thinker KV retained vs not.

End to end through a real server (``omniduplex serve --pipeline qwen3-omni-tiny``, a realtime
WebSocket session, the driver's ``session_key`` = session id), twice:

* **retained**: the shipped pipeline; the thinker keeps each session's KV cache in its
  replica's ``SessionKVStore`` (``budget.kv_bytes``, LRU) between turns, so the next turn
  prefills only the tokens after the common prefix;
* **not retained**: the same pipeline with ``kv_bytes: 0``, so nothing is kept and every turn
  prefills the whole conversation (what a replica without affinity, or after eviction, does).

Per trial: a fresh session gets a conversation of ``--pairs`` user/assistant text items
(``conversation.item.create``; ≥ 1,000 prompt tokens by default), then turn N
(``response.create``: prefills all of it; with retention, keeps the KV), then a new user item
and turn N+1, timed from ``response.create`` to the first ``response.output_audio.delta``.

    .venv/bin/python -m loadtest.bench_kv_affinity --trials 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from websockets.asyncio.client import ClientConnection, connect
from websockets.typing import Subprotocol

from loadtest.bench_gateway import wait_http
from loadtest.report import write_json
from loadtest.server_process import Child, free_port, spawn
from loadtest.stats import summarize
from runtime.spec import load_pipeline

PIPELINE = "qwen3-omni-tiny"
SENTENCES = (
    "Please tell me a short story about a robot who learns to sing with the birds every day.",
    "What is the weather like in the city this morning, and will the light wind stay warm?",
    "Let's talk about music, science, and the history of the world, one question at a time.",
    "The quick brown fox jumps over the lazy dog while the small robot listens and hums.",
)


def bench_pipeline(tmp: Path, *, retain: bool) -> Path:
    """The shipped pipeline, replies made deterministic and never empty (greedy, at least 8
    tokens: random tiny weights may sample EOS first); ``retain=False`` sets every stage's
    ``kv_bytes`` to 0 (nothing retained between turns)."""
    source = Path(load_pipeline(PIPELINE).source)
    doc = yaml.safe_load(source.read_text())
    for stage in doc["stages"]:
        if stage["name"] == "thinker":
            stage.setdefault("options", {}).update({"greedy": True, "min_tokens": 8})
        if not retain:
            stage.setdefault("budget", {})["kv_bytes"] = 0
    name = PIPELINE if retain else f"{PIPELINE}-no-kv"
    doc["name"] = name
    out = tmp / f"{name}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def history_tokens(pairs: int) -> int:
    from engines.qwen3_omni.tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    text = [SENTENCES[i % len(SENTENCES)] for i in range(2 * pairs)]
    return sum(len(tok.encode(t, add_special_tokens=False)) + 5 for t in text)  # + ChatML framing


async def _until(ws: ClientConnection, type_: str, timeout_s: float = 120.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while True:
            event: dict[str, Any] = json.loads(await ws.recv())
            if event["type"] == type_:
                return event
            if event["type"] == "error":
                raise RuntimeError(f"server error: {event['error']}")


async def _item(ws: ClientConnection, role: str, text: str) -> None:
    kind = "input_text" if role == "user" else "output_text"
    item = {"type": "message", "role": role, "content": [{"type": kind, "text": text}]}
    await ws.send(json.dumps({"type": "conversation.item.create", "item": item}))
    await _until(ws, "conversation.item.added")


async def trial(url: str, pairs: int, reply_tokens: int) -> float:
    """One session: history, turn N, then turn N+1's time to first audio (ms)."""
    async with connect(url, subprotocols=[Subprotocol("realtime")], proxy=None, max_size=None) as ws:
        await _until(ws, "session.created")
        for i in range(pairs):
            await _item(ws, "user", SENTENCES[(2 * i) % len(SENTENCES)])
            await _item(ws, "assistant", SENTENCES[(2 * i + 1) % len(SENTENCES)])
        create = json.dumps({"type": "response.create", "response": {"max_output_tokens": reply_tokens}})
        await _item(ws, "user", "Can you hear me now?")
        await ws.send(create)
        await _until(ws, "response.done")
        await _item(ws, "user", "Thanks for asking, that is a great question.")
        t0 = time.perf_counter()
        await ws.send(create)
        async with asyncio.timeout(120):
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_audio.delta":
                    ttfa = (time.perf_counter() - t0) * 1000.0
                    break
                if event["type"] in ("response.done", "error"):
                    raise RuntimeError(f"turn N+1 ended without audio: {json.dumps(event)[:400]}")
        await _until(ws, "response.done")
        return ttfa


async def start_server(pipeline: str, tmp: Path) -> Child:
    port = free_port()
    data_dir = str(tmp / f"data-{port}")
    args_ = ["-m", "web.cli", "serve", "--pipeline", pipeline, "--port", str(port), "--data-dir", data_dir]
    return spawn("serve", [*args_, "--log-level", "warning"], tmp, port)


def thinker_prefill_ms(pairs: int, repeats: int = 5) -> dict[str, float]:
    """The thinker alone (in this process): next turn's start + prefill + first token, warm vs cold."""
    from engines.qwen3_omni.stages import ThinkerEngine
    from runtime.engine import EngineRequest, StepInput

    engine = ThinkerEngine({"model": "tiny", "seed": 0, "session_kv_bytes": 256 << 20})
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "text": SENTENCES[i % len(SENTENCES)]}
        for i in range(2 * pairs)
    ]
    turn_n = {"text": "Can you hear me now?", "history": history, "max_tokens": 8, "greedy": True, "seed": 0}

    def first_token_ms(params: dict[str, Any], key: str | None) -> float:
        t0 = time.perf_counter()
        state = engine.start(EngineRequest(f"r{time.perf_counter_ns()}", params, session_key=key))
        engine.step([StepInput(state=state)])
        elapsed = (time.perf_counter() - t0) * 1000.0
        while not engine.step([StepInput(state=state)])[0].done:
            pass
        engine.finish(state, cancelled=False)
        return elapsed

    warm, cold = [], []
    for i in range(repeats + 1):
        first_token_ms(turn_n, f"s{i}")  # turn N: retained under s<i>
        later = [
            *history,
            {"role": "user", "text": "Can you hear me now?"},
            {"role": "assistant", "text": "Yes."},
        ]
        turn_n1 = {**turn_n, "text": "Thanks for asking.", "history": later}
        w, c = first_token_ms(turn_n1, f"s{i}"), first_token_ms(turn_n1, None)
        if i:  # the first round warms the model up
            warm.append(w)
            cold.append(c)
    return {
        "retained_p50": round(float(np.median(warm)), 1),
        "not_retained_p50": round(float(np.median(cold)), 1),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="od-bench-kv-") as name:
        tmp = Path(name)
        servers = {
            "retained": await start_server(str(bench_pipeline(tmp, retain=True)), tmp),
            "not_retained": await start_server(str(bench_pipeline(tmp, retain=False)), tmp),
        }
        try:
            for server in servers.values():
                await wait_http(server, "/readyz", timeout_s=300)
            urls = {k: f"ws://127.0.0.1:{s.port}/v1/realtime" for k, s in servers.items()}
            for url in urls.values():
                await trial(url, 2, args.reply_tokens)  # warm-up: lazy model load, first calls
            ttfa: dict[str, list[float]] = {k: [] for k in urls}
            for _ in range(args.trials):  # alternate, so drifting machine load hits both alike
                for key, url in urls.items():
                    ttfa[key].append(await trial(url, args.pairs, args.reply_tokens))
        finally:
            for server in servers.values():
                server.stop()
    return {
        "pipeline": PIPELINE,
        "history_tokens_approx": history_tokens(args.pairs),
        "trials": args.trials,
        "ttfa_next_turn_ms": {k: summarize(v, 1) for k, v in ttfa.items()},
        "thinker_first_token_ms": thinker_prefill_ms(args.pairs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=24, help="user/assistant item pairs in the history")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--reply-tokens", type=int, default=16, help="max_output_tokens of each reply")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    out = asyncio.run(run(args))
    r, c = out["ttfa_next_turn_ms"]["retained"], out["ttfa_next_turn_ms"]["not_retained"]
    print(f"history ≈ {out['history_tokens_approx']} tokens, {out['trials']} trials each\n")
    print("| next turn TTFA | p50 ms | min ms | max ms |\n|---|---|---|---|")
    print(f"| KV retained (affinity) | {r['p50']} | {r['min']} | {r['max']} |")
    print(f"| not retained (kv_bytes 0) | {c['p50']} | {c['min']} | {c['max']} |")
    t = out["thinker_first_token_ms"]
    print(
        f"\nthinker alone, next turn start + prefill + first token: {t['retained_p50']} ms retained, "
        f"{t['not_retained_p50']} ms not retained (p50)"
    )
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
