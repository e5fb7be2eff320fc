"""World sessions over WebRTC: a real aiortc peer posts an offer, receives the video track and
drives the session over the ``controls`` data channel (same core and driver as the WebSocket)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription

from tests.world.conftest import WorldServer

pytestmark = pytest.mark.system


class RtcClient:
    def __init__(self) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.pc.addTransceiver("video", direction="recvonly")
        self.channel = self.pc.createDataChannel("controls")
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.opened = asyncio.Event()
        self.track: Any = None
        self.channel.on("open", self.opened.set)
        self.channel.on("message", lambda m: self.events.put_nowait(json.loads(m)))
        self.pc.on("track", self._on_track)

    def _on_track(self, track: Any) -> None:
        self.track = track

    async def connect(self, server: WorldServer) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with httpx.AsyncClient() as http:
            response = await http.post(
                f"{server.url}/v1/realtime/video/calls",
                content=self.pc.localDescription.sdp,
                headers={"Content-Type": "application/sdp"},
            )
        assert response.status_code == 201, response.text
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=response.text, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 15)
        return response.headers["location"]

    def send(self, event: dict[str, Any]) -> None:
        self.channel.send(json.dumps(event))

    async def expect(self, kind: str, limit_s: float = 10.0) -> dict[str, Any]:
        while True:
            event = await asyncio.wait_for(self.events.get(), limit_s)
            if event["type"] == kind:
                return event
            assert event["type"] != "error", event


async def test_webrtc_call_streams_frames_and_takes_controls(world_server: WorldServer) -> None:
    client = RtcClient()
    try:
        location = await client.connect(world_server)
        assert location.startswith("/v1/realtime/video/calls/vrtc_")
        client.send({"type": "session.start", "model": "tiny-jepa", "width": 128, "height": 96, "fps": 30})
        start = await client.expect("video.start")
        assert start["config"]["width"] == 128
        status = await client.expect("video.chunk_metadata")
        assert status["kind"] == "rtp" and status["chunk_index"] == 0 and status["byte_length"] == 0
        assert client.track is not None and client.track.kind == "video"
        frames = [await asyncio.wait_for(client.track.recv(), 10) for _ in range(8)]
        assert (frames[-1].width, frames[-1].height) == (128, 96)
        pictures = [f.to_ndarray(format="rgb24") for f in frames]
        assert max(float(p.max()) for p in pictures) > 100  # not a black stream
        client.send(
            {"type": "session.interaction", "event_id": "go", "actions": [{"event": "keydown", "key": "d"}]}
        )
        queued = await client.expect("session.interaction.queued")
        applied = await client.expect("session.interaction.applied")
        assert applied["chunk_index"] == queued["applies_at_chunk"] and applied["event_ids"] == ["go"]
        later = await client.expect("video.chunk_metadata")
        assert later["chunk_index"] > status["chunk_index"] and later["queue_depth"] is not None
        client.send({"type": "session.ping"})
        await client.expect("session.pong")
        client.send({"type": "session.stop"})
        done = await client.expect("session.done")
        assert done["stopped"] is True and done["frames"] >= 8
    finally:
        await client.pc.close()
    # the server lets the call go once the peer is gone
    for _ in range(100):
        if not world_server.service.calls:
            break
        await asyncio.sleep(0.05)
    assert not world_server.service.calls


async def test_bad_offers_are_refused(world_server: WorldServer) -> None:
    async with httpx.AsyncClient() as http:
        empty = await http.post(f"{world_server.url}/v1/realtime/video/calls", content=b"")
        assert empty.status_code == 400 and empty.json()["error"]["code"] == "invalid_offer"
        audio_only = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        audio_only.addTransceiver("audio", direction="recvonly")
        await audio_only.setLocalDescription(await audio_only.createOffer())
        refused = await http.post(
            f"{world_server.url}/v1/realtime/video/calls", content=audio_only.localDescription.sdp
        )
        await audio_only.close()
        assert refused.status_code == 400 and "video" in refused.json()["error"]["message"]
        gone = await http.delete(f"{world_server.url}/v1/realtime/video/calls/vrtc_nope")
        assert gone.status_code == 404
