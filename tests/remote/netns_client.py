"""Run inside the server's network namespace by test_netns: wait for the remote stages, then one
audio turn over the official openai SDK; prints one JSON line with what happened."""

from __future__ import annotations

import asyncio
import base64
import json
import sys
import time

import httpx
from openai import AsyncOpenAI


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
    audio = 0
    done: dict[str, object] = {}
    async with client.realtime.connect(model="qwen3-omni-tiny") as conn:
        await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"]})
        await conn.conversation.item.create(
            item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello"}]}
        )
        await conn.response.create()
        async for event in conn:
            if event.type == "response.output_audio.delta":
                audio += len(base64.b64decode(event.delta))
            elif event.type == "response.done":
                done = event.response.model_dump()
                break
    async with httpx.AsyncClient(base_url=base, timeout=5) as http:
        rows = (await http.get("/v1/stages")).json()["data"]
    return {"status": done.get("status"), "audio_bytes": audio, "rows": rows}


if __name__ == "__main__":
    result = asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2:]), 400))
    print(json.dumps(result, default=str), flush=True)
