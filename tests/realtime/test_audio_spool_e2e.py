"""A live server spools answered turns' audio to disk: `conversation.item.retrieve` of an
older item still returns it, /metrics counts it as spooled rather than held, and the files
go once the session ends here."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.live_server import LiveServer
from tests.sessions.client import Conn, opened, until, user_text
from tests.sessions.conftest import session_server

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("srv")
    with session_server(folder, None, audio_ms=600, disconnect_grace_s=0.3) as live:
        yield live


def pcm16(seconds: float, freq: float = 330.0) -> bytes:
    t = np.arange(int(seconds * 24_000)) / 24_000
    return np.rint(0.3 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes()


async def retrieve(conn: Conn, item_id: str) -> dict[str, object]:
    await conn.send({"type": "conversation.item.retrieve", "item_id": item_id})
    got = await conn.events.wait_for("conversation.item.retrieved", within_s=10)
    item = got.raw["item"]
    assert isinstance(item, dict)
    return item


def audio_of(item: dict[str, object]) -> bytes:
    content = item["content"]
    assert isinstance(content, list)
    return base64.b64decode(content[0]["audio"])


async def metric(server: LiveServer, name: str) -> float:
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        body = (await http.get("/metrics")).text
    match = re.search(rf"^{name} (\S+)$", body, re.MULTILINE)
    assert match is not None, name
    return float(match.group(1))


def spool_files(server: LiveServer) -> list[Path]:
    spool = server.ctx.audio_spool
    assert spool is not None  # on by default
    return [p for p in spool.directory.iterdir() if p.is_file()]


async def test_retrieve_of_an_older_item_returns_its_spooled_audio(server: LiveServer) -> None:
    sent = pcm16(0.8)
    async with opened(server) as conn:
        await conn.send(
            {
                "type": "session.update",
                "session": {"type": "realtime", "audio": {"input": {"turn_detection": None}}},
            }
        )
        await conn.events.wait_for("session.updated", within_s=10)
        audio_item = {"type": "input_audio", "audio": base64.b64encode(sent).decode()}
        await conn.send(
            {
                "type": "conversation.item.create",
                "item": {"type": "message", "role": "user", "content": [audio_item]},
            }
        )
        user_id = str((await conn.events.wait_for("conversation.item.done", within_s=10)).raw["item"]["id"])
        await conn.send({"type": "response.create"})
        reply = await conn.events.collect_until("response.done", within_s=30)
        assistant_id = str(reply[-1].raw["response"]["output"][0]["id"])
        deltas = b"".join(
            base64.b64decode(r.raw["delta"]) for r in reply if r.type == "response.output_audio.delta"
        )
        assert deltas
        await user_text(conn, "and now something else")  # both earlier items are now older turns
        await until(lambda: len(spool_files(server)) >= 2, within_s=5)
        assert await metric(server, "omniduplex_conversation_audio_spooled_bytes") >= len(deltas)

        user = await retrieve(conn, user_id)
        back = np.frombuffer(audio_of(user), "<i2").astype(np.float32) / 32768
        want = np.frombuffer(sent, "<i2").astype(np.float32) / 32768
        assert len(back) == pytest.approx(len(want), abs=3)
        n = min(len(back), len(want))
        assert np.max(np.abs(back[300 : n - 300] - want[300 : n - 300])) < 2e-3  # via PCM16 16 kHz
        assert audio_of(await retrieve(conn, assistant_id)) == deltas  # the exact bytes sent

        await conn.send(
            {
                "type": "conversation.item.truncate",
                "item_id": assistant_id,
                "content_index": 0,
                "audio_end_ms": 200,
            }
        )
        await conn.events.wait_for("conversation.item.truncated", within_s=10)
        assert audio_of(await retrieve(conn, assistant_id)) == deltas[: 24 * 2 * 200]

    # the client left: after the disconnect grace the session is parked, its audio discarded
    await until(lambda: spool_files(server) == [], within_s=10)
