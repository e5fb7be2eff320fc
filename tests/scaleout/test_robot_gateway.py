"""Robot sessions scaled out, with real processes (a redis-server, two replicas, a gateway):
``/v1/realtime/robot/openpi`` is routed like the voice and world sockets (new → a picked
replica, ``?session_id=`` → the owner), and when the owner dies the session moves to the other
replica with its policy context (the record's ``config.context``): the chunk after the
failover is the one an unbroken session makes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.robot.robot_client import RobotClient, observation
from tests.scaleout.cluster import Cluster, Proc, get, replica_id_of

pytestmark = pytest.mark.system


def robot_url(proc: Proc, query: str = "") -> str:
    return proc.url.replace("http://", "ws://") + "/v1/realtime/robot/openpi" + query


async def test_a_robot_session_fails_over_with_its_context(two_replicas: Cluster) -> None:
    c = two_replicas
    ids = {await replica_id_of(r): r for r in c.replicas}
    straight = await RobotClient.connect(robot_url(c.gateway), None)
    meta = straight.metadata
    expected = [
        (await straight.infer(observation(meta, i, prompt="wipe the table")))["actions"] for i in range(3)
    ]
    await straight.close()

    robot = await RobotClient.connect(robot_url(c.gateway), None)
    state = (await get(f"{c.gateway.url}/v1/sessions/{robot.session_id}")).json()
    assert state["kind"] == "robot"
    owner_id = state["replica"]["id"]
    for i in range(2):
        await robot.infer(observation(meta, i, prompt="wipe the table"))
    await asyncio.sleep(2.5)  # the context is written at most once a second while robots run
    ids[owner_id].kill9()
    robot.ws.transport.abort()

    back = await RobotClient.connect(
        robot_url(c.gateway, f"?session_id={robot.session_id}"), None, {"X-Omni-Resume-Token": robot.token}
    )
    assert back.metadata["omni_session"]["inferences"] == 2
    third = (await back.infer(observation(meta, 2)))["actions"]
    np.testing.assert_allclose(third, expected[2], atol=1e-5)
    moved = (await get(f"{c.gateway.url}/v1/sessions/{robot.session_id}")).json()
    assert moved["replica"]["id"] != owner_id and moved["robot"]["prompt"] == "wipe the table"
    await back.close()
