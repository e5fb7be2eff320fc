"""A voice session live in this process, as :class:`~session.voice.hosting.SessionHost` and
its resume part (:mod:`session.voice.hosting_resume`) hold it."""

from __future__ import annotations

from dataclasses import dataclass

from session.lifecycle import HostedSession as LiveSession
from session.link import Transport
from session.voice.driver import RealtimeDriver


@dataclass(eq=False, slots=True)
class HostedSession(LiveSession[RealtimeDriver, Transport]):
    """A voice session live in this process. Its connection is its driver's link (the base's
    ``connection`` stays None): the driver attaches and detaches transports itself."""

    orphans: tuple[bool, str | None] = (False, None)  # restored: (end them?, lost replica)
    migrated_from: str | None = None  # scale-out failover: the lost owner, told at the next resume

    @property
    def connected(self) -> bool:
        return self.driver.link is not None
