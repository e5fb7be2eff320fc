"""Browser origins (web/edge/cors.py): preflight and CORS headers on every route a browser calls,
`403 origin_not_allowed` for other origins (HTTP and WebSocket), against a real server.

The browser itself (the official SDK from a page on another origin) is in
tests/browser/test_agents_sdk.py; this is the policy, route by route.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import websockets
from websockets.exceptions import InvalidStatus

from tests.conftest_redis import RedisServerProcess
from tests.live_server import LiveServer
from tests.sessions.conftest import session_server
from web.edge.cors import OriginPolicy

pytestmark = pytest.mark.system

KEY = "sk-cors"
APP = "https://app.example.com"
LOOPBACK_PAGE = "http://127.0.0.1:9"  # another port of this machine: a local dev page
ELSEWHERE = "https://elsewhere.example.net"
# The routes a browser app calls (the SDK's offer; a backend-less app's key, state, delete).
BROWSER_ROUTES = [
    ("POST", "/v1/realtime/calls"),
    ("POST", "/v1/realtime/client_secrets"),
    ("GET", "/v1/sessions/sess_abcdefgh12345678"),
    ("DELETE", "/v1/sessions/sess_abcdefgh12345678"),
    ("POST", "/v1/realtime/video/calls"),
]
SDK_HEADERS = "authorization,content-type,x-openai-agents-sdk,openai-beta"


@pytest.fixture(scope="module")
def open_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    """Open (no API keys) with the default policy: loopback origins only."""
    with session_server(tmp_path_factory.mktemp("open"), module_redis.url) as live:
        yield live


@pytest.fixture(scope="module")
def keyed_server(
    tmp_path_factory: pytest.TempPathFactory, module_redis: RedisServerProcess
) -> Iterator[LiveServer]:
    with session_server(
        tmp_path_factory.mktemp("keyed"), module_redis.url, api_keys=f"{KEY}:t", cors_origins=APP
    ) as live:
        yield live


def test_policy_from_setting() -> None:
    default_open = OriginPolicy.from_setting(None, open_mode=True)
    assert default_open.allows("http://localhost:5173", "127.0.0.1:8000")
    assert default_open.allows("http://[::1]:3000", "127.0.0.1:8000")
    assert not default_open.allows(APP, "127.0.0.1:8000")
    default_keyed = OriginPolicy.from_setting(None, open_mode=False)
    assert not default_keyed.allows("http://localhost:5173", "127.0.0.1:8000")
    assert default_keyed.allows("http://127.0.0.1:8000", "127.0.0.1:8000")  # same origin
    listed = OriginPolicy.from_setting(f"{APP}/, http://localhost:3000", open_mode=True)
    assert listed.allows(APP, "api.example.com") and listed.allows("http://localhost:3000", None)
    assert not listed.allows("http://localhost:3001", None)  # a list replaces the default
    assert OriginPolicy.from_setting("*", open_mode=False).allows(ELSEWHERE, None)
    assert not OriginPolicy.from_setting("", open_mode=True).allows("http://localhost:1", None)
    with pytest.raises(ValueError, match="not an origin"):
        OriginPolicy.from_setting("app.example.com", open_mode=False)
    with pytest.raises(ValueError, match="not an origin"):
        OriginPolicy.from_setting("https://app.example.com/path", open_mode=False)


async def preflight(server: LiveServer, method: str, path: str, origin: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as http:
        return await http.options(
            f"{server.http_url}{path}",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": method,
                "Access-Control-Request-Headers": SDK_HEADERS,
            },
        )


@pytest.mark.parametrize(("method", "path"), BROWSER_ROUTES)
async def test_preflight_on_every_browser_route(open_server: LiveServer, method: str, path: str) -> None:
    ok = await preflight(open_server, method, path, LOOPBACK_PAGE)
    assert ok.status_code == 204, ok.text
    assert ok.headers["access-control-allow-origin"] == LOOPBACK_PAGE
    assert method in ok.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in ok.headers["access-control-allow-headers"].split(",")}
    assert set(SDK_HEADERS.split(",")) <= allowed
    assert "Location" in ok.headers["access-control-expose-headers"]
    assert "access-control-allow-credentials" not in ok.headers  # bearer keys, never cookies
    refused = await preflight(open_server, method, path, ELSEWHERE)
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in refused.headers


async def test_answers_carry_cors_headers_and_other_origins_are_refused(open_server: LiveServer) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        secret = await http.post(
            f"{open_server.http_url}/v1/realtime/client_secrets", json={}, headers={"Origin": LOOPBACK_PAGE}
        )
        assert secret.status_code == 200 and secret.json()["value"].startswith("ek_")
        assert secret.headers.get_list("access-control-allow-origin") == [LOOPBACK_PAGE]
        assert "Location" in secret.headers["access-control-expose-headers"]
        # A "simple" request (no preflight: multipart) from another origin never reaches the
        # route: it would open a session the page cannot even read.
        refused = await http.post(
            f"{open_server.http_url}/v1/realtime/calls",
            files={"sdp": (None, "v=0"), "session": (None, "{}")},
            headers={"Origin": ELSEWHERE},
        )
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
        # The demo pages: same origin, and no Origin at all (SDKs, curl) always pass.
        same = await http.post(
            f"{open_server.http_url}/v1/realtime/client_secrets",
            json={},
            headers={"Origin": open_server.http_url},
        )
        assert same.status_code == 200
        assert (await http.get(f"{open_server.http_url}/healthz")).status_code == 200


async def test_websocket_origin_policy(open_server: LiveServer) -> None:
    url = f"{open_server.ws_url}/v1/realtime"
    for path in ("/v1/realtime", "/v1/realtime/video"):
        with pytest.raises(InvalidStatus) as refused:
            async with websockets.connect(f"{open_server.ws_url}{path}", origin=ELSEWHERE, open_timeout=10):
                pass
        assert refused.value.response.status_code == 403
        body = json.loads(refused.value.response.body or b"{}")
        assert body["error"]["code"] == "origin_not_allowed"
    async with websockets.connect(url, origin=LOOPBACK_PAGE, open_timeout=10) as ws:  # type: ignore[arg-type]
        assert json.loads(await ws.recv())["type"] == "session.created"


async def test_configured_origins_replace_the_default(keyed_server: LiveServer) -> None:
    ok = await preflight(keyed_server, "POST", "/v1/realtime/calls", APP)
    assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == APP
    assert (await preflight(keyed_server, "POST", "/v1/realtime/calls", LOOPBACK_PAGE)).status_code == 403
    auth = {"Authorization": f"Bearer {KEY}"}
    async with websockets.connect(
        f"{keyed_server.ws_url}/v1/realtime",
        origin=APP,  # type: ignore[arg-type]
        additional_headers=auth,
        open_timeout=10,
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "session.created"
    with pytest.raises(InvalidStatus) as refused:
        async with websockets.connect(
            f"{keyed_server.ws_url}/v1/realtime",
            origin=LOOPBACK_PAGE,  # type: ignore[arg-type]
            additional_headers=auth,
            open_timeout=10,
        ):
            pass
    assert refused.value.response.status_code == 403
