"""The official browser SDK (`@openai/agents-realtime`) drives the server from another origin.

As any web app that uses this server would: the page (tests/browser/agents_sdk/page.html and
its esbuild bundle, `make browser-sdk`) is served by a second HTTP server on another loopback
port, so every call the SDK makes is cross-origin (CORS, web/edge/cors.py). The app's backend mints
an `ek_` key (`POST /v1/realtime/client_secrets` with the real API key), and the page calls
`session.connect({apiKey: ek})` with `OpenAIRealtimeWebRTC({baseUrl: ".../v1/realtime/calls"})`
in a real headless Chromium. Here: a text turn, a spoken turn (Chromium's fake microphone plays
a Piper WAV) and an agent with a function tool, with no `error` reaching the application and no
CORS or fetch failure in the console; and a page origin not in `--cors-origins` that the SDK
cannot connect from.

The server's pipelines never decide to call a tool (the echo responder), so the tool test
checks what the server owns, as tests/realtime/test_agents_sdk.py does for the Python SDK: the
SDK's tool definition is accepted, kept in the session and answered with a normal turn.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Page

from tests.browser.test_demo_page import CHROMIUM, WAV_RATE, launch, silence, write_wav
from tests.live_server import LiveServer, free_port, live_server
from tests.speech_audio import SENTENCE, speak, words

pytestmark = pytest.mark.browser

SDK_DIR = Path(__file__).parent / "agents_sdk"
BUNDLE = SDK_DIR / "dist" / "page.js"
KEY = "sk-browser-app"


class PageHandler(SimpleHTTPRequestHandler):
    """Serves the page and its bundle, quietly."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """A static file server for the page: another origin than the omniduplex server's."""
    assert BUNDLE.exists(), f"{BUNDLE} is missing: bundle the browser SDK with `make browser-sdk`"
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", free_port()), functools.partial(PageHandler, directory=str(SDK_DIR))
    )
    thread = threading.Thread(target=httpd.serve_forever, name="page-server", daemon=True)
    thread.start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, page_port: int) -> Iterator[LiveServer]:
    """With API keys (as a deployment runs), allowing the app's origin and no other."""
    with live_server(
        Path(tmp_path_factory.mktemp("srv")),
        api_keys=f"{KEY}:app",
        cors_origins=f"http://127.0.0.1:{page_port}",
    ) as live:
        yield live


@pytest.fixture(scope="module")
def silent_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_wav(Path(tmp_path_factory.mktemp("wav")) / "silence.wav", [silence(60)])


@pytest.fixture(scope="module")
def speech_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("wav")) / "sentence.wav"
    return write_wav(path, [silence(1.5), speak(SENTENCE, WAV_RATE), silence(40)])


async def mint_key(server: LiveServer) -> str:
    """What the app's backend does: an `ek_` key from the real one (no browser involved)."""
    async with httpx.AsyncClient(base_url=server.http_url, timeout=10) as http:
        issued = await http.post(
            "/v1/realtime/client_secrets",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"session": {"type": "realtime"}},
        )
    assert issued.status_code == 200, issued.text
    secret = issued.json()["value"]
    assert secret.startswith("ek_")
    return str(secret)


@asynccontextmanager
async def app_page(wav: Path, url: str) -> AsyncIterator[tuple[Page, list[str]]]:
    """The app's page in a Chromium whose fake microphone plays `wav`; the console collected."""
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: install Debian's chromium (make system-deps)"
    browser: Browser
    async with launch(CHROMIUM, wav) as browser:
        page = await browser.new_page()
        console: list[str] = []
        page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
        page.on("pageerror", lambda exc: console.append(f"pageerror: {exc}"))
        page.on("requestfailed", lambda req: console.append(f"requestfailed: {req.url} {req.failure}"))
        await page.goto(url)
        await page.wait_for_function("window.agentsTest !== undefined")
        try:
            yield page, console
        finally:
            await page.evaluate("window.agentsTest.close()")
            await page.close()


async def connect(page: Page, server: LiveServer, config: dict[str, Any], with_tool: bool = False) -> Any:
    options = {
        "baseUrl": f"{server.http_url}/v1/realtime/calls",
        "apiKey": await mint_key(server),
        "withTool": with_tool,
        "config": config,
    }
    return await page.evaluate("options => window.agentsTest.connect(options)", options)


async def seen(page: Page) -> dict[str, Any]:
    result: dict[str, Any] = await page.evaluate("JSON.parse(JSON.stringify(window.agentsTest.seen))")
    return result


async def until(page: Page, condition: str, console: list[str], within_s: float) -> dict[str, Any]:
    try:
        await page.wait_for_function(
            f"(seen => {condition})(window.agentsTest.seen)", timeout=within_s * 1000
        )
    except Exception:
        raise AssertionError(
            f"not reached: {condition}; seen {await seen(page)}; console {console[-20:]}"
        ) from None
    return await seen(page)


