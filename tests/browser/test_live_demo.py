"""The browser demo on a duplex pipeline through GPT-Live (``?protocol=live``), in a real headless
Chromium (Debian's, via Playwright): the page posts its WebRTC offer to ``/v1/live/sessions``
with the demo's ``ek_`` key, sends ``session.start`` on the ``oai-events`` channel, streams the
fake microphone (a Piper sentence) on its track, and shows the model's own speech: its
transcript on the page (duplex-tiny's random weights: noise words) and its audio on the remote
track. Hanging up closes the session (``session.closed``) and leaves nothing on the server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.browser.test_demo_page import ARTIFACTS, chromium, launch, silence, write_wav
from tests.live_server import LiveServer, live_server
from tests.speech_audio import SENTENCE, speak

pytestmark = pytest.mark.browser

__all__ = ["chromium"]  # the fixture (a missing Chromium fails the test, never skips it)


@pytest.fixture(scope="module")
def duplex_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv")), pipeline="duplex-tiny", vad=False) as live:
        yield live


@pytest.fixture(scope="module")
def mic_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("wav")) / "mic.wav"
    return write_wav(path, [silence(0.5), speak(SENTENCE, 48_000), silence(30)])


async def test_demo_page_talks_to_a_duplex_pipeline_over_gpt_live(
    duplex_server: LiveServer, chromium: Path, mic_wav: Path
) -> None:
    async with launch(chromium, mic_wav) as browser:
        page = await browser.new_page()
        console: list[str] = []
        page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
        await page.goto(f"{duplex_server.http_url}/?protocol=live")
        await page.click("#connect")
        try:
            await page.wait_for_function("window.demo.state === 'listening'", timeout=30_000)
            await page.wait_for_function(
                "window.demo.assistantTranscripts.some((t) => t.length > 0)", timeout=60_000
            )
            await page.wait_for_function(
                "(async () => await window.demo.inboundAudioBytes())()", timeout=5_000
            )
        except Exception:
            state = await page.evaluate("JSON.stringify(window.demo)")
            raise AssertionError(f"demo state {state}; console {console[-20:]}") from None
        await asyncio.sleep(2.0)  # more of the model's stream
        result = await page.evaluate(
            """async () => ({
                protocol: window.demo.protocol,
                transport: window.demo.transport,
                errors: window.demo.errors,
                events: window.demo.events.map((e) => e[1]),
                bytes: await window.demo.inboundAudioBytes(),
                assistantText: [...document.querySelectorAll('.msg.assistant')].map((e) => e.textContent),
                used: document.querySelector('#transport-used').textContent,
            })"""
        )
        ARTIFACTS.mkdir(exist_ok=True)
        await page.screenshot(path=str(ARTIFACTS / "live-demo.png"), full_page=True)
        assert result["protocol"] == "live" and result["transport"] == "webrtc", result
        assert result["errors"] == [], result
        assert result["used"] == "webrtc (GPT-Live)"
        assert result["events"][0] == "session.started", result
        assert "session.output_transcript.delta" in result["events"]
        assert "session.output_audio.delta" not in result["events"]  # the audio is on the track
        assert any(text.strip() for text in result["assistantText"]), result
        assert result["bytes"] > 10_000, result  # the model's stream played on the remote track
        await page.click("#hangup")
        await page.wait_for_function(
            "window.demo.events.some((e) => e[1] === 'session.closed')", timeout=10_000
        )
        await page.close()
    for _ in range(100):
        if duplex_server.ctx.metrics.session_counts()["live"] == 0:
            break
        await asyncio.sleep(0.05)
    assert duplex_server.ctx.metrics.session_counts()["live"] == 0
