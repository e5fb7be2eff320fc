"""What a realtime driver (:mod:`session.voice.driver`) calls out to: the session's log (the
store's ``SessionWriter``) and the metrics observer (web/server/metrics.py), as typed interfaces."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class DriverObserver(Protocol):
    """Metrics hooks (web/server/metrics.py): one call per response start, first audio and end, and
    per error event; never per audio frame."""

    def response_started(self) -> None: ...

    def first_audio(self, seconds: float) -> None: ...

    def response_finished(self, status: str, seconds: float) -> None: ...

    def error(self, code: str) -> None: ...


class SessionLog(Protocol):
    """Where a session's client-visible events and durable state go (the store's
    ``SessionWriter``). Every method is synchronous and does no I/O: the log batches."""

    def append(self, event: Mapping[str, Any], logged: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Log one server event (or `logged` in its place); returns the copy to send (the log
        owns `event_id`)."""
        ...

    def put_item(self, item: Mapping[str, Any], previous_item_id: str | None = None) -> None: ...

    def delete_item(self, item_id: str) -> None: ...

    def set_config(self, config: Mapping[str, Any]) -> None: ...

    def set_open_response(self, response: Mapping[str, Any] | None) -> None: ...

    def mark_activity(self) -> None: ...

    @property
    def held_bytes(self) -> int:
        """Bytes it keeps in process only for a resume here (held audio deltas: their PCM)."""
        ...
