"""/v1/realtime/video over a real socket: a `websockets` client against uvicorn on loopback."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.timing import slack
from tests.world.conftest import WorldServer, open_client

pytestmark = pytest.mark.system


def jpeg_frames(data: bytes, lengths: list[int]) -> list[np.ndarray]:
    frames, offset = [], 0
    for length in lengths:
        frames.append(np.asarray(Image.open(io.BytesIO(data[offset : offset + length])).convert("RGB")))
        offset += length
    assert offset == len(data)
    return frames


async def test_start_chunks_ping_stop(world_server: WorldServer) -> None:
    client = await open_client(world_server)
    async with client.ws:
        await client.send(
            {"type": "session.start", "model": "tiny-jepa", "format": "jpeg", "width": 256, "height": 192}
        )
        start = await client.event()
        assert start["type"] == "video.start"
        assert start["format"] == "jpeg"
        assert start["config"]["width"] == 256 and start["config"]["height"] == 192
        request_id = start["request_id"]
        for index in range(4):
            chunk = await client.chunk()
            meta = chunk.meta
            assert meta["request_id"] == request_id
            assert meta["chunk_index"] == index == meta["transport_chunk_index"]
            assert meta["frame_count"] == 2 == len(meta["frame_byte_lengths"])
            assert meta["mime_type"] == "image/jpeg"
            for frame in jpeg_frames(chunk.data, meta["frame_byte_lengths"]):
                assert frame.shape == (192, 256, 3)
        await client.send({"type": "session.ping"})
        assert (await client.expect("session.pong"))["type"] == "session.pong"
        await client.send({"type": "session.stop"})
        done = await client.expect("session.done")
        assert done["stopped"] is True and done["reason"] == "stopped"
        assert done["request_id"] == request_id and done["chunks"] >= 4
        # the connection stays usable: a second session on the same socket
        await client.send({"type": "session.start", "model": "tiny-jepa", "num_frames": 3})
        second = await client.expect("video.start")
        assert second["request_id"] != request_id
        frames = 0
        while True:
            event = await client.event()
            if event["type"] == "video.chunk_metadata":
                frames += event["frame_count"]
                assert isinstance(await client.ws.recv(), bytes)
            elif event["type"] == "session.done":
                assert event["reason"] == "completed" and event["stopped"] is False
                assert event["frames"] == frames == 3
                break


@pytest.mark.timing
async def test_pacing_follows_fps(world_server: WorldServer) -> None:
    """Chunks go out at the stream's frame rate, not as fast as the model can make them."""
    import time

    client = await open_client(world_server)
    async with client.ws:
        await client.send(
            {"type": "session.start", "model": "tiny-jepa", "fps": 20, "extra_params": {"chunk_frames": 2}}
        )
        await client.expect("video.start")
        await client.chunk()
        began = time.monotonic()
        frames = 0
        for _ in range(10):
            frames += (await client.chunk()).meta["frame_count"]
        elapsed = time.monotonic() - began
        assert frames == 20
        assert 0.85 <= elapsed <= slack(1.4), elapsed  # 20 frames at 20 fps: one second


