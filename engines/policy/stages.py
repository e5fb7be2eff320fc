"""``policy.pi0_tiny``: the tiny π0-shaped policy (random weights) as a runtime engine.

One live request per robot session. The session appends each observation as an
:class:`~runtime.payloads.Observation` (``append_input``) and sends prompt changes and episode
resets as :class:`~runtime.payloads.Conditioning` (``update``): ``{"prompt": str}``,
``{"reset": True}``. Every step takes the newest pending observation of each request in the
batch (older ones were already dropped by the session: it keeps one in flight) and answers it
with one client-visible :class:`~runtime.payloads.ActionChunk`; all requests of the batch run
through the model together. The request never finishes on its own: the session cancels it.

Per-session context (the previous chunk, the prompt, the inference counter that seeds the
noise) lives in the request state and starts from the submit params, so a session rebuilt
elsewhere from its stored context continues exactly where it was:
``{"seed": int, "prompt": str, "previous": float32 [horizon, action_dim] | None, "step": int}``.

Options: those of :class:`~engines.policy.pi0_tiny.PolicyConfig`, plus ``num_threads`` (1:
torch's intra-op threads, as the other CPU engines set them).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.policy.pi0_tiny import PolicyConfig, PolicyInput, build_model, infer_chunks
from runtime.engine import Engine, EngineRequest, StepInput, StepOutput
from runtime.payloads import ActionChunk, Observation

NOISE_STRIDE = 1_000_003  # seed · stride + step: distinct noise per session and inference


@dataclass(slots=True)
class PolicyRequest:
    seed: int
    prompt: str
    previous: np.ndarray | None
    step: int
    prompt_tokens: Any = None  # cached tokens of `prompt`


class Pi0TinyEngine(Engine):
    """The tiny π0-shaped policy; several robots' observations per step."""

    batchable = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        self.config = PolicyConfig.from_options(self.options)
        self.num_threads = int(self.options.get("num_threads", 1))
        self._model: Any = None

    def load(self) -> None:
        import torch

        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        self._model = build_model(self.config)

    def start(self, request: EngineRequest) -> PolicyRequest:
        params = request.params
        previous = params.get("previous")
        shape = (self.config.horizon, self.config.action_dim)
        if previous is not None:
            previous = np.asarray(previous, dtype=np.float32)
            if previous.shape != shape:
                raise ValueError(f"previous chunk has shape {previous.shape}, expected {shape}")
        return PolicyRequest(
            seed=int(params.get("seed", 0)),
            prompt=str(params.get("prompt", "")),
            previous=previous,
            step=int(params.get("step", 0)),
        )

    def step(self, batch: Sequence[StepInput]) -> list[StepOutput]:
        if self._model is None:
            raise RuntimeError("Pi0TinyEngine.load() must run before the first request")
        work: list[tuple[int, PolicyInput, Observation]] = []
        for row, item in enumerate(batch):
            state: PolicyRequest = item.state
            for update in item.updates:
                if update.values.get("reset"):
                    state.previous = None
                prompt = update.values.get("prompt")
                if isinstance(prompt, str) and prompt != state.prompt:
                    state.prompt, state.prompt_tokens = prompt, None
            observations = [p for p in item.inputs if isinstance(p, Observation)]
            if not observations:
                continue
            obs = observations[-1]
            images = [obs.images[key] for key in self.config.image_keys]
            policy_input = PolicyInput(
                images=images,
                state=np.asarray(obs.state, dtype=np.float32).reshape(self.config.state_dim),
                prompt=state.prompt,
                previous=state.previous,
                noise_seed=state.seed * NOISE_STRIDE + state.step,
                prompt_tokens=state.prompt_tokens,
            )
            work.append((row, policy_input, obs))
        outputs = [StepOutput(wait_for_input=True) for _ in batch]
        if not work:
            return outputs
        started = time.perf_counter()
        chunks = infer_chunks(self._model, self.config, [w[1] for w in work])
        infer_ms = (time.perf_counter() - started) * 1000.0
        for (row, policy_input, obs), actions in zip(work, chunks, strict=True):
            state = batch[row].state
            state.previous = actions
            state.prompt_tokens = policy_input.prompt_tokens
            state.step += 1
            outputs[row].client.append(ActionChunk(actions, seq=obs.seq, infer_ms=infer_ms, batch=len(work)))
        return outputs
