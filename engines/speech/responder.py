"""Text responders for the voice cascade: what the assistant says back to a transcript.

* :class:`EchoResponder` (the default): deterministic, no model. It answers
  ``"You said: <transcript>"``, streamed word by word, so the cascade runs and can be tested
  end to end with no language model at all.
* :class:`CausalLmResponder`: a local ``transformers`` causal LM loaded from a directory
  (``llm: PATH``), greedy, streamed token by token. It uses the tokenizer's chat template when
  it has one (instructions as the system message, then ``history``, then the user's text).

A responder turns one user turn into an iterator of text deltas; the engine pulls a few per
step, so cancellation stops generation within one step.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

ECHO_PREFIX = "You said:"
ECHO_NOTHING = "I did not hear anything."


@dataclass(frozen=True, slots=True)
class Turn:
    """One user turn with its context, from the submit params."""

    user_text: str
    history: tuple[tuple[str, str], ...] = ()  # (role, text), role "user" | "assistant"
    instructions: str = ""
    max_tokens: int = 128

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
        )


class Responder(Protocol):
    def respond(self, turn: Turn) -> Iterator[str]:
        """Text deltas of the reply; concatenated they give the whole reply."""
        ...


class EchoResponder:
    """``"You said: <transcript>"``, one word per delta (later words carry their leading space)."""

    def respond(self, turn: Turn) -> Iterator[str]:
        text = " ".join(turn.user_text.split())
        reply = f"{ECHO_PREFIX} {text}" if text else ECHO_NOTHING
        for i, word in enumerate(reply.split(" ")):
            yield word if i == 0 else f" {word}"


class CausalLmResponder:
    """Greedy decoding with a KV cache from a local causal LM directory. Thread-safe for reads.

    Each call keeps its own cache; the weights are shared. Text is detokenised incrementally:
    a delta is released only once it no longer ends in a partial UTF-8 sequence.
    """

    def __init__(self, path: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"llm path is not a directory: {self.path}")
        self._torch: Any = torch
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(self.path), local_files_only=True, dtype=torch.float32
        )
        self.model.eval()
        # transformers 5.x renamed the KV-cache argument and output field from
        # ``past_key_values`` to ``cache``; accept models on either side of the rename.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        # Only the last position's logits are needed; skip the vocab projection for the rest.
        self._extra: dict[str, Any] = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        self._stop_ids = self._find_stop_ids()

    def _find_stop_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        candidates: list[Any] = [self.tokenizer.eos_token_id]
        gen_config = getattr(self.model, "generation_config", None)
        if gen_config is not None:
            candidates.append(gen_config.eos_token_id)
        for cand in candidates:
            if isinstance(cand, int):
                ids.add(cand)
            elif isinstance(cand, Sequence):
                ids.update(int(c) for c in cand)
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return frozenset(ids)

    def prompt_ids(self, turn: Turn) -> list[int]:
        messages: list[dict[str, str]] = []
        if turn.instructions:
            messages.append({"role": "system", "content": turn.instructions})
        messages.extend({"role": role, "content": text} for role, text in turn.history)
        messages.append({"role": "user", "content": turn.user_text})
        if getattr(self.tokenizer, "chat_template", None):
            prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
        prompt = "\n".join([*lines, "Assistant:"])
        return list(self.tokenizer(prompt)["input_ids"])

    def respond(self, turn: Turn) -> Iterator[str]:
        torch = self._torch
        input_ids = torch.tensor([self.prompt_ids(turn)], dtype=torch.long)
        generated: list[int] = []
        emitted = ""
        past: Any = None
        for _ in range(max(0, turn.max_tokens)):
            with torch.inference_mode():
                kwargs = {**self._extra, self._cache_arg: past} if past is not None else self._extra
                out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
            past = getattr(out, "cache", None)
            if past is None:
                past = getattr(out, "past_key_values", None)
            next_id = int(out.logits[0, -1].argmax())
            if next_id in self._stop_ids:
                break
            generated.append(next_id)
            input_ids = torch.tensor([[next_id]], dtype=torch.long)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue  # a multi-byte character is still incomplete
            if len(text) > len(emitted) and text.startswith(emitted):
                delta, emitted = text[len(emitted) :], text
                yield delta
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        if len(text) > len(emitted) and text.startswith(emitted):
            yield text[len(emitted) :]


_CACHE_LOCK = threading.Lock()
_LM_CACHE: dict[str, CausalLmResponder] = {}


def make_responder(llm_path: str | None) -> Responder:
    """The echo responder, or the (process-cached) causal LM at ``llm_path``."""
    if not llm_path:
        return EchoResponder()
    key = str(Path(llm_path).resolve())
    with _CACHE_LOCK:
        lm = _LM_CACHE.get(key)
        if lm is None:
            lm = CausalLmResponder(key)
            _LM_CACHE[key] = lm
        return lm
