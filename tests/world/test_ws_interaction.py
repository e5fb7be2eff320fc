"""Prompt updates and actions over a real socket: applied at the declared chunk, output changes from it on."""

from __future__ import annotations

import asyncio
import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.world.conftest import Chunk, VideoClient, WorldServer, open_client

pytestmark = pytest.mark.system


async def stream(
    server: WorldServer,
    start: dict[str, Any],
    chunks: int,
    interaction: dict[str, Any] | None = None,
    after: int = 2,
) -> tuple[list[Chunk], dict[str, Any] | None, VideoClient]:
    """Read ``chunks`` chunks; send ``interaction`` once chunk ``after`` has arrived."""
    client = await open_client(server)
    await client.send({"type": "session.start", **start})
    await client.expect("video.start")
    got: list[Chunk] = []
    queued = None
    while len(got) < chunks:
        got.append(await client.chunk())
        if interaction is not None and len(got) == after + 1:
            await client.send({"type": "session.interaction", **interaction})
    for item in (event for c in got for event in c.events_before):
        if item["type"] == "session.interaction.queued":
            queued = item
    await client.send({"type": "session.stop"})
    await client.expect("session.done")
    await client.ws.close()
    return got, queued, client


def decode(chunk: Chunk) -> list[np.ndarray]:
    out, offset = [], 0
    for length in chunk.meta["frame_byte_lengths"]:
        out.append(
            np.asarray(Image.open(io.BytesIO(chunk.data[offset : offset + length])).convert("L"), float)
        )
        offset += length
    return out


def applied_before(chunk: Chunk) -> dict[str, Any] | None:
    return next((e for e in chunk.events_before if e["type"] == "session.interaction.applied"), None)


async def test_prompt_update_applies_at_declared_chunk(world_server: WorldServer) -> None:
    start = {
        "model": "tiny-video-random",
        "prompt": "a red fox in the snow",
        "seed": 11,
        "width": 64,
        "height": 64,
    }
    update = {"event_id": "upd-1", "prompt": "a blue whale in the deep sea"}
    (reference, _, _), (updated, queued, _) = await asyncio.gather(
        stream(world_server, start, 10), stream(world_server, start, 10, update)
    )
    assert queued is not None and queued["event_id"] == "upd-1"
    at = queued["applies_at_chunk"]
    assert 3 <= at <= 4  # sent after chunk 2 arrived: chunk 3 unless chunk 3 was already demanded
    for k in range(10):
        assert updated[k].meta["chunk_index"] == k
        same = updated[k].data == reference[k].data
        assert same == (k < at), f"chunk {k} (update applies at {at})"
    applied = applied_before(updated[at])
    assert applied is not None and applied["chunk_index"] == at and applied["event_ids"] == ["upd-1"]
    assert all(applied_before(c) is None for c in updated[:at])


async def test_action_changes_frames_from_declared_chunk(world_server: WorldServer) -> None:
    start = {"model": "tiny-jepa", "seed": 0, "width": 64, "height": 64}
    press = {"event_id": "right", "actions": [{"event": "keydown", "key": "d", "t_ms": 0}]}
    (still, _, _), (moved, queued, _) = await asyncio.gather(
        stream(world_server, start, 14), stream(world_server, start, 14, press)
    )
    assert queued is not None
    at = queued["applies_at_chunk"]
    for k in range(14):
        assert (moved[k].data == still[k].data) == (k < at), f"chunk {k} (action applies at {at})"
    assert applied_before(moved[at]) is not None
    # the picture really differs (not only the bytes): mean absolute difference of decoded frames
    diff = np.mean([np.abs(a - b).mean() for a, b in zip(decode(moved[-1]), decode(still[-1]), strict=True)])
    assert diff > 2.0


async def test_action_flood_is_coalesced(world_server: WorldServer) -> None:
    client = await open_client(world_server)
    async with client.ws:
        await client.send({"type": "session.start", "model": "tiny-jepa", "width": 64, "height": 64})
        await client.expect("video.start")
        await client.chunk()
        sent = 1500
        for i in range(sent):
            kind = "keydown" if i % 2 == 0 else "keyup"
            await client.send(
                {"type": "session.interaction", "actions": [{"event": kind, "key": "ArrowLeft"}]}
            )
        queued = applied = chunks = 0
        while queued < sent:
            event = await client.event()
            if event["type"] == "session.interaction.queued":
                queued += 1
            elif event["type"] == "session.interaction.applied":
                applied += 1
                assert len(event["event_ids"]) <= 64
            elif event["type"] == "video.chunk_metadata":
                chunks += 1
                assert isinstance(await client.ws.recv(), bytes)
            else:
                raise AssertionError(event)
        assert applied <= chunks + 1  # at most one applied event per chunk, whatever the flood
        driver = world_server.drivers()[0]
        assert driver.stats.chunks_received - driver.stats.chunks_sent <= 1
        await client.chunk()  # still streaming
