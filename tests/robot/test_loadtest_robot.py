"""The ``robot`` load-test scenario's pieces: a level against a real server, and the capacity
search (doubling, then bisecting) on scripted probes."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.robot import capacity, run_level
from loadtest.server_process import Target
from tests.live_server import LiveServer

pytestmark = pytest.mark.system


async def test_a_level_measures_latency_and_chunk_rate(robot_server: LiveServer) -> None:
    level = await run_level(Target(robot_server.http_url), 2, 20.0, 1.0, "sk-robot-a")
    assert level["error_count"] == 0, level["errors"]
    assert level["latency_ms"]["n"] >= 10 and level["latency_ms"]["p50"] > 0
    assert level["server_infer_ms"]["p50"] <= level["latency_ms"]["p99"]
    assert level["chunks_per_s"] > 10 and level["actions_per_s"] == level["chunks_per_s"] * 50


async def test_capacity_finds_the_largest_n_within_the_objective() -> None:
    seen: list[int] = []

    async def measure(n: int) -> dict[str, Any]:
        seen.append(n)
        return {"latency_ms": {"p99": 10.0 * n}, "error_count": 0}  # p99 ≤ 100 ms up to N = 10

    found = await capacity(measure, 100.0, 128, lambda _line: None)
    assert found["largest_n"] == 10
    assert seen[:5] == [1, 2, 4, 8, 16] and len(seen) == len(set(seen))
