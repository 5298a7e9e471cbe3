"""Exact retrieval attention over a 16-bit store: one streaming read of the store per call.

One decoder layer's step is one call for every query of that step (every head, beam and row
of one document): ``attend(states [N, d], queries [nq, d], k)`` returns, per query, the softmax-
weighted sum of its top-k stored states. How the store is read:

- k >= N (dense attention): one pass, block by block; each block is scored and, while it is
  still in cache, summed into the output under an online softmax (running maxima and sums).
- k < N: one pass scores every query against the whole store, the top-k are selected, then
  either the k winners are gathered (k small next to N; with the native kernel one fused
  ``embedding_bag`` call, no gathered copy, where measured faster; in fp32 on a CPU, the compiled sum of
  unlimisum/search/compiled.py, no gathered copy either) or a second dense pass sums the
  masked softmax over every state (k a large share of N).

Three score kernels, the same result within the documented precision:

- ``native``: the query is rounded to the storage dtype (on every machine alike) and the
  matmul runs in that dtype with fp32 accumulation; the scores come out rounded to the
  storage dtype (rounding error up to 2^-8 relative in bf16, 2^-11 in fp16). Fast where the CPU or GPU has 16-bit
  units (AVX512-BF16/AMX, tensor cores).
- ``float32``: blocks of the store are widened to fp32 into a reused buffer that stays in cache
  and multiplied with the fp32 query: exact fp32 scores; faster on CPUs without 16-bit units.
- ``packed`` (CPU, torch builds with fbgemm): the store packed once in fbgemm's fp16 layout, widened in
  registers, fp32 arithmetic (unlimisum/search/packed.py): the float32 kernel's scores within fp32 rounding, at
  the cost of two packed copies beside the store (about 2.6x its bytes). Chosen only when measured
  ``PACKED_MIN_SPEEDUP`` times faster than the best unpacked kernel; a store that is not packed (its copies
  over their memory budget, a value beyond fp16's range) runs that best unpacked kernel (``KernelChoice.fallback``).

Which one runs, the block size, the layout the top-k is selected in ([nq, N] scores, or
[N, nq] from ``states @ queries^T``, the faster matmul orientation on some CPUs), and when a
dense pass beats gathering are measured on the machine that runs (``calibrate``, once per
machine, device, dtype and width, about a second on two CPU cores, then kept in the user's cache folder:
unlimisum/measurements.py), never assumed; a kernel that loses by far (an emulated 16-bit matmul) is
timed once, not in every race.
The attention weights are the softmax of the kernel's scores in every path; the weighted sum
of states runs in the storage dtype with the native kernel, in fp32 with the other two.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from unlimisum import measurements
from unlimisum.search import compiled
from unlimisum.search import packed as packing
from unlimisum.search.packed import PackedStates

SCORE_KERNELS = ("native", "float32", "packed")
# Calibration store: large enough to leave the caches (as real stores do), small enough to time quickly.
CALIBRATION_ROWS = 32_768
CALIBRATION_QUERIES = 12  # one greedy step of a 12-head layer, the common case
CALIBRATION_GATHER_ROWS = 8_192
CALIBRATION_FILL_ROWS = 4_096  # rows of the calibration store drawn at a time (a 12 MiB float32 temporary at d=768)
BLOCK_CHOICES = (512, 2_048, 8_192)  # rows per block of the blocked passes (widened, or scored and summed at once)
# Bound on the fp32 scores buffer [nq, N]; beyond it the store is scored in slices with a running top-k.
MAX_SCORE_BYTES = 256 * 2**20
# Rows gathered at a time (16-bit rows plus their fp32 widening stay in a reused buffer of a few MB).
GATHER_ROWS = 2_048
# from this many states, the fp32 sums over them run compiled on a CPU (unlimisum/search/compiled.py), and
# the key store's heads may score compiled (head_kernels.py); below, torch's: the first compile (a few seconds per
# kernel, once per machine) would cost more than a short store saves, and no kernel is compiled for it at all
COMPILED_MIN_STATES = 16_384
# ... but the top-k runs compiled from this many (its one kernel compiled, once per machine, while the book is
# encoded): a support reading's 1,536 rows of 8,192 scores at k = 1,024 took 65 ms with torch.topk and 15 compiled,
# of 16,114 scores 118 and 20 (EPYC Zen 2, two threads), and a step's 12 rows gain too
COMPILED_TOP_K_MIN_STATES = 8_192
# what the measurements of this module are called in the user's cache folder: a new version measures again
MEASUREMENT_VERSION = 4  # 4: the top-k compiled as a long store runs it (compiled.top_k)
# top_k: the block-maxima pre-selection runs with blocks of at least this many columns (about sqrt(N / k));
# shorter rows save too little against torch.topk over the whole row.
TOPK_MIN_BLOCK = 8
# The packed kernel is chosen only when its scores and dense pass are measured at least this many times faster than
# the best unpacked kernel's: its copies take ~2.6x the store's bytes beside it, and a smaller gain does not pay for
# them (measured: 1.25x on a Zen 4 CPU with AVX512-BF16, which would triple the store's memory; 1.6-1.9x on an
# AVX2-only CPU, where packing stays).
PACKED_MIN_SPEEDUP = 1.5
# exp's floor in the online softmax: torch.exp took ~10x longer (AVX2 CPU, torch 2.13) on arguments whose result
# falls below fp32's normal range (under -87.3); a weight below e^-87 (1.6e-38) of the largest, whose own weight
# is 1, is raised to it, which changes the normalising sum by less than N * 1.6e-38 (nothing at fp32's precision).
EXP_FLOOR = -87.0


@dataclass(frozen=True)
class KernelChoice:
    """How exact retrieval runs on one device for one storage dtype and width (see ``calibrate``)."""

    scores: str  # "native" | "float32" | "packed"
    block_rows: int  # rows per block of the float32 kernel's widened passes (also for unpacked stores)
    tokens_major: bool  # native top-k selection scores as states @ queries^T ([N, nq]), measured faster
    gather_row_cost: float  # seconds per gathered state (gather + the weighted sum)
    dense_row_cost: float  # seconds per stored state for one dense pass over the store
    reason: str = ""  # what was measured, for `unlimisum info` and the benchmarks
    dense_block_rows: int | None = None  # rows per block of the one-pass dense attention; None: block_rows
    fallback: str = "float32"  # the best unpacked kernel measured: serves a store that is not packed
    fused_gather: bool = True  # the native kernel's gather as one fused embedding_bag call, measured faster
    select_row_cost: float = 0.0  # seconds per stored state of the (unpacked) kernel's top-k, k=LIVE_K, 12 queries

    @property
    def widens(self) -> bool:
        """The float32 and packed kernels: 16-bit numbers are widened to fp32 before every multiplication."""
        return self.scores != "native"

    def unpacked(self) -> "KernelChoice":
        """The best unpacked kernel (``fallback``) in place of the packed one, for a store that is not packed."""
        if self.scores != "packed":
            return self
        return KernelChoice(self.fallback, self.block_rows, self.tokens_major and self.fallback == "native",
                            self.gather_row_cost, self.dense_row_cost, self.reason, self.dense_block_rows,
                            self.fallback, self.fused_gather)

    def dense_is_cheaper(self, n_queries: int, k: int, n_tokens: int) -> bool:
        """Gathering nq*k states costs more than a second dense pass over all N states."""
        return n_queries * k * self.gather_row_cost > n_tokens * self.dense_row_cost


_CALIBRATED: dict[tuple, KernelChoice] = {}
_LIVE: dict[KernelChoice, measurements.LiveCheck] = {}  # a kept choice's check against the live steps
LIVE_K = 1024  # the k its top-k is timed with for that check (the default retrieval k)


def forced_kernel() -> str | None:
    """UNLIMISUM_SCORE_KERNEL=native|float32|packed forces a kernel (tests, benchmarks); unset: measured."""
    value = os.environ.get("UNLIMISUM_SCORE_KERNEL", "").strip().lower()
    if value and value not in SCORE_KERNELS:
        raise ValueError(f"UNLIMISUM_SCORE_KERNEL must be native, float32 or packed, not {value!r}")
    return value or None


def kernel_for(device: torch.device, dtype: torch.dtype, dim: int, sample: torch.Tensor | None = None, *,
               compiled_sums: bool = False) -> KernelChoice:
    """The calibrated choice for this device, dtype and width: measured once per machine and kept in the user's
    cache folder (unlimisum/measurements.py), then reused by every process.

    ``sample``: a store's states [N, dim] the first measurement may time on instead of a synthetic store
    of its own (see ``calibrate``). ``compiled_sums``: the store runs the compiled sums (``uses_compiled``): they
    are timed, compiled first where they are not yet; else the torch ones, and nothing is compiled."""
    compiled_sums = compiled_sums and torch.device(device).type == "cpu" and dtype in compiled.SCAN_DTYPES
    key = (str(device), dtype, dim, forced_kernel(), compiled_sums)
    if key not in _CALIBRATED:
        _CALIBRATED[key] = _remembered_choice(torch.device(device), dtype, dim, forced_kernel(), sample,
                                              compiled_sums)
    return _CALIBRATED[key]


def uses_compiled(n_tokens: int, device: torch.device | str) -> bool:
    """Whether a store of ``n_tokens`` on ``device`` runs compiled kernels where they are ready: on a CPU, from
    COMPILED_MIN_STATES tokens (the kernel_for and head_kernels.kernel_for choices for it are measured so)."""
    return torch.device(device).type == "cpu" and n_tokens >= COMPILED_MIN_STATES


def compiled_kernels_for(n_tokens: int, dtype: torch.dtype, device: torch.device | str, dim: int, *,
                         per_layer: bool = False, values: bool = False) -> tuple[str, ...]:
    """The compiled kernels (compiled.KERNELS) an exact store of ``n_tokens`` states of width ``dim`` in ``dtype``
    on ``device`` may run and have measured: the top-k of its scores; with per-layer keys its heads' scores and scan
    (with the layers' values for dense steps, k >= N, the one-pass dense attention and the heads' value sums; a
    top-k step sums its chosen values with the weighted sums); the weighted sums of the
    chosen states (a reading's many queries sum them compiled whatever the kernel: ``gathered_attention``); and
    the dense sums where its kernel widens them to fp32 (``kernel_for``: the native kernel sums in the storage
    dtype); the top-k alone for a store from COMPILED_TOP_K_MIN_STATES to COMPILED_MIN_STATES; none for a shorter
    store, off the CPU, or of a dtype they do not read. What ``compiled.warm`` compiles while a book is encoded,
    and what ``prepare`` waits for."""
    if dtype not in compiled.SCAN_DTYPES or torch.device(device).type != "cpu":
        return ()
    if not uses_compiled(n_tokens, device):
        return ("top_k",) if n_tokens >= COMPILED_TOP_K_MIN_STATES else ()
    names: tuple[str, ...] = ("top_k",)
    if per_layer:
        names += ("select", "scores") + (("attend_dense", "head_dense_sum") if values else ())
    names += ("weighted_sum",)
    if kernel_for(torch.device(device), dtype, dim).widens:  # measured already where a key store was planned
        names += ("dense_sum",)
    return names


def _remembered_choice(device: torch.device, dtype: torch.dtype, dim: int, force: str | None,
                       sample: torch.Tensor | None, compiled_sums: bool) -> KernelChoice:
    """This machine's kept calibration for (device, dtype, width, forced kernel, sums), else ``calibrate`` now."""
    name = (f"retrieval kernel v{MEASUREMENT_VERSION} {measured_device(device)} {str(dtype).removeprefix('torch.')} "
            f"d={dim}" + (" compiled sums" if compiled_sums else "") + (f" {force} forced" if force else ""))
    choice, kept = measurements.remembered_choice(name, lambda: calibrate(
        device, dtype, dim, force=force, sample=sample, compiled_sums=compiled_sums), KernelChoice)
    if kept is not None:  # a choice another release kept is measured again for this process, and not checked
        _LIVE.setdefault(choice, measurements.LiveCheck(name, kept=kept))
    return choice


def measured_device(device: torch.device) -> str:
    """How a measurement's name says where it was made: ``cpu`` (the CPU itself is in the store's machine key),
    or a GPU's kind and model."""
    if device.type == "cpu":
        return "cpu"
    return f"{device.type} {torch.cuda.get_device_name(device) if device.type == 'cuda' else device}"


def calibrate(device: torch.device, dtype: torch.dtype, dim: int, *, force: str | None = None,
              rows: int = CALIBRATION_ROWS, sample: torch.Tensor | None = None,
              timer: Callable[[Callable[[], object]], float] | None = None,
              compiled_sums: bool = False) -> KernelChoice:
    """Time the score kernels and their block sizes, the one-pass dense attention, a gather and a dense
    values pass on a store of ``rows`` states, and choose the kernel whose scores and dense pass cost least.

    The store is the first ``rows`` of ``sample`` (a real store's states, read in place) when it has that
    many in this dtype and device, all within fp16's range (the packed race copies them); else a synthetic
    one, allocated for the calibration (``rows`` x ``dim`` 16-bit numbers beside the real store).
    ``timer(run)`` -> seconds of one call of a candidate (default: the clock around it; tests inject one).
    ``compiled_sums``: the gather, the dense values pass and the top-k are timed as a store of COMPILED_MIN_STATES
    or more runs them (compiled, on a CPU where they run), else as a shorter one does (torch)."""
    device = torch.device(device)
    if compiled_sums and device.type == "cpu":
        compiled.ready("top_k", torch.float32)  # the top-k races as a long store runs it
    generator = torch.Generator(device="cpu").manual_seed(0)
    sixteen_bit = dtype != torch.float32
    can_pack = sixteen_bit and device.type == "cpu" and packing.available()
    states = _calibration_states(sample, rows, dim, dtype, device, generator, can_pack)  # [rows, d]
    queries = torch.randn(CALIBRATION_QUERIES, dim, generator=generator).to(device)  # [nq, d] fp32
    plain = {kernel: KernelChoice(kernel, BLOCK_CHOICES[1], False, 0.0, 0.0) for kernel in SCORE_KERNELS}
    score_runs = {f"float32/{block}": (lambda b=block: float32_scores(states, queries, b)) for block in BLOCK_CHOICES}
    if sixteen_bit:
        score_runs["native"] = lambda: native_scores(states, queries)
    if can_pack and force in (None, "packed"):
        packed_scores = PackedStates(states, values=False)  # freed after the race: it is as large as the store
        score_runs["packed"] = lambda: packed_scores.scores(queries)
    timings = _race(score_runs, device, timer)
    score_runs.clear()
    packed_scores = None
    block = min(BLOCK_CHOICES, key=lambda b: timings[f"float32/{b}"])
    plain["float32"] = KernelChoice("float32", block, False, 0.0, 0.0)
    quarter = states[: rows // 4]
    quarter_packed = PackedStates(quarter) if can_pack and force in (None, "packed") else None
    kernel = fallback = "float32"
    verdict = ""
    if sixteen_bit and force == "native":
        kernel = fallback = "native"
    elif can_pack and force == "packed":
        kernel = "packed"
    elif sixteen_bit and force is None:
        # on a quarter of the rows (times four): an emulated 16-bit dense pass can take a second at full size;
        # the native one at each block size (its speed depends on it as much as on the kernel: 2x on a Zen 4),
        # the float32 one at the block its scores were fastest with
        # the native kernel at one block size first: where it is emulated (no 16-bit units) it loses by far, and
        # its other block sizes are not timed at all
        dense_runs = {"dense/native@2048": lambda: dense_attention(quarter, queries, KernelChoice("native", 2_048, False,
                                                                                             0.0, 0.0)),
                      "dense/float32": lambda: dense_attention(quarter, queries, plain["float32"])}
        if quarter_packed is not None:
            dense_runs["dense/packed"] = lambda: dense_attention(quarter, queries, plain["packed"], packed=quarter_packed)
        dense = _race(dense_runs, device, timer)
        if dense["dense/native@2048"] <= measurements.GIVE_UP_FACTOR * min(dense.values()):
            dense.update(_race({f"dense/native@{b}": (lambda c=KernelChoice("native", b, False, 0.0, 0.0):
                                                      dense_attention(quarter, queries, c))
                                for b in BLOCK_CHOICES if b != 2_048}, device, timer))
        dense = {name: 4 * seconds for name, seconds in dense.items()}
        dense["dense/native"] = min(seconds for name, seconds in dense.items() if name.startswith("dense/native@"))
        timings.update(dense)
        cost = {name: timings[score] + dense[f"dense/{name}"]
                for name, score in (("native", "native"), ("float32", f"float32/{block}"), ("packed", "packed"))
                if f"dense/{name}" in dense}
        kernel, fallback = choose_scores(cost)
        if "packed" in cost:
            verdict = (f"; packed {cost[fallback] / cost['packed']:.2f}x the best unpacked ({fallback}), "
                       f"{'at least' if kernel == 'packed' else 'under'} the {PACKED_MIN_SPEEDUP}x its copies need")
    if kernel != "packed":
        quarter_packed = None  # not needed for the costs below
    tokens_major = False
    if "native" in (kernel, fallback):
        k = max(1, rows // 128)  # a long row for k: the block-maxima pre-selection takes part
        layouts = _race({f"select/{'tokens' if layout else 'queries'}-major":
                         (lambda c=KernelChoice("native", block, layout, 0.0, 0.0): select(states, queries, k, c))
                         for layout in (False, True)}, device, timer)
        tokens_major = layouts["select/tokens-major"] < layouts["select/queries-major"]
        timings.update(layouts)
    # the one-pass dense attention's block: larger blocks pay fewer steps (a few small ops each), smaller ones
    # stay in cache; measured for the kernel chosen (for the packed kernel: for the float32 one that serves a
    # store that is not packed), on the quarter of the rows (larger than the caches too)
    blocked = fallback if kernel == "packed" else kernel
    blocks = _race({f"dense/{blocked}/{candidate}":
                    (lambda c=KernelChoice(blocked, block, tokens_major, 0.0, 0.0, dense_block_rows=candidate):
                     dense_attention(quarter, queries, c)) for candidate in BLOCK_CHOICES}, device, timer)
    timings.update(blocks)
    dense_block = min(BLOCK_CHOICES, key=lambda b: blocks[f"dense/{blocked}/{b}"])
    choice = KernelChoice(kernel, block, tokens_major, 0.0, 0.0, dense_block_rows=dense_block, fallback=fallback)
    # the compiled sums run where the chosen kernel widens: compiled (or loaded) before they are timed
    compiled_sums = compiled_sums and choice.widens and _compiled_sums(states, "weighted_sum", True) and \
        _compiled_sums(states, "dense_sum", True)
    ids = torch.randint(0, rows, (CALIBRATION_QUERIES, CALIBRATION_GATHER_ROWS // CALIBRATION_QUERIES),
                        generator=generator).to(device)
    weights = torch.rand(ids.shape, generator=generator).to(device)
    if kernel == "packed":  # its dense values pass reads the packed copy: timed on the quarter, times four
        dense_values_run, dense_rows = (lambda: quarter_packed.values(weights.new_zeros(CALIBRATION_QUERIES, rows // 4)),
                                        rows // 4)
    else:
        dense_values_run, dense_rows = (lambda: dense_values(states, weights.new_zeros(CALIBRATION_QUERIES, rows),
                                                             choice, compiled_sums), rows)
    gathers = {"gather": lambda: gathered_attention(states, ids, weights, choice.widens, fused=False,
                                                    compiled_sums=compiled_sums)}
    # the native kernel's gather: fused (embedding_bag) or gathered rows and a bmm; measured also where the packed
    # kernel is chosen and the native one serves the stores it does not pack (a key store's values among them:
    # unfused there, a greedy step's 12 x 1,024 values took 0.24 ms against 0.04 on an EPYC Zen 5)
    unfused = "gather" if not choice.widens else "gather/16-bit"
    if not choice.unpacked().widens:
        gathers["gather/fused"] = lambda: gathered_attention(states, ids, weights, False, fused=True)
        if choice.widens:
            gathers[unfused] = lambda: gathered_attention(states, ids, weights, False, fused=False)
    costs = _race(dict(gathers, **{"dense values": dense_values_run}), device, timer)
    timings.update({name: costs[name] for name in gathers})
    fused_gather = "gather/fused" in costs and costs["gather/fused"] < costs[unfused]
    if not choice.widens:  # the chosen kernel's own gather is the native one
        costs["gather"] = min(costs["gather"], costs.get("gather/fused", float("inf")))
    # the chosen (unpacked) kernel's top-k, what a live step's costs are checked against (measurements.LiveCheck)
    timings["select"] = _race({"select": lambda: select(states, queries, min(LIVE_K, rows // 16), choice.unpacked())},
                              device, timer)["select"]
    measured = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in timings.items()
                         if seconds < float("inf"))
    unavailable = " (packed unavailable here)" if force == "packed" and not can_pack else ""
    release_scratch()  # the races' widened blocks (up to 24 MiB): the chosen kernel makes its own again
    sums = "compiled" if compiled_sums else "torch" if choice.widens else "16-bit"
    reason = (f"{kernel} scores{' (forced)' if force else ''}{unavailable}, blocks of {block:,} rows (dense attention "
              f"{dense_block:,}), {sums} sums; measured on {rows:,} x {dim} {str(dtype)[6:]} for "
              f"{CALIBRATION_QUERIES} queries: "
              f"{measured}{verdict}")
    return KernelChoice(
        scores=kernel, block_rows=block, tokens_major=tokens_major,
        gather_row_cost=costs["gather"] / ids.numel(), dense_row_cost=costs["dense values"] / dense_rows,
        reason=reason, dense_block_rows=dense_block, fallback=fallback, fused_gather=fused_gather,
        select_row_cost=timings["select"] / rows,
    )


def _calibration_states(sample: torch.Tensor | None, rows: int, dim: int, dtype: torch.dtype, device: torch.device,
                        generator: torch.Generator, can_pack: bool) -> torch.Tensor:
    """[rows, dim] states to time on: ``sample``'s first rows where they serve (within fp16's range where the
    packed kernel races, ``can_pack``), else random ones."""
    usable = (sample is not None and sample.dim() == 2 and sample.shape[0] >= rows and sample.shape[1] == dim
              and sample.dtype == dtype and sample.device == device)
    if usable and (not can_pack or packing.packable(sample[:rows])):
        return sample[:rows]
    states = torch.empty(rows, dim, dtype=dtype, device=device)  # filled in parts: a float32 one
    for start in range(0, rows, CALIBRATION_FILL_ROWS):  # at once would be twice the 16-bit store's bytes
        part = states[start:start + CALIBRATION_FILL_ROWS]
        part.copy_(torch.randn(part.shape, generator=generator))
    return states


def choose_scores(cost: dict[str, float]) -> tuple[str, str]:
    """(kernel, fallback) from the measured seconds of each kernel's scores plus dense pass (``cost``: native,
    float32 and, where it can run, packed): the fastest unpacked kernel, or packed when it is at least
    PACKED_MIN_SPEEDUP times faster than that one; the fallback is the fastest unpacked kernel either way."""
    fallback = min((name for name in cost if name != "packed"), key=cost.get)
    if "packed" in cost and cost[fallback] >= PACKED_MIN_SPEEDUP * cost["packed"]:
        return "packed", fallback
    return fallback, fallback


def _race(runs: dict, device: torch.device, timer=None) -> dict[str, float]:
    """Best time of each run, measured in turns (unlimisum/measurements.py ``race``): a run whose first call
    already took four times the leader's best is not called again (its slow time stays: it is not chosen).
    ``timer(run)``: seconds of one call (tests inject one); default the clock around it."""
    return measurements.race(runs, timer=timer or (lambda run: _timed(run, device)))


def _timed(run, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


# --- reused buffers ---------------------------------------------------------------------------

_SCRATCH = threading.local()


def _scratch(name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A [rows, cols] buffer kept per thread and reused by every call: a fresh tensor of a few MB would be
    page-faulted in on every block of every step, which costs more than the matmul it feeds.

    Always an ordinary tensor, also when first asked for under ``torch.inference_mode()`` (the Summarizer
    runs there): an inference tensor could not be written to by a later call outside it (under no_grad)."""
    buffers = getattr(_SCRATCH, "buffers", None)
    if buffers is None:
        buffers = _SCRATCH.buffers = {}
    key = (name, dtype, device)
    buffer = buffers.get(key)
    if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != cols:
        with torch.inference_mode(False):
            buffer = buffers[key] = torch.empty(max(rows, 0 if buffer is None else buffer.shape[0]), cols,
                                                dtype=dtype, device=device)
    return buffer[:rows]


def release_scratch() -> None:
    """Free this thread's reused buffers (a dense step's weights of a long book can hold up to MAX_SCORE_BYTES);
    the next call that needs one makes it again."""
    _SCRATCH.buffers = {}


def _widened(rows: torch.Tensor, name: str = "widened") -> torch.Tensor:
    """[b, d] fp32 copy of 16-bit rows in a reused buffer (fp32 rows are returned as they are)."""
    if rows.dtype == torch.float32:
        return rows
    return _scratch(name, rows.shape[0], rows.shape[1], torch.float32, rows.device).copy_(rows)


# --- the kernels ------------------------------------------------------------------------------


def native_scores(states: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[nq, N] scores in the storage dtype from one matmul in it (query rounded to it; fp32 accumulation)."""
    return queries.to(states.dtype) @ states.T


def native_scores_tokens_major(states: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[N, nq] scores in the storage dtype: ``states @ queries^T``, the faster orientation on some CPUs."""
    return states @ queries.to(states.dtype).T


def float32_scores(states: torch.Tensor, queries: torch.Tensor, block_rows: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """[nq, N] exact fp32 scores: blocks of the store widened to fp32, each multiplied once."""
    n = states.shape[0]
    if out is None:
        out = queries.new_empty(queries.shape[0], n)  # [nq, N]
    for start in range(0, n, block_rows):
        block = _widened(states[start:start + block_rows])  # [b, d] fp32, stays in cache
        torch.mm(queries, block.T, out=out[:, start:start + block.shape[0]])
    return out


def scores(states: torch.Tensor, queries: torch.Tensor, choice: KernelChoice) -> torch.Tensor:
    """[nq, N] scores by the chosen kernel: in the storage dtype (native) or fp32 (float32 kernel and stores)."""
    if choice.scores == "native" and states.dtype != torch.float32:
        return native_scores(states, queries)
    return float32_scores(states, queries, choice.block_rows)


def gathered_attention(states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, widen: bool,
                       fused: bool = True, compiled_sums: bool | None = None) -> torch.Tensor:
    """sum_j weights[i, j] * states[ids[i, j]]: ids, weights [nq, k] -> [nq, d] fp32.

    ``widen`` sums in fp32 (float32 kernel and the approximate stores): on a CPU, for a store of at least
    COMPILED_MIN_STATES (``compiled_sums`` None) or where the caller says so (True: its own kernels run compiled,
    however short the store), by the compiled kernel (compiled.weighted_sum: each chosen state read once and
    widened in registers), elsewhere as below;
    the same where the queries read each state ``compiled.BLOCKED_SUMS_MIN_READS`` times or more on average (a
    reading's many positions: its blocked sums measured 1.2-1.5x faster than ``embedding_bag`` there, natively and
    as AVX2 on a Zen 4); otherwise the 16-bit states are summed in their dtype with fp32 accumulation: ``fused``, in one
    ``embedding_bag`` call (fbgemm's kernel on CPUs: no gathered copy; the sums rounded to the storage dtype,
    as a 16-bit bmm rounds them), else gathering at most GATHER_ROWS states at a time into reused buffers
    (whole queries while they fit, slices of one query's k beyond), one bmm each.
    """
    nq, k = ids.shape
    d = states.shape[1]
    if k == 0:
        return torch.zeros(nq, d, dtype=torch.float32, device=states.device)
    many_reads = (ids.numel() >= compiled.BLOCKED_SUMS_MIN_READS * states.shape[0]
                  and _compiled_sums(states, "weighted_sum", compiled_sums))  # and they run compiled here
    if fused and not widen and not many_reads:
        # [nq, k] ids are nq bags of k rows; weights in the storage dtype, as the bmm below rounds them
        return F.embedding_bag(ids, states, mode="sum", per_sample_weights=weights.to(states.dtype)).float()
    widen = widen or states.dtype == torch.float32
    if many_reads or widen and _compiled_sums(states, "weighted_sum", compiled_sums):  # one read of each, no copy
        return compiled.weighted_sum(states, ids, weights)
    out = torch.zeros(nq, d, dtype=torch.float32, device=states.device)
    queries_per_step = max(1, GATHER_ROWS // k)
    k_step = min(k, GATHER_ROWS)
    for first in range(0, nq, queries_per_step):
        part = slice(first, first + queries_per_step)
        for column in range(0, k, k_step):
            columns = slice(column, column + k_step)
            chosen = ids[part, columns]  # [r, c]
            r, c = chosen.shape
            rows = _scratch("gathered", r * c, d, states.dtype, states.device)
            torch.index_select(states, 0, chosen.reshape(-1), out=rows)
            if widen:
                summed = torch.bmm(weights[part, columns].float().unsqueeze(1), _widened(rows).view(r, c, d))
            else:
                summed = torch.bmm(weights[part, columns].to(states.dtype).unsqueeze(1), rows.view(r, c, d)).float()
            out[part] += summed.squeeze(1)  # [r, d]
    return out


def topk_block(n: int, k: int) -> int | None:
    """Columns per block for the top-k of rows of n: about sqrt(n / k), a power of two, so that the block maxima
    (n / block) and the candidates (k * block) are both few; None: torch.topk over the whole row."""
    block = 2 ** round(math.log2(max(n, 1) / k) / 2)
    return block if block >= TOPK_MIN_BLOCK and n >= 4 * k * block else None


def top_k(logits: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k, dim=1, sorted=ordered)``: [nq, k] values and columns, sorted descending when ``ordered``
    (sorting them costs more than finding them on CPUs), faster for long rows: unordered on a CPU, the compiled
    top-k (``_compiled_top_k``: no sort at all); else the top-k elements lie in the k blocks (of ``topk_block``
    columns) with the highest maxima (any other block has k larger elements above its max)."""
    nq, n = logits.shape
    if not ordered and _compiled_top_k(logits, k):
        return compiled.top_k(logits, k)
    block = topk_block(n, k)
    if block is None:
        return logits.topk(k, dim=1, sorted=ordered)
    usable = n - n % block
    maxima = logits[:, :usable].view(nq, -1, block).amax(dim=2)  # [nq, n / block]
    _, blocks = maxima.topk(k, dim=1, sorted=False)  # [nq, k]
    return _top_k_of_blocks(logits, blocks, block, k, usable, ordered)


def _compiled_top_k(logits: torch.Tensor, k: int) -> bool:
    """Whether ``top_k`` runs compiled (compiled.top_k): fp32 rows on a CPU, of COMPILED_TOP_K_MIN_STATES or more,
    once the kernel is ready in this process (``compiled_kernels_for`` a store of that many tokens names it; a
    shorter store's run never compiles it)."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] >= COMPILED_TOP_K_MIN_STATES and 0 < k <= logits.shape[1]
            and compiled.is_ready("top_k"))


def top_k_tokens_major(logits: torch.Tensor, k: int, ordered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` of ``logits.T`` for scores laid out [N, nq] (as ``states @ queries.T`` gives them, the
    fast matmul orientation on some CPUs), without transposing all of them: [nq, k] values and ids."""
    n, nq = logits.shape
    block = topk_block(n, k)
    if block is None:
        values, ids = logits.topk(k, dim=0, sorted=ordered)  # [k, nq]
        return values.T, ids.T
    usable = n - n % block
    maxima = logits[:usable].view(-1, block, nq).amax(dim=1).T.contiguous()  # [nq, n / block]
    _, blocks = maxima.topk(k, dim=1, sorted=False)  # [nq, k]
    return _top_k_of_blocks(logits.T, blocks, block, k, usable, ordered)


def _top_k_of_blocks(logits: torch.Tensor, blocks: torch.Tensor, block: int, k: int, usable: int, ordered: bool):
    """The top-k of ``logits`` [nq, n] among the columns of ``blocks`` [nq, k] (of ``block`` columns each) and the
    last, partial block."""
    nq, n = logits.shape
    columns = (blocks.unsqueeze(2) * block + torch.arange(block, device=logits.device)).view(nq, -1)
    if usable < n:  # the last, partial block always takes part
        columns = torch.cat([columns, torch.arange(usable, n, device=logits.device).expand(nq, -1)], 1)
    values, order = logits.gather(1, columns).topk(k, dim=1, sorted=ordered)
    return values, columns.gather(1, order)


def _compiled_sums(states: torch.Tensor, kernel: str, compiled_sums: bool | None = None) -> bool:
    """Whether the fp32 sums over ``states`` [N, d] run by the compiled ``kernel`` (weighted_sum or dense_sum):
    on a CPU where it runs, for a store of COMPILED_MIN_STATES or more (``compiled_sums`` None), or as the caller
    says (True: its own kernels run compiled, however short the store; False: never)."""
    wanted = states.shape[0] >= COMPILED_MIN_STATES if compiled_sums is None else compiled_sums
    return wanted and compiled.usable_states(states, kernel)


def dense_values(states: torch.Tensor, weights: torch.Tensor, choice: KernelChoice,
                 compiled_sums: bool | None = None) -> torch.Tensor:
    """weights [nq, N] @ states [N, d] -> [nq, d] fp32: the second dense pass (fp32 sums on a CPU, from
    COMPILED_MIN_STATES states or as ``compiled_sums`` says (``_compiled_sums``): the compiled one of
    unlimisum/search/compiled.py, widened in registers)."""
    if not choice.widens and states.dtype != torch.float32:
        return (weights.to(states.dtype) @ states).float()
    if _compiled_sums(states, "dense_sum", compiled_sums):
        return compiled.dense_sum(states, weights)
    out = weights.new_zeros(weights.shape[0], states.shape[1])  # [nq, d]
    for start in range(0, states.shape[0], choice.block_rows):
        block = _widened(states[start:start + choice.block_rows])  # [b, d]
        out.addmm_(weights[:, start:start + block.shape[0]], block)
    return out


def dense_attention(states: torch.Tensor, queries: torch.Tensor, choice: KernelChoice,
                    coverage: torch.Tensor | None = None, packed: PackedStates | None = None) -> torch.Tensor:
    """Softmax over every stored state times the states, in one pass: each block of the store (or each slice
    of its ``packed`` copies) is scored and summed while it is in cache, under running maxima and sums (the
    online softmax).

    queries [nq, d] fp32 -> [nq, d] fp32. ``coverage`` [N] gets every query's weights added; it reuses the
    scores when they fit in MAX_SCORE_BYTES, else a second scoring pass computes them.
    """
    n, nq = states.shape[0], queries.shape[0]
    if n == 0:  # nothing to attend to: no weights, a zero sum (not 0/0)
        return queries.new_zeros(nq, states.shape[1])
    if packed is not None:
        parts = ((start, logits, lambda weights, i=index: packed.slice_values(i, weights))
                 for index, (start, logits) in enumerate(packed.slice_scores(queries)))
        return _online_softmax(parts, queries, states.shape[1], n, coverage, lambda: packed.slice_scores(queries))
    block = choice.dense_block_rows or choice.block_rows
    rescored = lambda: ((start, scores(states[start:start + block], queries, choice).float())  # noqa: E731
                        for start in range(0, n, block))
    return _online_softmax(_dense_blocks(states, queries, choice, block), queries, states.shape[1], n, coverage,
                           rescored)


def _dense_blocks(states: torch.Tensor, queries: torch.Tensor, choice: KernelChoice, block: int):
    """(start, logits [nq, b] fp32, weighted sum of the block's rows) for each block of the store, scored by the
    native kernel in the storage dtype or from rows widened into the reused buffer."""
    native = not choice.widens and states.dtype != torch.float32
    q16 = queries.to(states.dtype) if native else None
    for start in range(0, states.shape[0], block):
        rows = states[start:start + block]  # [b, d]
        if native:
            yield start, (q16 @ rows.T).float(), lambda weights, r=rows: (weights.to(r.dtype) @ r).float()
        else:
            rows = _widened(rows)  # valid until the next block is widened: the sum is taken before that
            yield start, queries @ rows.T, lambda weights, r=rows: weights @ r


def _online_softmax(parts, queries: torch.Tensor, dim: int, n: int, coverage: torch.Tensor | None,
                    rescored) -> torch.Tensor:
    """sum_i softmax(logits)_i rows_i over ``parts`` (start, logits [nq, b], weighted_sum(weights) -> [nq, d]),
    kept as running maxima and sums; coverage from the logits kept, or from ``rescored()`` (start, logits)."""
    nq = queries.shape[0]
    kept = [] if coverage is not None and nq * n * 4 <= MAX_SCORE_BYTES else None
    peak = queries.new_full((nq, 1), float("-inf"))  # running maximum score per query
    total = queries.new_zeros(nq, 1)  # running sum of exp(score - peak)
    out = queries.new_zeros(nq, dim)  # running sum of exp(score - peak) * state
    for start, logits, weighted_sum in parts:
        if kept is not None:
            kept.append((start, logits.clone()))
        new_peak = torch.maximum(peak, logits.amax(dim=1, keepdim=True))
        rescale = torch.exp(peak - new_peak)  # [nq, 1]; 0 on the first block
        weights = torch.exp(logits.sub_(new_peak).clamp_(min=EXP_FLOOR))  # [nq, b]
        total.mul_(rescale).add_(weights.sum(dim=1, keepdim=True))
        out.mul_(rescale).add_(weighted_sum(weights))
        peak = new_peak
    out.div_(total)
    if coverage is not None:
        for start, logits in kept if kept is not None else rescored():
            coverage[start:start + logits.shape[1]] += (torch.exp((logits - peak).clamp_(min=EXP_FLOOR))
                                                        .div_(total).sum(dim=0))
    return out


def attend(states: torch.Tensor, queries: torch.Tensor, k: int, choice: KernelChoice,
           coverage: torch.Tensor | None = None, packed: PackedStates | None = None) -> torch.Tensor:
    """Exact top-k retrieval attention: queries [nq, d] fp32 (scaling folded in) -> [nq, d] fp32.

    Per query: softmax over its k highest scores, times those states. k >= N is dense attention.
    ``coverage`` [N] fp32, when given, gets every query's attention weights added to it. ``packed``: the
    store's packed copies, which the packed kernel reads (without them it runs the float32 kernel).
    """
    n, nq = states.shape[0], queries.shape[0]
    queries = queries.to(states.device, torch.float32)
    check = _LIVE.get(choice)
    if packed is None or choice.scores != "packed":
        choice, packed = choice.unpacked(), None
    if k >= n:
        return dense_attention(states, queries, choice, coverage, packed)
    if nq * n * 4 <= MAX_SCORE_BYTES and choice.dense_is_cheaper(nq, k, n):
        logits = scores(states, queries, choice) if packed is None else packed.scores(queries)  # [nq, N]
        top, ids = top_k(logits, k, ordered=False)  # exactly the k ids the gather path would take
        # the masked softmax over all N columns, as the softmax over the k kept ones put in place
        kept = torch.softmax(top, dim=1, dtype=torch.float32)  # [nq, k]
        weights = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, kept)
        if coverage is not None:
            coverage.index_add_(0, ids.reshape(-1), kept.reshape(-1))
        return dense_values(states, weights, choice) if packed is None else packed.values(weights)
    started = time.perf_counter()
    logits, ids = select(states, queries, k, choice, packed)
    if (check is not None and not check.done and packed is None and nq == CALIBRATION_QUERIES and k <= LIVE_K
            and n >= CALIBRATION_ROWS):  # a step as the measurement timed it: is the kept choice still right?
        check.observe(time.perf_counter() - started, n * choice.select_row_cost)
    weights = torch.softmax(logits, dim=1, dtype=torch.float32)  # [nq, k]
    if coverage is not None:
        coverage.index_add_(0, ids.reshape(-1), weights.reshape(-1))
    return gathered_attention(states, ids, weights, choice.widens, choice.fused_gather)


def select(states: torch.Tensor, queries: torch.Tensor, k: int, choice: KernelChoice,
           packed: PackedStates | None = None, exclude: torch.Tensor | None = None):
    """(scores, ids) [nq, k] of each query's top-k by the kernel's scores, in no particular order.

    One pass over the store; beyond MAX_SCORE_BYTES of scores it goes in slices with a running top-k
    (with ``packed`` and the packed kernel: in the packed copy's slices, merged likewise). ``exclude`` [N] bool:
    states no query may select (their score is -inf; with fewer than k others, some of the k have -inf).
    """
    n = states.shape[0]
    queries = queries.to(states.device, torch.float32)
    if packed is None or choice.scores != "packed":
        choice, packed = choice.unpacked(), None
    tokens_major = choice.tokens_major and choice.scores == "native" and states.dtype != torch.float32
    if packed is not None:  # all scores at once while they fit: one top-k over the whole row is cheapest
        whole = queries.shape[0] * n * 4 <= MAX_SCORE_BYTES
        parts = [(0, packed.scores(queries))] if whole else packed.slice_scores(queries)
    else:
        step = max(k, MAX_SCORE_BYTES // (queries.shape[0] * 4))
        parts = ((start, None) for start in range(0, n, step))
    best_scores = best_ids = None
    for start, part in parts:
        if part is not None:
            part = _excluded(part, exclude, start)
            top, ids = top_k(part, min(k, part.shape[1]), ordered=False)
        elif tokens_major:
            block = states[start:start + step]
            logits = native_scores_tokens_major(block, queries)  # [b, nq]
            if exclude is not None:
                logits = logits.masked_fill(exclude[start:start + block.shape[0], None], float("-inf"))
            top, ids = top_k_tokens_major(logits, min(k, block.shape[0]), ordered=False)
        else:
            part = _excluded(scores(states[start:start + step], queries, choice), exclude, start)  # [nq, <=step]
            top, ids = top_k(part, min(k, part.shape[1]), ordered=False)
        ids += start
        if best_scores is not None:
            top, ids = torch.cat([best_scores, top], 1), torch.cat([best_ids, ids], 1)
            top, order = top.topk(min(k, top.shape[1]), dim=1, sorted=False)
            ids = ids.gather(1, order)
        best_scores, best_ids = top, ids
    return best_scores, best_ids


def _excluded(logits: torch.Tensor, exclude: torch.Tensor | None, start: int) -> torch.Tensor:
    """``logits`` [nq, b] (columns start..start+b of the store) with the excluded columns at -inf."""
    if exclude is None:
        return logits
    return logits.masked_fill(exclude[start:start + logits.shape[1]], float("-inf"))


def retrieve(states: torch.Tensor, queries: torch.Tensor, k: int, choice: KernelChoice,
             packed: PackedStates | None = None, exclude: torch.Tensor | None = None):
    """``attend`` that also returns what it attended to: (ids [nq, k'], weights [nq, k'] fp32, out [nq, d] fp32),
    k' = min(k, N); the weights are the softmax of the kernel's own scores (as in ``attend``: no rescoring).

    For the evidence pass, whose queries are every position of a summary at once (hundreds, not a decoder step's
    dozen): the scores are one matmul per block of the store (compute-bound, not bandwidth-bound), and the
    weighted sum gathers the winners or, where that costs more, runs one dense pass. ``exclude`` [N] bool: states
    hidden from every query (the ablation pass hides a sentence's passages).
    """
    n = states.shape[0]
    k = min(k, n)
    queries = queries.to(states.device, torch.float32)
    if packed is None or choice.scores != "packed":
        choice, packed = choice.unpacked(), None
    if k == n and queries.shape[0] * n * 4 <= MAX_SCORE_BYTES:  # every state: no selection, one softmax
        logits = scores(states, queries, choice) if packed is None else packed.scores(queries)  # [nq, N]
        weights = torch.softmax(_excluded(logits.float(), exclude, 0), dim=1).nan_to_num_(0.0)
        out = dense_values(states, weights, choice) if packed is None else packed.values(weights)
        return torch.arange(n, device=states.device).expand(queries.shape[0], n), weights, out
    logits, ids = select(states, queries, k, choice, packed, exclude)  # [nq, k]
    weights = torch.softmax(logits.float(), dim=1).nan_to_num_(0.0)  # all -inf (all hidden): attend to nothing
    if queries.shape[0] * n * 4 <= MAX_SCORE_BYTES and _dense_values_cheaper(choice, queries.shape[0], k, n,
                                                                              states.shape[1]):
        dense = torch.zeros(queries.shape[0], n, dtype=torch.float32, device=states.device).scatter_(1, ids, weights)
        out = dense_values(states, dense, choice) if packed is None else packed.values(dense)
    else:
        out = gathered_attention(states, ids, weights, choice.widens, choice.fused_gather)
    return ids, weights, out


def _dense_values_cheaper(choice: KernelChoice, n_queries: int, k: int, n_tokens: int, dim: int) -> bool:
    """A dense values pass over all N states costs less than gathering nq*k: for a step's dozen queries the
    calibrated costs say (a bandwidth-bound pass); for hundreds of queries the dense pass is a matmul of
    nq x N x d multiply-adds, which grows with nq while the calibration timed CALIBRATION_QUERIES."""
    scale = max(1.0, n_queries / CALIBRATION_QUERIES)
    return n_queries * k * choice.gather_row_cost > n_tokens * choice.dense_row_cost * scale
