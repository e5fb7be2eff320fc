"""Wall-clock bounds in tests marked ``timing``: upper bounds stretch on a loaded machine.

``OMNIDUPLEX_TEST_SLOWDOWN`` (default 1) scales every upper bound taken through :func:`slack`,
so a shared or throttled runner can loosen them without editing tests; lower bounds (what a
sleep or a pacer guarantees) stay as they are.
"""

from __future__ import annotations

import os


def slowdown() -> float:
    """The factor from ``OMNIDUPLEX_TEST_SLOWDOWN`` (at least 1)."""
    raw = os.environ.get("OMNIDUPLEX_TEST_SLOWDOWN", "").strip()
    try:
        return max(1.0, float(raw)) if raw else 1.0
    except ValueError:
        raise ValueError(f"OMNIDUPLEX_TEST_SLOWDOWN must be a number, got {raw!r}") from None


def slack(bound: float) -> float:
    """An upper bound on elapsed time, stretched by :func:`slowdown`."""
    return bound * slowdown()


class FakeClock:
    """A monotonic clock a test sets by hand (``clock.now = ...``), for code that takes ``clock``."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now
