"""Identifiers in OpenAI's style: `<prefix>_<22 base62 chars>`."""

from __future__ import annotations

import secrets
from collections.abc import Callable

_ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"

IdFactory = Callable[[str], str]
"""Makes a fresh id for a prefix (`event`, `item`, `resp`, `sess`, `conv`)."""


def random_id(prefix: str) -> str:
    n = secrets.randbits(128)
    chars = []
    for _ in range(22):
        n, r = divmod(n, 62)
        chars.append(_ALPHABET[r])
    return f"{prefix}_{''.join(chars)}"


class SequentialIds:
    """Deterministic ids for tests: `item_000001`, `event_000002`, ..."""

    def __init__(self) -> None:
        self._n = 0

    def __call__(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n:06d}"
