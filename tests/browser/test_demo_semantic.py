"""The demo page's turn-end selector: "semantic" over WebRTC in a real Chromium.

The fake microphone says a sentence with a 1.2 s pause cut in mid-clause ("The doctor said that |
I should ..."; `loadtest.turn_set`'s recipe). With the selector on semantic the session runs
semantic_vad on the same session core as WebSocket sessions: the end-of-turn model hears the
pause as unfinished, so the page shows one user turn with both halves and one answer to it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.turn_set import RATE, paused_clip
from media.audio import resample
from tests.browser.test_demo_page import CHROMIUM, WAV_RATE, launch, silence, write_wav
from tests.live_server import LiveServer, live_server
from tests.speech_audio import words

pytestmark = pytest.mark.browser

SENTENCE, CUT = "The doctor said that I should drink more water every day.", 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    with live_server(Path(tmp_path_factory.mktemp("srv"))) as live:
        yield live


@pytest.fixture(scope="module")
def chromium() -> Path:
    assert CHROMIUM.exists(), f"{CHROMIUM} is missing: install Debian's chromium (make system-deps)"
    return CHROMIUM


@pytest.fixture(scope="module")
def paused_wav(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clip = paused_clip(SENTENCE, CUT, pause_s=1.2)
    path = Path(tmp_path_factory.mktemp("wav")) / "paused.wav"
    return write_wav(path, [silence(1.5), resample(clip.audio, RATE, WAV_RATE), silence(40)])


async def test_semantic_selector_over_webrtc_keeps_a_paused_sentence_whole(
    server: LiveServer, paused_wav: Path, chromium: Path
) -> None:
    async with launch(chromium, paused_wav) as browser:
        page = await browser.new_page()
        await page.goto(f"{server.http_url}/?transport=webrtc")
        await page.select_option("#turn-detection", "semantic_vad")
        await page.click("#connect")
        try:
            await page.wait_for_function("window.demo.assistantTranscripts.length > 0", timeout=120_000)
            await page.wait_for_function("window.demo.state === 'listening'", timeout=60_000)
            await page.wait_for_timeout(2000)  # a second turn (a cut at the pause) would show by now
        except Exception:
            state = await page.evaluate("JSON.stringify(window.demo)")
            raise AssertionError(f"demo state {state}") from None
        demo = await page.evaluate(
            "({transport: demo.transport, td: demo.turnDetection, user: demo.userTranscripts,"
            " assistant: demo.assistantTranscripts, errors: demo.errors,"
            " stopped: demo.events.filter(e => e[1] === 'input_audio_buffer.speech_stopped').length})"
        )
        assert demo["transport"] == "webrtc" and demo["td"] == "semantic_vad", demo
        assert demo["errors"] == [], demo
        assert demo["stopped"] == 1 and len(demo["user"]) == 1, demo  # not cut at the pause
        heard = words(demo["user"][0])
        assert heard[:3] == ["the", "doctor", "said"] and heard[-2:] == ["every", "day"], demo
        assert len(demo["assistant"]) == 1, demo
        await page.click("#hangup")
