"""Exact retrieval attention over a key store per decoder layer: each head scores its own keys.

One decoder layer's step for one document: ``queries`` [H, nq, dh] (per head: its beams, steps and rows, the
model's scaling folded in), that layer's ``keys`` [H, N, dh] (unlimisum/search/keys.py) and the shared
``states`` [N, d]:

- scores per head, [H, nq, N] = queries @ keys^T: one pass over the keys, one multiply-add per number read for
  each query of a head. ``native``: a batched matmul in the storage dtype (the query rounded to it, fp32
  accumulation, the scores rounded to it: 2^-8 relative in bf16), for CPUs with 16-bit units and GPUs;
  ``float32``: blocks of every head's rows widened to fp32 into a reused buffer that stays in cache, then one
  batched matmul per block (exact fp32 scores of the stored keys), for CPUs without them.
  ``compiled``: numba's kernels of unlimisum/search/compiled.py (CPU, bfloat16 or fp32 keys), every
  query of a head against each row while it is in cache, the keys widened in registers (the float32 kernel's
  numbers);
- top-k per head (``kernels.top_k`` over the [H * nq, N] rows), then the softmax of those scores; or, on a CPU
  and for stores long enough that it is measured faster, both at once by a scan (``scan_select``): the compiled
  one (compiled.select: scores and a running top-k in one pass over each head's keys, all its queries at once)
  or faiss' flat scalar-quantizer scan (``faiss_select``, a pass per query), no [nq, N] scores in memory, the
  heads spread over the threads;
- the weighted sum over the shared states, as the shared store does it (``kernels.gathered_attention``, or a
  dense values pass where measured cheaper), in fp32 by compiled.weighted_sum where the scores run compiled;
  where the key store keeps the layer's values, over each head's chosen values instead (``gathered_values``:
  d_head numbers a token rather than d, the output already projected by W_v; ``value_sums_for`` measures what
  that saves against what projecting them costs, for the plan);
  k >= N: every score's softmax times the states (on a CPU, one compiled pass over them; elsewhere each block
  scored and summed under an online softmax), which equals full cross-attention; where the key store keeps the
  layer's values (``values`` [H, N, dh], keys.py), every score's softmax times each head's own values instead
  (``head_dense_values``): H times fewer multiply-adds, the output already projected by W_v.

Which kernel and block size run, which scan takes over and from how many tokens, and whether the key store is
faster than the shared store at all, are measured on the machine that runs (``calibrate_heads``, once per
machine through ``kernel_for``, kept in the user's cache folder: unlimisum/measurements.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from unlimisum import measurements
from unlimisum.search import compiled, kernels
from unlimisum.search import packed as packing

HEAD_KERNELS = ("native", "float32", "compiled")
SCANNERS = ("compiled", "faiss")  # the scans that select each head's top-k in one pass (CPU)
BLOCK_CHOICES = (256, 1_024, 4_096)  # rows of every head widened at once (12 x 1,024 x 64 fp32 = 3 MiB)
MEASURE_ROWS = 16_384  # synthetic rows of the measurement: both stores at least 2 MiB at d=64, out of the L2
# a scan against the best head kernel again at this many rows (its top-k's cost fades with length, a kernel's
# scores do not): where it wins only here, it takes over from the length where the two meet
LONG_MEASURE_ROWS = 131_072
# ... but only a scan at most this much slower at MEASURE_ROWS: from 16k to 131k rows the scans gained 1.6x on the
# head kernel (EPYC Zen 2, faiss, 1 and 32 queries per head: 1.25x as slow to 0.80x, 2.93x to 1.78x), so one
# slower by more would not meet it there (that race took 2 s of a first run's 7 s of measuring)
LONG_RACE_MAX_RATIO = 2.5
# what the measurements of this module are called in the user's cache folder: a new version measures again
MEASUREMENT_VERSION = 7  # 7: 8-63 queries summed as this machine measured faster (compiled.tiled_from); 6: from 8
# queries the bfloat16 keys scored in the lanes; 5: the top-k compiled
MEASURE_REPEATS = 3
# a top-k of each query's scores is selected from at least this many rows per measured k (k = rows / 16)
MEASURE_ROWS_PER_K = 16
# a dense step's scores scored, softmaxed and summed at once (``dense_blocks``): in the L3 of most CPUs, and
# below glibc's largest mmap threshold (32 MiB), above which every fresh tensor is page-faulted in again
DENSE_SCORE_BYTES = 8 * 2**20
VALUE_BLOCK_ROWS = 16_384  # rows of every head's values widened at once where the compiled sum cannot read them


@dataclass(frozen=True)
class HeadKernelChoice:
    """How the per-head scores run on one device for one dtype and shape (see ``calibrate_heads``)."""

    scores: str  # "native" | "float32" | "compiled"
    block_rows: int  # rows of every head per widened block (float32) or per block of the dense pass
    speedup: float = 1.0  # the shared store's scores and top-k time over the key store's, measured
    reason: str = ""  # what was measured, for `unlimisum info` and the benchmarks
    scanner: str | None = None  # "compiled" | "faiss": the scan that selects each head's top-k (CPU); None: none
    scan_min_rows: int | None = None  # ... from this many keys per head on
    queries_per_head: int = 1  # as measured: the faiss scan serves at most this many (it makes a pass per query);
    # the compiled one any number (each block of keys meets every query in cache: for a reading's 16-64 queries
    # per head 2-3x faster than the kernels' scores and top-k, measured at 16k and 300k keys)
    kernel_row_seconds: float = 0.0  # the head kernel's top-k, seconds per key of a head, as measured
    scan_row_seconds: float = 0.0  # ... the scan's, where one was chosen (at the length it won from)

    def selects_with_scan(self, keys: torch.Tensor, queries: torch.Tensor) -> bool:
        """Whether ``head_select`` searches ``keys`` [H, n, dh] for ``queries`` [H, nq, dh] with the scan under
        this choice: on a CPU, from ``scan_min_rows`` keys; the faiss scan for no more queries per head than were
        measured, the compiled one for any number."""
        return (self.scanner is not None and self.scan_min_rows is not None and keys.shape[1] >= self.scan_min_rows
                and (self.scanner == "compiled" or queries.shape[1] <= self.queries_per_head)
                and keys.device.type == "cpu" and _scan_usable(self.scanner, keys))


_MEASURED: dict[tuple, HeadKernelChoice] = {}
_LIVE: dict[HeadKernelChoice, measurements.LiveCheck] = {}  # a kept choice's check against the live steps


def kernel_for(device: torch.device | str, dtype: torch.dtype, dim: int, heads: int, head_dim: int, *,
               queries_per_head: int = 1, k: int = 1024, compiled_kernels: bool = False) -> HeadKernelChoice:
    """The measured choice for this device, dtype, shape, queries per head and k: measured once per machine
    (kept in the user's cache folder), then reused. The one seam through which the policy and the kernels read
    the measurement. ``compiled_kernels``: the compiled kernels race too (a store of
    ``kernels.uses_compiled`` length: they are compiled first where they are not yet); else none is compiled."""
    device = torch.device(device)
    forced = kernels.forced_kernel()
    compiled_kernels = compiled_kernels and device.type == "cpu" and dtype in compiled.SCAN_DTYPES
    k = max(1, min(k, MEASURE_ROWS // MEASURE_ROWS_PER_K))  # as measured: a larger k is timed as this one
    key = (str(device), dtype, dim, heads, head_dim, queries_per_head, k, forced, compiled_kernels)
    if key not in _MEASURED:
        name = (f"key store kernel v{MEASUREMENT_VERSION} {kernels.measured_device(device)} "
                f"{str(dtype).removeprefix('torch.')} d={dim} {heads}x{head_dim} heads, {queries_per_head} per head, "
                f"k={k}" + (" compiled" if compiled_kernels else "") + (f" {forced} forced" if forced else ""))
        choice, kept = measurements.remembered_choice(name, lambda: calibrate_heads(
            device, dtype, dim, heads, head_dim, queries_per_head=queries_per_head, k=k,
            compiled_kernels=compiled_kernels), HeadKernelChoice)
        _MEASURED[key] = choice
        if kept is not None:  # a choice another release kept is measured again for this process, and not checked
            _LIVE.setdefault(choice, measurements.LiveCheck(name, kept=kept))
    return _MEASURED[key]


def measure(candidates: dict[str, Callable], time_one: Callable[[str, Callable], float],
            repeats: int = MEASURE_REPEATS) -> dict[str, float]:
    """Best seconds of each candidate, timed in turns (a b c a b c ...) so that a busy moment of a shared machine
    falls on all of them alike (unlimisum/measurements.py ``race``: the first turn also warms up, and a clear loser,
    an emulated 16-bit kernel, is called once)."""
    timed = {name: (lambda name=name, run=run: time_one(name, run)) for name, run in candidates.items()}
    return measurements.race(timed, turns=repeats, timer=lambda time_candidate: time_candidate())


def calibrate_heads(device: torch.device | str, dtype: torch.dtype, dim: int, heads: int, head_dim: int, *,
                    queries_per_head: int = 1, k: int = 1024, rows: int = MEASURE_ROWS,
                    long_rows: int = LONG_MEASURE_ROWS, time_one: Callable[[str, Callable], float] | None = None,
                    shared: kernels.KernelChoice | None = None, compiled_kernels: bool = True) -> HeadKernelChoice:
    """Time the shared store's scores and top-k (its measured kernel, ``shared``: ``kernels.kernel_for`` when
    None) against the key store's, each head kernel and block size and (on a CPU, where they run) the two scans,
    on synthetic stores of ``rows`` tokens; choose the fastest head kernel and the faster scan, and say how much
    faster than the shared store the key store is there (``speedup``: its fastest, a scan included). Where the
    scan loses at ``rows`` (by LONG_RACE_MAX_RATIO at most), it races the fastest head kernel again at
    ``long_rows`` (the keys tiled, each copy scaled apart) and, if it wins there, takes over from the length where
    the two meet (``scan_min_rows``, interpolated in log length).

    ``time_one(name, run)`` -> seconds (default: the wall clock around one run); UNLIMISUM_SCORE_KERNEL=native
    forces the native head kernel, float32 or packed the float32 one (there is no packed head kernel; neither
    uses a scan). ``compiled_kernels``: False leaves the compiled kernels out (nothing is compiled)."""
    device = torch.device(device)
    time_one = time_one or (lambda name, run: kernels._timed(run, device))  # the wall clock around one run
    if compiled_kernels and device.type == "cpu":
        compiled.ready("top_k", torch.float32)  # the head kernels' top-k races as a long store runs it
    generator = torch.Generator(device="cpu").manual_seed(0)
    states = torch.randn(rows, dim, generator=generator).to(device, dtype)  # [rows, d]
    keys = torch.randn(heads, rows, head_dim, generator=generator).to(device, dtype)  # [H, rows, dh]
    head_queries = torch.randn(heads, queries_per_head, head_dim, generator=generator).to(device)  # [H, nq, dh]
    shared_queries = torch.randn(heads * queries_per_head, dim, generator=generator).to(device)  # [H * nq, d]
    k = max(1, min(k, rows // MEASURE_ROWS_PER_K))
    shared = shared or kernels.kernel_for(device, dtype, dim)
    packed = None
    if shared.scores == "packed" and packing.packable(states):
        packed = packing.PackedStates(states, values=False)  # what a packed shared store would read
    forced = kernels.forced_kernel()
    sixteen_bit = dtype != torch.float32
    candidates = {"shared": lambda: kernels.select(states, shared_queries, k, shared, packed)}
    if not sixteen_bit or forced != "native":  # widened blocks (for fp32 keys: plain blocks)
        for block in BLOCK_CHOICES:
            candidates[f"float32/{block}"] = (lambda c=HeadKernelChoice("float32", block):
                                              head_select(keys, head_queries, k, c))
    if sixteen_bit and forced in (None, "native"):
        candidates["native"] = lambda c=HeadKernelChoice("native", BLOCK_CHOICES[1]): head_select(keys, head_queries,
                                                                                                 k, c)
    scanners = [name for name in SCANNERS if forced is None and device.type == "cpu"
                and (compiled_kernels or name != "compiled") and _scan_usable(name, keys)]
    if "compiled" in scanners and compiled.usable(keys, "scores"):
        candidates["compiled"] = lambda c=HeadKernelChoice("compiled", BLOCK_CHOICES[2]): head_select(
            keys, head_queries, k, c)
    for name in scanners:
        candidates[f"{name} scan"] = lambda name=name: scan_select(name, keys, head_queries, k)
    if "compiled" in scanners:  # its own measurement first: not within a candidate's first timed call
        compiled.measure_before_timing(keys, queries_per_head)
    seconds = measure(candidates, time_one)
    fastest = min((name for name in candidates if name != "shared" and not name.endswith(" scan")), key=seconds.get)
    kernel, _, block = fastest.partition("/")
    choice = HeadKernelChoice(kernel, int(block) if block else (BLOCK_CHOICES[2] if kernel == "compiled"
                                                                  else BLOCK_CHOICES[1]))
    del packed, states
    scanner = min(scanners, key=lambda name: seconds[f"{name} scan"]) if scanners else None
    scan_min_rows = None
    if scanner is not None and seconds[f"{scanner} scan"] <= seconds[fastest]:
        scan_min_rows = rows
    elif (scanner is not None and long_rows > rows  # again at long_rows: a scan's fixed costs fade with length
          and seconds[f"{scanner} scan"] <= LONG_RACE_MAX_RATIO * seconds[fastest]):
        copies = -(-long_rows // rows)
        long_keys = keys.repeat(1, copies, 1)  # [H, copies * rows, dh]
        for copy in range(1, copies):  # scaled apart (exact in 16 bits): no copy's scores tie another's
            long_keys[:, copy * rows:(copy + 1) * rows] *= 1 + copy / 64
        seconds.update(measure({f"{fastest} long": lambda: head_select(long_keys, head_queries, k, choice),
                                f"{scanner} scan long": lambda: scan_select(scanner, long_keys, head_queries, k)},
                               time_one))
        del long_keys
        short_ratio = seconds[f"{scanner} scan"] / max(seconds[fastest], 1e-12)  # > 1: the scan loses at rows
        long_ratio = seconds[f"{scanner} scan long"] / max(seconds[f"{fastest} long"], 1e-12)
        if long_ratio < 1:  # it wins at long_rows: from where the two meet, interpolated in log length
            where = math.log(short_ratio) / (math.log(short_ratio) - math.log(long_ratio))  # 0..1 of the way
            scan_min_rows = int(math.ceil(rows * copies ** where / 1024) * 1024)
    scan_row_seconds = 0.0
    if scanner is not None and scan_min_rows == rows:
        scan_row_seconds = seconds[f"{scanner} scan"] / rows
    elif scan_min_rows is not None:
        scan_row_seconds = seconds[f"{scanner} scan long"] / (rows * copies)
    if scan_min_rows is None:
        scanner = None
    key_seconds = min([seconds[fastest]] + [seconds[f"{name} scan"] for name in scanners])
    speedup = seconds["shared"] / max(key_seconds, 1e-12)
    measured = ", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in seconds.items())
    scan = "" if scanner is None else f", the {scanner} scan selecting from {scan_min_rows:,} tokens on"
    reason = (f"per-head {kernel} scores{' (forced)' if forced else ''}"
              f"{f', blocks of {int(block):,} rows' if block else ''}{scan}: {speedup:.2f}x the shared store's "
              f"{shared.scores} scores; measured on {rows:,} tokens x {heads} heads x {head_dim} for "
              f"{queries_per_head} quer{'y' if queries_per_head == 1 else 'ies'} per head, k={k:,}: {measured}")
    kernels.release_scratch()  # the races' buffers: the chosen kernel makes its own again
    return dataclasses.replace(choice, speedup=speedup, reason=reason, scanner=scanner, scan_min_rows=scan_min_rows,
                               queries_per_head=queries_per_head, kernel_row_seconds=seconds[fastest] / rows,
                               scan_row_seconds=scan_row_seconds)


@dataclass(frozen=True)
class ValueSums:
    """What keeping each layer's values beside its keys costs and saves at top-k steps on one device, measured
    (``value_sums_for``): a cost once per token of the input, a saving at every step and support reading, each
    head summing its chosen tokens' dh values instead of their d-wide states."""

    projection_seconds: float  # one token's state projected into one layer's values (every head)
    step_seconds: float  # one layer's sums at one step (its queries per head): the chosen states' less the values'
    reading_seconds: float  # ... at one support reading (its queries per head)
    reason: str = ""  # what was measured, for the logs and the benchmarks


