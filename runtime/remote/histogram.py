"""A cumulative latency histogram (thread-safe), read by the Prometheus exporter at scrape time."""

from __future__ import annotations

import bisect
import threading

BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = BUCKETS_S) -> None:
        self.buckets = buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one: above every bound
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.buckets, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, float]], float, int]:
        """Cumulative ``(le, count)`` pairs (``+Inf`` last), the sum and the count."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, pairs = 0, []
        for bound, count in zip([*map(str, self.buckets), "+Inf"], counts, strict=True):
            cumulative += count
            pairs.append((bound, float(cumulative)))
        return pairs, total, cumulative
