"""Which CPUs' int8 products saturate: x86 without VNNI (the words model computes in float32 there)."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from engines.speech.int8_kernels import cpu_flags, exact_int8_compute_type, int8_saturates, saturates

pytestmark = pytest.mark.unit

ZEN3 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512bw avx512_vnni avx512_bf16\n"


def test_x86_without_vnni_saturates_and_with_it_does_not() -> None:
    assert cpu_flags(ZEN3) == frozenset({"fpu", "sse2", "avx", "avx2", "fma", "bmi2"})
    assert saturates("x86_64", cpu_flags(ZEN3))
    assert not saturates("x86_64", cpu_flags(ZEN4))
    assert not saturates("x86_64", frozenset({"avx2", "avx_vnni"}))  # Alder Lake and later
    assert saturates("AMD64", frozenset({"avx512bw"}))  # AVX-512 without VNNI (Skylake-X)


def test_other_architectures_and_unreadable_flags() -> None:
    assert not saturates("aarch64", frozenset())
    assert saturates("x86_64", cpu_flags(""))  # no flags to read on x86: the safe answer
    here = cpu_flags(Path("/proc/cpuinfo").read_text()) if Path("/proc/cpuinfo").exists() else frozenset()
    assert int8_saturates() == saturates(platform.machine(), here)
    assert exact_int8_compute_type() == ("float32" if int8_saturates() else "int8")