_VALUE_SUMS: dict[tuple, ValueSums] = {}
VALUE_SUMS_VERSION = 1  # what the measurement of ValueSums is called in the user's cache folder


def value_sums_for(device: torch.device | str, dtype: torch.dtype, dim: int, heads: int, head_dim: int, *,
                   queries_per_head: int = 1, reading_queries: int = 32, k: int = 1024,
                   compiled_kernels: bool = False) -> ValueSums:
    """``calibrate_values`` for this device, dtype, shape, queries per head (a step's and a reading's) and k:
    measured once per machine (kept in the user's cache folder), then reused. ``compiled_kernels``: the sums run
    compiled, as a store of ``kernels.uses_compiled`` length runs them (compiled first where they are not yet)."""
    device = torch.device(device)
    compiled_kernels = compiled_kernels and device.type == "cpu" and dtype in compiled.SCAN_DTYPES
    k = max(1, min(k, MEASURE_ROWS // MEASURE_ROWS_PER_K))  # as measured: a larger k is timed as this one
    key = (str(device), dtype, dim, heads, head_dim, queries_per_head, reading_queries, k, compiled_kernels)
    if key not in _VALUE_SUMS:
        name = (f"value sums v{VALUE_SUMS_VERSION} {kernels.measured_device(device)} "
                f"{str(dtype).removeprefix('torch.')} d={dim} {heads}x{head_dim} heads, {queries_per_head} and "
                f"{reading_queries} per head, k={k}" + (" compiled" if compiled_kernels else ""))
        _VALUE_SUMS[key], _ = measurements.remembered_choice(name, lambda: calibrate_values(
            device, dtype, dim, heads, head_dim, queries_per_head=queries_per_head, reading_queries=reading_queries,
            k=k, compiled_kernels=compiled_kernels), ValueSums)
    return _VALUE_SUMS[key]


def calibrate_values(device: torch.device | str, dtype: torch.dtype, dim: int, heads: int, head_dim: int, *,
                     queries_per_head: int = 1, reading_queries: int = 32, k: int = 1024,
                     rows: int = MEASURE_ROWS, compiled_kernels: bool = True,
                     time_one: Callable[[str, Callable], float] | None = None,
                     shared: kernels.KernelChoice | None = None) -> ValueSums:
    """Time, on a synthetic store of ``rows`` tokens: projecting a block of states into one layer's values (fp32
    sums, rounded into the head-major layout, as the keys are built), and the weighted sums of a step's (``queries_per_head``) and a reading's
    (``reading_queries``) k chosen tokens per head, over the d-wide states (as ``shared``, the shared store's
    measured kernel, sums them: ``kernels.kernel_for`` when None) and over each head's dh values."""
    device = torch.device(device)
    time_one = time_one or (lambda name, run: kernels._timed(run, device))  # the wall clock around one run
    shared = (shared or kernels.kernel_for(device, dtype, dim)).unpacked()
    compiled_sums = compiled_kernels and device.type == "cpu" and compiled.usable_states(
        torch.empty(1, dim, dtype=dtype), "weighted_sum")
    generator = torch.Generator(device="cpu").manual_seed(0)
    states = torch.randn(rows, dim, generator=generator).to(device, dtype)  # [rows, d]
    values = torch.randn(heads, rows, head_dim, generator=generator).to(device, dtype)  # [H, rows, dh]
    weight = torch.randn(heads * head_dim, dim, generator=generator).to(device)  # one layer's [H * dh, d]
    block = states[:min(rows, 4_096)]
    projected = torch.empty(heads, block.shape[0], head_dim, dtype=dtype, device=device)  # as the builder keeps them
    k = max(1, min(k, rows // MEASURE_ROWS_PER_K))
    candidates = {"projection": lambda: projected.copy_((block.float() @ weight.T).view(-1, heads, head_dim)
                                                        .transpose(0, 1))}
    for name, queries in (("step", queries_per_head), ("reading", reading_queries)):
        ids = torch.randint(0, rows, (heads, queries, k), generator=generator).to(device)  # [H, nq, k]
        weights = torch.softmax(torch.randn(heads, queries, k, generator=generator), dim=2).to(device)
        candidates[f"{name} states"] = (lambda ids=ids, weights=weights: kernels.gathered_attention(
            states, ids.view(heads * ids.shape[1], k), weights.view(heads * ids.shape[1], k), shared.widens,
            shared.fused_gather, compiled_sums))
        candidates[f"{name} values"] = (lambda ids=ids, weights=weights: gathered_values(
            values, ids, weights, shared, compiled_sums))
    # not rivals: each is timed at every turn (a race stops timing what is far slower than its leader)
    timed = {name: (lambda name=name, run=run: time_one(name, run)) for name, run in candidates.items()}
    seconds = measurements.race(timed, turns=MEASURE_REPEATS, give_up=math.inf, timer=lambda run: run())
    kernels.release_scratch()
    measured = ", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in seconds.items())
    sums = ValueSums(projection_seconds=seconds["projection"] / block.shape[0],
                     step_seconds=seconds["step states"] - seconds["step values"],
                     reading_seconds=seconds["reading states"] - seconds["reading values"])
    reason = (f"a layer's values cost {sums.projection_seconds * 1e6:.2f} us a token and save "
              f"{sums.step_seconds * 1e3:.3f} ms a step ({queries_per_head} per head), "
              f"{sums.reading_seconds * 1e3:.2f} ms a reading "
              f"({reading_queries} per head); measured on {rows:,} tokens x {heads} heads x {head_dim}, d={dim}, "
              f"k={k:,}{', compiled sums' if compiled_sums else ''}: {measured} "
              f"(projection of {block.shape[0]:,} tokens)")
    return dataclasses.replace(sums, reason=reason)


def _scan_usable(scanner: str, keys: torch.Tensor) -> bool:
    """Whether the scan ``scanner`` can read ``keys`` [H, n, dh] here."""
    if scanner == "compiled":
        return compiled.usable(keys, "select")
    return keys.device.type == "cpu" and faiss_available(keys.dtype)


def scan_select(scanner: str, keys: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [H, nq, k'] fp32, ids [H, nq, k'] int64) of each head's top-k by the scan ``scanner``."""
    if scanner == "compiled":
        return compiled.select(keys, queries, k)
    return faiss_select(keys, queries, k)


# --- the faiss scan -----------------------------------------------------------------------------


def _faiss_index(rows: torch.Tensor):
    """The exact store's flat inner-product index (``flat.new_flat_index``) over ``rows`` [n, dh] (CPU,
    contiguous), reading them where they are: its code buffer made a view of the tensor's memory (faiss >= 1.10's
    MaybeOwnedVector), nothing copied. The tensor must outlive the index."""
    import faiss

    from unlimisum.search.flat import new_flat_index

    n, head_dim = rows.shape
    index = new_flat_index(head_dim, rows.dtype)
    codes = index.codes
    if not isinstance(codes, getattr(faiss, "MaybeOwnedVectorUInt8", ())):  # faiss < 1.10: a plain std::vector
        raise TypeError("this faiss's indexes own their codes")
    codes.is_owned = False
    codes.view_data = codes.c_ptr = faiss.cast_integer_to_uint8_ptr(rows.data_ptr())
    codes.view_size = codes.c_size = rows.numel() * rows.element_size()
    index.ntotal = n
    return index


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of the parent's threads


def _pool(workers: int) -> ThreadPoolExecutor:
    """Threads that search one head each; faiss runs single-threaded in each (its OpenMP setting is per thread)."""
    with _POOLS_LOCK:
        if workers not in _POOLS:
            import faiss

            _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="unlimisum-heads",
                                                 initializer=faiss.omp_set_num_threads, initargs=(1,))
        return _POOLS[workers]


def faiss_select(keys: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [H, nq, k'] fp32, ids [H, nq, k'] int64) of each head's top-k, k' = min(k, n), sorted descending:
    keys [H, n, dh] (CPU; bfloat16, float16 or float32) searched in place by faiss, queries [H, nq, dh].

    One pass over each head's keys, widened to fp32 in registers, each score an fp32 dot product (the float32
    kernel's scores within fp32 rounding: the sums run in another order), a running top-k heap per query; the
    heads spread over ``torch.get_num_threads()`` threads (faiss lets go of the GIL). Bandwidth-bound for one
    query per head, where a torch kernel writes and reads back [nq, n] scores; each further query is another
    pass, which is why beams keep the torch kernels (measured: ``calibrate_heads``)."""
    heads, n, _ = keys.shape
    k = min(k, n)
    queries = queries.to(torch.float32).contiguous()  # [H, nq, dh]
    if k == 0 or queries.shape[1] == 0:
        return queries.new_empty(heads, queries.shape[1], k), torch.empty(heads, queries.shape[1], k,
                                                                          dtype=torch.long)
    head_queries = queries.numpy()

    def search(head: int):
        rows = keys[head].contiguous()  # [n, dh] (a view where it already is), alive till returned
        return _faiss_index(rows).search(head_queries[head], k)

    workers = min(torch.get_num_threads(), heads)
    found = list(_pool(workers).map(search, range(heads))) if workers > 1 else [search(h) for h in range(heads)]
    scores = torch.from_numpy(np.stack([distances for distances, _ in found]))
    ids = torch.from_numpy(np.stack([labels for _, labels in found]))
    return scores, ids


@functools.lru_cache(maxsize=None)
def faiss_available(dtype: torch.dtype) -> bool:
    """Whether faiss can scan keys of ``dtype`` in place here: checked once per process against torch on a
    small store (an older faiss without views, a dtype faiss does not store, or a layout that changed, is left
    out, never trusted)."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 300, 8, generator=generator).to(dtype)  # [H, n, dh]
    queries = torch.randn(2, 3, 8, generator=generator)
    try:
        scores, ids = faiss_select(keys, queries, 5)
    except (ImportError, AttributeError, KeyError, RuntimeError, TypeError):
        return False
    expected = torch.einsum("hqd,hnd->hqn", queries, keys.float()).topk(5, dim=2)
    return bool(torch.equal(ids, expected.indices) and torch.allclose(scores, expected.values, atol=1e-4))


# --- the kernels ------------------------------------------------------------------------------


def head_scores(keys: torch.Tensor, queries: torch.Tensor, choice: HeadKernelChoice,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """[H, nq, n] fp32 scores of each head's queries [H, nq, dh] (fp32) against its keys [H, n, dh], written into
    ``out`` [H, nq, n] fp32 where given (a reused buffer: a dense step's scores of a long book, fresh each layer,
    would be page-faulted in each time)."""
    if choice.scores == "native" and keys.dtype != torch.float32:
        scored = torch.bmm(queries.to(keys.dtype), keys.transpose(1, 2))  # [H, nq, n] in the keys' dtype
        return scored.float() if out is None else out.copy_(scored)  # widened as it is copied: no fp32 temporary
    if choice.scores == "compiled" and compiled.usable(keys, "scores"):
        return compiled.scores(keys, queries, out=out)
    heads, n, head_dim = keys.shape
    nq = queries.shape[1]
    out = queries.new_empty(heads, nq, n) if out is None else out
    block = choice.block_rows
    for start in range(0, n, block):
        rows = keys[:, start:start + block]  # [H, b, dh]
        b = rows.shape[1]
        if rows.dtype != torch.float32:  # widened into a reused buffer that stays in cache
            widened = kernels._scratch("head-widened", heads * block, head_dim, torch.float32, keys.device)
            rows = widened[:heads * b].view(heads, b, head_dim).copy_(rows)
        part = kernels._scratch("head-scores", heads * nq * block, 1, torch.float32, keys.device)
        part = part[:heads * nq * b].view(heads, nq, b)
        torch.bmm(queries, rows.transpose(1, 2), out=part)
        out[:, :, start:start + b] = part
    return out


def head_select(keys: torch.Tensor, queries: torch.Tensor, k: int,
                choice: HeadKernelChoice) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, ids) [H, nq, k] of each head's top-k by the kernel's scores, in no particular order.

    One pass over the keys: the scan where the choice says (``selects_with_scan``); otherwise its scores, beyond
    MAX_SCORE_BYTES of them in slices with a running top-k."""
    if choice.selects_with_scan(keys, queries):
        return scan_select(choice.scanner, keys, queries, k)
    heads, n, _ = keys.shape
    nq = queries.shape[1]
    queries = queries.to(keys.device, torch.float32)
    step = max(k, kernels.MAX_SCORE_BYTES // (heads * nq * 4))
    tops, columns = [], []  # each slice's top-k, merged at the end
    for start in range(0, n, step):
        part = head_scores(keys[:, start:start + step], queries, choice).view(heads * nq, -1)  # [H * nq, <=step]
        top, ids = kernels.top_k(part, min(k, part.shape[1]), ordered=False)
        tops.append(top)
        columns.append(ids + start)
    top, ids = torch.cat(tops, 1), torch.cat(columns, 1)  # [H * nq, slices * k]
    if len(tops) > 1:
        top, order = top.topk(min(k, top.shape[1]), dim=1, sorted=False)
        ids = ids.gather(1, order)
    return top.view(heads, nq, -1), ids.view(heads, nq, -1)


def head_retrieve(keys: torch.Tensor, states: torch.Tensor, queries: torch.Tensor, k: int, choice: HeadKernelChoice,
                  shared: kernels.KernelChoice, exclude: torch.Tensor | None = None,
                  values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``head_attend`` that also says what each query attended to: (ids [H, nq, k'], weights [H, nq, k'] fp32,
    in no particular order; attended [H, nq, d] fp32), k' = min(k, N), the weights the softmax of the kernel's own
    scores (as generation weighs them). ``exclude`` [N] bool: tokens hidden from every query, as if they were not
    stored (weight 0 where fewer than k' are left). With the layer's ``values`` [H, N, dh], ``attended`` is
    [H, nq, dh]: the weighted sum of each head's chosen values (k >= N: of all of them, ``head_dense_values``)."""
    heads, n, _ = keys.shape
    nq = queries.shape[1]
    wanted = min(k, n)
    hidden = exclude.to(keys.device) if exclude is not None else None
    if values is not None and wanted == n:
        ids = torch.empty(heads, nq, n, dtype=torch.long, device=keys.device)
        weights = torch.empty(heads, nq, n, dtype=torch.float32, device=keys.device)

        def keep(head: slice, part: slice, block_weights: torch.Tensor) -> None:  # [h, c, N]: in descending weight
            weights[head, part], ids[head, part] = block_weights.sort(dim=2, descending=True)

        attended = head_dense_values(keys, values, queries, choice, hidden=hidden, on_weights=keep)
        return ids, weights, attended
    if hidden is None:
        scores, ids = head_select(keys, queries, wanted, choice)  # [H, nq, k'], in no order
    else:  # one group: the hidden ones' scores -inf before the top-k, or fetched and dropped after the scan
        scores, ids = _select_masked(keys, queries.to(keys.device, torch.float32), k, choice, [hidden])
    weights, attended = _weighed_sums(states, scores, ids, choice, shared, values)
    return ids, weights, attended


def _weighed_sums(states: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, choice: HeadKernelChoice,
                  shared: kernels.KernelChoice,
                  values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [H, nq, k'] fp32: the softmax of each query's selected scores, 0 where all are -inf; attended
    [H, nq, d] fp32: the states ``ids`` chose, summed by those weights; with the layer's ``values`` [H, N, dh],
    [H, nq, dh]: each head's own chosen values summed instead), one sum for every head and query."""
    heads, nq, _ = scores.shape
    weights = torch.softmax(scores, dim=2, dtype=torch.float32).nan_to_num(0.0)
    shared = shared.unpacked()
    if values is not None:
        return weights, gathered_values(values, ids, weights, shared, _compiled(choice) or None)
    attended = kernels.gathered_attention(states, ids.reshape(heads * nq, -1), weights.reshape(heads * nq, -1),
                                          shared.widens, shared.fused_gather, _compiled(choice) or None)
    return weights, attended.view(heads, nq, -1)


def gathered_values(values: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, shared: kernels.KernelChoice,
                    compiled_sums: bool | None = None) -> torch.Tensor:
    """[H, nq, dh] fp32 = sum_j weights[h, q, j] * values[h, ids[h, q, j]]: each head's chosen values [H, N, dh]
    summed as ``kernels.gathered_attention`` sums the shared states (``shared``'s widening and fused gather; on a
    CPU from COMPILED_MIN_STATES rows or as ``compiled_sums`` says, compiled), every head's rows read where they
    lie (a chapter's view included) through one id space: head h's row j is row h * pitch + j."""
    heads, nq, k = ids.shape
    head_dim = values.shape[2]
    if k == 0:
        return torch.zeros(heads, nq, head_dim, dtype=torch.float32, device=values.device)
    if compiled_sums is None:  # as for the states: compiled from COMPILED_MIN_STATES tokens, not rows of all heads
        compiled_sums = kernels.uses_compiled(values.shape[1], values.device)
    rows, pitch = compiled.head_row_view(values)  # [(H - 1) * pitch + N, dh]
    offsets = torch.arange(heads, device=ids.device).view(heads, 1, 1) * pitch
    summed = kernels.gathered_attention(rows, (ids + offsets).view(heads * nq, k), weights.reshape(heads * nq, k),
                                        shared.widens, shared.fused_gather, compiled_sums)
    return summed.view(heads, nq, head_dim)


def head_attend_masked(keys: torch.Tensor, states: torch.Tensor, queries: torch.Tensor, k: int,
                       choice: HeadKernelChoice, shared: kernels.KernelChoice,
                       hidden: Sequence[torch.Tensor], values: torch.Tensor | None = None) -> torch.Tensor:
    """``head_attend`` for queries [H, G * m, dh] in G = len(hidden) equal groups, group g's (queries
    [:, g * m:(g + 1) * m]) with the tokens ``hidden[g]`` ([N] bool) out of its retrieval, k < N: what G calls of
    ``head_attend(..., exclude=hidden[g])`` give (but for the order of each query's sums), in one selection
    (``_select_masked``) and one sum of all the chosen states, which reads each from memory once for every group.
    -> [H, G * m, d] fp32; with the layer's ``values`` [H, N, dh], [H, G * m, dh]: their sums."""
    if queries.shape[1] % len(hidden):
        raise ValueError(f"{queries.shape[1]} queries per head cannot be {len(hidden)} equal groups")
    scores, ids = _select_masked(keys, queries.to(keys.device, torch.float32), k, choice,
                                 [mask.to(keys.device) for mask in hidden])  # [H, G * m, k']
    return _weighed_sums(states, scores, ids, choice, shared, values)[1]


def _select_masked(keys: torch.Tensor, queries: torch.Tensor, k: int, choice: HeadKernelChoice,
                   masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, ids) [H, G * m, min(k, N)] of ``head_attend_masked``'s groups (``head_retrieve``'s one, with its
    ``exclude``), each group's top-k without its masked tokens (weight 0 where fewer are left), in no order. The
    scores are taken once where the groups' queries are equal (a support reading's rows before their first
    cross-attention). Where they fit one matrix, each group's masked columns are set to -inf there before its
    top-k; the scan instead fetches as many more as the largest mask holds, for every group alike, and drops the
    masked ones after."""
    heads, n, _ = keys.shape
    groups, wanted = len(masks), min(k, n)
    parts = queries.chunk(groups, dim=1)  # [H, m, dh] each
    m = parts[0].shape[1]
    alike = all(torch.equal(parts[0], part) for part in parts[1:])
    read = parts[0] if alike else queries
    if choice.selects_with_scan(keys, read) or heads * read.shape[1] * n * 4 > kernels.MAX_SCORE_BYTES:
        fetch = min(n, wanted + max(int(mask.sum()) for mask in masks))
        scores, ids = head_select(keys, read, fetch, choice)  # [H, m or G * m, fetch]
        kept = []
        for group, mask in enumerate(masks):
            top, chosen = (scores, ids) if alike else (scores[:, group * m:(group + 1) * m],
                                                       ids[:, group * m:(group + 1) * m])
            if fetch > wanted:  # the hidden ones dropped: the k' best of the rest (an unsorted top-k)
                top, order = top.masked_fill(mask[chosen], float("-inf")).topk(wanted, dim=2, sorted=False)
                chosen = chosen.gather(2, order)
            kept.append((top, chosen))
        return torch.cat([top for top, _ in kept], dim=1), torch.cat([chosen for _, chosen in kept], dim=1)
    reused = kernels._scratch("masked-scores", heads * read.shape[1], n, torch.float32, keys.device)
    scored = head_scores(keys, read, choice, out=reused.view(heads, read.shape[1], n))  # [H, m or G * m, N]
    columns = [mask.nonzero().squeeze(1) for mask in masks]
    if not alike:  # every group's columns masked in its rows, then one top-k of them all
        for group, hidden in enumerate(columns):
            scored[:, group * m:(group + 1) * m].index_fill_(2, hidden, float("-inf"))
        top, ids = kernels.top_k(scored.view(heads * groups * m, n), wanted, ordered=False)
        return top.view(heads, groups * m, -1), ids.view(heads, groups * m, -1)
    found: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by group
    masked = [group for group in range(groups) if columns[group].numel()]
    unmasked = [group for group in range(groups) if not columns[group].numel()]
    if unmasked:  # one top-k of the scores as they are, for every group that hides nothing, before any masking
        top, ids = kernels.top_k(scored.view(heads * m, n), wanted, ordered=False)
        found.update({group: (top.view(heads, m, -1), ids.view(heads, m, -1)) for group in unmasked})
    for group in masked:  # the last masks the scores themselves, the others a copy
        rows = scored if group == masked[-1] else scored.clone()
        rows.index_fill_(2, columns[group], float("-inf"))
        top, ids = kernels.top_k(rows.view(heads * m, n), wanted, ordered=False)
        found[group] = top.view(heads, m, -1), ids.view(heads, m, -1)
    return (torch.cat([found[group][0] for group in range(groups)], dim=1),
            torch.cat([found[group][1] for group in range(groups)], dim=1))


def head_attend(keys: torch.Tensor, states: torch.Tensor, queries: torch.Tensor, k: int, choice: HeadKernelChoice,
                shared: kernels.KernelChoice, coverage: torch.Tensor | None = None,
                values: torch.Tensor | None = None, exclude: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k retrieval attention per head: queries [H, nq, dh] (scaling folded in) -> [H, nq, d] fp32, the
    softmax-weighted sum of each query's top-k shared states [N, d]. k >= N is dense attention: with the layer's
    ``values`` [H, N, dh], [H, nq, dh], the weighted sum of each head's own values (``head_dense_values``); at
    k < N the same of each head's chosen values (``gathered_values``: dh numbers a chosen token instead of d).

    ``shared``: the shared store's measured kernel, whose gather and dense values pass sum the states here too;
    ``coverage`` [N] fp32, when given, gets every query's attention weights added to it. ``exclude`` [N] bool:
    tokens hidden from every query (``head_retrieve``'s, without what each query attended to: a support reading
    wants only the output); with it every call takes the same path, whatever the mask holds."""
    if exclude is not None:
        hidden = exclude.to(keys.device)
        if values is not None and k >= keys.shape[1]:  # no weights sorted for ids nobody reads
            return head_dense_values(keys, values, queries.to(keys.device, torch.float32), choice, coverage,
                                     hidden=hidden)
        return head_retrieve(keys, states, queries, k, choice, shared, exclude=hidden, values=values)[2]
    heads, n, _ = keys.shape
    nq, dim = queries.shape[1], states.shape[1]
    rows = heads * nq
    queries = queries.to(keys.device, torch.float32)
    # the states are summed unpacked (the scores come from the keys); the measured cost of a dense values pass is
    # the packed copy's when the packed kernel was chosen, far below the unpacked pass that would run here
    dense_measured = shared.scores != "packed"
    shared = shared.unpacked()
    if k >= n:
        if values is not None:
            return head_dense_values(keys, values, queries, choice, coverage)
        return head_dense_attention(keys, states, queries, choice, shared, coverage)
    dense_scores = rows * n * 4 <= kernels.MAX_SCORE_BYTES and not choice.selects_with_scan(keys, queries)
    # a dense pass over the shared states against their gather, as measured; a head's values are always gathered
    if values is None and dense_measured and dense_scores and shared.dense_is_cheaper(rows, k, n):
        logits = head_scores(keys, queries, choice).view(rows, n)
        top, ids = kernels.top_k(logits, k, ordered=False)
        kept = torch.softmax(top, dim=1, dtype=torch.float32)  # [rows, k]
        weights = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(1, ids, kept)
        if coverage is not None:
            coverage.index_add_(0, ids.reshape(-1), kept.reshape(-1))
        return kernels.dense_values(states, weights, shared).view(heads, nq, dim)
    started = time.perf_counter()
    top, ids = head_select(keys, queries, k, choice)
    check = _LIVE.get(choice)
    if (check is not None and not check.done and n >= MEASURE_ROWS and nq == choice.queries_per_head
            and k <= MEASURE_ROWS // MEASURE_ROWS_PER_K):  # a step as measured: is the kept choice still right?
        per_key = choice.scan_row_seconds if choice.selects_with_scan(keys, queries) else choice.kernel_row_seconds
        check.observe(time.perf_counter() - started, n * per_key)
    weights = torch.softmax(top.view(rows, -1), dim=1, dtype=torch.float32)  # [rows, k]
    ids = ids.view(rows, -1)
    if coverage is not None:
        coverage.index_add_(0, ids.reshape(-1), weights.reshape(-1))
    if values is not None:
        return gathered_values(values, ids.view(heads, nq, -1), weights.view(heads, nq, -1), shared,
                               _compiled(choice) or None)
    return kernels.gathered_attention(states, ids, weights, shared.widens, shared.fused_gather,
                                      _compiled(choice) or None).view(heads, nq, dim)


def _compiled(choice: HeadKernelChoice) -> bool:
    """Whether the choice's scores or scan run compiled (the sums over the states may then too, however short)."""
    return choice.scores == "compiled" or choice.scanner == "compiled"


def head_dense_attention(keys: torch.Tensor, states: torch.Tensor, queries: torch.Tensor, choice: HeadKernelChoice,
                         shared: kernels.KernelChoice, coverage: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax over every key of each head times the shared states. On a CPU, where the scores fit
    MAX_SCORE_BYTES: every score, their softmax, then one pass of the compiled sum over the states. Elsewhere in
    one pass: each block of rows scored per head and summed while it is in cache, under running maxima and sums
    (``kernels._online_softmax``).

    queries [H, nq, dh] fp32 -> [H, nq, d] fp32; ``coverage`` [N] gets every query's weights added."""
    heads, n, _ = keys.shape
    nq, dim = queries.shape[1], states.shape[1]
    flat = queries.reshape(heads * nq, -1)  # the online softmax keeps one running sum per (head, query)
    if n == 0:
        return flat.new_zeros(heads, nq, dim)
    block = choice.block_rows
    native_values = not shared.widens and states.dtype != torch.float32
    if (not native_values and kernels._compiled_sums(states, "dense_sum", _compiled(choice) or None)
            and heads * nq * n * 4 <= kernels.MAX_SCORE_BYTES):
        # on a CPU: every weight, a block of heads and queries at a time into a reused buffer (``dense_blocks``),
        # then one compiled pass over the states for all of them
        weights = kernels._scratch("head-dense-weights", heads * nq * n, 1, torch.float32, keys.device)
        weights = weights[:heads * nq * n].view(heads, nq, n)
        for head, part in dense_blocks(heads, nq, n):
            weights[head, part] = _dense_weights(keys[head], queries[head, part], choice, None)
        if coverage is not None:
            coverage += weights.sum(dim=(0, 1))
        return compiled.dense_sum(states, weights.view(heads * nq, n)).view(heads, nq, dim)

    def parts():
        for start in range(0, n, block):
            logits = head_scores(keys[:, start:start + block], queries, choice).view(heads * nq, -1)  # [H * nq, b]
            rows = states[start:start + block]  # [b, d]
            if native_values:
                yield start, logits, lambda weights, r=rows: (weights.to(r.dtype) @ r).float()
            else:
                rows = kernels._widened(rows)  # valid until the next block is widened: summed before that
                yield start, logits, lambda weights, r=rows: weights @ r

    rescored = lambda: ((start, head_scores(keys[:, start:start + block], queries, choice).view(heads * nq, -1))  # noqa: E731
                        for start in range(0, n, block))
    return kernels._online_softmax(parts(), flat, dim, n, coverage, rescored).view(heads, nq, dim)


def dense_blocks(heads: int, queries: int, n: int) -> Iterator[tuple[slice, slice]]:
    """(heads, queries) slices of a dense step over n keys, each block's [h, c, n] fp32 scores within
    DENSE_SCORE_BYTES where one head's query can be (in the cache, and a reused buffer's worth); at least as many
    heads a block as there are threads where that many fit, so that every thread scores a head."""
    per_query = max(n, 1) * 4
    chunk = max(1, min(queries, DENSE_SCORE_BYTES // per_query))
    per_block = max(1, min(heads, DENSE_SCORE_BYTES // (chunk * per_query)))
    per_block = max(per_block, min(torch.get_num_threads(), heads))  # a head a thread, however few fit the budget
    for first in range(0, queries, chunk):
        for head in range(0, heads, per_block):
            yield slice(head, head + per_block), slice(first, first + chunk)


def _dense_weights(keys: torch.Tensor, queries: torch.Tensor, choice: HeadKernelChoice,
                   hidden: torch.Tensor | None) -> torch.Tensor:
    """[h, c, n] fp32 softmax over every key of each head's scores (``hidden`` [n] bool: weight 0; a row with
    every key hidden, all zeros), scored into a reused buffer (``dense_blocks`` keeps it small)."""
    heads, n, _ = keys.shape
    nq = queries.shape[1]
    logits = kernels._scratch("head-dense-scores", heads * nq * n, 1, torch.float32, keys.device)
    logits = head_scores(keys, queries, choice, out=logits[:heads * nq * n].view(heads, nq, n))
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    return torch.softmax(logits, dim=2).nan_to_num_(0.0)


def head_dense_values(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, choice: HeadKernelChoice,
                      coverage: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                      on_weights: Callable[[slice, slice, torch.Tensor], None] | None = None) -> torch.Tensor:
    """Dense attention of each head over its own keys and values [H, N, dh]: queries [H, nq, dh] fp32 (scaling
    folded in) -> [H, nq, dh] fp32, softmax(q K^T) V (the value bias not added: the weights sum to one, or to
    zero where ``hidden`` [N] bool hides every token). A block of heads and queries at a time (``dense_blocks``):
    its scores, their softmax and its sums while the scores are in cache; ``coverage`` [N] gets every query's
    weights added, ``on_weights(heads, queries, weights)`` each block's [h, c, N] (valid during the call).
    Where the scores run compiled and no token is hidden or weight handed out: in one compiled pass
    (``compiled.attend_dense``) that writes no scores, or, counting coverage, only the weights, into a reused
    buffer."""
    heads, n, head_dim = keys.shape
    nq = queries.shape[1]
    queries = queries.to(keys.device, torch.float32)
    if (hidden is None and on_weights is None and choice.scores == "compiled" and values.dtype == keys.dtype
            and compiled.usable(keys, "attend_dense") and compiled.usable(values, "attend_dense")
            and (coverage is None or heads * nq * n * 4 <= kernels.MAX_SCORE_BYTES)):
        kept = (kernels._scratch("head-dense-weights", heads * nq * n, 1, torch.float32, keys.device)
                if coverage is not None else None)
        return compiled.attend_dense(keys, values, queries, coverage, kept)
    out = torch.empty(heads, nq, head_dim, dtype=torch.float32, device=keys.device)
    for head, part in dense_blocks(heads, nq, n):
        weights = _dense_weights(keys[head], queries[head, part], choice, hidden)  # [h, c, N]
        if coverage is not None:
            coverage += weights.sum(dim=(0, 1))
        if on_weights is not None:
            on_weights(head, part, weights)
        out[head, part] = _value_sums(values[head], weights,
                                      _compiled(choice) or kernels.uses_compiled(n, keys.device))
    return out


def _value_sums(values: torch.Tensor, weights: torch.Tensor, compiled_sums: bool) -> torch.Tensor:
    """[H, nq, dh] fp32 = weights [H, nq, N] fp32 @ values [H, N, dh] per head, from the stored numbers: on a
    CPU where ``compiled_sums`` (the store's kernels run compiled) compiled (one read of each value, widened in
    registers), elsewhere in blocks widened to fp32."""
    if compiled_sums and values.device.type == "cpu" and compiled.usable(values, "head_dense_sum"):
        return compiled.head_dense_sum(values, weights)
    heads, n, head_dim = values.shape
    out = weights.new_zeros(heads, weights.shape[1], head_dim)
    for start in range(0, n, VALUE_BLOCK_ROWS):
        out.baddbmm_(weights[:, :, start:start + VALUE_BLOCK_ROWS], values[:, start:start + VALUE_BLOCK_ROWS].float())
    return out
