"""The model's dtype under ``--dtype auto``: bfloat16 where it is measured faster, float32 elsewhere on CPU.

On GPUs auto is bfloat16 (float16 without bf16 support). On a CPU, bfloat16 pays only where the
CPU has bf16 units (AVX512-BF16, AMX): there it encodes a book ~2.6x faster than float32, and
the trained needle model gives the same answers (30 of 30 inputs 50 windows long, in bf16 as in
fp32). Whether it pays is measured once per process with the encoder's own matmul shape, never
assumed from the CPU's name. ``UNLIMISUM_CPU_BFLOAT16=0`` keeps float32 (``=1`` forces bf16)
without measuring; ``--dtype`` overrides all of this.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

# bfloat16 must be at least this much faster than float32 on this CPU for auto to choose it: below,
# the rounding is not worth it.
CPU_BF16_MIN_SPEEDUP = 1.5
_ENV = "UNLIMISUM_CPU_BFLOAT16"


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the weights are loaded in, and why."""

    dtype: torch.dtype
    reason: str


def choose_auto_dtype(device: torch.device) -> DtypeChoice:
    """What ``--dtype auto`` means on ``device``."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return DtypeChoice(torch.bfloat16, "auto: bfloat16 on a GPU that supports it")
        return DtypeChoice(torch.float16, "auto: float16 on a GPU without bfloat16")
    if device.type == "mps":
        return DtypeChoice(torch.float16, "auto: float16 on MPS")
    setting = os.environ.get(_ENV, "").strip()
    if setting in ("0", "1"):
        dtype = torch.bfloat16 if setting == "1" else torch.float32
        return DtypeChoice(dtype, f"auto: {str(dtype)[6:]} ({_ENV}={setting})")
    speedup = cpu_bfloat16_speedup()
    if speedup >= CPU_BF16_MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, measured {speedup:.1f}x faster than float32 on this CPU")
    return DtypeChoice(torch.float32, f"auto: float32, bfloat16 measured {speedup:.1f}x on this CPU "
                                      f"(needs {CPU_BF16_MIN_SPEEDUP}x)")


@lru_cache(maxsize=1)
def cpu_bfloat16_speedup() -> float:
    """float32 time / bfloat16 time of an encoder feed-forward matmul ([512, 768] x [768, 3072]) here."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 768, generator=generator)
    w = torch.randn(768, 3072, generator=generator)
    return _best_time(x, w) / _best_time(x.bfloat16(), w.bfloat16())


def _best_time(x: torch.Tensor, w: torch.Tensor, repeats: int = 5) -> float:
    x @ w  # warm up: the first call picks the kernel
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(4):
            x @ w
        best = min(best, time.perf_counter() - started)
    return best
