"""Tenant isolation: a session is visible to its tenant only (state, delete, resume), and
another tenant learns nothing, not even that the id exists."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import opened, resumed, turn
from tests.sessions.conftest import session_server

pytestmark = pytest.mark.system

KEY_A, KEY_B = "key-a", "key-b"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"), module_redis.url, api_keys=f"{KEY_A}:tenantA,{KEY_B}:tenantB"
    ) as live:
        yield live


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_other_tenant_sees_session_not_found_everywhere(server: LiveServer) -> None:
    async with opened(server, api_key=KEY_A) as conn:
        await turn(conn, "private", audio=False)
        sid, token = conn.session_id, conn.resume_token
        async with httpx.AsyncClient(base_url=server.http_url) as http:
            for method in ("GET", "DELETE"):
                other = await http.request(method, f"/v1/sessions/{sid}", headers=bearer(KEY_B))
                unknown = await http.request(
                    method, "/v1/sessions/sess_unknown0000000000000000", headers=bearer(KEY_B)
                )
                assert other.status_code == unknown.status_code == 404
                assert other.json() == unknown.json()  # indistinguishable from an unknown id
                assert other.json()["error"]["code"] == "session_not_found"
            assert (await http.get(f"/v1/sessions/{sid}")).status_code == 401
            mine = await http.get(f"/v1/sessions/{sid}", headers=bearer(KEY_A))
            assert mine.status_code == 200 and mine.json()["id"] == sid
        # Even with the right resume token, another tenant cannot resume it.
        with pytest.raises(InvalidStatus) as caught:
            async with resumed(server, sid, token, conn.last_event_id, api_key=KEY_B):
                pass
        assert caught.value.response.status_code == 404
        assert json.loads(caught.value.response.body)["error"]["code"] == "session_not_found"
        # The session was not disturbed: still served on its connection.
        await conn.send({"type": "input_audio_buffer.clear"})
        await conn.events.wait_for("input_audio_buffer.cleared", within_s=5)
        conn.abort()
    async with resumed(server, sid, token, conn.last_event_id, api_key=KEY_A) as again:
        assert again.events.log[0].raw["replay_count"] == 0


async def test_tenant_deletes_its_own_session(server: LiveServer) -> None:
    async with opened(server, api_key=KEY_B) as conn:
        pass  # parked
    async with httpx.AsyncClient(base_url=server.http_url) as http:
        assert (
            await http.delete(f"/v1/sessions/{conn.session_id}", headers=bearer(KEY_A))
        ).status_code == 404
        assert (
            await http.delete(f"/v1/sessions/{conn.session_id}", headers=bearer(KEY_B))
        ).status_code == 200
        assert (await http.get(f"/v1/sessions/{conn.session_id}", headers=bearer(KEY_B))).status_code == 404
    with pytest.raises(InvalidStatus) as caught:
        async with resumed(server, conn.session_id, conn.resume_token, conn.last_event_id, api_key=KEY_B):
            pass
    assert caught.value.response.status_code == 404
