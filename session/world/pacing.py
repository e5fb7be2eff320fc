"""When to send a chunk and when to ask for the next one (pure; the driver supplies the time).

Chunks go out at the stream's frame rate: chunk ``k+1`` is due one chunk duration after chunk
``k`` was due. A late chunk goes out at once; the timeline holds while the lateness is within
``catch_up_s`` (a loaded host's scheduling hiccups of tens of ms: the next chunks go out as
soon as they are ready until the stream is back on time, so the sustained rate stays the one
asked for), and moves when it is later than that (a real stall: no long burst to catch up).
The next chunk is demanded *just in time*: its due time minus the expected time to make and
encode it (twice the smoothed demand → ready latency, plus a margin). Demanding late is what
keeps an action's latency near one chunk instead of a whole queue of chunks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ChunkPacer:
    margin_s: float = 0.003
    catch_up_s: float = 0.2  # lateness the stream makes up; beyond it the timeline moves
    smoothing: float = 0.3
    latency_s: float | None = None  # smoothed demand → chunk ready (generate + decode + encode)
    next_due: float | None = None  # when the next chunk should go out

    def observe_latency(self, seconds: float) -> None:
        if self.latency_s is None:
            self.latency_s = seconds
        else:
            self.latency_s += self.smoothing * (seconds - self.latency_s)

    @property
    def lead_s(self) -> float:
        return 2.0 * (self.latency_s or 0.0) + self.margin_s

    def send_at(self, now: float) -> float:
        """When a chunk that is ready at ``now`` goes out."""
        return now if self.next_due is None else max(now, self.next_due)

    def sent(self, at: float, duration_s: float) -> None:
        """A chunk of ``duration_s`` started going out at ``at``. Late by less than a chunk or
        ``catch_up_s`` keeps the timeline, so the rate does not drift; later than that moves it."""
        due = self.next_due
        base = due if due is not None and at - due < max(duration_s, self.catch_up_s) else at
        self.next_due = base + duration_s

    def demand_at(self, now: float) -> float:
        """When to demand the next chunk (``now`` or later)."""
        if self.next_due is None:
            return now
        return max(now, self.next_due - self.lead_s)
