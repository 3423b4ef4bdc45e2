"""What this CPU's vector units can do: the fast paths choose by it, a precision it can only
emulate warns, and every speed number names it.

``MPILEARN_CPU_FLAGS`` (space-separated ``/proc/cpuinfo`` flags) stands in for the CPU's own,
for tests of a CPU that is not at hand.
"""
from __future__ import annotations

import os
import platform
from typing import Optional, Set

FLAGS_ENV = "MPILEARN_CPU_FLAGS"
# what an emulated bf16 costs, measured (bench/generate.py, batch 1, the full angle generator)
EMULATED_BF16_COST = ("measured on an AVX2-only AMD EPYC, bf16-fast took 2 220 ms per shower "
                      "against fp32-fast's 62 and int8-fast's 28")
# the flags that decide the int8 and bf16 kernels (oneDNN, ONNX Runtime)
WANTED = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def _cpuinfo(key: str) -> Optional[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(key)),
                        None)
    except OSError:
        return None


def flags(env=os.environ) -> Set[str]:
    """The CPU's flags among :data:`WANTED`."""
    given = env.get(FLAGS_ENV)
    found = given.split() if given is not None else (_cpuinfo("flags") or "").split()
    return {f for f in found if f in WANTED}


def model() -> str:
    return _cpuinfo("model name") or platform.processor() or "an unknown CPU"


def bf16_native(have: Optional[Set[str]] = None) -> bool:
    """bf16 arithmetic in hardware (AVX-512 BF16 or AMX); elsewhere oneDNN emulates it."""
    have = flags() if have is None else have
    return bool(have & {"avx512_bf16", "amx_bf16"})


def describe(have: Optional[Set[str]] = None) -> str:
    """E.g. "AMD EPYC (avx2 avx512f avx512_bf16 avx512_vnni)": the name every speed number
    carries."""
    have = flags() if have is None else have
    return f"{model()} ({' '.join(f for f in WANTED if f in have) or 'no AVX2'})"


def emulated(precision: str, have: Optional[Set[str]] = None) -> Optional[str]:
    """Why ``precision`` runs emulated on this CPU, or None where it does not."""
    if precision.startswith("bf16") and not bf16_native(have):
        return f"{describe(have)} has no AVX-512 BF16 or AMX: its bf16 arithmetic is emulated"
    return None
