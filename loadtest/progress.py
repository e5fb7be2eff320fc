"""A progress bar for a load level: elapsed time against the planned time, live counters."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator

from tqdm import tqdm

from loadtest.voice_ws import LiveCounters


class ProgressBar:
    """tqdm on stderr, refreshed twice a second by an owned task; silent when disabled."""

    def __init__(self, label: str, total_s: float, counters: LiveCounters, *, enabled: bool = True) -> None:
        self.label = label
        self.total_s = total_s
        self.counters = counters
        self.enabled = enabled

    def _postfix(self) -> str:
        c = self.counters
        refused = f" refused={c.refused}" if c.refused else ""
        return f"live={c.live} turns={c.turns} errors={c.errors}{refused}"

    async def _refresh(self, bar: tqdm, start: float) -> None:
        while True:
            await asyncio.sleep(0.5)
            elapsed = min(self.total_s, time.monotonic() - start)
            bar.n = round(elapsed, 1)
            bar.set_postfix_str(self._postfix(), refresh=False)
            bar.refresh()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        if not self.enabled:
            yield
            return
        bar = tqdm(
            total=round(self.total_s, 1),
            desc=self.label,
            unit="s",
            file=sys.stderr,
            dynamic_ncols=True,
            bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s{postfix}",
        )
        task = asyncio.create_task(self._refresh(bar, time.monotonic()), name="loadtest:progress")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            bar.n = bar.total
            bar.set_postfix_str(self._postfix())
            bar.close()
