"""A session past its maximum duration gets `error session_expired`, then close 1001."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import LiveServer, live_server
from tests.realtime.wire import sdk_session

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), session_max_duration_s=1) as live:
        yield live


async def test_session_expires_with_error_then_1001(server: LiveServer) -> None:
    t0 = time.monotonic()
    async with sdk_session(server) as (_conn, events):
        created = events.log[0].event.session
        assert created.expires_at is not None
        error = (await events.wait_for("error", within_s=10)).event.error
        assert error.code == "session_expired" and error.type == "invalid_request_error"
        assert await events.close_code(within_s=10) == 1001
    assert 0.9 < time.monotonic() - t0 < 5.0
