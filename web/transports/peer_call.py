"""What a WebRTC call as a session's transport shares, for a Realtime session
(:class:`~web.transports.webrtc_call.RealtimeCall`) and a GPT-Live one
(:class:`~web.transports.live_call.LiveCall`): its peer link, a bounded inbox of the client's
events (filled by the data channel's callback), the :class:`~session.link.ConnectionInfo` its
host reads once the link is done, and the ``close`` and ``receive`` of the
:class:`~session.link.Transport`."""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

from media.webrtc import PeerLink
from session.link import ConnectionInfo

CLEAN_CLOSE = 1000

L = TypeVar("L", bound=PeerLink)


class PeerCall(Generic[L]):
    """A call's link, inbox and connection info (module docstring)."""

    def __init__(
        self,
        call_id: str,
        link: L,
        info: ConnectionInfo,
        *,
        connect_timeout_s: float,
        new_session: bool,
        inbox_max: int,
    ) -> None:
        self.call_id = call_id
        self.link = link
        self.info = info
        self.connect_timeout_s = connect_timeout_s
        self.new_session = new_session
        self._inbox: asyncio.Queue[str] = asyncio.Queue(inbox_max)

    async def close(self, code: int, reason: str) -> None:
        await self.link.close(f"session closed ({code}): {reason}")

    async def receive(self) -> str | None:
        text = await self.link.next_from(self._inbox)
        if text is None:
            self._note_end()
        return text

    def _note_end(self) -> None:
        """Tell the host how the call ended: the client closed the channel itself (a clean close)."""
        if self.link.closed_by_peer:
            self.info.disconnect_code = CLEAN_CLOSE
