"""The packed score kernel: the store in fbgemm's fp16 GEMM layout, multiplied in fp32 (CPU only).

On CPUs without 16-bit arithmetic units the float32 kernel widens each block of the 16-bit store to fp32
in memory before multiplying it. fbgemm's fp16 GEMM (shipped with torch's x86 builds, the engine behind
``torch.ops.quantized.linear_dynamic_fp16``) reads a matrix packed once in its own fp16 layout and widens
it in registers instead: fp32 queries times fp32 values of the packed fp16 numbers, accumulated in fp32.
The scores are the float32 kernel's within fp32 rounding (the sums run in another order).

``PackedStates`` keeps two packed copies of the store, in slices of ``SLICE_ROWS`` rows: the states
[b, d] (scores: queries @ states^T) and their transpose [d, b] (values: weights @ states). Together
they take about 2.5 times the 16-bit store's bytes, beside it (the store itself still serves gathers),
so a store is packed only when the kernel is measured ``kernels.PACKED_MIN_SPEEDUP`` times faster than
the best unpacked one (``kernels.calibrate``) and the copies fit ``PACKED_MEMORY_FRACTION`` of the memory
left beside what this process already holds (the model, the store): physical memory, or the container's
limit, or this process's share of the machine when it runs beside others (a Ray worker's,
``MEMORY_LIMIT_ENV``), whichever is lowest. A chapter's view of a packed store reads the book's copies
(``PackedStates.window``) instead of packing its rows again.

bfloat16 values become fp16 exactly when |x| >= 2^-17 (fp16's 11 significant bits hold bfloat16's 8);
smaller ones are rounded to fp16's grid of 2^-24, an absolute error below 3e-8. A store holding a value
beyond fp16's range (|x| > 65504) is not packed.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

SLICE_ROWS = 16_384  # rows per packed slice: bounds the temporaries (packing them); fbgemm blocks for the caches inside
FP16_MAX = 65504.0
# the packed copies of one store may take this share of the memory left beside what the process holds
# (usable memory minus its resident set: the model and the store are in it by the time a store is packed)
PACKED_MEMORY_FRACTION = 0.125
BYTES_PER_NUMBER = 2.6  # packed copy bytes per stored number, each of the two (measured: 2.54 at d=768)


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether this torch build has fbgemm's fp16 GEMM (x86 CPU builds do; others fall back)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(2, 2), None)
        return torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 2), packed).shape == (1, 2)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def packed_bytes(n_tokens: int, dim: int) -> int:
    """About how many bytes the two packed copies of an [n_tokens, dim] store take."""
    return int(2 * BYTES_PER_NUMBER * n_tokens * dim)


# where a container's memory limit is written (cgroup v2, then v1); "max" or a huge number: no limit
CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")
# bytes this process may use when it shares the machine with others like it: each Ray worker gets its share
MEMORY_LIMIT_ENV = "UNLIMISUM_MEMORY_LIMIT"


def usable_memory() -> int | None:
    """Bytes this process may use: physical memory, or the container's limit or this process's share
    (``UNLIMISUM_MEMORY_LIMIT``, set for each Ray worker) when lower."""
    try:
        usable = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    for path in CGROUP_LIMIT_FILES:
        try:
            with open(path) as file:
                text = file.read().strip()
        except OSError:
            continue
        if text.isdigit():
            usable = min(usable, int(text))
    share = os.environ.get(MEMORY_LIMIT_ENV, "").strip()
    if share.isdigit() and int(share) > 0:
        usable = min(usable, int(share))
    return usable


def resident_memory() -> int:
    """Bytes this process holds now (its resident set); 0 where that cannot be read."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001  (no /proc, a sandbox): count nothing held
        return 0


def memory_budget() -> int:
    """Bytes the packed copies of one store may take: PACKED_MEMORY_FRACTION of the usable memory left beside
    this process's resident set; 0 where the usable memory is unknown."""
    usable = usable_memory()
    return 0 if usable is None else max(0, int(PACKED_MEMORY_FRACTION * (usable - resident_memory())))


def memory_allows(n_tokens: int, dim: int) -> bool:
    """The packed copies of an [n_tokens, dim] store fit ``memory_budget``."""
    return packed_bytes(n_tokens, dim) <= memory_budget()


def packable(states: torch.Tensor) -> bool:
    """A CPU store of 16-bit numbers within fp16's range, on a torch build with fbgemm."""
    if states.device.type != "cpu" or states.dtype not in (torch.float16, torch.bfloat16) or not available():
        return False
    if states.dtype == torch.float16 or states.numel() == 0:
        return True
    low, high = torch.aminmax(states)  # no temporary as large as the store
    return -FP16_MAX <= float(low) and float(high) <= FP16_MAX


