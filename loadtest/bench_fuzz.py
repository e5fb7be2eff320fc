"""What fuzzing sessions make the server and Redis keep (issue 33): server + Redis RSS per
fuzzing session, the measure of the 64 MB per abusive session budget.

Starts its own ``redis-server`` and a server running the session tests' echo engine (the one
``tests/sessions/test_fuzz.py`` runs: each reply echoes the conversation's text, so a fuzzer
that fills the conversation also gets the largest replies), then ``--clients`` realtime
sessions send mutated events (``loadtest/fuzz_events.py``, the fuzz test's mutations, the same
seeds) in bursts of 25, each burst followed by a well-formed ``session.update`` that must be
answered, for ``--seconds``. The server's and redis-server's RSS are sampled every 100 ms.

    PYTHONPATH=. .venv/bin/python -m loadtest.bench_fuzz --clients 3 --seconds 20
    PYTHONPATH=. .venv/bin/python -m loadtest.bench_fuzz --server-arg=--event-log-max-bytes=4194304

"Peak" is the largest sum of both processes' growth at one sample; "per session" divides it
by the number of fuzzing clients. What they still hold is given twice: ``total_rss_end_mb``
1 s after the fuzzing stopped (the sessions detached, in their grace), ``total_rss_closed_mb``
once every session has ended and 2 s more (what an abusive session leaves behind).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
import websockets

from loadtest.bench_abuse import Rig
from loadtest.fuzz_events import base_events, frame, mutate

BURST = 25


def echo_server(folder: Path) -> list[str]:
    """The fuzz test's server: the session tests' echo engine, 120 ms of audio per reply."""
    from tests.sessions.history_engine import pipeline_file  # the test engine's pipeline file

    pipeline = pipeline_file(folder, audio_ms=120)
    serve = [sys.executable, "-m", "tests.sessions.serve_with_test_engines", "serve"]
    return [*serve, "--pipeline", str(pipeline)]


async def fuzz_session(rig: Rig, rng: random.Random, until_t: float, *, slow: bool) -> tuple[int, str]:
    """Mutated events until ``until_t``; (frames sent, how it ended). Server events are read
    as they come, or (``slow``) only after each burst, up to the first ``session.updated``: a
    client that reads slower than the server writes (as the fuzz test's client, which
    validates every event with the SDK's models, can be), so the server's outbox fills."""
    sent = 0
    url = f"ws://127.0.0.1:{rig.port}/v1/realtime"
    async with websockets.connect(url, max_size=None, open_timeout=30) as ws:
        answered: asyncio.Queue[str] = asyncio.Queue()

        async def read() -> None:
            try:
                async for message in ws:
                    if json.loads(message)["type"] == "session.updated":
                        answered.put_nowait("updated")
            finally:
                answered.put_nowait("closed")

        async def read_some() -> None:
            async with asyncio.timeout(60):
                while json.loads(await ws.recv())["type"] != "session.updated":
                    pass

        reader = None if slow else asyncio.create_task(read())
        bases = base_events(rng)
        try:
            while time.monotonic() < until_t:
                for _ in range(BURST):
                    text = frame(mutate(rng.choice(bases), rng), rng)
                    if len(text) < 1_900_000:  # the frame limit's 1009 close is another test's
                        await ws.send(text)
                        sent += 1
                check = {"type": "session.update", "session": {"type": "realtime"}}
                await ws.send(json.dumps(check))
                if reader is None:
                    await read_some()
                    continue
                while answered.qsize():
                    answered.get_nowait()
                async with asyncio.timeout(60):
                    answer = await answered.get()
                if answer == "closed":  # else answered: not broken
                    return sent, f"closed {ws.close_code} {ws.close_reason}"
        except websockets.ConnectionClosed as closed:
            return sent, f"closed {closed.rcvd or 'without a close frame'}"
        finally:
            if reader is not None:
                reader.cancel()
    return sent, "ok"


async def run(
    clients: int, seconds: float, seed: int, server_args: list[str], *, slow: bool
) -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="bench-fuzz-"))
    rig = Rig(folder, 2.0, serve=[*echo_server(folder), *server_args])
    try:
        await rig.ready()
        before = await rig.memory()
        peak = [0.0, 0.0, 0.0, 0.0]  # growth: server RSS, Redis used, Redis RSS, server + Redis RSS
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                now = await rig.memory()
                grown = (now[0] - before[0], now[1] - before[1], now[2] - before[2])
                for i, value in enumerate((*grown, grown[0] + grown[2])):
                    peak[i] = max(peak[i], value)
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        until_t = time.monotonic() + seconds
        try:
            outcomes = await asyncio.gather(
                *(
                    fuzz_session(rig, random.Random(seed * 100 + i), until_t, slow=slow)
                    for i in range(clients)
                )
            )
            await asyncio.sleep(1.0)  # what the sessions keep once the fuzzing stops
        finally:
            done.set()
            await sampler
        end = await rig.memory()
        async with httpx.AsyncClient() as http:
            alive = (await http.get(f"{rig.http}/readyz", timeout=5)).status_code
        deadline = time.monotonic() + 30  # the sessions' grace (2 s), then what stays
        while await rig.sessions() and time.monotonic() < deadline:  # noqa: ASYNC110 (another process)
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # a heap trim interval and then some
        closed = await rig.memory()
        return {
            "clients": clients,
            "reading": "slow" if slow else "all",
            "seconds": seconds,
            "seed": seed,
            "server_args": server_args,
            "sent": sum(s for s, _ in outcomes),
            "endings": sorted({how for _, how in outcomes}),
            "server_rss_before_mb": round(before[0], 1),
            "redis_rss_before_mb": round(before[2], 1),
            "server_rss_peak_mb": round(peak[0], 1),
            "redis_used_peak_mb": round(peak[1], 1),
            "redis_rss_peak_mb": round(peak[2], 1),
            "total_rss_peak_mb": round(peak[3], 1),
            "per_session_mb": round(peak[3] / clients, 1),
            "total_rss_end_mb": round(end[0] - before[0] + end[2] - before[2], 1),
            "server_rss_closed_mb": round(closed[0] - before[0], 1),
            "redis_rss_closed_mb": round(closed[2] - before[2], 1),
            "total_rss_closed_mb": round(closed[0] - before[0] + closed[2] - before[2], 1),
            "readyz": alive,
        }
    finally:
        await rig.client.aclose()
        rig.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=1313, help="the fuzz test's OMNI_FUZZ_SEED")
    parser.add_argument("--read", choices=("slow", "all"), default="slow", help="see fuzz_session")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to serve (repeatable)")
    args = parser.parse_args(argv)
    row = asyncio.run(run(args.clients, args.seconds, args.seed, args.server_arg, slow=args.read == "slow"))
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
