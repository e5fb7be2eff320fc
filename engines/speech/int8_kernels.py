"""Whether this CPU's int8 matrix products are exact: x86 without VNNI saturates.

Quantized models multiply unsigned 8-bit activations by signed 8-bit weights. On x86 the fast
instruction for that before VNNI (``vpmaddubsw``, AVX2 / AVX-512BW) adds each pair of products
in 16 bits with saturation, so large activations clip; with VNNI (``vpdpbusd``: AVX512_VNNI,
AVX_VNNI, AMX) the products are summed in 32 bits. Libraries that take the fast path on such a
CPU (onnxruntime's default u8s8 kernel, CTranslate2's int8 GEMMs) compute something else than
the quantized model: on an AMD Zen 3 (AVX2, no VNNI) Smart Turn's scores moved by up to 0.9
(:mod:`engines.speech.smart_turn` asks onnxruntime for its precise kernel there) and SmolLM2's
log P(end of message) by 1.5-4 nats against float32 (a first half "I would like to book a
flight." -11.8 against -15.6; docs/benchmarks.md, issue 30 thirteenth round). Other
architectures (ARM's dot-product instructions) sum in 32 bits.
"""

from __future__ import annotations

import platform
from functools import lru_cache
from pathlib import Path

EXACT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def saturates(machine: str, flags: frozenset[str]) -> bool:
    """Whether int8 products on a CPU of `machine` (``platform.machine()``) with these
    ``/proc/cpuinfo`` flags saturate (x86 without VNNI)."""
    x86 = machine.lower() in ("x86_64", "amd64", "i386", "i686")
    return x86 and not flags & EXACT_FLAGS


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first processor's flags in ``/proc/cpuinfo`` text (empty where it has none)."""
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def int8_saturates() -> bool:
    """This host's answer (`saturates`); a host without ``/proc/cpuinfo`` counts as exact
    unless it is x86 (where no flags can be read, the safe answer is that it saturates)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return saturates(platform.machine(), cpu_flags(text))


def exact_int8_compute_type() -> str:
    """The CTranslate2 compute type that computes an int8 model as quantized here: ``int8``, or
    ``float32`` where int8 products saturate (the int8 weights widened)."""
    return "float32" if int8_saturates() else "int8"
