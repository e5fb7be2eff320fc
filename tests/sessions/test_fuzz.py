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

import httpx
import psutil
import pytest
import websockets

from loadtest.fuzz_events import base_events, frame, mutate
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