async def test_error_codes_keep_session_usable(world_server: WorldServer) -> None:
    client = await open_client(world_server)
    async with client.ws:
        cases = [
            ("not json", "invalid_json"),
            ('{"type": "session.dance"}', "invalid_event"),
            ('{"type": "session.start", "model": "no-such-model"}', "unknown_model"),
            ('{"type": "session.start", "model": "tiny-jepa", "format": "gif"}', "unsupported_format"),
            (
                '{"type": "session.start", "model": "tiny-jepa", "width": 4096, "height": 64}',
                "size_too_large",
            ),
            (
                '{"type": "session.start", "model": "tiny-jepa", "format": "m4s", "width": 255}',
                "invalid_parameter",
            ),
            ('{"type": "session.start", "model": "tiny-jepa", "fps": 0}', "invalid_parameter"),
            ('{"type": "session.interaction", "prompt": "hello"}', "no_active_session"),
            ('{"type": "session.stop"}', "no_active_session"),
        ]
        for text, code in cases:
            await client.ws.send(text)
            event = await client.event()
            assert event["type"] == "error" and event["code"] == code, (text, event)
        await client.ws.send(b"\x00\x01")
        assert (await client.event())["code"] == "invalid_event"
        await client.send({"type": "session.start", "model": "tiny-jepa"})
        await client.expect("video.start")
        await client.chunk()
        bad_actions: list[tuple[dict[str, Any], str]] = [
            ({"actions": [{"event": "keypress", "key": "w"}]}, "invalid_action"),
            ({"actions": [{"event": "keydown", "key": "q"}]}, "invalid_action"),
            ({"actions": [{"event": "keydown"}]}, "invalid_action"),
            ({"actions": "w"}, "invalid_event"),
            ({"prompt": "a forest"}, "prompt_not_supported"),  # tiny-jepa has no text conditioning
        ]
        for body, code in bad_actions:
            await client.send({"type": "session.interaction", "event_id": f"bad-{code}", **body})
            event = await client.expect("error")
            assert event["code"] == code, (body, event)
        await client.send({"type": "session.start", "model": "tiny-jepa"})
        assert (await client.expect("error"))["code"] == "session_already_active"
        # still streaming, still taking valid interactions
        await client.send(
            {"type": "session.interaction", "actions": [{"event": "keydown", "key": "ArrowUp"}]}
        )
        queued = await client.expect("session.interaction.queued")
        applied = await client.expect("session.interaction.applied")
        assert applied["chunk_index"] == queued["applies_at_chunk"]
        await client.chunk()


async def test_m4s_stream_decodes_with_pyav(world_server: WorldServer) -> None:
    import av

    client = await open_client(world_server)
    async with client.ws:
        await client.send(
            {
                "type": "session.start",
                "model": "tiny-jepa",
                "format": "m4s",
                "width": 128,
                "height": 96,
                "num_frames": 12,
            }
        )
        start = await client.expect("video.start")
        assert start["format"] == "m4s"
        pieces = []
        for index in range(6):
            chunk = await client.chunk()
            assert chunk.meta["chunk_index"] == index
            assert chunk.meta["mime_type"].startswith('video/mp4; codecs="avc1.')
            if index == 0:
                assert chunk.data[4:8] == b"ftyp" and chunk.meta["init_byte_length"] > 0
                init = chunk.data[: chunk.meta["init_byte_length"]]
                assert b"moov" in init
                assert (
                    chunk.data[chunk.meta["init_byte_length"] + 4 : chunk.meta["init_byte_length"] + 8]
                    == b"moof"
                )
            else:
                assert chunk.data[4:8] == b"moof" and "init_byte_length" not in chunk.meta
            pieces.append(chunk.data)
        done = await client.expect("session.done")
        assert done["frames"] == 12
    with av.open(io.BytesIO(b"".join(pieces)), "r") as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 12
    assert (frames[0].width, frames[0].height) == (128, 96)
    times = [f.time for f in frames]
    assert times == sorted(times) and abs(times[-1] - 11 / 30) < 1e-3


async def test_vllm_omni_interaction_progress_and_done(world_server: WorldServer) -> None:
    """vLLM-Omni's nested interaction form; every chunk's metadata carries its
    started/active/completed event ids, and `session.done` carries `chunks` and `stopped`
    (what its example client and demo read)."""
    client = await open_client(world_server)
    async with client.ws:
        start = {
            "type": "session.start",
            "model": "tiny-video-random",
            "prompt": "a road",
            "width": 64,
            "height": 64,
        }
        await client.send(start)
        request_id = (await client.expect("video.start"))["request_id"]
        await client.chunk()
        interaction = {"event_id": "turn-left", "event": {"prompt": "a snowy road"}, "transition_chunks": 2}
        await client.send({"type": "session.interaction", "interaction": interaction})
        queued = await client.expect("session.interaction.queued")
        assert queued["event_id"] == "turn-left"
        metas: list[dict[str, Any]] = []
        while not metas or metas[-1]["generation_chunk_index"] <= queued["applies_at_chunk"]:
            metas.append((await client.chunk()).meta)
        for meta in metas:
            landed = meta["generation_chunk_index"] == queued["applies_at_chunk"]
            assert meta["started_event_ids"] == (["turn-left"] if landed else []), meta
            assert meta["completed_event_ids"] == (["turn-left"] if landed else []), meta
            assert meta["active_event_ids"] == [], meta
        await client.send({"type": "session.stop"})
        done = await client.expect("session.done")
        assert done["request_id"] == request_id and done["stopped"] is True
        assert done["chunks"] == len(metas) + 1
