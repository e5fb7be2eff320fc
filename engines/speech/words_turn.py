"""Do the words of a turn so far end the user's message? A language model's log P(end of message).

The second end-of-turn cue of ``semantic_vad`` (``session.realtime.words_turn``): Smart Turn
(:mod:`engines.speech.smart_turn`) hears *how* the words were said, ~30 ms into a pause; on a
third of this voice's finished sentences it calls the turn unfinished there (P < 0.1 on "... moved
to Thursday afternoon.", "... near the station at this hour?"), and the turn waits the maximum
pause (4 s at auto) although its words end a sentence. Those words are scored here: the
probability that a chat model ends the user's message after them, as LiveKit's turn detector
reads it (theirs is SmolLM2 fine-tuned for the task and licensed with LiveKit Agents only; this
is SmolLM2-135M-Instruct as it ships, the responder's own model). Finished sentences score
log P >= -15.0 (p50 -7.1), mid-clause first halves that Whisper closed with a period <= -15.9
(docs/benchmarks.md, issue 30 twelfth round).

The text is read as the detector reads it: lower case, no punctuation (the ASR's period is not
the speaker's), in the chat template's user turn after the template's default system prompt;
log P(``<|im_end|>``) is the model's next-token log-probability there. The model runs on
CTranslate2 (int8, its own intra-op threads, not torch's process-wide pool, which the
responder's forward steps use): converted once from the bundled weights (``resolve_llm``) into
the cache directory, ~10 s. The system prompt's keys and values are computed once
and reused (``static_prompt``): a call processes only the user's words, ~40 ms of one core
for a 15-token sentence. On an x86 CPU without VNNI its int8 products saturate
(:mod:`engines.speech.int8_kernels`: scores 1.5-4 nats higher than the model's, a first half
over the bar's margin), so there the int8 weights are computed in float32 (~2x the time: ~125
ms a sentence on an AMD Zen 3 core, ~540 MB resident instead of ~135 MB).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engines.speech.chat import BUNDLED, cache_dir, converted_once, resolve_llm
from engines.speech.int8_kernels import exact_int8_compute_type

END_TOKEN = "<|im_end|>"
CT2_DIR = "smollm2-135m-instruct-ct2-int8"
_PLACEHOLDER = "\x00words\x00"
_NOT_WORD = re.compile(r"[^\w\s'-]")


def message_words(text: str) -> str:
    """The transcript as the model reads it: lower case, punctuation dropped, single spaces."""
    return " ".join(_NOT_WORD.sub("", text.lower()).split())


def converted(llm: str = BUNDLED) -> Path:
    """The CTranslate2 int8 copy of the chat model `llm` (converted once; needs torch and
    transformers for that, as the bundled model's own conversion does)."""
    source = resolve_llm(llm)
    target = cache_dir() / CT2_DIR if llm == BUNDLED else source.with_name(source.name + "-ct2-int8")

    def convert(out: Path) -> None:
        from ctranslate2.converters import TransformersConverter

        TransformersConverter(str(source)).convert(str(out), quantization="int8")

    return converted_once(target, "model.bin", convert)


class WordsTurn:
    """log P(end of message | the words so far) from a small chat model (module docstring)."""

    def __init__(self, llm: str = BUNDLED, *, threads: int = 1) -> None:
        import ctranslate2
        from transformers import AutoTokenizer

        source = resolve_llm(llm)
        self._tok: Any = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        self.compute_type = exact_int8_compute_type()
        self._gen: Any = ctranslate2.Generator(
            str(converted(llm)), device="cpu", compute_type=self.compute_type, intra_threads=threads
        )
        end = self._tok.convert_tokens_to_ids(END_TOKEN)
        assert isinstance(end, int)
        self._end = end
        template = str(
            self._tok.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}], tokenize=False)
        )
        self._head = template[: template.index(_PLACEHOLDER)]
        self._head_tokens: list[str] = self._tokens(self._head)

    def _tokens(self, text: str) -> list[str]:
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        return list(self._tok.convert_ids_to_tokens(ids))

    def logp_end(self, texts: Sequence[str]) -> list[float]:
        """For each transcript: log P(the user's message ends after its words). One model call
        each: CTranslate2's logits of a padded batch are not the unpadded prompt's."""
        return [self._one(text) for text in texts]

    def _one(self, text: str) -> float:
        # The head tokenizes the same alone and before the words (it ends on a newline).
        tokens = self._tokens(self._head + message_words(text))[len(self._head_tokens) :]
        (result,) = self._gen.generate_batch(
            [tokens or ["\n"]],
            static_prompt=self._head_tokens,
            max_length=1,
            sampling_topk=1,
            return_logits_vocab=True,
            include_prompt_in_result=False,
        )
        logits = np.asarray(result.logits[0], dtype=np.float32).reshape(-1)
        top = float(logits.max())
        return float(logits[self._end] - top - np.log(np.exp(logits - top).sum()))
