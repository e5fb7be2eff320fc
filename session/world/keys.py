"""Held-key state between two chunks: key events are coalesced, never queued.

A browser repeats ``keydown`` while a key is held (30/s or more) and a client may flood events
far faster than chunks are made. What a chunk needs is which keys are down, in press order
(the last key pressed wins), plus the keys tapped (pressed and released) since the last chunk
so that a short tap still moves the world by one chunk. That state is bounded by the number
of distinct keys, whatever the event rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from session.world.events import KeyEvent


def normalize_key(key: str) -> str:
    """``w``/``W``/``KeyW`` → ``W``; ``ArrowUp`` → ``ARROWUP`` (the engines read the same forms)."""
    name = key.strip().upper()
    if len(name) == 4 and name.startswith("KEY"):
        name = name[3:]
    return name


@dataclass(slots=True)
class KeyFlush:
    """Key events to send around one chunk demand: ``before`` it, then ``after`` it."""

    before: list[tuple[str, str]] = field(default_factory=list)  # (keydown|keyup, key)
    after: list[tuple[str, str]] = field(default_factory=list)


@dataclass(slots=True)
class HeldKeys:
    down: dict[str, None] = field(default_factory=dict)  # held now, in press order
    pressed: dict[str, None] = field(default_factory=dict)  # went down since the last flush
    engine_down: set[str] = field(default_factory=set)  # what the model was last told

    def apply(self, event: KeyEvent) -> bool:
        """Take one event (key already normalized); True if it changes what the model sees."""
        key = event.key
        if event.event == "keydown":
            if key in self.down:
                return False  # auto-repeat
            self.down[key] = None
            self.pressed.pop(key, None)
            self.pressed[key] = None
            return True
        if key not in self.down:
            return False
        del self.down[key]
        return True

    @property
    def dirty(self) -> bool:
        return bool(self.pressed) or set(self.down) != self.engine_down

    def flush(self) -> KeyFlush:
        """What the model must be told before the next chunk (and right after it, for taps)."""
        out = KeyFlush()
        out.before += [("keyup", k) for k in sorted(self.engine_down) if k not in self.down]
        out.before += [("keydown", k) for k in self.pressed]
        out.after += [("keyup", k) for k in self.pressed if k not in self.down]
        self.engine_down = set(self.down)
        self.pressed.clear()
        return out
