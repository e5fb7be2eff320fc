"""The transcripts of the user's audio items: which items are asked for (`TranscribeInput`),
which are done, and the deltas a live ASR streamed before an item's final transcript."""

from __future__ import annotations

from collections import OrderedDict

from session.realtime.conversation import Item
from session.realtime.core_state import CoreState
from session.realtime.effects import TranscribeInput

STREAMED_ITEMS_MAX = 16  # items whose transcription deltas are remembered until their final


def _word_keys(text: str) -> list[str]:
    return ["".join(ch for ch in w.lower() if ch.isalnum() or ch == "'") for w in text.split()]


def remaining_words(streamed: str, final: str) -> str:
    """What a final transcript adds to the deltas already sent: its words after those the
    deltas said (case and punctuation aside), with a leading space after streamed text; ""
    when the deltas said it all or said something else (the completed event then corrects)."""
    said, words = _word_keys(streamed), final.split()
    if said != _word_keys(" ".join(words[: len(said)])):
        return ""
    rest = " ".join(words[len(said) :])
    return (" " + rest if said else rest) if rest else ""


class Transcripts:
    """The user items' transcription: asked, streamed, completed or failed."""

    def __init__(self, state: CoreState) -> None:
        self.state = state
        self.transcribed: set[str] = set()  # final (or failed, or its audio is gone)
        self.requested: set[str] = set()
        self.streamed: OrderedDict[str, str] = OrderedDict()  # item id → deltas sent before its final

    def request(self, item: Item) -> None:
        """Ask the driver to transcribe `item` (`TranscribeInput`), once, when configured."""
        if self.state.config.transcription is None or item.id in self.requested:
            return
        if item.id in self.transcribed:
            return
        audio = item.audio_16k  # once: a spilled item's is read back
        if audio is None:
            return
        self.requested.add(item.id)
        self.state.out.effect(TranscribeInput(item.id, audio))

    def on_transcript(self, item_id: str, text: str, *, final: bool, speaking: str | None) -> None:
        """Words for `item_id`; `speaking`: the item being spoken (not in the conversation yet)."""
        state = self.state
        conversation, out = state.conversation, state.out
        enabled = state.config.transcription is not None
        if not final and item_id == speaking and item_id is not None:
            # A live ASR's words while the item is still being spoken (it is added at commit).
            if enabled and text:
                self.delta(item_id, 0, text)
            return
        if item_id not in conversation or item_id in self.transcribed:
            return
        item = conversation.get(item_id)
        index = next((k for k, c in enumerate(item.content) if c.type == "input_audio"), None)
        if index is None:
            return
        part = item.content[index]
        if not final:
            if enabled and text:
                self.delta(item_id, index, text)
            return
        self.transcribed.add(item_id)
        streamed = self.streamed.pop(item_id, None)
        part.heard = text
        conversation.mark_changed(item_id)
        if enabled:
            rest = remaining_words(streamed or "", text)
            if rest:  # what the deltas did not say yet, so the deltas add up to the transcript
                out.event(
                    "conversation.item.input_audio_transcription.delta",
                    item_id=item_id,
                    content_index=index,
                    delta=rest,
                )
            part.transcript = text
            seconds = (part.audio_ms() or part.dropped_ms or 0.0) / 1000.0
            out.event(
                "conversation.item.input_audio_transcription.completed",
                item_id=item_id,
                content_index=index,
                transcript=text,
                usage={"type": "duration", "seconds": round(seconds, 3)},
            )

    def delta(self, item_id: str, index: int, text: str) -> None:
        self.state.out.event(
            "conversation.item.input_audio_transcription.delta",
            item_id=item_id,
            content_index=index,
            delta=text,
        )
        streamed = self.streamed
        streamed[item_id] = streamed.pop(item_id, "") + text
        while len(streamed) > STREAMED_ITEMS_MAX:  # items that were never committed or finished
            streamed.popitem(last=False)

    def failed(self, item_id: str, message: str) -> None:
        if item_id in self.state.conversation and item_id not in self.transcribed:
            self.transcribed.add(item_id)
            if self.state.config.transcription is not None:
                self.state.out.event(
                    "conversation.item.input_audio_transcription.failed",
                    item_id=item_id,
                    content_index=0,
                    error={"type": "transcription_error", "code": "transcription_failed", "message": message},
                )
