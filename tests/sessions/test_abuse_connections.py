"""Issue 13 points 8 to 10 and 13 against a real server: half-open connections are dropped at
the documented deadlines, an empty key set is no key set, `ek_` keys see only their own
sessions, and a non-UTF-8 text frame is one log line and close 1007."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.client import opened, user_text
from tests.sessions.conftest import session_server
from web.commands.serve import check_bind
from web.settings import ServerSettings

pytestmark = pytest.mark.system

HTTP_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
API_KEY = "sk-abuse-test"


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("srv"),
        module_redis.url,
        api_keys=f"{API_KEY}:acme",
        http_timeout_s=HTTP_TIMEOUT_S,
        keep_alive_s=KEEP_ALIVE_S,
    ) as live:
        yield live


# --- point 8: half-open connections ---------------------------------------------------------------


def _dropped(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closed `sock` (EOF or reset) before `deadline`."""
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_idle_and_partial_connections_are_dropped_in_time(server: LiveServer) -> None:
    port = server.settings.port
    socks: list[socket.socket] = []
    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            if i % 4 == 1:  # half a request line
                sock.sendall(b"GET /v1/realtime?model=x HT")
            elif i % 4 == 2:  # an upgrade whose headers never end
                sock.sendall(
                    b"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                )
            elif i % 4 == 3:  # a complete request, then an idle keep-alive connection
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            socks.append(sock)  # i % 4 == 0: connects and says nothing
        started = time.monotonic()
        deadline = started + max(HTTP_TIMEOUT_S, KEEP_ALIVE_S) + 4.0
        held = [i for i, sock in enumerate(socks) if not _dropped(sock, deadline)]
        assert held == [], f"{len(held)} connections still held {time.monotonic() - started:.1f} s later"
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"{server.http_url}/healthz", timeout=5).status_code == 200  # still serving


def test_endless_headers_are_refused(server: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", server.settings.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(200):
                sock.sendall(b"X-Filler-%d: %s\r\n" % (i, b"f" * 1000))
        except OSError:
            pass  # refused mid-way
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]


def test_slow_body_is_timed_out(server: LiveServer) -> None:
    with socket.create_connection(("127.0.0.1", server.settings.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/realtime/client_secrets HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
            + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        started = time.monotonic()
        answer = sock.recv(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:100]
    assert time.monotonic() - started < HTTP_TIMEOUT_S + 3


# --- point 13: a text frame that is not UTF-8 ------------------------------------------------------


async def test_non_utf8_text_frame_is_1007_and_one_log_line(
    server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with websockets.connect(
        f"{server.ws_url}/v1/realtime",
        additional_headers={"Authorization": f"Bearer {API_KEY}"},
        open_timeout=20,
    ) as ws:
        while True:  # past session.created
            if '"session.created"' in str(await asyncio.wait_for(ws.recv(), 10)):
                break
        ws.protocol.send_text(b"\xff\xfe not utf-8")  # a raw text frame, as a broken client sends
        ws.send_data()
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1007
    lines = [r for r in caplog.records if "not UTF-8" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info is not None], "a traceback was logged"


# --- point 9: an empty key set is no key set --------------------------------------------------------


@pytest.mark.parametrize("keys", [",", " ", " , ,"])
def test_empty_key_set_does_not_pass_the_bind_check(keys: str) -> None:
    assert check_bind(ServerSettings(host="0.0.0.0", api_keys=keys)) is not None
    assert check_bind(ServerSettings(host="0.0.0.0", api_keys=keys, insecure=True)) is None
    assert check_bind(ServerSettings(host="0.0.0.0", api_keys="k:t")) is None


def test_serve_refuses_a_public_bind_with_an_empty_key_set() -> None:
    env = {**os.environ, "OMNIDUPLEX_API_KEYS": ","}
    done = subprocess.run(
        [sys.executable, "-m", "web.cli", "serve", "--host", "0.0.0.0", "--port", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "refusing to serve on 0.0.0.0 without API keys" in done.stderr


# --- point 10: ek_ keys are scoped to the sessions they opened -------------------------------------


async def test_ephemeral_key_sees_only_its_own_sessions(server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=server.http_url, timeout=20) as http:
        minted = await http.post(
            "/v1/realtime/client_secrets", headers=headers, json={"session": {"type": "realtime"}}
        )
        ek = minted.json()["value"]
        async with opened(server, api_key=API_KEY) as other, opened(server, api_key=ek) as own:
            await user_text(own, "hello")
            ek_headers = {"Authorization": f"Bearer {ek}"}
            assert (await http.get(f"/v1/sessions/{own.session_id}", headers=ek_headers)).status_code == 200
            for method in ("GET", "DELETE"):
                refused = await http.request(method, f"/v1/sessions/{other.session_id}", headers=ek_headers)
                assert refused.status_code == 404 and refused.json()["error"]["code"] == "session_not_found"
            assert (await http.get(f"/v1/sessions/{other.session_id}", headers=headers)).status_code == 200
            assert (await http.get(f"/v1/sessions/{own.session_id}", headers=headers)).status_code == 200
            assert (
                await http.delete(f"/v1/sessions/{own.session_id}", headers=ek_headers)
            ).status_code == 200
            await user_text(other, "untouched")
