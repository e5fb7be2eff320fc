"""WebRTC network faults for tests: a peer whose network vanishes, and fast ICE consent checks
so the server notices in about 2 s instead of 30 (shared by the voice and world call tests)."""

from __future__ import annotations

from typing import Any

import pytest
from aiortc import RTCPeerConnection


@pytest.fixture
def fast_consent(monkeypatch: pytest.MonkeyPatch) -> None:
    """RFC 7675 consent checks every ~0.2 s, lost after 3 misses (aioice: every 5 s, 6 misses).
    Server and client share the module, so both sides use it."""
    import aioice.ice

    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.2)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", 3)


def vanish(pc: RTCPeerConnection) -> None:
    """The peer's network goes away: its ICE sockets neither send nor receive any more, so the
    server gets no hangup, no SCTP ABORT and no DTLS close_notify (unlike `pc.close()`), only
    silence: consent checks fail and the server's connection fails."""
    sctp = pc.sctp
    assert sctp is not None
    connection: Any = sctp.transport.transport._connection  # aioice
    assert connection._protocols
    for protocol in connection._protocols:
        protocol.transport.sendto = lambda *args, **kwargs: None
        protocol.datagram_received = lambda *args, **kwargs: None