class PackedStates:
    """Two packed fp16 copies of a store [N, d], for scores and for weighted sums of its rows."""

    def __init__(self, states: torch.Tensor, slice_rows: int | None = None, values: bool = True):
        """Pack ``states`` [N, d] (16-bit, within fp16's range: see ``packable``) in slices of ``slice_rows``
        (default SLICE_ROWS); ``values=False`` packs only the copy for scores (``values`` and
        ``slice_values`` then cannot run)."""
        slice_rows = slice_rows or SLICE_ROWS
        self.n_tokens, self.dim = states.shape
        self.starts = list(range(0, self.n_tokens, slice_rows))

        def pack(start: int):
            # one fp32 temporary of the slice at a time (48 MiB at d=768): the rows, then their transpose, widened
            # straight from the 16-bit store
            part = states[start:start + slice_rows]  # [b, d]
            with torch.inference_mode(False):
                rows = torch.ops.quantized.linear_prepack_fp16(part.float(), None)
                columns = None
                if values:
                    transposed = torch.empty(part.shape[1], part.shape[0], dtype=torch.float32).copy_(part.T)
                    columns = torch.ops.quantized.linear_prepack_fp16(transposed, None)
            return rows, columns

        # fbgemm packs on one thread (about 15 ns per number per copy) and lets go of the GIL: slices in parallel
        workers = min(torch.get_num_threads(), len(self.starts))
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                packed = list(pool.map(pack, self.starts))
        else:
            packed = [pack(start) for start in self.starts]
        self._rows = [rows for rows, _ in packed]
        self._columns = [columns for _, columns in packed] if values else []
        ends = self.starts[1:] + [self.n_tokens]
        self._widths = [end - start for start, end in zip(self.starts, ends)]  # rows of each packed slice
        # what this object reads: (packed slice, first and last column of it, position of the first in the rows here)
        self._parts = [(index, 0, end - start, start) for index, (start, end) in enumerate(zip(self.starts, ends))]
        self.covered_rows = self.n_tokens  # rows of the packed slices read (a window's end slices may be wider)

    def window(self, start: int, end: int) -> "PackedStates":
        """The rows [start, end) as packed states of their own (rows 0..end-start), sharing these copies: the
        slices that hold them, their outer columns cut off from scores and given no weight in sums."""
        if not 0 <= start < end <= self.n_tokens:
            raise ValueError(f"a window needs 0 <= start < end <= {self.n_tokens}, got [{start}, {end})")
        window = object.__new__(PackedStates)
        window.n_tokens, window.dim = end - start, self.dim
        window._rows, window._columns, window._widths = self._rows, self._columns, self._widths
        window._parts = []
        for index, first, last, at in self._parts:
            low, high = max(start, at), min(end, at + last - first)
            if low < high:
                window._parts.append((index, first + low - at, first + high - at, low - start))
        window.starts = [at for _, _, _, at in window._parts]
        window.covered_rows = sum(self._widths[index] for index, *_ in window._parts)
        return window

    def slice_scores(self, queries: torch.Tensor):
        """(start, scores [nq, b] fp32) for every slice of the store, in order; queries [nq, d] fp32."""
        queries = queries.contiguous()
        for index, first, last, at in self._parts:
            part = torch.ops.quantized.linear_dynamic_fp16(queries, self._rows[index])
            yield at, part if first == 0 and last == part.shape[1] else part[:, first:last].contiguous()

    def scores(self, queries: torch.Tensor) -> torch.Tensor:
        """[nq, N] fp32 scores of every query against every stored state."""
        out = queries.new_empty(queries.shape[0], self.n_tokens)
        for start, part in self.slice_scores(queries):
            out[:, start:start + part.shape[1]] = part
        return out

    def slice_values(self, index: int, weights: torch.Tensor) -> torch.Tensor:
        """weights [nq, b] @ the rows of the ``index``-th slice (as ``slice_scores`` yields them) -> [nq, d] fp32."""
        packed, first, last, _ = self._parts[index]
        width = self._widths[packed]
        if first != 0 or last != width:  # a window's end slice: no weight on the rows outside it
            padded = weights.new_zeros(weights.shape[0], width)
            padded[:, first:last] = weights
            weights = padded
        return torch.ops.quantized.linear_dynamic_fp16(weights.contiguous(), self._columns[packed])

    def values(self, weights: torch.Tensor) -> torch.Tensor:
        """weights [nq, N] @ states [N, d] -> [nq, d] fp32."""
        out = weights.new_zeros(weights.shape[0], self.dim)
        for index, (_, first, last, at) in enumerate(self._parts):
            out += self.slice_values(index, weights[:, at:at + last - first])
        return out
