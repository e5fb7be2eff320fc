"""The tiny model's weights are a function of the seed alone, whatever the process went through."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from engines.qwen3_omni.config import tiny_config
from engines.qwen3_omni.seeded import build_tiny_model, check_initialised

pytestmark = pytest.mark.system


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not different, different[:10]


def assert_sane(weights: dict[str, torch.Tensor]) -> None:
    for name, t in weights.items():
        if t.is_floating_point():
            assert t.dtype == torch.float32, name
            assert bool(torch.isfinite(t).all()), name
            assert float(t.abs().max()) < 1e3, name


@pytest.fixture(scope="module")
def clean() -> dict[str, torch.Tensor]:
    return tensors(build_tiny_model(tiny_config(), 0))


def test_every_parameter_and_buffer_is_initialised(clean: dict[str, torch.Tensor]) -> None:
    assert_sane(clean)
    # transformers 5.x leaves the talker's MoE experts as torch.empty and its router at zero.
    for layer in (0, 1):
        for key in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
            weight = clean[f"talker.model.layers.{layer}.mlp.{key}"]
            assert bool(weight.any()) and 0.005 < float(weight.std()) < 0.05, key


def test_build_ignores_global_rng_dtype_and_allocator_garbage(
    clean: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(12345)
    torch.randn(1000)  # other default-RNG draws
    garbage = [torch.full((n,), float("nan")) for n in (64, 4096, 8192, 65536) for _ in range(20)]
    del garbage
    real_empty = torch.empty

    def poisoned_empty(*args: object, **kwargs: object) -> torch.Tensor:
        out = real_empty(*args, **kwargs)  # type: ignore[call-overload]
        if out.is_floating_point():
            out.fill_(float("nan"))  # what recycled memory may hold: nothing may rely on it
        return out

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    previous = torch.get_default_dtype()
    rng_before = torch.get_rng_state()
    torch.set_default_dtype(torch.float64)  # what from_pretrained(dtype=...) does on another thread
    try:
        disturbed = tensors(build_tiny_model(tiny_config(), 0))
    finally:
        torch.set_default_dtype(previous)
    monkeypatch.undo()
    assert torch.equal(rng_before, torch.get_rng_state()), "the build drew from the global RNG"
    assert_sane(disturbed)
    assert_identical(clean, disturbed)
    other_seed = tensors(build_tiny_model(tiny_config(), 1))
    assert any(not torch.equal(clean[n], other_seed[n]) for n in clean)


def test_concurrent_builds_and_random_draws_on_other_threads(clean: dict[str, torch.Tensor]) -> None:
    stop = threading.Event()
    built: list[dict[str, torch.Tensor]] = []
    errors: list[BaseException] = []

    def draw() -> None:
        while not stop.is_set():
            torch.rand(256)

    def build() -> None:
        try:
            built.append(tensors(build_tiny_model(tiny_config(), 0)))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    noise = threading.Thread(target=draw)
    builders = [threading.Thread(target=build) for _ in range(2)]
    noise.start()
    try:
        for t in builders:
            t.start()
        for t in builders:
            t.join(timeout=120)
    finally:
        stop.set()
        noise.join(timeout=10)
    assert not errors, errors
    assert len(built) == 2
    for weights in built:
        assert_identical(clean, weights)


def test_check_initialised_names_the_bad_tensor() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[1].weight.zero_()
    with pytest.raises(RuntimeError, match=r"1\.weight: all zero"):
        check_initialised(model)
    with torch.no_grad():
        model[1].weight.fill_(1.0)
        model[0].bias[0] = float("nan")
    with pytest.raises(RuntimeError, match=r"0\.bias: non-finite"):
        check_initialised(model)
