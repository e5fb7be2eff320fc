"""The Redis session store: state, conversation, event log, embedded server.

See ``docs/CONTRACTS.md`` ("Session store API") for what the session driver calls when.
"""

from session.store.embedded import EmbeddedRedis, find_redis_server, redis_connection
from session.store.errors import (
    ReplayUnavailable,
    ResumeTokenInvalid,
    SessionExists,
    SessionGone,
    SessionNotFound,
    StaleEpoch,
    StoreError,
    StoreUnavailable,
)
from session.store.event_log import SessionWriter
from session.store.redis_store import SessionBatch, SessionRecord, SessionSnapshot, SessionStore
from session.store.writer_hub import WriterHub

__all__ = [
    "EmbeddedRedis",
    "ReplayUnavailable",
    "ResumeTokenInvalid",
    "SessionBatch",
    "SessionExists",
    "SessionGone",
    "SessionNotFound",
    "SessionRecord",
    "SessionSnapshot",
    "SessionStore",
    "SessionWriter",
    "StaleEpoch",
    "StoreError",
    "StoreUnavailable",
    "WriterHub",
    "find_redis_server",
    "redis_connection",
]
