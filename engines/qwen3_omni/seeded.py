"""Building the tiny random-weight model so its weights depend on the seed and nothing else.

Constructing a ``transformers`` model normally reads process-wide state: every initialiser draws
from the global RNG (which other threads and tests advance), parameters start as ``torch.empty``
(whatever the allocator hands back), and factories follow the global default dtype (which
``from_pretrained(dtype=...)`` flips temporarily, for every thread). And transformers 5.x's
``Qwen3OmniMoe`` ``_init_weights`` misses the talker's MoE (``Qwen3OmniMoeTalkerTextExperts``
stays ``torch.empty``, its router stays zero): in a fresh process those pages happen to be zero,
after a few hundred MiB of churn they hold garbage (~1e38), so two builds "with the same seed"
differed.

:func:`build_tiny_model` constructs under :class:`SeededConstruction`, a torch-function mode
(thread-local: other threads are not affected) that gives every random draw a private generator
seeded from ``seed``, zero-fills every ``empty`` and pins default-dtype factories to float32; then
it initialises what transformers leaves out from the same generator and checks that every
parameter and floating buffer is finite and no weight matrix is left all zero.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qmodeling

# Functions that consume random numbers and take ``generator=`` (torch.nn.init's and Tensor's
# in-place samplers, torch's random factories). Matched by ``__name__``.
_RANDOM = frozenset(
    {
        # torch.nn.init
        "uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
        "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_",
        # Tensor in-place samplers
        "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_", "cauchy_",
        # factories
        "rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson",
        "rand_like", "randn_like", "randint_like",
    }
)  # fmt: skip
_EMPTY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# Factories whose result has the default dtype when no dtype is given.
_DEFAULT_FLOAT = frozenset({"empty", "zeros", "ones", "rand", "randn", "empty_strided"})
_INFERRED = frozenset({"full", "arange", "linspace", "logspace", "tensor", "as_tensor"})


class SeededConstruction(TorchFunctionMode):
    """Random draws from ``generator``, zero-filled ``empty``, float32 instead of the default dtype.

    A torch-function mode is pushed on the calling thread only, so models built concurrently on
    other threads (and their RNG) are untouched.
    """

    def __init__(self, generator: torch.Generator, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.generator = generator
        self.dtype = dtype

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kw = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        if name in _RANDOM and kw.get("generator") is None:
            kw["generator"] = self.generator
        pin = torch.get_default_dtype() != self.dtype and kw.get("dtype") is None
        if pin and name in _DEFAULT_FLOAT:
            kw["dtype"] = self.dtype
        out = func(*args, **kw)
        if name in _EMPTY and isinstance(out, torch.Tensor):
            out.zero_()
        if (
            pin
            and name in _INFERRED
            and isinstance(out, torch.Tensor)
            and out.dtype == torch.get_default_dtype()
        ):
            out = out.to(self.dtype)
        return out


def _complete_init(model: nn.Module, std: float) -> int:
    """Initialise the parameters transformers' ``_init_weights`` misses; returns how many."""
    done = 0
    for module in model.modules():
        if isinstance(module, qmodeling.Qwen3OmniMoeTalkerTextExperts):
            tensors = [module.gate_up_proj, module.down_proj]
        elif isinstance(module, qmodeling.Qwen3OmniMoeTalkerTextTopKRouter):
            tensors = [module.weight]
        else:
            continue
        for tensor in tensors:
            nn.init.normal_(tensor, mean=0.0, std=std)
            done += 1
    return done


def check_initialised(model: nn.Module) -> None:
    """Raise if a parameter or floating buffer is non-finite or a weight matrix is all zero."""
    problems: list[str] = []
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if not tensor.is_floating_point():
                continue
            if not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name}: non-finite values")
            elif tensor.dim() >= 2 and isinstance(tensor, nn.Parameter) and not bool(tensor.any()):
                problems.append(f"{name}: all zero (left uninitialised)")
    if problems:
        raise RuntimeError("qwen3_omni: tiny model built with bad weights: " + "; ".join(problems[:8]))


def build_tiny_model(config: Qwen3OmniMoeConfig, seed: int) -> Qwen3OmniMoeForConditionalGeneration:
    """The random-weight model for ``config``: a pure function of ``(config, seed)``."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    talker_text: Any = getattr(config.talker_config, "text_config", None)
    std = float(getattr(talker_text, "initializer_range", 0.02))
    with torch.no_grad(), SeededConstruction(generator):
        model = Qwen3OmniMoeForConditionalGeneration(config)
        _complete_init(model, std)
    check_initialised(model)
    return model
