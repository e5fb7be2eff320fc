"""A seeded fuzz run against a real server (real redis-server), bounded in time (issue 13).

Well-formed realtime client events are mutated (fields dropped, retyped, nested deep, made huge,
given lone surrogates, unknown keys, broken JSON) and sent on several sessions at once, with
some `client_secrets` bodies and world-model (`/v1/realtime/video`) events mutated the same
way. Every server event is validated strictly against the `openai` SDK (tests/realtime/wire.py).
Afterwards:

* 0 tracebacks in the server log (the server runs as its own process, `--log-level info`,
  its output in a file);
* 0 broken sessions: each answers a well-formed `session.update` after every burst;
* bounded memory: the server's RSS grew by less than ``RSS_BOUND`` in all, and by less than
  ``LATE_GROWTH`` from the first half of the run to the second (no growth with time);
* every admission slot is returned: afterwards ``SLOTS`` sessions open at once, none queued
  (``--admission-queue-s 1``: a leaked slot would refuse the last with 1013).

``OMNI_FUZZ_SEED`` / ``OMNI_FUZZ_SECONDS`` replay or lengthen a run.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import websockets

from tests.conftest_redis import RedisServerProcess, _free_port
from tests.sessions.client import Conn, opened
from tests.sessions.history_engine import pipeline_file

pytestmark = pytest.mark.system

SEED = int(os.environ.get("OMNI_FUZZ_SEED", "1313"))
SECONDS = float(os.environ.get("OMNI_FUZZ_SECONDS", "20"))
SESSIONS = 3
SLOTS = SESSIONS + 2  # the fuzzed sessions, a world, and the one still leaving before it
ROOT = Path(__file__).resolve().parents[2]
BURST = 25
RSS_BOUND = 512 << 20  # in all: the per-session budgets of SLOTS sessions, plus allocator slack
LATE_GROWTH = 64 << 20  # in the second half of the run, once the budgets are reached


@dataclass
class ServerProcess:
    """The server under test as a child process, its log in a file."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("fuzz")
    port = _free_port()
    log = folder / "server.log"
    cmd = [sys.executable, "-m", "tests.sessions.serve_with_test_engines", "serve", "--port", str(port)]
    cmd += ["--pipeline", str(pipeline_file(folder, audio_ms=120)), "--redis-url", module_redis.url]
    cmd += ["--data-dir", str(folder / "data"), "--max-sessions", str(SLOTS), "--admission-queue-s", "1"]
    cmd += ["--log-level", "info"]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        yield ServerProcess(proc, port, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


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


async def healthy(conn: Conn, n: int) -> None:
    """A well-formed event is answered: the session is not broken."""
    await conn.send({"type": "session.update", "session": {"type": "realtime"}, "event_id": f"evt_check_{n}"})
    await conn.events.wait_for("session.updated", within_s=20)


async def fuzz_session(server: ServerProcess, rng: random.Random, until_t: float) -> int:
    sent = 0
    async with opened(server.ws) as conn:
        bases = base_events(rng)
        while time.monotonic() < until_t:
            for _ in range(BURST):
                text = frame(mutate(rng.choice(bases), rng), rng)
                if len(text) < 1_900_000:  # the frame limit's 1009 close is another test's
                    await conn.ws.send(text)
                    sent += 1
            await healthy(conn, sent)
    return sent


async def fuzz_rest_and_video(server: ServerProcess, rng: random.Random, until_t: float) -> int:
    sent = 0
    url = f"{server.http}/v1/realtime/client_secrets"
    body = {"expires_after": {"anchor": "created_at", "seconds": 600}, "session": {"type": "realtime"}}
    start = {"type": "session.start", "model": "tiny-video-random", "width": 32, "height": 32, "fps": 4}
    async with httpx.AsyncClient(timeout=30) as http:
        while time.monotonic() < until_t:
            answer = await http.post(url, content=frame(mutate(body, rng), rng))
            assert answer.status_code in (200, 400, 413), (answer.status_code, answer.text[:300])
            sent += 1
            async with websockets.connect(f"{server.ws}/v1/realtime/video", open_timeout=20) as ws:
                for _ in range(3):
                    text = frame(mutate(start, rng), rng)
                    if len(text) < 1_900_000:  # over the frame limit: 1009, another test's
                        await ws.send(text)
                        sent += 1
                await ws.send(json.dumps({"type": "session.stop"}))
                await ws.send(json.dumps({"type": "session.ping"}))
                while True:  # the world socket still answers well-formed events
                    message = await asyncio.wait_for(ws.recv(), 20)
                    if isinstance(message, bytes):  # a chunk of a world a mutated start began
                        continue
                    if json.loads(message)["type"] == "session.pong":
                        break
    return sent


async def test_fuzz_realtime_rest_and_video(server: ServerProcess) -> None:
    rss_before = server.rss()
    rngs = [random.Random(SEED * 100 + i) for i in range(SESSIONS + 1)]
    until_t = time.monotonic() + SECONDS
    samples: list[tuple[float, int]] = []

    async def sample_rss() -> None:
        while time.monotonic() < until_t:
            samples.append((time.monotonic(), server.rss()))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_rss())
    counts = await asyncio.gather(
        *(fuzz_session(server, rngs[i], until_t) for i in range(SESSIONS)),
        fuzz_rest_and_video(server, rngs[-1], until_t),
    )
    await sampler
    assert sum(counts) > 100, counts
    rss_growth = server.rss() - rss_before
    half = until_t - SECONDS / 2  # bounded: no growth with time once the budgets are full
    first = max((r for t, r in samples if t < half), default=rss_before)
    second = max((r for t, r in samples if t >= half), default=rss_before)
    async with httpx.AsyncClient(timeout=10) as http:  # the closed sessions leave (parked/ended)
        for _ in range(300):  # 30 s: a loaded CI host
            live = (await http.get(f"{server.http}/readyz")).json()
            if not live["sessions"]:
                break
            await asyncio.sleep(0.1)
        assert not live["sessions"], f"seed {SEED}: sessions left after the fuzz: {live}"
    async with contextlib.AsyncExitStack() as stack:  # every slot is back: SLOTS open at once
        conns = [await stack.enter_async_context(opened(server.ws)) for _ in range(SLOTS)]
        assert len({c.session_id for c in conns}) == SLOTS
    log = server.log.read_text(errors="replace")
    tracebacks = [line for line in log.splitlines() if "Traceback" in line]
    assert tracebacks == [], f"seed {SEED}: {len(tracebacks)} tracebacks in the server log:\n{log[-4000:]}"
    assert rss_growth < RSS_BOUND, f"seed {SEED}: the server grew by {rss_growth >> 20} MB"
    assert second - first < LATE_GROWTH, f"seed {SEED}: still growing: +{(second - first) >> 20} MB late"
