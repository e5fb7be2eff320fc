"""Distribution summaries used by reports (percentiles: :func:`runtime.metrics.percentile`)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from runtime.metrics import percentile

QUANTILES = (50, 90, 95, 99)


def summarize(values: Iterable[float | None], digits: int = 1) -> dict[str, float | int | None]:
    """``n``, ``mean``, ``min``, ``p50``/``p90``/``p95``/``p99`` and ``max`` of the non-None values."""
    data = np.array([v for v in values if v is not None], dtype=np.float64)
    out: dict[str, float | int | None] = {"n": int(data.size)}
    if data.size == 0:
        out.update({"mean": None, "min": None, **{f"p{q}": None for q in QUANTILES}, "max": None})
        return out
    out["mean"] = round(float(data.mean()), digits)
    out["min"] = round(float(data.min()), digits)
    for q in QUANTILES:
        out[f"p{q}"] = round(percentile(data, q), digits)
    out["max"] = round(float(data.max()), digits)
    return out


def ecdf(values: Iterable[float | None]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted values and their cumulative fractions (for CDF plots)."""
    data = np.sort(np.array([v for v in values if v is not None], dtype=np.float64))
    if data.size == 0:
        return data, data
    return data, np.arange(1, data.size + 1, dtype=np.float64) / data.size
