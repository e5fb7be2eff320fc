"""The conversation: ordered items with their stored audio, transcripts and text.

User audio is kept as PCM16 (int16) 16 kHz, half the size of float32, and handed to
pipelines as float32 16 kHz (`Item.audio_16k`); assistant audio as the exact wire bytes
that were sent (so `conversation.item.truncate` positions match what the client counted).
Items render to GA `ConversationItem` dicts with `to_wire`.

Audio is bounded per conversation (`Conversation.retain_audio`): only the newest items keep
theirs, up to a number of seconds (the newest item with audio always keeps its own). Older
items keep transcripts and text; `conversation.item.retrieve` renders them without `audio`
(the field is optional in the GA schema), as it does for items restored after a failover.
Pipelines only ever take the audio of the trailing user items (earlier turns go to them as
transcripts), so the bound changes nothing for them unless the trailing user turns alone
exceed it: then the older ones of those go as transcripts too.

Retained audio that no prompt can need any more leaves the heap when the conversation has an
:class:`~session.realtime.audio_store.AudioStore` (the server's spools it to disk): see
`Conversation.retain_audio` for when. A spilled part keeps its length (`spilled_len`), so
durations, truncation and the stored records never read it back; only retrieve (and a
`response.create` whose `input` names an older audio item) does.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from media.audio import VAD_RATE, WireFormat, b64encode_audio, int16_to_float32, resample
from session.realtime.audio_store import AudioHandle, AudioStore
from session.realtime.errors import INVALID_VALUE, ITEM_NOT_FOUND, UNSUPPORTED_CONTENT, ProtocolError
from session.realtime.gc_untrack import untrack

ItemType = Literal["message", "function_call", "function_call_output"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]


@dataclass(slots=True)
class Content:
    type: str  # input_text | input_audio | input_image | output_text | output_audio
    text: str | None = None
    transcript: str | None = None  # client-visible transcript
    heard: str | None = None  # what ASR made of user audio, for history even if not shown
    input_audio: np.ndarray | None = None  # user audio, int16 16 kHz
    output_audio: bytearray | None = None  # assistant audio, wire bytes as sent
    output_format: WireFormat | None = None
    truncated: bool = False  # assistant audio cut by truncate: later audio is not stored
    image_url: str | None = None
    detail: str | None = None
    dropped_ms: float | None = None  # the audio was dropped (retention); it lasted this long
    # The audio was spilled to an AudioStore (`input_audio` / `output_audio` are then None):
    # its first `spilled_len` bytes are the part's (truncate shortens it without a rewrite).
    spilled: AudioHandle | None = None
    spilled_len: int = 0

    @property
    def has_audio(self) -> bool:
        """The part still holds audio, in memory or spilled."""
        return self.input_audio is not None or self.output_audio is not None or self.spilled is not None

    def output_audio_ms(self) -> float:
        if self.dropped_ms is not None and self.type == "output_audio":
            return self.dropped_ms
        if self.type != "output_audio":
            return 0.0
        return self.audio_ms()

    def audio_ms(self) -> float:
        """Duration of the audio this part still holds (0 when none or dropped)."""
        if self.input_audio is not None:
            return len(self.input_audio) * 1000.0 / VAD_RATE
        if self.output_audio is not None and self.output_format is not None:
            return self.output_format.duration_ms(len(self.output_audio))
        if self.spilled is not None:
            if self.type == "input_audio":
                return self.spilled_len // 2 * 1000.0 / VAD_RATE
            if self.output_format is not None:
                return self.output_format.duration_ms(self.spilled_len)
        return 0.0

    def pcm16(self) -> np.ndarray | None:
        """User audio of this part, int16 16 kHz (read back from its store when spilled)."""
        if self.input_audio is not None:
            return self.input_audio
        if self.type != "input_audio":
            return None
        data = self._read_spilled()
        return None if data is None else np.frombuffer(data, dtype=np.int16)

    def output_bytes(self) -> bytes | None:
        """Assistant audio of this part, wire bytes as sent (read back when spilled)."""
        if self.output_audio is not None:
            return bytes(self.output_audio)
        return self._read_spilled() if self.type == "output_audio" else None

    def spill(self, store: AudioStore) -> bool:
        """Move the audio held in memory to `store` (True if there was any to move)."""
        if self.input_audio is not None:
            data = self.input_audio.tobytes()
        elif self.output_audio is not None:
            data = bytes(self.output_audio)
        else:
            return False
        if not data:
            return False  # nothing to gain
        self.spilled, self.spilled_len = store.put(data), len(data)
        self.input_audio = None
        self.output_audio = None
        return True

    def drop_audio(self) -> None:
        """Forget the audio (retention); keep its duration, transcripts and text."""
        if not self.has_audio:
            return
        self.dropped_ms = self.audio_ms()
        if self.spilled is not None:
            self.spilled.discard()
        self.input_audio = None
        self.output_audio = None
        self.spilled, self.spilled_len = None, 0

    def _read_spilled(self) -> bytes | None:
        if self.spilled is None:
            return None
        data = self.spilled.read()
        if data is None:  # its store lost it (or was closed): as if retention had dropped it
            self.drop_audio()
            return None
        return data[: self.spilled_len]

    def text_for_history(self) -> str:
        if self.type in ("input_text", "output_text"):
            return self.text or ""
        if self.type in ("input_audio", "output_audio"):
            return self.transcript or self.heard or ""
        return ""

    def to_wire(self, *, with_audio: bool, input_format: WireFormat | None) -> dict[str, Any]:
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text or ""}
        if self.type == "input_image":
            out: dict[str, Any] = {"type": "input_image", "image_url": self.image_url}
            if self.detail is not None:
                out["detail"] = self.detail
            return out
        out = {"type": self.type, "transcript": self.transcript}
        if with_audio:
            if self.type == "output_audio" and (data := self.output_bytes()) is not None:
                out["audio"] = b64encode_audio(data)
            elif self.type == "input_audio" and input_format is not None:
                pcm = self.pcm16()
                if pcm is None:
                    return out
                audio = resample(int16_to_float32(pcm), VAD_RATE, input_format.rate)
                out["audio"] = b64encode_audio(input_format.encode(audio))
        return out


@dataclass(slots=True)
class Item:
    id: str
    type: ItemType
    role: str | None = None
    status: ItemStatus = "completed"
    content: list[Content] = field(default_factory=list)
    name: str | None = None
    arguments: str | None = None
    call_id: str | None = None
    output: str | None = None
    response_id: str | None = None  # the response that produced this (assistant) item

    @property
    def audio_16k(self) -> np.ndarray | None:
        """User input audio of this item (all its audio parts), float32 16 kHz (stored as
        int16: converted on each call, i.e. when a response or a transcription needs it; read
        back from the store if it was spilled)."""
        parts = [a for a in (c.pcm16() for c in self.content if c.has_audio) if a is not None]
        if not parts:
            return None
        return int16_to_float32(parts[0] if len(parts) == 1 else np.concatenate(parts))

    def text_for_history(self) -> str:
        return " ".join(t for t in (c.text_for_history() for c in self.content) if t)

    def to_wire(self, *, with_audio: bool = False, input_format: WireFormat | None = None) -> dict[str, Any]:
        base: dict[str, Any] = {
            "id": self.id,
            "object": "realtime.item",
            "type": self.type,
            "status": self.status,
        }
        if self.type == "message":
            base["role"] = self.role
            base["content"] = [
                c.to_wire(with_audio=with_audio, input_format=input_format) for c in self.content
            ]
        elif self.type == "function_call":
            base.update(name=self.name, arguments=self.arguments or "", call_id=self.call_id)
        else:
            base.update(call_id=self.call_id, output=self.output or "")
        return base


class Conversation:
    """Items in order, with `previous_item_id` placement. With an `audio_store`, audio that
    no prompt needs any more is spilled to it (`retain_audio`); `close` discards it all."""

    def __init__(self, audio_store: AudioStore | None = None) -> None:
        self._items: list[Item] = []
        self._by_id: dict[str, Item] = {}
        # The change journal for the store: ids changed / deleted since `take_changes`.
        self._changed: dict[str, None] = {}
        self._deleted: list[str] = []
        # At least as many items as may hold audio (retain_audio stops scanning once it has
        # seen that many): those it kept last time plus every item inserted since.
        self._audio_holders_bound = 0
        self._store = audio_store
        # Spilled audio goes with the conversation even if nobody calls `close` (the finalizer
        # holds the item list, not the conversation).
        self._release = weakref.finalize(self, _discard_spilled, self._items) if audio_store else None
        if self._release is not None:
            self._release.atexit = False  # the spool's own close removes its files at exit
        # UTF-8 bytes of every item's text (see `text_bytes`): the session's text budget.
        self.text_bytes = 0
        self._sizes: dict[str, int] = {}

    def close(self) -> None:
        """The session ended: discard all spilled audio (idempotent). Audio still in memory
        stays; nothing is spilled from now on."""
        self._store = None
        if self._release is not None:
            self._release()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._by_id

    @property
    def items(self) -> list[Item]:
        return list(self._items)

    def last_id(self) -> str | None:
        return self._items[-1].id if self._items else None

    def get(self, item_id: str, param: str = "item_id") -> Item:
        item = self._by_id.get(item_id)
        if item is None:
            raise ProtocolError(
                ITEM_NOT_FOUND, f"Conversation item with id '{item_id}' does not exist.", param=param
            )
        return item

    def check_insert(self, item: Item, previous_item_id: str | None) -> None:
        """Raise if `insert` would fail (so callers can validate before changing state)."""
        if item.id in self._by_id:
            raise ProtocolError(
                INVALID_VALUE, f"Conversation item with id '{item.id}' already exists.", param="item.id"
            )
        if previous_item_id not in (None, "root") and previous_item_id not in self._by_id:
            raise ProtocolError(
                ITEM_NOT_FOUND,
                f"Previous item with id '{previous_item_id}' does not exist.",
                param="previous_item_id",
            )

    def insert(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert after `previous_item_id` (None: at the end, "root": first); return the id
        of the item now before it."""
        self.check_insert(item, previous_item_id)
        if previous_item_id is None:
            index = len(self._items)
        elif previous_item_id == "root":
            index = 0
        else:
            index = self._items.index(self._by_id[previous_item_id]) + 1
        self._items.insert(index, item)
        self._by_id[item.id] = item
        _leave_gc_scans(item)
        self._resize(item)
        self._changed[item.id] = None
        self._audio_holders_bound += 1
        return self._items[index - 1].id if index > 0 else None

    def delete(self, item_id: str) -> Item:
        item = self.get(item_id)
        self._items.remove(item)
        del self._by_id[item_id]
        self.text_bytes -= self._sizes.pop(item_id, 0)
        self._changed.pop(item_id, None)
        self._deleted.append(item_id)
        for part in item.content:
            if part.spilled is not None:
                part.drop_audio()  # nothing can retrieve it any more
        return item

    def mark_changed(self, item_id: str) -> None:
        """An item's stored form changed (status, transcript): persist it at the next take."""
        item = self._by_id.get(item_id)
        if item is not None:
            self._changed[item_id] = None
            _leave_gc_scans(item)  # a part added since it was inserted (a response's)

    def take_changes(self) -> tuple[list[str], list[tuple[Item, str]]] | None:
        """Deleted ids, then changed items in conversation order with the id of the item
        before each ("root" for the first); None when nothing changed since the last take."""
        if not self._changed and not self._deleted:
            return None
        deleted, self._deleted = self._deleted, []
        changed, self._changed = self._changed, {}
        upserts: list[tuple[Item, str]] = []
        if changed:
            # From the newest back, only as far as the oldest changed item: a change is almost
            # always to the last items, and an hour-long session has hundreds before them.
            items = self._items
            left = sum(1 for item_id in changed if item_id in self._by_id)
            for index in range(len(items) - 1, -1, -1):
                if not left:
                    break
                item = items[index]
                if item.id in changed:
                    left -= 1
                    self._resize(item)  # its text grew (a response, a transcript) or was cut
                    upserts.append((item, items[index - 1].id if index > 0 else "root"))
            upserts.reverse()  # conversation order
        return deleted, upserts

    def _resize(self, item: Item) -> None:
        size = text_bytes(item)
        self.text_bytes += size - self._sizes.get(item.id, 0)
        self._sizes[item.id] = size

    def retain_audio(self, limit_s: float) -> int:
        """Drop the audio of all but the newest items, keeping at most `limit_s` seconds in
        all (the newest item with audio keeps its own whatever its length); return the number
        of parts whose audio was dropped. Called once per item or response; it walks back
        from the newest item only as far as items may still hold audio (not the whole
        conversation of an hour-long session).

        With an audio store, the kept audio of every item but the trailing user messages (a
        prompt's audio) and items still in progress (a response streaming into one) is
        spilled to it. So a user turn leaves memory once something follows it (in practice
        when its response ends: the core calls this then) and an assistant turn when its
        response ends; what stays in memory is the turn being answered and the answer."""
        budget_ms = limit_s * 1000.0
        kept_ms = 0.0
        first = True
        dropped = 0
        seen = 0  # items met that hold (or may yet get) audio
        trailing = True  # in the run of user messages at the end (a prompt may need them)
        for item in reversed(self._items):
            if seen >= self._audio_holders_bound:
                break  # nothing older holds audio
            trailing = trailing and item.type == "message" and item.role == "user"
            if item.status == "in_progress":
                seen += 1  # a response still streaming into it: never cut under its feet
                continue
            ms = sum(part.audio_ms() for part in item.content)
            if ms <= 0:
                continue
            seen += 1
            if first or kept_ms + ms <= budget_ms:
                kept_ms += ms
                first = False
                if not trailing and self._store is not None:
                    for part in item.content:
                        part.spill(self._store)
                continue
            seen -= 1
            budget_ms = -1.0  # past the bound: everything older goes too
            for part in item.content:
                if part.has_audio:
                    part.drop_audio()
                    dropped += 1
        self._audio_holders_bound = seen
        return dropped

    def audio_bytes_in_memory(self) -> int:
        """Bytes of audio the items hold in process memory (spilled audio only while its write
        is pending, or for good after a failed one). Walks back from the newest item only as
        far as `retain_audio` does: nothing older holds audio, and /metrics asks every second
        for every session (a walk over whole conversations grew with their length)."""
        total = 0
        seen = 0
        for item in reversed(self._items):
            if seen >= self._audio_holders_bound:
                break
            for part in item.content:
                if part.input_audio is not None:
                    total += part.input_audio.nbytes
                if part.output_audio is not None:
                    total += len(part.output_audio)
                if part.spilled is not None:
                    total += part.spilled.resident_bytes
            if item.status == "in_progress" or sum(part.audio_ms() for part in item.content) > 0:
                seen += 1  # the same count as retain_audio's
        return total

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut assistant audio at `audio_end_ms` and the transcript in proportion."""
        item = self.get(item_id)
        if item.type != "message" or item.role != "assistant":
            raise ProtocolError(
                UNSUPPORTED_CONTENT, "Only assistant messages with audio can be truncated.", param="item_id"
            )
        if content_index >= len(item.content) or item.content[content_index].type != "output_audio":
            raise ProtocolError(
                INVALID_VALUE,
                f"Content part {content_index} of item '{item_id}' is not an audio part.",
                param="content_index",
            )
        part = item.content[content_index]
        total_ms = part.output_audio_ms()
        if audio_end_ms > int(np.ceil(total_ms)):
            raise ProtocolError(
                INVALID_VALUE,
                f"Audio content of {int(total_ms)}ms is already shorter than {audio_end_ms}ms.",
                param="audio_end_ms",
            )
        if part.output_audio is not None and part.output_format is not None:
            keep = min(len(part.output_audio), part.output_format.bytes_for_ms(audio_end_ms))
            del part.output_audio[keep:]
        elif part.spilled is not None and part.output_format is not None:
            part.spilled_len = min(part.spilled_len, part.output_format.bytes_for_ms(audio_end_ms))
        elif part.dropped_ms is not None:
            part.dropped_ms = min(part.dropped_ms, float(audio_end_ms))
        fraction = 1.0 if total_ms <= 0 else min(1.0, audio_end_ms / total_ms)
        if part.transcript is not None:
            part.transcript = cut_text(part.transcript, fraction)
        part.truncated = True
        if item.status == "in_progress":
            item.status = "incomplete"
        self._changed[item_id] = None


def _leave_gc_scans(item: Item) -> None:
    """Items live as long as their session and are freed by reference counting (an item, its
    content list and its parts refer to nothing that refers back to them): the cyclic GC need
    not scan them in every full collection (session/realtime/gc_untrack.py)."""
    untrack(item)
    untrack(item.content)
    for part in item.content:
        untrack(part)


def text_bytes(item: Item) -> int:
    """UTF-8 bytes of an item's text (ids, names, arguments, outputs, text and transcripts;
    not audio): what the conversation budget (`CoreOptions.max_conversation_bytes`) counts."""
    fields = [item.id, item.name, item.arguments, item.call_id, item.output]
    for part in item.content:
        fields += [part.text, part.transcript, part.heard, part.image_url]
    return sum(len(f.encode("utf-8", "surrogatepass")) for f in fields if f)


def cut_text(text: str, fraction: float) -> str:
    """The first `fraction` of `text`, ended at a word boundary (an estimate of what was heard)."""
    if fraction >= 1.0:
        return text
    cut = int(len(text) * max(fraction, 0.0))
    if cut <= 0:
        return ""
    if cut < len(text) and not text[cut].isspace():
        space = text.rfind(" ", 0, cut)
        cut = space if space > 0 else 0
    return text[:cut].rstrip()


def _discard_spilled(items: list[Item]) -> None:
    for item in items:
        for part in item.content:
            if part.spilled is not None:
                part.drop_audio()
