"""Errors raised by the Redis session store.

The web layer maps them to wire answers: ``SessionNotFound`` → ``session_not_found`` (also for
another tenant's session, so nothing is revealed), ``ResumeTokenInvalid`` → HTTP 403 before the
upgrade, ``StoreUnavailable`` → HTTP 503, ``StaleEpoch`` → the replica lost the session and must
stop serving it, ``ReplayUnavailable`` → resync the client from the snapshot instead of replaying.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every store error."""


class StoreUnavailable(StoreError):
    """Redis could not be reached (or timed out); the caller answers 503."""


class SessionNotFound(StoreError):
    """No such session for this tenant: never existed, expired, deleted or another tenant's."""

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session_not_found: {session_id}")
        self.session_id = session_id


class SessionExists(StoreError):
    """A session with this id already exists (ids are random, so this is a bug or an attack)."""


class ResumeTokenInvalid(StoreError):
    """The resume token is missing or does not match the session's (HTTP 403)."""


class StaleEpoch(StoreError):
    """A write carried an epoch that is no longer the session's binding epoch (fencing)."""

    def __init__(self, session_id: str, epoch: int, current: int | None) -> None:
        super().__init__(f"stale epoch for {session_id}: wrote with {epoch}, binding is at {current}")
        self.session_id = session_id
        self.epoch = epoch
        self.current = current


class WriteRejected(StoreError):
    """A session's own ops could not be written (not a Redis outage: they cannot even be
    encoded, or the write raised a bug). Fatal for that session's writer alone, so the writer
    hub goes on persisting every other session."""

    def __init__(self, session_id: str, cause: BaseException) -> None:
        super().__init__(f"session {session_id}: its log could not be written: {type(cause).__name__}")
        self.session_id = session_id
        self.cause = cause


class SessionGone(StoreError):
    """The session's keys vanished under a writer (expired or deleted); the writer stops."""


class ReplayUnavailable(StoreError):
    """The events after ``last_event_id`` cannot be replayed exactly; resync from the snapshot.

    ``reason`` is one of ``trimmed`` (the id fell off the bounded stream), ``unknown_event_id``
    (not an id of this session, or one that was never made durable, e.g. lost with a dead
    replica), ``gap`` (events between were never made durable during a Redis outage).
    """

    def __init__(self, session_id: str, last_event_id: str | None, reason: str) -> None:
        super().__init__(f"cannot replay {session_id} after {last_event_id!r}: {reason}")
        self.session_id = session_id
        self.last_event_id = last_event_id
        self.reason = reason
