"""Client items → stored `Item`s, and the conversation → pipeline submit params.

Submit params follow CONTRACTS.md: the trailing run of user messages is the prompt (their
audio concatenated as `audio`, float32 16 kHz (stored as int16); or their text joined as `text`); earlier
user/assistant messages become `history` (`[{"role", "text"}]`, audio represented by its
transcript); session instructions plus any system messages become `instructions`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from media.audio import (
    VAD_RATE,
    AudioFormatError,
    WireFormat,
    b64decode_audio,
    float32_to_int16_exact,
    resample,
)
from session.realtime.conversation import Content, Item
from session.realtime.errors import INVALID_VALUE, ProtocolError
from session.realtime.events import FunctionCallItemIn, FunctionCallOutputItemIn, MessageItemIn
from session.realtime.ids import IdFactory
from session.realtime.responses import PromptStats

_ALLOWED = {
    "user": {"input_text", "input_audio", "input_image"},
    "system": {"input_text"},
    "assistant": {"output_text", "output_audio"},
}


def item_from_client(
    data: MessageItemIn | FunctionCallItemIn | FunctionCallOutputItemIn,
    *,
    new_id: IdFactory,
    input_format: WireFormat,
    output_format: WireFormat,
    param: str = "item",
) -> Item:
    """Build a stored item from a client item; raises `ProtocolError` with the failing param."""
    item_id = data.id or new_id("item")
    if isinstance(data, FunctionCallItemIn):
        return Item(
            item_id,
            "function_call",
            name=data.name,
            arguments=data.arguments,
            call_id=data.call_id or new_id("call"),
        )
    if isinstance(data, FunctionCallOutputItemIn):
        return Item(item_id, "function_call_output", call_id=data.call_id, output=data.output)
    item = Item(item_id, "message", role=data.role)
    for k, c in enumerate(data.content):
        where = f"{param}.content[{k}]"
        kind = c.type
        if kind == "text":
            kind = "output_text" if data.role == "assistant" else "input_text"
        if kind not in _ALLOWED[data.role]:
            allowed = ", ".join(f"'{t}'" for t in sorted(_ALLOWED[data.role]))
            raise ProtocolError(
                INVALID_VALUE,
                f"Invalid value: '{c.type}'. Content of a '{data.role}' message must be one of {allowed}.",
                param=f"{where}.type",
            )
        part = Content(
            type=kind, text=c.text, transcript=c.transcript, image_url=c.image_url, detail=c.detail
        )
        if kind in ("input_text", "output_text") and c.text is None:
            raise ProtocolError(
                INVALID_VALUE, f"'{where}.text' is required for '{kind}'.", param=f"{where}.text"
            )
        if kind == "input_audio":
            if c.audio is None:
                raise ProtocolError(
                    INVALID_VALUE, f"'{where}.audio' is required for 'input_audio'.", param=f"{where}.audio"
                )
            part.input_audio = float32_to_int16_exact(
                resample(_decode(c.audio, input_format, f"{where}.audio"), input_format.rate, VAD_RATE)
            )
        if kind == "output_audio":
            part.output_format = output_format
            part.output_audio = bytearray()
            if c.audio is not None:
                _decode(c.audio, output_format, f"{where}.audio")
                part.output_audio += b64decode_audio(c.audio)
        item.content.append(part)
    return item


def _decode(b64: str, fmt: WireFormat, param: str) -> np.ndarray:
    try:
        return fmt.decode(b64decode_audio(b64))
    except AudioFormatError as exc:
        raise ProtocolError(INVALID_VALUE, f"Invalid value for '{param}': {exc}.", param=param) from None


def build_submit_params(
    items: list[Item],
    *,
    instructions: str,
    modalities: Sequence[str],
    max_output_tokens: int | str,
    truncation: Any = "auto",
    words_for_audio: bool = False,
) -> tuple[dict[str, Any], PromptStats]:
    """Pipeline submit params for a response over `items` (in conversation order). The
    session's ``truncation`` goes along: an LM engine drops the oldest history entries to fit
    its context with ``"auto"`` (a retention-ratio object counts as auto) and refuses an
    over-long prompt with ``"disabled"``. `words_for_audio` (a pipeline whose model reads only
    the words of the user's audio, ASR first): of several user messages in a row, the leading
    ones whose words are known go as text, not as audio to transcribe again (see
    `_known_words`)."""
    start = len(items)
    while start > 0 and items[start - 1].type == "message" and items[start - 1].role == "user":
        start -= 1
    earlier, trailing = items[:start], items[start:]
    history = [h for h in (_history_entry(i) for i in earlier) if h is not None]
    if words_for_audio:
        known = _known_words(trailing)
        history += [{"role": "user", "text": i.text_for_history()} for i in trailing[:known]]
        trailing = trailing[known:]
    system = [i.text_for_history() for i in items if i.type == "message" and i.role == "system"]
    stats = PromptStats()
    # Each item's audio once: a spilled item (one named in `response.create` input) is read back.
    with_audio = [(i, a) for i in trailing if (a := i.audio_16k) is not None and len(a)]
    params: dict[str, Any] = {}
    if with_audio:
        audio_items = [i for i, _ in with_audio]
        for i in trailing:
            if i not in audio_items and (text := i.text_for_history()):
                history.append({"role": "user", "text": text})
        audio = np.concatenate([a for _, a in with_audio]).astype(np.float32)
        params["audio"] = audio
        stats.audio_s = len(audio) / VAD_RATE
        stats.audio_item_ids = [i.id for i in audio_items]
    else:
        params["text"] = "\n".join(t for t in (i.text_for_history() for i in trailing) if t)
        stats.text_chars = len(params["text"])
    params["history"] = history
    params["instructions"] = "\n\n".join(s for s in [instructions, *system] if s)
    params["modalities"] = ["text", "audio"] if "audio" in modalities else ["text"]
    params["truncation"] = "disabled" if truncation == "disabled" else "auto"
    if isinstance(max_output_tokens, int):
        params["max_tokens"] = max_output_tokens
    # As long as the history joined with spaces (each entry and the space after it), no copy.
    stats.text_chars += sum(len(h["text"]) + 1 for h in history) - (1 if history else 0)
    stats.text_chars += len(params["instructions"])
    return params, stats


def _known_words(trailing: list[Item]) -> int:
    """How many of the user messages in a row go as their words: the leading ones whose words
    are known (an audio message's transcript, made ahead or by the ASR, or typed text), never
    the last message with audio. The user spoke again before an answer came (a barge-in
    cancelled it before any output): the earlier turns' audio was transcribed already, and an
    ASR-first pipeline would otherwise transcribe all of it again with the last turn's, which
    is also then no longer the audio transcribed ahead (the whole of it goes through the
    pipeline's ASR)."""
    with_audio = [k for k, i in enumerate(trailing) if (a := i.audio_16k) is not None and len(a)]
    if len(with_audio) < 2:
        return 0
    known = 0
    while known < with_audio[-1] and trailing[known].text_for_history():
        known += 1
    return known


def _history_entry(item: Item) -> dict[str, str] | None:
    if item.type != "message" or item.role not in ("user", "assistant"):
        return None
    text = item.text_for_history()
    return {"role": str(item.role), "text": text} if text else None
