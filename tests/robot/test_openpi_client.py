"""The real ``openpi-client`` (PyPI) against ``omniduplex serve --openpi-port``: it sees
exactly openpi's policy server (metadata first, ``actions`` + ``server_timing`` per
observation, an error as a text frame then close 1011), with API keys, and a dropped robot
resumes its session (same policy context) through the URL."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.asyncio.client import connect

from tests.live_server import LiveServer
from tests.robot.robot_client import refused

pytestmark = pytest.mark.system

SCRIPT = Path(__file__).with_name("openpi_client_script.py")
KEY = "sk-robot-a"


def run_client(
    python: Path, server: LiveServer, mode: str, *args: str, host: str = "127.0.0.1"
) -> list[dict[str, Any]]:
    port = "-" if host.startswith("ws") else str(server.settings.openpi_port)
    done = subprocess.run(
        [str(python), str(SCRIPT), host, port, KEY, mode, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_openpi_client_gets_metadata_then_action_chunks(
    openpi_client_python: Path, robot_server: LiveServer
) -> None:
    lines = run_client(openpi_client_python, robot_server, "infer", "3")
    meta = lines[0]["metadata"]
    assert meta["image_keys"] == ["observation/image", "observation/wrist_image"]
    assert meta["image_shape"] == [64, 64, 3] and meta["state_dim"] == 8
    assert (meta["action_horizon"], meta["action_dim"]) == (50, 7)
    assert "omni_session" not in meta  # a stock openpi client gets the policy's metadata only
    results = lines[1:]
    assert len(results) == 3
    for i, result in enumerate(results):
        assert result["shape"] == [50, 7] and result["dtype"] == "float32"
        assert result["keys"] == ["actions", "server_timing"]  # openpi's reply, nothing else
        assert result["timing"] == (["infer_ms"] if i == 0 else ["infer_ms", "prev_total_ms"])
        assert np.isfinite(np.array(result["actions"])).all()
    # the previous chunk is part of the context: consecutive chunks differ
    assert not np.allclose(results[0]["actions"], results[1]["actions"])


def test_openpi_client_sees_a_bad_observation_as_text_then_1011(
    openpi_client_python: Path, robot_server: LiveServer
) -> None:
    lines = run_client(openpi_client_python, robot_server, "bad")
    error = lines[1]["error"]
    assert error.startswith("Error in inference server:\ninvalid_shape:"), error
    assert "[64, 64, 3]" in error and "[5, 5, 3]" in error
    assert lines[2]["close_code"] == 1011


def test_openpi_client_resumes_its_session_with_the_same_context(
    openpi_client_python: Path, robot_server: LiveServer
) -> None:
    straight = run_client(openpi_client_python, robot_server, "infer", "3")
    asking = f"ws://127.0.0.1:{robot_server.settings.openpi_port}/?omni_extensions=1"
    first = run_client(openpi_client_python, robot_server, "infer", "2", host=asking)
    session = first[0]["metadata"]["omni_session"]
    url = (
        f"ws://127.0.0.1:{robot_server.settings.openpi_port}/"
        f"?session_id={session['session_id']}&resume_token={session['resume_token']}"
    )
    resumed = run_client(openpi_client_python, robot_server, "infer", "1", "2", host=url)
    assert resumed[0]["metadata"]["omni_session"] == {
        "session_id": session["session_id"],
        "expires_at": session["expires_at"],
        "resumed": True,
        "inferences": 2,
    }
    # the third chunk after a drop and a resume is the third chunk of an unbroken session
    np.testing.assert_allclose(resumed[1]["actions"], straight[3]["actions"], atol=1e-5)
    # a fresh session answering the same observation first has no such context
    fresh = run_client(openpi_client_python, robot_server, "infer", "1", "2")
    assert not np.allclose(fresh[1]["actions"], straight[3]["actions"], atol=1e-3)


async def test_openpi_port_takes_api_keys_and_serves_healthz(robot_server: LiveServer) -> None:
    import httpx

    base = f"127.0.0.1:{robot_server.settings.openpi_port}"
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"http://{base}/healthz")).status_code == 200
    status, body = await refused(f"ws://{base}/", {})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = await refused(f"ws://{base}/", {"Authorization": "Api-Key sk-wrong"})
    assert status == 401
    ws = await connect(f"ws://{base}/", additional_headers={"Authorization": f"Api-Key {KEY}"})
    assert isinstance(await ws.recv(), bytes)  # the metadata frame
    await ws.close()
