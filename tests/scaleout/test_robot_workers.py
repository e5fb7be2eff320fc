"""Robot sessions under ``serve --workers 2``: a resume that reaches the worker which does not
own the session is relayed to its owner (the session, its runtime request and its policy
context stay where they are): the chunk after the resume is the one an unbroken session makes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from tests.robot.robot_client import RobotClient, observation
from tests.scaleout.cluster import get
from tests.scaleout.workers_parent import start_parent

# Layer: real worker processes.
pytestmark = pytest.mark.system


def robot_url(base: str, query: str = "") -> str:
    return base.replace("http://", "ws://") + "/v1/realtime/robot/openpi" + query


async def test_a_resume_on_the_other_worker_reaches_the_owner(tmp_path: Path) -> None:
    parent = start_parent(tmp_path)
    try:
        deadline = time.monotonic() + 30
        while len(workers := (await get(parent.url + "/v1/replicas", admin=True)).json()["data"]) != 2:
            assert time.monotonic() < deadline, workers
            await asyncio.sleep(0.1)
        owner_url, other_url = (w["url"] for w in workers)
        straight = await RobotClient.connect(robot_url(owner_url), None)
        meta = straight.metadata
        expected = [(await straight.infer(observation(meta, i)))["actions"] for i in range(3)]
        await straight.close()

        robot = await RobotClient.connect(robot_url(owner_url), None)
        for i in range(2):
            await robot.infer(observation(meta, i))
        robot.ws.transport.abort()
        back = await RobotClient.connect(
            robot_url(other_url, f"?session_id={robot.session_id}"),
            None,
            {"X-Omni-Resume-Token": robot.token},
        )
        assert back.metadata["omni_session"]["inferences"] == 2  # the owner's live session
        np.testing.assert_allclose(
            (await back.infer(observation(meta, 2)))["actions"], expected[2], atol=1e-5
        )
        state = (await get(f"{other_url}/v1/sessions/{robot.session_id}")).json()
        assert state["replica"]["url"] == owner_url and state["robot"]["inferences"] == 3
        await back.close()
    finally:
        parent.stop()
