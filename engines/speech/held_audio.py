"""A session's recent audio as a stage holds it: ``(start sample, samples)`` pieces in order."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def held_span(pieces: Iterable[tuple[int, np.ndarray]], start: int, end: int, dtype: type) -> np.ndarray:
    """The held audio in [start, end) (what is not held any more is left out)."""
    parts = []
    for first, samples in pieces:
        last = first + len(samples)
        if last <= start or first >= end:
            continue
        parts.append(samples[max(0, start - first) : min(len(samples), end - first)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)
