"""Run inside the server's network namespace by test_netns: sticky assignment over two talker
hosts, a host with another key kept out, then a Redis restart; prints one JSON line per phase.

Sticky: session A's first turn goes to the lowest talker replica (both idle); session B's first
turn starts while A's runs, so it goes to the other one; then, with both idle, B's second turn
must stay on B's replica (least-loaded alone would send it back to the lowest) and A's on A's.
The talker replica a turn used is the one whose call count grew during it (one turn at a time).
Redis: the client prints ``STOP_REDIS`` and waits for a line on stdin (the test stops Redis),
waits for the server's registry error, prints ``START_REDIS`` and waits again (the test starts
an empty Redis at the same address), then waits for the registry to come back and runs a turn
in a new session (sessions live in Redis: the restart ended the old ones).
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time
from typing import Any

import httpx
from openai import AsyncOpenAI


async def listing(base: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        body: dict[str, Any] = (await http.get("/v1/stages")).json()
        return body


async def wait_for(base: str, what: str, test: Any, within_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + within_s
    body: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            body = await listing(base)
            if test(body):
                return body
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.3)
    raise TimeoutError(f"not within {within_s} s: {what} (last listing {body})")


def serving(body: dict[str, Any], stage: str) -> list[dict[str, Any]]:
    return [r for r in body["data"] if r["stage"] == stage and r["state"] == "SERVING"]


def talker_calls(body: dict[str, Any]) -> dict[str, int]:
    return {r["address"]: r["calls"] for r in body["data"] if r["stage"] == "talker"}


async def turn(conn: Any, on_first_audio: asyncio.Event | None = None) -> dict[str, Any]:
    await conn.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
    )
    await conn.response.create()
    audio = 0
    async for event in conn:
        if event.type == "response.output_audio.delta":
            audio += len(base64.b64decode(event.delta))
            if on_first_audio is not None:
                on_first_audio.set()
        elif event.type == "response.done":
            return {"status": event.response.status, "audio_bytes": audio}
    raise RuntimeError("the session closed mid-turn")


async def used(base: str, run: Any) -> tuple[dict[str, Any], list[str]]:
    """Run one turn alone; the talker replicas whose call count grew meanwhile."""
    before = talker_calls(await listing(base))
    result = await run
    after = talker_calls(await listing(base))
    return result, sorted(a for a in after if after[a] > before.get(a, 0))


async def main(base: str) -> None:
    body = await wait_for(
        base,
        "two talkers, a code2wav and the impostor refused",
        lambda b: len(serving(b, "talker")) == 2 and serving(b, "code2wav") and b["refused"],
        240,
    )
    print(json.dumps({"phase": "joined", "listing": body}), flush=True)
    client = AsyncOpenAI(api_key="unused", base_url=f"{base}/v1")
    async with (
        client.realtime.connect(model="qwen3-omni-tiny") as a,
        client.realtime.connect(model="qwen3-omni-tiny") as b,
    ):
        for conn in (a, b):
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        before = talker_calls(await listing(base))
        started = asyncio.Event()
        first_a = asyncio.create_task(turn(a, started))
        await asyncio.wait_for(started.wait(), 120)  # A's first turn holds its talker replica
        a_only = talker_calls(await listing(base))
        first_b = await turn(b)
        results = {"a1": await first_a, "b1": first_b}
        after = talker_calls(await listing(base))
        a1 = sorted(x for x in a_only if a_only[x] > before.get(x, 0))
        b1 = sorted(x for x in after if after[x] > a_only.get(x, 0) and x not in a1)
        results["b2"], b2 = await used(base, turn(b))
        results["a2"], a2 = await used(base, turn(a))
        replicas = {"a1": a1, "b1": b1, "b2": b2, "a2": a2}
        print(json.dumps({"phase": "sticky", "turns": results, "replicas": replicas}), flush=True)

    # Sessions live in Redis: a restart (empty) ends them; a new session after it is served.
    print("STOP_REDIS", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    down = await wait_for(base, "a registry error", lambda b: b["registry_error"] is not None, 30)
    print("START_REDIS", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    back = await wait_for(
        base,
        "the registry back",
        lambda b: b["registry_error"] is None and len(serving(b, "talker")) == 2 and serving(b, "code2wav"),
        60,
    )
    async with client.realtime.connect(model="qwen3-omni-tiny") as c:
        await c.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        after_restart = await turn(c)
    print(
        json.dumps(
            {
                "phase": "redis",
                "registry_error": down["registry_error"],
                "listing": back,
                "turn": after_restart,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(asyncio.wait_for(main(sys.argv[1]), 500))
