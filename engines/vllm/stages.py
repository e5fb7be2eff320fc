"""Stage engines on vLLM's async engine (``AsyncLLM``, v1), one engine process per replica.

* :class:`VllmEngine` (``vllm.generate``): a causal LM stage. The prompt is ``prompt_token_ids``
  or ``text`` from the submit params (entry stage), or the text of its upstream chunks
  (``input: upstream``). Out: ``TokenIds`` downstream and, with a tokenizer in the model
  directory, ``TextDelta`` to the client (and downstream with ``emit: text``).
* :class:`VllmResponderEngine` (``vllm.responder``): the voice cascade's responder on vLLM, the
  same chat prompt as the transformers responder (:mod:`engines.speech.chat`).

Scheduling stays with the stage in the sense of the runtime's contract: this engine never
picks among requests; every live request is submitted to vLLM, whose own scheduler batches
them continuously (paged KV, prefix cache). ``step`` hands over what arrived for each request
of the batch, waiting at most ``poll_ms`` for the first token of any of them, so the stage's
worker is never blocked for long. A cancelled request is aborted in vLLM at its ``finish``.

A session's next turn re-sends the whole conversation; vLLM's prefix cache makes it prefill
only the new tokens (``num_cached_tokens``, counted as ``prompt_cached`` tokens in the
stage's counters and so in ``/metrics``). Sticky assignment by session keeps a session on the
replica whose engine holds its prefix.

Options: ``model`` (directory, or ``smollm2``), ``python`` (the vLLM interpreter; default
``.venv-vllm``), ``dtype`` (float32 on CPU), ``device`` (cpu | cuda), ``gpu_memory_utilization``,
``max_model_len``, ``block_size`` (32 on CPU: its attention kernel needs a multiple of 32),
``max_num_seqs``, ``prefix_caching`` (true),
``max_tokens`` (64), ``temperature`` (0: greedy), ``ignore_eos``, ``poll_ms`` (10),
``startup_timeout_s``, ``env`` (extra environment), ``engine_args`` (any other vLLM
``AsyncEngineArgs`` field, e.g. ``limit_mm_per_prompt`` for a text-only multimodal model).
The KV cache space on CPU is the stage's
``budget.kv_bytes`` (whole GiB, at least 1; vLLM's ``VLLM_CPU_KVCACHE_SPACE``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.speech.chat import (
    VOICE_SYSTEM_PROMPT,
    IncrementalDetokenizer,
    Turn,
    chat_prompt_ids,
    resolve_llm,
    stop_token_ids,
)
from engines.vllm.client import HostConfig, RequestStream, VllmEngineDied, VllmProcess
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.kv import current_kv_store
from runtime.payloads import Payload, TextDelta, TokenIds

log = logging.getLogger(__name__)

GIB = 1024**3


class VllmRequestFailed(RuntimeError):
    """vLLM refused or lost this request (its message says why)."""


@dataclass(slots=True)
class VllmState:
    request_id: str
    params: Mapping[str, Any]
    upstream_text: list[str] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    stream: RequestStream | None = None
    process: VllmProcess | None = None  # the engine process the request went to
    detok: IncrementalDetokenizer | None = None
    done: bool = False
    counted: bool = False  # prompt / cached-prompt tokens reported


class VllmEngine(Engine):
    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.model = str(self.options.get("model") or "")
        if not self.model:
            raise ValueError(f"{type(self).__name__}: option 'model' (a directory or 'smollm2') is required")
        self.input = str(self.options.get("input", "params"))
        if self.input not in ("params", "upstream"):
            raise ValueError(f"vllm: input must be 'params' or 'upstream', got {self.input!r}")
        self.max_tokens = int(self.options.get("max_tokens", 64))
        self.poll_s = float(self.options.get("poll_ms", 10)) / 1e3
        self.emit = str(self.options.get("emit", "text"))
        self.tokenizer: Any = None
        self.stop_ids: frozenset[int] = frozenset()
        self.model_dir: Path | None = None
        self._process: VllmProcess | None = None
        self._restarting: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.restarts = 0
        self.max_model_len = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def load(self) -> None:
        self.model_dir = resolve_llm(self.model)
        if (self.model_dir / "tokenizer_config.json").is_file() or (
            self.model_dir / "tokenizer.json"
        ).is_file():
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
            self.stop_ids = stop_token_ids(self.tokenizer)
        self._process = self._spawn()

    def _host_config(self) -> HostConfig:
        assert self.model_dir is not None
        o = self.options
        device = str(o.get("device", "cpu"))
        env = {str(k): str(v) for k, v in (o.get("env") or {}).items()}
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # its INFO lines would drown the server's log
        if device == "cpu":
            kv_gib = max(1, math.ceil(current_kv_store().budget_bytes / GIB))
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_gib))
        engine: dict[str, Any] = {
            "dtype": o.get("dtype", "float32" if device == "cpu" else "auto"),
            "max_model_len": o.get("max_model_len"),
            "block_size": o.get("block_size", 32 if device == "cpu" else None),
            "max_num_seqs": o.get("max_num_seqs", 64),
            "prefix_caching": o.get("prefix_caching", True),
            "enforce_eager": o.get("enforce_eager", device == "cpu"),
            "gpu_memory_utilization": o.get("gpu_memory_utilization", 0.9),
            "seed": o.get("seed", 0),
            "engine_args": dict(o.get("engine_args") or {}),
        }
        return HostConfig(
            model=str(self.model_dir),
            python=o.get("python"),
            engine=engine,
            env=env,
            startup_timeout_s=float(o.get("startup_timeout_s", 600)),
        )

    def _spawn(self) -> VllmProcess:
        process = VllmProcess(self._host_config(), on_death=self._begin_restart)
        process.start()
        self.max_model_len = process.max_model_len
        log.info("vllm engine process %s up (max_model_len %d)", process.pid, process.max_model_len)
        return process

    def close(self) -> None:
        with self._lock:
            self._closed = True
            process, self._process = self._process, None
        if process is not None:
            process.close()
        if self._restarting is not None:
            self._restarting.join()

    @property
    def process(self) -> VllmProcess | None:
        """The live engine process (None while it restarts)."""
        with self._lock:
            process = self._process
        if process is not None and process.dead is not None:
            self._begin_restart(process)
            return None
        return process

    def _begin_restart(self, dead: VllmProcess) -> None:
        with self._lock:
            if (
                self._closed
                or self._process is not dead
                or (self._restarting is not None and self._restarting.is_alive())
            ):
                return
            self._process = None
            log.error("vllm engine process %s died (%s); starting a new one", dead.pid, dead.dead)
            self._restarting = threading.Thread(
                target=self._restart, args=(dead,), name="vllm-restart", daemon=True
            )
            self._restarting.start()

    def _restart(self, dead: VllmProcess) -> None:
        dead.close(timeout_s=5)
        delay = 0.5
        while True:
            try:
                process = self._spawn()
                break
            except Exception:
                log.exception("vllm engine restart failed; retrying in %.1f s", delay)
                time.sleep(delay)
                delay = min(delay * 2, 10.0)
        with self._lock:
            if self._closed:
                process.close()
                return
            self._process = process
            self.restarts += 1

    # -- requests -------------------------------------------------------------------------------

    def start(self, request: EngineRequest) -> VllmState:
        return VllmState(request.request_id, request.params)

    def prompt_for(self, state: VllmState) -> list[int]:
        """The prompt's token ids (from the params, or the upstream text)."""
        params = state.params
        ids = params.get("prompt_token_ids")
        if ids is not None:
            return [int(t) for t in ids]
        text = (
            " ".join(t.strip() for t in state.upstream_text if t.strip())
            if self.input == "upstream"
            else None
        )
        if text is None:
            text = str(params.get("text") or "")
        if self.tokenizer is None:
            raise ValueError("vllm: this model has no tokenizer; submit prompt_token_ids")
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def sampling_for(self, state: VllmState) -> dict[str, Any]:
        params, o = state.params, self.options
        greedy = bool(params.get("greedy", float(o.get("temperature", 0.0)) == 0.0))
        return {
            "max_tokens": int(params.get("max_tokens") or self.max_tokens),
            "min_tokens": int(params.get("min_tokens") or 0),
            "temperature": 0.0 if greedy else float(params.get("temperature", o.get("temperature", 0.8))),
            "top_p": float(params.get("top_p", o.get("top_p", 1.0))),
            "top_k": int(params.get("top_k", o.get("top_k", 0))),
            "seed": params.get("seed"),
            "ignore_eos": bool(params.get("ignore_eos", o.get("ignore_eos", False))),
            "stop_token_ids": sorted(self.stop_ids),
        }

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        # A request whose engine died fails alone: with others in the batch, raise before
        # taking anything, so the stage re-steps each request by itself.
        failed = [item.state for item in batch if self._failure(item.state) is not None]
        if failed:
            if len(batch) > 1:
                raise VllmRequestFailed("a request of the batch failed; stepping each alone")
            raise VllmEngineDied(self._failure(failed[0]))
        outputs: list[StepOutput | None] = [None] * len(batch)
        process = self.process
        for i, item in enumerate(batch):
            state: VllmState = item.state
            if state.stream is not None:
                continue
            for chunk in item.chunks:
                state.upstream_text.extend(p.text for p in chunk.items if isinstance(p, TextDelta))
            if self.input == "upstream" and not item.upstream_finished:
                outputs[i] = StepOutput(wait_for_input=True)
                continue
            if state.prompt_ids is None:
                state.prompt_ids = self.prompt_for(state)
                self.check_length(state.prompt_ids, process)
            if process is None:  # restarting: try again shortly
                outputs[i] = StepOutput(not_before=time.monotonic() + 0.1)
                continue
            state.process = process
            state.stream = process.submit(state.request_id, state.prompt_ids, self.sampling_for(state))
            state.detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        streams = [item.state.stream for i, item in enumerate(batch) if outputs[i] is None]
        waiting_on = [s for s in streams if s is not None]
        if waiting_on and process is not None:
            process.wait_any(waiting_on, self.poll_s)
        for i, item in enumerate(batch):
            if outputs[i] is None:
                outputs[i] = self._collect(item.state)
        return [o if o is not None else StepOutput() for o in outputs]

    def check_length(self, prompt_ids: list[int], process: VllmProcess | None) -> None:
        limit = process.max_model_len if process is not None else 0
        if limit and len(prompt_ids) >= limit:
            from engines.speech.chat import ContextLengthExceeded

            raise ContextLengthExceeded(len(prompt_ids), limit - 1, "disabled")

    def _failure(self, state: Any) -> str | None:
        stream = getattr(state, "stream", None) if isinstance(state, VllmState) else None
        if stream is None or stream.error is None:
            return None
        return f"{stream.error}; the stage restarts its vLLM engine"

    def _collect(self, state: VllmState) -> StepOutput:
        stream, process = state.stream, state.process
        if stream is None or process is None:
            return StepOutput(not_before=time.monotonic() + 0.1)
        ids, finished, error = process.take(stream)
        if error is not None:
            raise VllmRequestFailed(error)
        out = StepOutput(done=finished)
        state.done = finished
        if not state.counted and stream.prompt_tokens is not None:
            state.counted = True
            out.counters = {"prompt": stream.prompt_tokens, "prompt_cached": stream.cached_tokens or 0}
        if ids:
            out.downstream.append(TokenIds(np.asarray(ids, dtype=np.int64)))
        if state.detok is not None:
            text = state.detok.feed(ids) if ids else ""
            if finished:
                text += state.detok.flush()
            if text:
                self._emit_text(out, text)
        return out

    def _emit_text(self, out: StepOutput, text: str) -> None:
        delta: Payload = TextDelta(text)
        out.client.append(delta)
        if self.emit == "text":
            out.downstream = [delta]

    def finish(self, state: Any, *, cancelled: bool) -> None:
        if not isinstance(state, VllmState) or state.stream is None or state.process is None:
            return
        if not state.done:
            state.process.abort(state.request_id)


class VllmResponderEngine(VllmEngine):
    """``vllm.responder``: the voice cascade's responder on vLLM. Options as
    :class:`VllmEngine` (``model`` defaults to ``smollm2``, ``max_tokens`` to 128) plus
    ``system_prompt``; the user's text comes from upstream (the ASR stage)."""

    def __init__(self, options: Mapping[str, Any]) -> None:
        merged = {"model": "smollm2", "max_tokens": 128, **options, "input": "upstream", "emit": "text"}
        super().__init__(merged)
        self.system_prompt = str(self.options.get("system_prompt") or VOICE_SYSTEM_PROMPT)

    def prompt_for(self, state: VllmState) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("vllm.responder needs a model directory with a tokenizer")
        text = " ".join(t.strip() for t in state.upstream_text if t.strip())
        turn = Turn.from_params(text, state.params, self.max_tokens)
        context = self.max_model_len or 2048
        return chat_prompt_ids(self.tokenizer, turn, context_tokens=context, system_prompt=self.system_prompt)
