"""``speech.end_of_turn`` with words: Smart Turn's scores, and a language model's for the words.

The end-of-turn stage (:mod:`engines.speech.turn_stage`) as it is, plus one control kind: a
session appends ``TurnControl("score_words", {"ref", "text"})`` when the words of a pause end a
sentence that Smart Turn left open (``session.realtime.words_turn``), and the stage answers with
one ``TurnScore(ref, probability)``: the probability that the user's message ends after those
words (:class:`engines.speech.words_turn.WordsTurn`, SmolLM2-135M-Instruct on CTranslate2). The
words come in order with the audio, so a step scores them after the pause's audio scores.

A step makes every waiting score of either kind, whichever sessions they come from: one Smart
Turn call, then one language-model call per text (~40 ms each; a few a second at most, one per
undecided sentence). Of one session's step, at most the last ``MAX_WORDS`` texts are scored,
each its last ``MAX_TEXT_CHARS`` (the turn so far: a transcript the session was sent; what the
cue reads is its end).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from engines.speech.turn_stage import EndOfTurnEngine
from engines.speech.words_turn import WordsTurn
from runtime.engine import StepInput, StepOutput
from runtime.payloads import TurnControl, TurnScore

MAX_WORDS = 4  # texts a session may have waiting (a fifth drops the oldest: the session moved on)
MAX_TEXT_CHARS = 2000


class EndOfTurnWordsEngine(EndOfTurnEngine):
    """``speech.end_of_turn`` that also scores words. Options: those of
    :class:`EndOfTurnEngine`, ``llm`` (``smollm2``: the bundled chat model, or a local
    directory of one) and ``words_threads`` (the language model's intra-op threads, 1)."""

    provides = frozenset({"end_of_turn", "end_of_turn_words"})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.llm = str(self.options.get("llm", "smollm2"))
        self.words_threads = int(self.options.get("words_threads", 1))
        self._words: WordsTurn | None = None

    def load(self) -> None:
        super().load()
        self._words = WordsTurn(self.llm, threads=self.words_threads)
        self._words.logp_end(["warm up."])  # the first call sets up the static prompt

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        asked: list[list[TurnControl]] = []
        for item in batch:
            waiting: list[TurnControl] = []
            for chunk in item.chunks:
                for payload in chunk.items:
                    if isinstance(payload, TurnControl) and payload.kind == "score_words":
                        waiting.append(payload)
                    elif isinstance(payload, TurnControl) and payload.kind == "clear":
                        waiting.clear()
            asked.append(waiting[-MAX_WORDS:])
        outputs = super().step(batch)
        model = self._words
        assert model is not None
        began = time.perf_counter()
        for out, jobs in zip(outputs, asked, strict=True):
            if not jobs:
                continue
            texts = [str(job.params.get("text", ""))[-MAX_TEXT_CHARS:] for job in jobs]
            for job, logp in zip(jobs, model.logp_end(texts), strict=True):
                out.client.append(TurnScore(str(job.params.get("ref", "")), math.exp(logp)))
            out.counters["word_decisions"] = out.counters.get("word_decisions", 0) + len(jobs)
        spent = round((time.perf_counter() - began) * 1000)
        first = next((out for out, jobs in zip(outputs, asked, strict=True) if jobs), None)
        if first is not None:
            first.counters["words_model_ms"] = spent
        return outputs
