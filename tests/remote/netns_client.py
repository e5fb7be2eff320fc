"""Run inside the server's network namespace by test_netns: wait for the remote stages, then one
audio turn over the official openai SDK; prints one JSON line with what happened."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time

import httpx
from openai import AsyncOpenAI

TURNS = int(os.environ.get("NETNS_TURNS", "1"))


async def main(base: str, stages: list[str]) -> dict[str, object]:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        deadline = time.monotonic() + 240
        rows: list[dict[str, object]] = []
        while time.monotonic() < deadline:
            try:
                rows = (await http.get("/v1/stages")).json()["data"]
            except (httpx.HTTPError, ValueError):
                rows = []
            serving = {r["stage"] for r in rows if r["address"] != "local" and r["state"] == "SERVING"}
            if serving >= set(stages):
                break
            await asyncio.sleep(0.5)
        else:
            return {"error": "remote stages not ready", "rows": rows}
    client = AsyncOpenAI(api_key="unused", base_url=f"{base}/v1")
    turns: list[dict[str, object]] = []
    async with client.realtime.connect(model="qwen3-omni-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        for turn in range(TURNS):
            if turn:  # the test may replace a host meanwhile: wait for its word, then a live talker
                await asyncio.to_thread(sys.stdin.readline)
                await wait_serving(base, stages, 120)
            await conn.conversation.item.create(
                item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
            )
            await conn.response.create()
            audio = 0
            async for event in conn:
                if event.type == "response.output_audio.delta":
                    if not audio:
                        print("FIRST_AUDIO", flush=True)
                    audio += len(base64.b64decode(event.delta))
                elif event.type == "response.done":
                    turns.append({"response": event.response.model_dump(), "audio_bytes": audio})
                    print("TURN_DONE", flush=True)
                    break
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        rows = (await http.get("/v1/stages")).json()["data"]
    last = turns[-1]["response"]
    assert isinstance(last, dict)
    return {
        "status": last.get("status"),
        "audio_bytes": turns[-1]["audio_bytes"],
        "turns": turns,
        "rows": rows,
    }


async def wait_serving(base: str, stages: list[str], within_s: float) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            rows = (await http.get("/v1/stages")).json()["data"]
            serving = {r["stage"] for r in rows if r["address"] != "local" and r["state"] == "SERVING"}
            if serving >= set(stages) and len([r for r in rows if r["address"] != "local"]) == len(stages):
                return
            await asyncio.sleep(0.5)


if __name__ == "__main__":
    result = asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2:]), 400))
    print(json.dumps(result, default=str), flush=True)
