"""The /world demo in a real Chromium: it renders frames, and a key press changes the picture.

Two pages stream the same seeded tiny-jepa world; one presses "d". The page records a hash of
the canvas pixels after the first frame of every chunk: both pages must draw the very same
pixels before the chunk the server declared for the key press and different pixels from it on.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.world.conftest import WorldServer

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("OMNIDUPLEX_CHROMIUM", "/usr/bin/chromium")
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]



async def test_page_renders_frames_and_key_press_changes_picture(world_server: WorldServer) -> None:
    import playwright.async_api as playwright_api
    url = f"{world_server.url}/world/?autostart&debug&model=tiny-jepa&seed=0&size=128&fps=30"
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            still_ctx, press_ctx = await browser.new_context(), await browser.new_context()
            still, press = await still_ctx.new_page(), await press_ctx.new_page()
            errors: list[str] = []
            for page in (still, press):
                page.on("pageerror", lambda exc: errors.append(str(exc)))
            await still.goto(url)
            await press.goto(url)
            for page in (still, press):
                await page.wait_for_function(
                    "window.__world && window.__world.lastChunk >= 3", timeout=20_000
                )
            # the page renders frames: the canvas has the stream's size and is not blank
            stats: dict[str, Any] = await press.evaluate(
                """() => {
                    const c = document.getElementById('screen');
                    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                    let max = 0, sum = 0;
                    for (let i = 0; i < d.length; i += 4) { max = Math.max(max, d[i]); sum += d[i]; }
                    const drawn = window.__world.framesDrawn;
                    return {w: c.width, h: c.height, max, mean: sum / (d.length / 4), drawn};
                }"""
            )
            assert (stats["w"], stats["h"]) == (128, 128)
            assert stats["max"] > 150 and stats["mean"] > 5 and stats["drawn"] >= 6
            await press.click("#screen")
            await press.keyboard.down("d")
            applies_at = await press.wait_for_function(
                "() => Object.values(window.__world.queued)[0]", timeout=10_000
            )
            at = int(await applies_at.json_value())
            last = at + 4
            for page in (still, press):
                await page.wait_for_function(f"window.__world.lastChunk >= {last}", timeout=20_000)
            await press.keyboard.up("d")
            hashes = [await page.evaluate("window.__world.chunkHashes") for page in (still, press)]
            for k in range(at):
                key = str(k)
                if key in hashes[0] and key in hashes[1]:
                    assert hashes[0][key] == hashes[1][key], (
                        f"chunk {k} differs before the key press landed ({at})"
                    )
            assert sum(str(k) in hashes[0] and str(k) in hashes[1] for k in range(at)) >= 2
            for k in range(at, last + 1):
                assert hashes[0][str(k)] != hashes[1][str(k)], (
                    f"chunk {k} unchanged after the key press ({at})"
                )
            latency = await press.text_content("#latency")
            assert latency is not None and latency.strip().isdigit()
            assert errors == []
        finally:
            await browser.close()


async def test_page_plays_the_webrtc_video_track(world_server: WorldServer) -> None:
    import playwright.async_api as playwright_api
    url = f"{world_server.url}/world/?autostart&model=tiny-jepa&size=128&fps=30&transport=webrtc"
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        try:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(url)
            await page.wait_for_function("window.__world.framesDrawn >= 15", timeout=20_000)
            size = await page.evaluate(
                "[document.getElementById('video').videoWidth, document.getElementById('video').videoHeight]"
            )
            assert size == [128, 128]
            await page.click("#video")
            await page.keyboard.down("ArrowUp")
            await page.wait_for_function("Object.keys(window.__world.queued).length > 0", timeout=10_000)
            await page.wait_for_function("window.__world.latencies.length > 0", timeout=10_000)
            assert errors == []
        finally:
            await browser.close()
