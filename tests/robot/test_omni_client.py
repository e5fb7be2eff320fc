"""A vLLM-Omni-style client on ``/v1/realtime/robot/openpi``: its additions (``session_id``,
``{"endpoint": "reset"}``, prompt updates, errors as msgpack maps with the socket kept open,
the idle timeout, the 64 MiB cap), bad input, a flooding robot, and the session layer
(tenants, resume tokens, retention of the policy context)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest

from tests.live_server import LiveServer
from tests.robot.robot_client import RobotClient, observation, pack, refused

pytestmark = pytest.mark.system

KEY, OTHER = "sk-robot-a", "sk-robot-b"


def url(server: LiveServer, query: str = "") -> str:
    return f"{server.ws_url}/v1/realtime/robot/openpi{query}"


async def open_robot(server: LiveServer, key: str = KEY, query: str = "") -> RobotClient:
    return await RobotClient.connect(url(server, query), key)


async def on_server(server: LiveServer, coro: Any) -> Any:
    loop = server.ctx.host.loop
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    return await asyncio.wait_for(asyncio.wrap_future(future), 10)


async def test_infer_reset_and_session_id(robot_server: LiveServer) -> None:
    robot = await open_robot(robot_server)
    meta = robot.metadata
    assert "omni_session" not in meta and robot.token.startswith("rt_")  # resume data on the 101
    asked = await open_robot(robot_server, query="?omni_extensions=1")
    assert asked.metadata["omni_session"]["session_id"] == asked.session_id
    assert asked.metadata["omni_session"]["resume_token"] == asked.token
    await asked.close()
    reply = await robot.infer(observation(meta, 0, session_id=robot.session_id))
    assert reply["actions"].shape == (50, 7) and reply["actions"].dtype == np.float32
    assert reply["session_id"] == robot.session_id and reply["server_timing"]["infer_ms"] > 0
    second = await robot.infer(observation(meta, 0))
    await robot.send({"endpoint": "reset"})
    assert await robot.recv() == {"status": "reset successful"}
    after_reset = await robot.infer(observation(meta, 0))
    # the previous chunk conditions the next one; a reset forgets it (noise moves on)
    assert not np.allclose(second["actions"], after_reset["actions"], atol=1e-4)
    await robot.send(observation(meta, 0, session_id="sess_someoneelse"))
    error = await robot.recv()
    assert error["type"] == "error" and error["code"] == "session_mismatch"
    await robot.close()


BAD: list[tuple[str, Any, str]] = [
    ("not msgpack", b"\xc1\xc1 not msgpack", "invalid_msgpack"),
    ("text frame", "hello", "invalid_frame"),
    ("not a map", pack([1, 2, 3]), "invalid_message"),
    (
        "object dtype",
        {"observation/image": {b"__ndarray__": True, b"data": b"", b"dtype": "|O", b"shape": [0]}},
        "unsupported_dtype",
    ),
    (
        "complex dtype",
        {"observation/state": {b"__ndarray__": True, b"data": b"\0" * 64, b"dtype": "<c8", b"shape": [8]}},
        "unsupported_dtype",
    ),
    (
        "short data",
        {"observation/state": {b"__ndarray__": True, b"data": b"\0" * 3, b"dtype": "<f4", b"shape": [8]}},
        "invalid_array",
    ),
    ("unknown endpoint", {"endpoint": "fly"}, "unknown_endpoint"),
]


@pytest.mark.parametrize(("name", "frame", "code"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_an_error_map_and_the_socket_stays_open(
    robot_server: LiveServer, name: str, frame: Any, code: str
) -> None:
    robot = await open_robot(robot_server)
    await robot.infer(observation(robot.metadata, 1, session_id=robot.session_id))  # vllm-omni dialect
    if isinstance(frame, dict) and "endpoint" not in frame:
        frame = {**observation(robot.metadata, 1), **frame}
    await robot.send(frame)
    error = await robot.recv()
    assert error["type"] == "error" and error["code"] == code, error
    assert error["message"]
    reply = await robot.infer(observation(robot.metadata, 2))  # still served
    assert reply["actions"].shape == (50, 7)
    await robot.close()


async def test_shapes_are_checked_against_the_metadata(robot_server: LiveServer) -> None:
    robot = await open_robot(robot_server)
    meta = robot.metadata
    cases = [
        ({"observation/image": np.zeros((32, 32, 3), np.uint8)}, "invalid_shape", "[64, 64, 3]"),
        ({"observation/state": np.zeros(5, np.float32)}, "invalid_shape", "[8]"),
        ({"observation/wrist_image": None}, "missing_image", "observation/wrist_image"),
        ({"observation/state": np.full(8, np.nan, np.float32)}, "invalid_state", "NaN"),
    ]
    for change, code, needle in cases:
        obs = {k: v for k, v in observation(meta, 3).items() if change.get(k, 0) is not None}
        obs.update({k: v for k, v in change.items() if v is not None})
        await robot.send({**obs, "session_id": robot.session_id})
        error = await robot.recv()
        assert error["code"] == code and needle in error["message"], error
    chw = observation(meta, 4)
    chw["observation/image"] = np.ascontiguousarray(chw["observation/image"].transpose(2, 0, 1))
    assert (await robot.infer(chw))["actions"].shape == (50, 7)  # CHW is taken too
    await robot.close()


@pytest.mark.parametrize("port", ["main", "openpi"])
async def test_payload_over_64_mib_is_refused_clearly(robot_server: LiveServer, port: str) -> None:
    # both ports read robot frames a little over the cap (the main port's other routes keep
    # their 2 MiB limit), so the refusal is the server's own, and the socket stays open
    number = robot_server.settings.port if port == "main" else robot_server.settings.openpi_port
    robot = await RobotClient.connect(f"ws://127.0.0.1:{number}/v1/realtime/robot/openpi", KEY)
    big = {"blob": b"\0" * (64 * 1024 * 1024 + 16)}
    await robot.send(big)
    error = await robot.recv(60)
    assert error["code"] == "payload_too_large" and str(64 * 1024 * 1024) in error["message"]
    assert (await robot.infer(observation(robot.metadata, 5)))["actions"].shape == (50, 7)
    await robot.close()


async def test_prompt_updates_reach_the_policy(robot_server: LiveServer) -> None:
    a = await open_robot(robot_server)
    b = await open_robot(robot_server)
    c = await open_robot(robot_server)
    meta = a.metadata
    plain = await a.infer(observation(meta, 7, prompt="pick up the cup"))
    await b.send({"endpoint": "update", "prompt": "open the drawer"})
    assert (await b.recv())["status"] == "update successful"
    updated = await b.infer(observation(meta, 7))
    in_field = await c.infer(observation(meta, 7, prompt="open the drawer"))
    assert not np.allclose(plain["actions"], updated["actions"], atol=1e-4)
    np.testing.assert_allclose(updated["actions"], in_field["actions"], atol=1e-5)
    async with httpx.AsyncClient() as http:
        state = (
            await http.get(
                f"{robot_server.http_url}/v1/sessions/{b.session_id}",
                headers={"Authorization": f"Bearer {KEY}"},
            )
        ).json()
    assert state["kind"] == "robot" and state["robot"]["prompt"] == "open the drawer"
    for robot in (a, b, c):
        await robot.close()


async def test_a_flooding_robot_gets_its_newest_observation_answered(robot_server: LiveServer) -> None:
    robot = await open_robot(robot_server)
    sent = 40
    for i in range(sent):
        await robot.send(observation(robot.metadata, i, session_id=robot.session_id))
    answered, dropped = 0, 0
    while answered + dropped < sent:
        reply = await robot.recv()
        answered += 1
        dropped = reply["dropped_observations"]
    assert dropped > 0 and answered + dropped == sent
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"{robot_server.http_url}/metrics")).text
    line = next(
        x for x in metrics.splitlines() if x.startswith("omniduplex_robot_observations_dropped_total")
    )
    assert float(line.split()[-1]) >= dropped
    await robot.close()


async def test_resume_keeps_the_policy_context_and_tenant_rules(robot_server: LiveServer) -> None:
    straight = await open_robot(robot_server)
    meta = straight.metadata
    expected = [(await straight.infer(observation(meta, i)))["actions"] for i in range(3)]
    robot = await open_robot(robot_server)
    for i in range(2):
        await robot.infer(observation(meta, i, prompt=""))
    robot.ws.transport.abort()  # no close frame: the session is detached, not ended
    headers = {"Authorization": f"Bearer {KEY}"}
    resume = f"?session_id={robot.session_id}"
    status, body = await refused(url(robot_server, resume), headers)
    assert (status, body["error"]["code"]) == (403, "invalid_resume_token")
    status, _ = await refused(
        url(robot_server, resume), {"Authorization": f"Bearer {OTHER}", "X-Omni-Resume-Token": robot.token}
    )
    assert status == 404  # another tenant's session does not exist for it
    back = await RobotClient.connect(url(robot_server, resume), KEY, {"X-Omni-Resume-Token": robot.token})
    assert (
        back.metadata["omni_session"]["resumed"] is True and back.metadata["omni_session"]["inferences"] == 2
    )
    third = (await back.infer(observation(meta, 2)))["actions"]
    np.testing.assert_allclose(third, expected[2], atol=1e-5)
    await back.close()  # a clean close ends the session
    await straight.close()
    # the end is the server's reaction to the close frame: give a busy host time to see it
    async with httpx.AsyncClient() as http:
        for _ in range(100):
            state = await http.get(f"{robot_server.http_url}/v1/sessions/{robot.session_id}", headers=headers)
            if state.status_code == 404:
                break
            await asyncio.sleep(0.1)
    assert state.status_code == 404
    status, _ = await refused(url(robot_server, resume), {**headers, "X-Omni-Resume-Token": robot.token})
    assert status == 404


async def test_idle_link_is_closed_in_the_vllm_omni_dialect(robot_server: LiveServer) -> None:
    service = robot_server.server.config.app.state.robot_service

    async def set_idle(value: float) -> float:
        old, service.idle_timeout_s = service.idle_timeout_s, value
        return float(old)

    old = await on_server(robot_server, set_idle(0.5))
    try:
        robot = await open_robot(robot_server)
        error = await robot.recv(10)
        assert error["code"] == "idle_timeout"
        await asyncio.wait_for(robot.ws.wait_closed(), 10)
        assert robot.ws.close_code == 1000
    finally:
        await on_server(robot_server, set_idle(old))
