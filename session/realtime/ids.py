"""Identifiers in OpenAI's style: `<prefix>_<22 base62 chars>`."""

from __future__ import annotations

import secrets
from collections.abc import Callable

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

IdFactory = Callable[[str], str]
"""Makes a fresh id for a prefix (`event`, `item`, `resp`, `sess`, `conv`)."""


# byte → base62 char. 256 = 4 * 62 + 8, so eight chars are 5/4 as likely as the rest: each char
# still carries ~5.95 bits, 22 of them ~131 bits.
_BYTE_TO_CHAR = bytes(ord(_ALPHABET[b % 62]) for b in range(256))


def random_id(prefix: str) -> str:
    """A fresh id; one C call for the random bytes and one to map them (a divmod loop over
    a 128-bit int took 3x as long, and the core makes an id for every event it emits)."""
    return f"{prefix}_{secrets.token_bytes(22).translate(_BYTE_TO_CHAR).decode('ascii')}"


class SequentialIds:
    """Deterministic ids for tests: `item_000001`, `event_000002`, ..."""

    def __init__(self) -> None:
        self._n = 0

    def __call__(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n:06d}"
