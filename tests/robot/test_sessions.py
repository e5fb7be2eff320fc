"""Robot sessions on the session layer beyond one connection: admission slots shared with voice
sessions, and a session that moves with its policy context when its process goes away (the
context is in its Redis record; a new process rebuilds it on resume under a new binding)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect

from tests.conftest_redis import RedisServerProcess, start_tcp_redis
from tests.live_server import live_server
from tests.robot.robot_client import RobotClient, observation, refused

pytestmark = pytest.mark.system

KEY = "sk-robot-a"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def redis(tmp_path: Path) -> RedisServerProcess:
    server = start_tcp_redis(tmp_path / "redis")
    yield server  # type: ignore[misc]
    server.stop()


async def test_robots_share_admission_slots_with_voice_sessions(
    tmp_path: Path, redis: RedisServerProcess
) -> None:
    with live_server(
        tmp_path / "srv",
        pipeline="null",
        vad=False,
        redis_url=redis.url,
        api_keys=f"{KEY}:tenant-a",
        max_sessions=2,
        admission_queue_max=0,
    ) as server:
        robot_url = f"{server.ws_url}/v1/realtime/robot/openpi"
        voice = await connect(f"{server.ws_url}/v1/realtime?model=null", additional_headers=AUTH)
        await voice.recv()  # session.created: the voice session holds a slot
        robot = await RobotClient.connect(robot_url, KEY)
        status, body = await refused(robot_url, AUTH)
        assert status == 429 and body["error"]["code"] == "server_at_capacity"
        await voice.close()  # its slot comes back
        for _ in range(100):
            try:
                second = await RobotClient.connect(robot_url, KEY)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the voice session's slot did not come back")
        assert (await second.infer(observation(second.metadata, 0)))["actions"].shape == (50, 7)
        await second.close()
        await robot.close()


async def test_a_session_moves_to_a_new_process_with_its_context(
    tmp_path: Path, redis: RedisServerProcess
) -> None:
    settings = dict(pipeline="null", vad=False, redis_url=redis.url, api_keys=f"{KEY}:tenant-a")
    with live_server(tmp_path / "a", **settings) as first:  # type: ignore[arg-type]
        url = f"{first.ws_url}/v1/realtime/robot/openpi"
        straight = await RobotClient.connect(url, KEY)
        meta = straight.metadata
        expected = [
            (await straight.infer(observation(meta, i, prompt="stack the blocks")))["actions"]
            for i in range(3)
        ]
        await straight.close()
        robot = await RobotClient.connect(url, KEY)
        for i in range(2):
            await robot.infer(observation(meta, i, prompt="stack the blocks"))
        session_id, token = robot.session_id, robot.token
        # the process goes away (shutdown: the session is parked with its context in Redis)
    with live_server(tmp_path / "b", **settings) as second:  # type: ignore[arg-type]
        url = f"{second.ws_url}/v1/realtime/robot/openpi?session_id={session_id}"
        back = await RobotClient.connect(url, KEY, {"X-Omni-Resume-Token": token})
        assert back.metadata["omni_session"]["inferences"] == 2
        third = await back.infer(observation(meta, 2))  # no prompt field: the stored prompt holds
        np.testing.assert_allclose(third["actions"], expected[2], atol=1e-5)
        await back.close()


async def test_a_server_without_a_robot_policy_serves_the_rest_and_refuses_robots(tmp_path: Path) -> None:
    with live_server(tmp_path / "srv", pipeline="null", vad=False, robot_pipeline="no-such-policy") as server:
        status, body = await refused(f"{server.ws_url}/v1/realtime/robot/openpi", {})
        assert status == 503 and body["error"]["code"] == "robot_unavailable"
        voice = await connect(f"{server.ws_url}/v1/realtime?model=null")
        assert '"session.created"' in str(await voice.recv())
        await voice.close()


async def test_grace_expiry_and_delete_end_sessions_and_free_their_slots(tmp_path: Path) -> None:
    with live_server(
        tmp_path / "srv", pipeline="null", vad=False, api_keys=f"{KEY}:tenant-a", disconnect_grace_s=0.5
    ) as server:
        url = f"{server.ws_url}/v1/realtime/robot/openpi"
        dropped = await RobotClient.connect(url, KEY)
        await dropped.infer(observation(dropped.metadata, 0))
        dropped.ws.transport.abort()  # detached for the 0.5 s grace, then ended
        deleted = await RobotClient.connect(url, KEY)
        async with httpx.AsyncClient() as http:
            answer = await http.delete(f"{server.http_url}/v1/sessions/{deleted.session_id}", headers=AUTH)
            assert answer.status_code == 200 and answer.json()["deleted"] is True
            await asyncio.wait_for(deleted.ws.wait_closed(), 10)
            assert deleted.ws.close_code == 1000
            for _ in range(100):
                ready = (await http.get(f"{server.http_url}/readyz")).json()
                if ready["sessions_by_kind"]["robot"] == 0:
                    break
                await asyncio.sleep(0.1)
            assert ready["sessions_by_kind"]["robot"] == 0  # both gone from the process
        resume = f"{url}?session_id={dropped.session_id}"
        status, body = await refused(resume, {**AUTH, "X-Omni-Resume-Token": dropped.token})
        assert status == 404 and body["error"]["code"] == "session_not_found"


async def test_a_client_gone_before_the_upgrade_completes_leaves_no_session(tmp_path: Path) -> None:
    """The session is made before the 101 is sent; a client that vanishes right then must not
    leave it holding a slot until its idle TTL."""
    with live_server(
        tmp_path / "srv", pipeline="null", vad=False, max_sessions=1, admission_queue_max=0
    ) as server:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", server.settings.port)) as raw:
                raw.sendall(
                    b"GET /v1/realtime/robot/openpi HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                    b"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                    b"Sec-WebSocket-Version: 13\r\n\r\n"
                )
            # closed at once, before reading the 101
        for _ in range(100):  # with one slot, a leaked session would refuse the next robot
            try:
                robot = await RobotClient.connect(f"{server.ws_url}/v1/realtime/robot/openpi", None)
                break
            except Exception:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("a vanished client's session kept the only slot")
        assert (await robot.infer(observation(robot.metadata, 0)))["actions"].shape == (50, 7)
        await robot.close()