def assistant_texts(state: dict[str, Any]) -> list[str]:
    return [i["text"] for i in state["history"] if i["role"] == "assistant" and i["text"]]


def assert_clean(state: dict[str, Any], console: list[str]) -> None:
    assert state["errors"] == [], state["errors"]
    assert "error" not in state["events"], state["events"]
    assert not [t for t in state["events"] if t.startswith("omni.")], state["events"]
    failures = [
        line for line in console if "CORS" in line or "fetch" in line.lower() or "requestfailed" in line
    ]
    assert failures == [], console


async def assert_cross_origin(page: Page, server: LiveServer) -> None:
    origin = await page.evaluate("location.origin")
    assert origin.startswith("http://127.0.0.1:") and origin != server.http_url, (origin, server.http_url)


async def test_text_turn_from_another_origin(server: LiveServer, page_port: int, silent_wav: Path) -> None:
    async with app_page(silent_wav, f"http://127.0.0.1:{page_port}/page.html") as (page, console):
        await assert_cross_origin(page, server)
        connected = await connect(page, server, {"outputModalities": ["text"]})
        assert connected["ok"], (connected, console)
        assert connected["callId"], connected  # read from `Location`, exposed by CORS
        await page.evaluate("window.agentsTest.sendText('hello from the browser sdk')")
        state = await until(page, "seen.turnsEnded >= 1", console, 30)
        state = await until(page, "seen.history.some(i => i.role === 'assistant' && i.text)", console, 10)
        assert_clean(state, console)
        assert state["events"][0] == "session.created" and "session.updated" in state["events"]
        assert assistant_texts(state)[-1] == "You said: hello from the browser sdk", state["history"]


async def test_spoken_turn_from_another_origin(server: LiveServer, page_port: int, speech_wav: Path) -> None:
    config = {
        "audio": {
            "input": {
                "turnDetection": {"type": "server_vad", "silenceDurationMs": 500},
                "transcription": {"model": "whisper-1", "language": "en"},
            }
        }
    }
    async with app_page(speech_wav, f"http://127.0.0.1:{page_port}/page.html") as (page, console):
        connected = await connect(page, server, config)
        assert connected["ok"], (connected, console)
        state = await until(page, "seen.turnsEnded >= 1", console, 90)
        user = "seen.history.some(i => i.role === 'user' && i.text)"
        state = await until(
            page, f"{user} && seen.history.some(i => i.role === 'assistant' && i.text)", console, 30
        )
        assert_clean(state, console)
        user_texts = [i["text"] for i in state["history"] if i["role"] == "user" and i["text"]]
        assert words(user_texts[0]) == words(SENTENCE), state["history"]
        assert words(assistant_texts(state)[0]) == words("You said: " + SENTENCE), state["history"]
        assert "input_audio_buffer.speech_started" in state["events"], state["events"]
        # The answer played over the call (the server says when its track has sent it all): the
        # browser's own WebRTC stats count its audio, seconds of it (silence is a few bytes).
        await until(page, "seen.events.includes('output_audio_buffer.stopped')", console, 30)
        assert await page.evaluate("window.agentsTest.inboundAudioBytes()") > 10_000


async def test_session_with_a_function_tool_from_another_origin(
    server: LiveServer, page_port: int, silent_wav: Path
) -> None:
    async with app_page(silent_wav, f"http://127.0.0.1:{page_port}/page.html") as (page, console):
        connected = await connect(page, server, {"outputModalities": ["text"]}, with_tool=True)
        assert connected["ok"], (connected, console)
        state = await until(page, "seen.sessionUpdated && seen.sessionUpdated.tools.length > 0", console, 10)
        tools = state["sessionUpdated"]["tools"]
        assert [t["name"] for t in tools] == ["get_weather"], tools
        assert tools[0]["type"] == "function"
        assert tools[0]["parameters"]["properties"]["city"]["type"] == "string"
        await page.evaluate("window.agentsTest.sendText('what is the weather in Paris?')")
        state = await until(page, "seen.turnsEnded >= 1", console, 30)
        state = await until(page, "seen.history.some(i => i.role === 'assistant' && i.text)", console, 10)
        assert_clean(state, console)
        assert assistant_texts(state)[-1] == "You said: what is the weather in Paris?", state["history"]
        assert state["toolCalls"] == []  # the echo responder answers; it never calls the tool


async def test_an_origin_not_allowed_cannot_connect(
    server: LiveServer, page_port: int, silent_wav: Path
) -> None:
    """The same page from `http://localhost:PORT`, an origin `--cors-origins` does not list: the
    browser blocks the SDK's offer (the preflight gets 403), and the SDK says the connect failed."""
    async with app_page(silent_wav, f"http://localhost:{page_port}/page.html") as (page, console):
        connected = await connect(page, server, {"outputModalities": ["text"]})
        assert not connected["ok"], connected
        assert "Failed to fetch" in connected["error"], connected
        assert any("blocked by CORS policy" in line for line in console), console
        assert "session.created" not in (await seen(page))["events"]
