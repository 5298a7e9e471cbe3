"""The model's dtype under ``--dtype auto``: bfloat16 where it is measured faster, float32 elsewhere on CPU.

On GPUs auto is bfloat16 (float16 without bf16 support). On a CPU, bfloat16 pays only where the
CPU has bf16 units (AVX512-BF16, AMX): there it encodes a book ~2.6x faster than float32, and
the trained needle model gives the same answers (30 of 30 inputs 50 windows long, in bf16 as in
fp32). On the others (most laptops) a bfloat16 matmul is emulated and runs tens of times slower.
Whether it pays is measured with the encoder's own matmul shape, never assumed from the CPU's name,
and only once per machine (unlimisum/measurements.py keeps it): a small matmul first, which settles a
CPU without 16-bit units in a few hundredths of a second, then the encoder's feed-forward shape where
the small one leaves it open. ``UNLIMISUM_CPU_BFLOAT16=0`` keeps float32 (``=1`` forces bf16) without
measuring; ``--dtype`` overrides all of this, with a warning where the 16-bit dtype asked for was measured
much slower than float32 here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch

from unlimisum import measurements

# bfloat16 must be at least this much faster than float32 on this CPU for auto to choose it: below,
# the rounding is not worth it.
CPU_BF16_MIN_SPEEDUP = 1.5
# The shapes timed, smallest first ([rows, inner] x [inner, cols]): a matmul the size of one attention projection
# of 64 tokens, then the encoder's feed-forward matmul of a 512-token batch.
PROBE_SHAPES = ((64, 768, 768), (512, 768, 3072))
# A speedup below this at a smaller shape settles it (float32) without timing the larger one: there the 16-bit
# matmul is emulated (measured 0.02x on an AVX2-only CPU, where one call of the large shape took 3.5 s).
CLEARLY_SLOWER = 0.5
# A 16-bit dtype asked for with --dtype that was measured this much slower than float32 gets a warning.
WARN_BELOW_SPEEDUP = 0.5
_ENV = "UNLIMISUM_CPU_BFLOAT16"

Timer = Callable[[Callable[[], object]], float]


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype the weights are loaded in, and why (and what the user should know about it)."""

    dtype: torch.dtype
    reason: str
    warning: str | None = None  # one line for stderr: a dtype asked for that runs much slower here


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
    speedup = cpu_speedup(torch.bfloat16)
    if speedup >= CPU_BF16_MIN_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"auto: bfloat16, measured {speedup:.1f}x faster than float32 on this CPU")
    return DtypeChoice(torch.float32, f"auto: float32, bfloat16 measured {_factor(speedup)} on this CPU "
                                      f"(needs {CPU_BF16_MIN_SPEEDUP}x)")


def check_asked_dtype(dtype: torch.dtype, device: torch.device) -> str | None:
    """A warning line when a 16-bit ``dtype`` asked for on a CPU was measured much slower than float32 there."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return None
    speedup = cpu_speedup(dtype)
    if speedup >= WARN_BELOW_SPEEDUP:
        return None
    name = str(dtype).removeprefix("torch.")
    return (f"--dtype {name}: a {name} matmul was measured {1 / speedup:.0f}x slower than float32 on this CPU "
            f"(it has no {name} units); --dtype float32 or auto runs faster")


def cpu_speedup(dtype: torch.dtype = torch.bfloat16) -> float:
    """float32 time / ``dtype`` time of the encoder's matmuls on this CPU: measured once per machine and kept
    (unlimisum/measurements.py), once per process at most otherwise."""
    return _cpu_speedup(dtype)


@lru_cache(maxsize=None)
def _cpu_speedup(dtype: torch.dtype) -> float:
    name = f"cpu {str(dtype).removeprefix('torch.')} speedup"
    found = measurements.remembered(name, lambda: measure_cpu_speedup(dtype))
    try:
        return float(found.value)
    except (TypeError, ValueError):  # a damaged entry: measured again, in this process only
        return measure_cpu_speedup(dtype)[0]


def measure_cpu_speedup(dtype: torch.dtype = torch.bfloat16, *, timer: Timer | None = None,
                        shapes: tuple[tuple[int, int, int], ...] = PROBE_SHAPES) -> tuple[float, str]:
    """(float32 time / ``dtype`` time, what was measured): each shape of ``shapes`` raced in turns
    (measurements.race: the clear loser is called once), stopping at the first shape where ``dtype`` is
    ``CLEARLY_SLOWER`` than float32. ``timer(run)`` -> seconds of one call (tests inject a slow candidate)."""
    generator = torch.Generator().manual_seed(0)
    name = str(dtype).removeprefix("torch.")
    found = []
    speedup = 1.0
    for rows, inner, cols in shapes:
        x = torch.randn(rows, inner, generator=generator)
        w = torch.randn(inner, cols, generator=generator)
        x16, w16 = x.to(dtype), w.to(dtype)
        candidates = {"float32": lambda: x @ w, name: lambda: x16 @ w16}
        for run in candidates.values():  # untimed: oneDNN writes a shape's kernel at its first call (bf16 on a Zen
            run()  # 4: 1.4-4.4 ms, then 0.3), and a first call that slow made the race drop it as the clear loser
        times = measurements.race(candidates, timer=timer)
        speedup = times["float32"] / max(times[name], 1e-12)
        found.append(f"[{rows}x{inner}]x[{inner}x{cols}] float32 {times['float32'] * 1e3:.2f} ms, "
                     f"{name} {times[name] * 1e3:.2f} ms")
        if speedup < CLEARLY_SLOWER:
            break
    return speedup, f"{name} {_factor(speedup)} float32's speed: " + "; ".join(found)


def _factor(speedup: float) -> str:
    return f"{speedup:.2f}x" if speedup < 0.995 else f"{speedup:.1f}x"
