"""The Redis session store: state, conversation, event log, embedded server (its errors:
:mod:`session.store.errors`).

See ``docs/CONTRACTS.md`` ("Session store API") for what the session driver calls when.
"""

from session.store.embedded import EmbeddedRedis, find_redis_server, redis_connection
from session.store.event_log import SessionWriter
from session.store.redis_store import SessionBatch, SessionRecord, SessionSnapshot, SessionStore
from session.store.writer_hub import WriterHub

__all__ = [
    "EmbeddedRedis",
    "SessionBatch",
    "SessionRecord",
    "SessionSnapshot",
    "SessionStore",
    "SessionWriter",
    "WriterHub",
    "find_redis_server",
    "redis_connection",
]
