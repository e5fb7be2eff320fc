"""A vLLM-Omni-style robot client for the tests: ``websockets`` + ``msgpack`` with numpy arrays
packed as openpi does (``__ndarray__`` maps), speaking to ``/v1/realtime/robot/openpi``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgpack
import numpy as np
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(type(obj).__name__)


def _hook(obj: dict[Any, Any]) -> Any:
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


def pack(value: Any) -> bytes:
    data: bytes = msgpack.packb(value, default=_default, use_bin_type=True)
    return data


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, object_hook=_hook, raw=False)


def observation(meta: dict[str, Any], index: int, **extra: Any) -> dict[str, Any]:
    """A valid observation for ``meta`` (seeded by ``index``)."""
    rng = np.random.default_rng(index)
    obs: dict[str, Any] = {
        key: rng.integers(0, 256, meta["image_shape"], dtype=np.uint8) for key in meta["image_keys"]
    }
    obs[meta["state_key"]] = rng.standard_normal(meta["state_dim"]).astype(np.float32)
    obs.update(extra)
    return obs


class RobotClient:
    def __init__(self, ws: ClientConnection, metadata: dict[str, Any]) -> None:
        self.ws = ws
        self.metadata = metadata

    @property
    def session_id(self) -> str:
        """From the 101 (what a client that did not ask for the extensions reads)."""
        assert self.ws.response is not None
        return str(self.ws.response.headers["X-Omni-Session-Id"])

    @property
    def token(self) -> str:
        assert self.ws.response is not None
        return str(self.ws.response.headers["X-Omni-Resume-Token"])

    @classmethod
    async def connect(cls, url: str, key: str | None, headers: dict[str, str] | None = None) -> RobotClient:
        all_headers = dict(headers or {})
        if key is not None:
            all_headers["Authorization"] = f"Bearer {key}"
        ws = await connect(url, additional_headers=all_headers, max_size=None, compression=None)
        first = await asyncio.wait_for(ws.recv(), 30)
        assert isinstance(first, bytes), first
        return cls(ws, unpack(first))

    async def send(self, value: Any) -> None:
        await self.ws.send(value if isinstance(value, bytes | str) else pack(value))

    async def recv(self, limit_s: float = 30.0) -> Any:
        frame = await asyncio.wait_for(self.ws.recv(), limit_s)
        assert isinstance(frame, bytes), f"expected a binary frame, got text {frame!r}"
        return unpack(frame)

    async def infer(self, obs: dict[str, Any]) -> dict[str, Any]:
        await self.send(obs)
        reply: dict[str, Any] = await self.recv()
        return reply

    async def close(self) -> None:
        await self.ws.close()


async def refused(url: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of an upgrade refused before the WebSocket opens."""
    try:
        ws = await connect(url, additional_headers=headers)
    except InvalidStatus as exc:
        return exc.response.status_code, json.loads(exc.response.body or b"{}")
    await ws.close()
    raise AssertionError(f"{url} was accepted")
