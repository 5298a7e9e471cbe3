"""Compiled CPU kernels (numba) of exact retrieval: each head's scan of its keys, and the sums over the states.

torch has no kernel that reads 16-bit numbers at the memory's speed on a CPU without 16-bit units: a bfloat16
matrix-vector product there runs at about 7 GB/s on one thread, and widening blocks to fp32 first reads and writes
them again. These kernels, compiled by numba for the machine that runs (AVX2, AVX-512 or NEON, whatever LLVM
finds), read each number once:

- a bfloat16 number is the upper half of an fp32 one, so each 32-bit word of a bfloat16 tensor holds two of them:
  the word shifted left by 16 bits is the even dimension, the word with its lower half cleared the odd one; the
  queries are split the same way (even and odd dimensions), so the widening costs one integer operation per two
  numbers and no shuffles;
- ``select``: every query of a head (its beams) meets each key while it is in cache, one pass however many
  beams; four queries and two keys at a time in explicit 8-lane vectors (``_pair_four_bf16``: each key's words
  loaded and widened once, each query's lanes loaded once for both keys, a key's four sums reduced together),
  and the two or three after the last four the same way (a group of 7 query heads: 4 + 3), where a key's
  words (or fp32 numbers) are a multiple of 8; from a count of queries a head this machine measured
  (``tiled_from``), bfloat16 keys go into the lanes instead (a tile transposed once for all of them); the top-k
  of each query is kept as it goes: a block's scores are compared with the current threshold 8 at a time
  (``_above``), those above it appended to a buffer of ``2 k`` candidates, and a full buffer is cut to little
  more than its k largest (``_cut``: a sample says where, one branch-free pass keeps them), which raises the
  threshold; ``scores``: the same pass, every score written;
- ``select_grouped``: ``select`` for grouped-query attention (decoder-only generation): every query head of a
  key-value head scores each block of its keys, and each row's (beam's) g scores of a key are reduced to their
  largest before the running top-k keeps them: one selection per row and key-value head, one pass; with fewer
  key-value heads than threads, each head's keys in parts on threads of their own, merged (grouped_loops.py);
- ``weighted_sum``: each query's chosen states read once (four at a time, their reads in flight together) and
  summed in fp32, no gathered copy; where many queries choose the same states (a reading's positions), block by
  block of the states, each query's share of a block summed while the block is in cache;
  ``dense_sum``: weights [nq, N] times every state, each block of states met by every query while it is in
  cache; ``head_dense_sum``: the same per head over its own values [H, N, dh];
- ``top_k``: each row's k largest of a [rows, N] score matrix a matmul wrote, without sorting
  (top_k_loops.py);
- ``linear``: a generation step's few rows times a linear layer's weight, the weight streamed once at the
  memory's speed (linear_loops.py; projections.py races it against torch's forms);
- ``attend_dense``: softmax(q K^T) V per head over its own keys and values in one pass, each block of keys
  scored, weighed under a running maximum and sum (the online softmax, its exp in vectors) and its values
  summed while in cache.

Every loop that reads rows one after another asks for the rows ``llvm.PREFETCH_BYTES`` ahead (``_prefetch``):
some cores' own prefetchers keep too few reads in flight to stream at the memory's speed while they compute.

This module holds what each kernel computes (its public function) and which run here; their loops are in
compiled_loops.py (their scores in score_loops.py), the instructions numba would not emit in llvm.py, how they
are compiled and cached in jit.py.

Every score and sum is fp32 arithmetic on the stored numbers, widened exactly (the ``float32`` kernels'
numbers, summed in another order: within fp32 rounding of them); ties at the k-th score are broken arbitrarily,
as ``torch.topk`` breaks them. The heads (or queries, or blocks of states) are spread over
``torch.get_num_threads()`` threads by numba's OpenMP layer (measured faster than a pool of threads of its own).
That is one OpenMP runtime with torch's only where both load the same library: from pip, numba's links the
system's ``libgomp.so.1.0.0`` and torch brings its own, so two run side by side and each one's threads spin a
while after its work on the cores the other then uses (``GOMP_SPINCOUNT=0`` for both measured no faster a
step). Compiled once per machine, each kernel when a run first needs it (``ready``; ``warm`` compiles them in a
thread while the book is encoded): numba keeps the machine code in ``kernel_cache_folder()``, the folder kernels/
of unlimisum's cache home (never in the installed package, which may be read-only or shared; where that folder
cannot be written, every process compiles again). Without numba, or where a kernel disagrees with torch on a
small store (checked once per process), ``ready`` says False and the torch kernels and faiss serve
(head_kernels.py, kernels.py).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from unlimisum import measurements

SCAN_DTYPES = (torch.bfloat16, torch.float32)  # float16 keys keep the torch kernels and faiss
# the weighted sum runs blocked where its queries read each state this many times or more on average: against the
# per-query sums (bfloat16, d=768, k=1,024, 2 threads, EPYC Zen 4) 24 reads 2.0x as fast, 12 reads 1.8x, 3.9 reads
# 1.5x, 3 reads 1.07x; a greedy step's 0.75 reads 0.7x
BLOCKED_SUMS_MIN_READS = 4

try:
    import numba

    from unlimisum.search.compiled_loops import (BLOCK_ROWS, _attend_dense_heads_bf16, _attend_dense_heads_f32,
        _coverage, _dense_sums_heads_bf16, _dense_sums_heads_f32, _dense_sums_parts_bf16, _dense_sums_parts_f32,
        _scan_heads_bf16, _scan_heads_f32, _sums_blocked_parts_bf16, _sums_blocked_parts_f32, _sums_queries_bf16,
        _sums_queries_f32)
    from unlimisum.search.grouped_loops import _select_grouped_heads_bf16, _select_grouped_heads_f32, parts_of
    from unlimisum.search.linear_loops import _linear_rows_bf16, _linear_rows_f32
    from unlimisum.search.score_loops import TILED_MIN_QUERIES
    from unlimisum.search.top_k_loops import _top_k_rows
except ImportError:  # pragma: no cover - numba is a dependency; a broken install leaves the torch kernels
    numba = None


def _threads() -> int:
    """torch's thread count, as numba may run it (numba's pool is sized once, from the CPU count). torch keeps
    its count: numba's OpenMP layer, started by its first call, sets the calling thread's OpenMP thread count to
    the pool's size, which torch then reads as its own (a process set to 1 thread ran torch on 2 of 2 CPUs
    after its first compiled kernel, where that kernel ran on the thread that had set it)."""
    torch_threads = torch.get_num_threads()
    threads = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    return threads


# --- the public functions ------------------------------------------------------------------------


def head_row_view(keys: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows [(H - 1) * pitch + n, dh], pitch): keys (or values) [H, n, dh] as one matrix of rows, head h's
    being rows[h * pitch:h * pitch + n]: each head's rows where they lie when they are contiguous (a chapter's
    view of a book's keys: its rows at an offset into each head's block), else a copy."""
    heads, n, head_dim = keys.shape
    if not (keys.stride(2) == 1 and keys.stride(1) == head_dim and keys.stride(0) % head_dim == 0
            and (heads == 1 or keys.stride(0) >= n * head_dim)):
        keys = keys.contiguous()
    pitch = keys.stride(0) // head_dim if heads > 1 else n
    return torch.as_strided(keys, ((heads - 1) * pitch + n, head_dim), (head_dim, 1)), pitch  # no copy


def _head_rows(keys: torch.Tensor) -> tuple[np.ndarray, int]:
    """``head_row_view`` as the kernels read it: bfloat16 as [.., dh/2] uint32 words, fp32 as they are."""
    rows, pitch = head_row_view(keys)
    if keys.dtype == torch.bfloat16:
        return rows.view(torch.int32).numpy().view(np.uint32), pitch
    return rows.numpy(), pitch


def _split_queries(queries: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, ...]:
    """queries [H, nq, dh] as the kernels read them: fp32, for bfloat16 keys split in even and odd dimensions."""
    queries = queries.detach().to("cpu", torch.float32)
    if dtype == torch.bfloat16:
        return queries[..., 0::2].contiguous().numpy(), queries[..., 1::2].contiguous().numpy()
    return (queries.contiguous().numpy(),)


def _query_args(queries: torch.Tensor, dtype: torch.dtype) -> tuple:
    """A driver's arguments for queries [H, nq, dh]: ``_split_queries``'s, and for bfloat16 keys the count of
    queries a head from which their scores put the keys in the lanes (``tiled_from``)."""
    split = _split_queries(queries, dtype)
    if dtype != torch.bfloat16:
        return split
    return (*split, tiled_from(queries.shape[2]) if _asks_tiled_from(queries.shape[1]) else TILED_MIN_QUERIES)


def select(keys: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [H, nq, k'] fp32, ids [H, nq, k'] int64) of each head's top-k, k' = min(k, n), in no order:
    keys [H, n, dh] (CPU, ``SCAN_DTYPES``; bfloat16 needs an even dh) scanned once for every query [H, nq, dh].
    A score of -inf or NaN is never selected: a query with fewer than k' others gets -inf with id 0 for the rest."""
    heads, n, _ = keys.shape
    nq = queries.shape[1]
    k = min(k, n)
    scores = torch.empty(heads, nq, k, dtype=torch.float32)
    ids = torch.empty(heads, nq, k, dtype=torch.long)
    if k == 0 or nq == 0:
        return scores, ids
    rows, pitch = _head_rows(keys)
    kernel = _scan_heads_bf16 if keys.dtype == torch.bfloat16 else _scan_heads_f32
    _threads()
    kernel(rows, heads, pitch, n, *_query_args(queries, keys.dtype), k, scores.numpy(), ids.numpy(),
           np.empty((heads, nq, 0), np.float32))
    return scores, ids


def select_grouped(keys: torch.Tensor, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [B, G, k'] fp32, ids [B, G, k'] int64) of each row's and key-value head's top-k, k' = min(k, n),
    in no order, each key scored by the largest of its group's g scores (grouped-query attention): keys
    [G, n, D] (CPU, ``SCAN_DTYPES``; bfloat16 needs an even D; a view [:, a:b] of a larger store read in place),
    queries [B, G, g, D], all B * g of a head met by each key while it is in cache, one pass over its keys."""
    heads, n, _ = keys.shape
    rows, _, group, dim = queries.shape
    k = min(k, n)
    scores = torch.empty(heads, rows, k, dtype=torch.float32)  # [G, B, k]: each head's rows together
    ids = torch.empty(heads, rows, k, dtype=torch.long)
    if k == 0 or rows == 0 or group == 0:
        return scores.transpose(0, 1), ids.transpose(0, 1)
    per_head = queries.transpose(0, 1).reshape(heads, rows * group, dim)  # [G, B * g, D]: row b's g together
    _select_grouped_in(keys, per_head, group, k, scores, ids)
    return scores.transpose(0, 1), ids.transpose(0, 1)  # [B, G, k]


def _select_grouped_in(keys: torch.Tensor, per_head: torch.Tensor, group: int, k: int, scores: torch.Tensor,
                       ids: torch.Tensor, parts: int | None = None) -> None:
    """scores/ids [G, B, k] of ``select_grouped`` from queries [G, B * g, D], each head's keys scanned in
    ``parts`` parts (grouped_loops.py; 1: a thread a head; None: ``parts_of`` for the threads that run it)."""
    key_rows, pitch = _head_rows(keys)
    heads, n, _ = keys.shape
    threads = _threads()
    if parts is None:
        parts = parts_of(heads, n, threads)
    kernel = _select_grouped_heads_bf16 if keys.dtype == torch.bfloat16 else _select_grouped_heads_f32
    kernel(key_rows, heads, pitch, n, *_query_args(per_head, keys.dtype), group, k, parts, scores.numpy(),
           ids.numpy())


def scores(keys: torch.Tensor, queries: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[H, nq, n] fp32 scores of queries [H, nq, dh] against keys [H, n, dh] (CPU, ``SCAN_DTYPES``), written into
    ``out`` (contiguous [H, nq, n] fp32) where given."""
    heads, n, _ = keys.shape
    if out is None:
        out = torch.empty(heads, queries.shape[1], n, dtype=torch.float32)
    elif not (out.shape == (heads, queries.shape[1], n) and out.dtype == torch.float32 and out.is_contiguous()):
        raise ValueError(f"scores out= must be a contiguous float32 tensor of shape {(heads, queries.shape[1], n)}")
    if n == 0 or queries.shape[1] == 0:
        return out
    rows, pitch = _head_rows(keys)
    kernel = _scan_heads_bf16 if keys.dtype == torch.bfloat16 else _scan_heads_f32
    nq = queries.shape[1]
    _threads()
    kernel(rows, heads, pitch, n, *_query_args(queries, keys.dtype), 0, np.empty((heads, nq, 0), np.float32),
           np.empty((heads, nq, 0), np.int64), out.numpy())
    return out


def top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, dim=1, sorted=False)`` of scores [rows, n] fp32 (CPU, k <= n): (values, columns) [rows, k]
    in no order, the rows spread over the threads (unlimisum/search/top_k_loops.py: a floor from a sample, one
    pass keeping what reaches it, bins for the exact k; no sort). A row holding a NaN goes to ``torch.topk``
    (which orders NaN above every number), so the result is torch's but for the order and ties at the k-th."""
    rows, n = scores.shape
    values = torch.empty(rows, k, dtype=torch.float32)
    ids = torch.empty(rows, k, dtype=torch.long)
    if rows == 0 or k == 0:
        return values, ids
    scores = scores.detach().contiguous()
    done = np.empty(rows, np.bool_)
    _top_k_rows(scores.numpy(), k, min(_threads(), rows), values.numpy(), ids.numpy(), done)
    if not done.all():
        left = torch.from_numpy(~done)
        values[left], ids[left] = scores[left].topk(k, dim=1, sorted=False)
    return values, ids


def linear_operands(weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(weight, bias) as ``linear`` reads them: a bfloat16 weight [out, in] as [out, in / 2] uint32 words, an fp32
    one as it is (a view where it is contiguous), the bias in fp32 ([0]: none). Keep them for many calls."""
    weight = weight.detach().contiguous()
    words = (weight.view(torch.int32).numpy().view(np.uint32) if weight.dtype == torch.bfloat16
             else weight.numpy())
    added = (bias.detach().to(torch.float32).contiguous().numpy() if bias is not None
             else np.empty(0, np.float32))
    return words, added


def linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           operands: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
    """``F.linear(rows, weight, bias)`` for rows [R, in] (CPU, of the weight's dtype, one of ``SCAN_DTYPES``;
    bfloat16 needs an even ``in``): [R, out] in that dtype, each number summed in fp32 from the stored ones (so to
    fp32 rounding of torch's) and rounded once, the weight's rows spread over the threads (linear_loops.py).
    ``operands``: ``linear_operands(weight, bias)``, kept from an earlier call."""
    count, outputs = rows.shape[0], weight.shape[0]
    out = torch.empty(count, outputs, dtype=weight.dtype)
    if count == 0 or outputs == 0:
        return out
    words, added = operands if operands is not None else linear_operands(weight, bias)
    parts = min(_threads(), outputs)
    rows = rows.detach().contiguous()
    if weight.dtype == torch.bfloat16:
        _linear_rows_bf16(words, rows.view(torch.int16).numpy().view(np.uint16), added,
                          out.view(torch.int16).numpy().view(np.uint16), parts)
    else:
        _linear_rows_f32(words, rows.numpy(), added, out.numpy(), parts)
    return out


def weighted_sum(states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[nq, d] fp32 = sum_j weights[q, j] * states[ids[q, j]], summed in fp32 from the stored numbers: states
    [N, d] (CPU, ``SCAN_DTYPES``; bfloat16 needs an even d), ids [nq, k] int64, weights [nq, k]. One read of each
    chosen state, widened in registers: no gathered copy (``usable_states``). Where the queries choose each state
    ``BLOCKED_SUMS_MIN_READS`` times or more on average (a reading's 16-64 positions per head), block by block
    of the states, every query's share of a block summed while it is in cache (``_sums_blocked``)."""
    nq, dim = ids.shape[0], states.shape[1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= states.shape[0]):  # the kernels do not check
        raise IndexError(f"state ids outside 0..{states.shape[0] - 1}")
    blocked = ids.numel() >= BLOCKED_SUMS_MIN_READS * states.shape[0]
    ids = ids.to(torch.long).contiguous().numpy()
    weights = weights.detach().to(torch.float32).contiguous().numpy()
    parts = min(_threads(), nq)
    if states.dtype == torch.bfloat16:
        words = states.contiguous().view(torch.int32).numpy().view(np.uint32)  # [N, d/2]
        even = np.empty((nq, dim // 2), np.float32)
        odd = np.empty((nq, dim // 2), np.float32)
        if blocked:
            _sums_blocked_parts_bf16(words, ids, weights, even, odd, parts)
        else:
            _sums_queries_bf16(words, ids, weights, even, odd)
        return torch.from_numpy(np.stack((even, odd), axis=2).reshape(nq, dim))
    out = np.empty((nq, dim), np.float32)
    if blocked:
        _sums_blocked_parts_f32(states.contiguous().numpy(), ids, weights, out, np.empty((nq, 0), np.float32),
                                parts)
    else:
        _sums_queries_f32(states.contiguous().numpy(), ids, weights, out)
    return torch.from_numpy(out)


def dense_sum(states: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[nq, d] fp32 = weights [nq, N] @ states [N, d], summed in fp32 from the stored numbers (``weighted_sum``'s
    states): one read of the states, each block of rows met by every query while it is in cache; the rows split
    among the threads, their partial sums added at the end."""
    nq, dim = weights.shape[0], states.shape[1]
    n = states.shape[0]
    weights = weights.detach().to(torch.float32).contiguous().numpy()
    parts = max(1, min(_threads(), n // 1024))  # at least a few hundred KiB of states each
    bounds = np.linspace(0, n, parts + 1).round().astype(np.int64)
    if states.dtype == torch.bfloat16:
        words = states.contiguous().view(torch.int32).numpy().view(np.uint32)  # [N, d/2]
        even = np.empty((parts, nq, dim // 2), np.float32)
        odd = np.empty((parts, nq, dim // 2), np.float32)
        _dense_sums_parts_bf16(words, weights, bounds, even, odd)
        return torch.from_numpy(np.stack((even.sum(0), odd.sum(0)), axis=2).reshape(nq, dim))
    out = np.empty((parts, nq, dim), np.float32)
    _dense_sums_parts_f32(states.contiguous().numpy(), weights, bounds, out)
    return torch.from_numpy(out.sum(0))


def head_dense_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[H, nq, dh] fp32 = weights [H, nq, N] @ values [H, N, dh] for each head (CPU, ``SCAN_DTYPES``; bfloat16
    needs an even dh): one read of each head's values where they lie (``_head_rows``), widened in registers and
    summed in fp32; the heads spread over the threads."""
    heads, n, head_dim = values.shape
    nq = weights.shape[1]
    if n == 0 or nq == 0:
        return torch.zeros(heads, nq, head_dim)
    rows, pitch = _head_rows(values)
    weights = weights.detach().to(torch.float32).contiguous().numpy()  # [H, nq, N]
    _threads()
    if values.dtype == torch.bfloat16:
        even = np.empty((heads, nq, head_dim // 2), np.float32)
        odd = np.empty((heads, nq, head_dim // 2), np.float32)
        _dense_sums_heads_bf16(rows, heads, pitch, n, weights, even, odd)
        return torch.from_numpy(np.stack((even, odd), axis=3).reshape(heads, nq, head_dim))
    out = np.empty((heads, nq, head_dim), np.float32)
    _dense_sums_heads_f32(rows, heads, pitch, n, weights, out)
    return torch.from_numpy(out)


def attend_dense(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor,
                 coverage: torch.Tensor | None = None, kept: torch.Tensor | None = None) -> torch.Tensor:
    """[H, nq, dv] fp32 = softmax(queries K^T) V for each head: keys [H, N, dh], values [H, N, dv] (CPU, one of
    ``SCAN_DTYPES``, both the same; bfloat16 needs even dh and dv), queries [H, nq, dh] (scaling folded in). One
    pass over each head's keys and values where they lie: a block's scores, their weights under running maxima
    and sums (as ``kernels._online_softmax``, exp floored at EXP_FLOOR) and its values' sums, in cache; no scores
    written. A row whose scores are all NaN sums to zeros.

    ``coverage`` [N]: every head's and query's weights added to it. Then each block's weights are left in
    ``kept`` (a [H * nq * N] fp32 buffer or larger, reused: a fresh one would be page-faulted in every step; one
    of that size where not given) and summed once the peaks are known, in a second pass over them only."""
    heads, n, _ = keys.shape
    nq, value_dim = queries.shape[1], values.shape[2]
    if n == 0 or nq == 0:
        return torch.zeros(heads, nq, value_dim)
    if values.dtype != keys.dtype or values.shape[:2] != keys.shape[:2]:
        raise ValueError(f"attend_dense needs values [H, N, dv] of the keys' dtype, got {tuple(values.shape)} "
                         f"{values.dtype} for keys {tuple(keys.shape)} {keys.dtype}")
    key_rows, key_pitch = _head_rows(keys)
    value_rows, value_pitch = _head_rows(values)
    blocks = -(-n // BLOCK_ROWS)
    if coverage is None:
        weights = np.empty((heads, nq, 0), np.float32)
        block_peaks = np.empty((heads, nq, 0), np.float32)
    else:
        if kept is None:
            kept = torch.empty(heads * nq * n)
        if kept.dtype != torch.float32 or not kept.is_contiguous() or kept.numel() < heads * nq * n:
            raise ValueError(f"attend_dense kept= must be a contiguous float32 buffer of {heads * nq * n} or more")
        weights = kept.reshape(-1)[:heads * nq * n].view(heads, nq, n).numpy()
        block_peaks = np.empty((heads, nq, blocks), np.float32)
    peak = np.empty((heads, nq), np.float32)
    total = np.empty((heads, nq), np.float32)
    out = np.empty((heads, nq, value_dim), np.float32)  # bfloat16: each row's even dimensions, then its odd ones
    _threads()
    if keys.dtype == torch.bfloat16:
        _attend_dense_heads_bf16(key_rows, value_rows, heads, key_pitch, value_pitch, n,
                                 *_query_args(queries, keys.dtype), weights, block_peaks, peak, total, out)
        halves = out.reshape(heads, nq, 2, value_dim // 2)
        out = np.ascontiguousarray(halves.transpose(0, 1, 3, 2)).reshape(heads, nq, value_dim)
    else:
        _attend_dense_heads_f32(key_rows, value_rows, heads, key_pitch, value_pitch, n,
                                *_split_queries(queries, keys.dtype), weights, block_peaks, peak, total, out)
    if coverage is not None:
        added = np.empty(n, np.float32)
        _coverage(weights, block_peaks, peak, total, added)
        coverage += torch.from_numpy(added).to(coverage.dtype)
    return torch.from_numpy(out)


# --- where the bfloat16 scores put the keys in the lanes: measured once per machine ----------------------------

# the counts of queries a head raced each way (``measure_tiled_from``); from TILED_ALWAYS on the keys go into the
# lanes on every machine (64 queries a head measured 1.64x faster there on an EPYC Zen 2; 48 1.10-1.16x on a Zen 4)
TILED_RACED_QUERIES = (8, 16, 32)
TILED_ALWAYS = 64
TILED_KEYS = 16_384  # the store raced on: 12 heads (bart-base's), k = 1,024
_TILED_FROM: dict[int, int] = {}  # this process's answers, by head width


def tiled_from(head_dim: int) -> int:
    """Queries a head from which the bfloat16 scores of keys ``head_dim`` numbers wide put the keys in the lanes
    (score_loops.py: a tile of keys transposed once for all the queries) rather than summing four queries at a
    time: measured once per machine (``measure_tiled_from``) and kept (unlimisum/measurements.py), since where
    the two ways cross differs from CPU to CPU (8 queries on an EPYC Zen 2, 32 on a Zen 4). Until the scan or the
    grouped select runs in this process (checked or called once: no measurement compiles one),
    score_loops.TILED_MIN_QUERIES."""
    found = _TILED_FROM.get(head_dim)
    if found is not None:
        return found
    if _tiled_race_driver() is None:
        return TILED_MIN_QUERIES
    measured = measurements.remembered(f"scan keys in the lanes, dh={head_dim}",
                                       lambda: measure_tiled_from(head_dim))
    try:
        found = int(measured.value)
    except (TypeError, ValueError):  # a damaged entry: measured again, for this process
        found = measure_tiled_from(head_dim)[0]
    _TILED_FROM[head_dim] = found
    return found


def _tiled_race_driver() -> str | None:
    """Which compiled driver ``measure_tiled_from`` times: "scan" (``select``'s) where it runs in this process,
    else "grouped" (``select_grouped``'s, a group of one: decoder-only generation), else None."""
    if _READY.get(_key("select", torch.bfloat16), False) or _scan_heads_bf16.signatures:
        return "scan"
    if _READY.get(_key("select_grouped", torch.bfloat16), False) or _select_grouped_heads_bf16.signatures:
        return "grouped"
    return None


def _asks_tiled_from(queries_per_head: int) -> bool:
    """Whether the scores of ``queries_per_head`` queries a head go by the count this machine measured: from
    TILED_MIN_QUERIES, below TILED_ALWAYS (elsewhere every machine sums them the same way)."""
    return TILED_MIN_QUERIES <= queries_per_head < TILED_ALWAYS


def measure_before_timing(keys: torch.Tensor, queries_per_head: int, kernel: str = "select") -> None:
    """Take this machine's ``tiled_from`` for keys like ``keys`` [H, n, dh] now, where that many queries a head
    would ask for it, so that a race timing the first call of ``kernel`` (``select`` or ``select_grouped``) does
    not time the measurement with it."""
    if (keys.device.type == "cpu" and keys.dtype == torch.bfloat16 and _asks_tiled_from(queries_per_head)
            and usable(keys, kernel)):
        tiled_from(keys.shape[2])


def measure_tiled_from(head_dim: int, *, timer: Callable[[Callable[[], object]], float] | None = None,
                       n: int = TILED_KEYS) -> tuple[int, str]:
    """(the fewest of TILED_RACED_QUERIES queries a head from which the keys in the lanes select faster than the
    four-query sums, else TILED_ALWAYS; what was measured): the compiled scan (``_tiled_race_driver``: or the
    grouped select, groups of one) of ``n`` random bfloat16 keys of 12 heads, k = 1,024, both ways raced in turns
    for each count (``measurements.race``; ``timer``: seconds of one call, for tests)."""
    generator = torch.Generator().manual_seed(11)
    heads, k = 12, min(1024, n)
    keys = torch.randn(heads, n, head_dim, generator=generator).to(torch.bfloat16)
    rows, pitch = _head_rows(keys)
    _threads()
    grouped = _tiled_race_driver() == "grouped"
    by = ", the grouped select's" if grouped else ""
    said = []
    for count in TILED_RACED_QUERIES:
        even, odd = _split_queries(torch.randn(heads, count, head_dim, generator=generator) * head_dim ** -0.5,
                                   torch.bfloat16)
        scores = np.empty((heads, count, k), np.float32)
        ids = np.empty((heads, count, k), np.int64)

        def scan(from_count: int, even=even, odd=odd, scores=scores, ids=ids, count=count) -> None:
            if grouped:
                _select_grouped_heads_bf16(rows, heads, pitch, n, even, odd, from_count, 1, k, 1, scores, ids)
            else:
                _scan_heads_bf16(rows, heads, pitch, n, even, odd, from_count, k, scores, ids,
                                 np.empty((heads, count, 0), np.float32))

        best = measurements.race({"lanes": lambda: scan(count), "sums": lambda: scan(count + 1)}, timer=timer)
        said.append(f"{count} queries: in the lanes {best['lanes'] * 1e3:.2f} ms, four at a time "
                    f"{best['sums'] * 1e3:.2f} ms")
        if best["lanes"] < best["sums"]:
            return count, f"keys in the lanes from {count} queries a head ({'; '.join(said)}; {n:,} keys{by})"
    return TILED_ALWAYS, f"keys in the lanes from {TILED_ALWAYS} queries a head ({'; '.join(said)}; {n:,} keys{by})"


# --- which kernels run here: each compiled when a run first needs it, and checked against torch -----------------

KERNELS = ("select", "select_grouped", "scores", "weighted_sum", "dense_sum", "head_dense_sum", "attend_dense",
           "top_k", "linear")
SCORES_KERNELS = ("top_k",)  # read fp32 scores whatever the store holds: ready once, as for a float32 store
# seconds each kernel took to compile from an empty cache, for the estimate the display shows while a first run
# waits for them: ``python -m bench.compile_time --dtypes bfloat16`` (a fresh process each, after the kernels a run
# compiles before it; one dtype, bfloat16 but the top-k's; a 2-core EPYC Zen 4, numba 0.68; medians of two, once
# the drivers called their kernels by address; linear once its shares were one). select and scores share one driver: the first of the two takes the
# time. The grouped select first in a process (a decoder-only run's) took 8.9 s; loading a compiled kernel takes
# ~0.1 s. The same compile differs by up to 5 s from one process to the next.
COMPILE_SECONDS = {"select": 8.6, "select_grouped": 8.5, "scores": 0.1, "weighted_sum": 3.0, "dense_sum": 1.4,
                   "head_dense_sum": 1.2, "attend_dense": 4.4, "top_k": 3.2, "linear": 0.9}

# warm's thread loads kernels compiled before in about 0.5 s (all seven and numba's import, EPYC Zen 2): one that
# is alive after this long is compiling
LOADING_SECONDS = 1.0

_READY: dict[tuple[str, torch.dtype], bool] = {}
_LOCKS: dict[tuple[str, torch.dtype], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def usable_states(states: torch.Tensor, kernel: str = "weighted_sum") -> bool:
    """Whether ``kernel`` (``weighted_sum``, ``dense_sum`` or ``linear``) can read these states [N, d] (or a
    weight [out, in]) here."""
    return usable(states.unsqueeze(0), kernel)


def usable(keys: torch.Tensor, kernel: str = "select") -> bool:
    """Whether the compiled ``kernel`` can read these keys [H, n, dh] here: on the CPU, in ``SCAN_DTYPES``, an even
    dh for bfloat16, and the kernel ``ready`` (compiled or loaded now where it is not yet)."""
    return (keys.device.type == "cpu" and keys.dtype in SCAN_DTYPES
            and (keys.dtype != torch.bfloat16 or keys.shape[2] % 2 == 0) and ready(kernel, keys.dtype))


def ready(kernel: str, dtype: torch.dtype) -> bool:
    """Whether the compiled ``kernel`` (one of ``KERNELS``) runs here for keys and states of ``dtype``: numba
    imports, the kernel compiles (or loads from the kernel cache: so that no measurement times a compile) and on
    a small store finds what torch finds. Checked once per process; where ``warm`` is compiling it, this waits."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown compiled kernel {kernel!r}; one of {', '.join(KERNELS)}")
    if numba is None or dtype not in SCAN_DTYPES:
        return False
    key = _key(kernel, dtype)
    if key in _READY:
        return _READY[key]
    with _LOCKS_LOCK:
        lock = _LOCKS.setdefault(key, threading.Lock())
    with lock:
        if key not in _READY:
            try:
                _READY[key] = bool(_CHECKS[kernel](dtype))
            except Exception:  # noqa: BLE001 - a compiler or loader failure of any kind leaves the torch kernels
                _READY[key] = False
        return _READY[key]


def pending(kernels: Iterable[str], dtype: torch.dtype) -> list[str]:
    """Those of ``kernels`` not yet checked (compiled or loaded) in this process for ``dtype``, where they can run."""
    if numba is None or dtype not in SCAN_DTYPES:
        return []
    return [kernel for kernel in kernels if _key(kernel, dtype) not in _READY]


def is_ready(kernel: str) -> bool:
    """Whether ``kernel`` of ``SCORES_KERNELS`` was made ready in this process (never compiles it: callers that
    may not compile, a short store's, ask this)."""
    return _READY.get(_key(kernel, torch.float32), False)


def _key(kernel: str, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    return kernel, torch.float32 if kernel in SCORES_KERNELS else dtype


def warm(kernels: Iterable[str], dtype: torch.dtype,
         also: Iterable[tuple[str, torch.dtype]] = ()) -> threading.Thread | None:
    """Compile (or load) ``kernels`` for ``dtype``, and each (kernel, dtype) of ``also``, in a thread of their own,
    so that they are ready when a run first calls them (a book being encoded meanwhile; measured on 2 cores: a 12 s
    encode took 20 s beside 12 s of compiling, where one after the other take 24 s). The thread, or None when there
    is nothing to do."""
    wanted = [(kernel, dtype) for kernel in kernels] + list(also)
    missing = [(kernel, of) for kernel, of in dict.fromkeys(wanted) if pending([kernel], of)]
    if not missing:
        return None
    thread = threading.Thread(target=lambda: [ready(kernel, of) for kernel, of in missing],
                              name="unlimisum-compile", daemon=True)
    thread.start()
    return thread


@contextmanager
def core_for(compiling: threading.Thread | None) -> Iterator[Callable[[], None]]:
    """Within: torch computes on one thread fewer while ``compiling`` (``warm``'s thread) is alive, so that the
    compile has a core of its own. Beside a matmul on every core it would stall all of torch's threads in turn
    (measured on the EPYC (Zen 2), 2 cores: 25 s of compiling added 25 s to a 30 s encode, nothing overlapped).
    Yields a function that gives torch its thread back once the compile has ended (call it between batches); on
    exit torch has its threads back either way. Nothing changes where torch has one thread or nothing compiles,
    nor where the thread ends within LOADING_SECONDS (it loaded kernels compiled before: waited for, rather than
    a whole first batch encoded on one thread, 1.7 s more on a later run of a 10k- or 16k-token book)."""
    threads = torch.get_num_threads()
    if compiling is not None and threads >= 2:
        compiling.join(timeout=LOADING_SECONDS)
    if compiling is None or threads < 2 or not compiling.is_alive():
        yield lambda: None
        return
    torch.set_num_threads(threads - 1)
    given_back = False

    def give_back_when_compiled() -> None:
        nonlocal given_back
        if not given_back and not compiling.is_alive():
            torch.set_num_threads(threads)
            given_back = True

    try:
        yield give_back_when_compiled
    finally:
        if not given_back:
            torch.set_num_threads(threads)


def wait_ready(needed: Iterable[tuple[str, torch.dtype]],
               report: Callable[[int, int, float], None] | None = None) -> None:
    """Make every (kernel, dtype) of ``needed`` ready here, waiting for ``warm``'s thread where it is compiling
    one; ``report(done, total, seconds_left)`` before the first and after each, ``seconds_left`` estimated from
    COMPILE_SECONDS (nothing is reported where every one is ready already)."""
    missing = [(kernel, dtype) for kernel, dtype in dict.fromkeys(needed) if pending([kernel], dtype)]
    for done, (kernel, dtype) in enumerate(missing):
        if report is not None:
            report(done, len(missing), sum(COMPILE_SECONDS[name] for name, _ in missing[done:]))
        ready(kernel, dtype)
    if missing and report is not None:
        report(len(missing), len(missing), 0.0)


def _small_keys(dtype: torch.dtype):
    """Small stores the checks run on: keys [3, 700, 8] (several blocks and cuts), queries [3, 2, 8]; wide keys
    [2, 303, 32] (16 words a key: the explicit vectors; four keys at a time, then three), queries [2, 7, 32] (four
    at a time, then three; the select checks also the first five: four, then one against four keys at a time)."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 700, 8, generator=generator).to(dtype)
    queries = torch.randn(3, 2, 8, generator=generator)
    wide = torch.randn(2, 303, 32, generator=generator).to(dtype)
    wide_queries = torch.randn(2, 7, 32, generator=generator)
    return keys, queries, wide, wide_queries


def _scores_of(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hqd,hnd->hqn", queries, keys.float())


def _check_select(dtype: torch.dtype) -> bool:
    keys, queries, wide, wide_queries = _small_keys(dtype)
    found = []
    for k, q in ((keys, queries), (wide, wide_queries), (wide, wide_queries[:, :5]), (wide, wide_queries[:, :1])):
        scores, ids = select(k, q, 5)
        scores, order = scores.sort(dim=2, descending=True)
        expected = _scores_of(k, q).topk(5, dim=2)
        found.append(torch.equal(ids.gather(2, order), expected.indices)
                     and torch.allclose(scores, expected.values, atol=1e-4))
    return all(found)


def _check_select_grouped(dtype: torch.dtype) -> bool:
    keys, queries, _, _ = _small_keys(dtype)
    long_keys = torch.randn(1, 2_500, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    found = []
    # 3 KV heads of 2 query heads each; one head of 2,500 keys in 3 parts (none, 1,024 keys, the rest) and whole
    for k, q, parts in ((keys, queries, 1), (long_keys, queries[:1], 3), (long_keys, queries[:1], 1)):
        scores, ids = torch.empty(k.shape[0], 1, 5), torch.empty(k.shape[0], 1, 5, dtype=torch.long)
        _select_grouped_in(k, q, 2, 5, scores, ids, parts)  # [G, 1, 5]
        expected = _scores_of(k, q).amax(dim=1).topk(5, dim=1)  # [G, 5]: the largest of each head's 2 scores
        scores, order = scores[:, 0].sort(dim=1, descending=True)
        found.append(torch.equal(ids[:, 0].gather(1, order), expected.indices)
                     and torch.allclose(scores, expected.values, atol=1e-4))
    return all(found)


def _check_scores(dtype: torch.dtype) -> bool:
    keys, queries, wide, wide_queries = _small_keys(dtype)
    return all(torch.allclose(scores(k, q), _scores_of(k, q), atol=1e-4)
               for k, q in ((keys, queries), (wide, wide_queries), (wide, wide_queries[:, :5])))


def _check_weighted_sum(dtype: torch.dtype) -> bool:
    """Per query (2 x 5 of 700 states), and blocked (10 x 300: each state chosen about 4 times)."""
    keys, _, _, _ = _small_keys(dtype)
    generator = torch.Generator().manual_seed(1)
    found = []
    for shape in ((2, 5), (10, 300)):
        ids = torch.randint(0, keys.shape[1], shape, generator=generator)
        weights = torch.rand(shape, generator=generator)
        expected = torch.einsum("qk,qkd->qd", weights.double(), keys[0].double()[ids]).float()
        found.append(torch.allclose(weighted_sum(keys[0], ids, weights), expected, atol=1e-4))
    return all(found)


def _check_dense_sum(dtype: torch.dtype) -> bool:
    keys, queries, _, _ = _small_keys(dtype)
    weights = _scores_of(keys, queries)[0]  # [2, 700]
    return torch.allclose(dense_sum(keys[0], weights), weights @ keys[0].float(), rtol=1e-4, atol=1e-3)


def _check_head_dense_sum(dtype: torch.dtype) -> bool:
    keys, queries, _, _ = _small_keys(dtype)
    weights = _scores_of(keys, queries)  # [3, 2, 700]
    return torch.allclose(head_dense_sum(keys, weights), torch.bmm(weights, keys.float()), rtol=1e-4, atol=1e-3)


def _check_attend_dense(dtype: torch.dtype) -> bool:
    _, _, wide, wide_queries = _small_keys(dtype)
    covered = torch.zeros(wide.shape[1])
    attended = attend_dense(wide, wide, wide_queries, covered)  # [2, 7, 32]: the keys as their own values
    weights = torch.softmax(_scores_of(wide, wide_queries), dim=2)
    return (torch.allclose(attended, weights @ wide.float(), rtol=1e-4, atol=1e-4)
            and torch.allclose(covered, weights.sum(dim=(0, 1)), rtol=1e-4, atol=1e-5))


def _check_top_k(dtype: torch.dtype) -> bool:
    """On rows of 700 (sampled floors), 40 (none), ties, infinities and a NaN (left to torch)."""
    generator = torch.Generator().manual_seed(2)
    found = []
    for rows, n, k in ((5, 700, 9), (3, 40, 7)):
        scores = torch.randn(rows, n, generator=generator)
        scores[0, ::3] = 0.5  # ties
        scores[1, 5], scores[1, 9] = float("inf"), float("-inf")
        scores[2, 2] = float("nan")
        values, ids = top_k(scores, k)
        expected = scores.topk(k, dim=1)
        ordered = values.nan_to_num(7.0).sort(dim=1, descending=True).values  # NaN as torch orders it: first
        found.append(torch.equal(ordered, expected.values.nan_to_num(7.0))
                     and torch.equal(scores.gather(1, ids).nan_to_num(7.0), values.nan_to_num(7.0)))
    return all(found)


def _check_linear(dtype: torch.dtype) -> bool:
    """One row and three, with a bias and without, against fp64 products of the same numbers rounded once to
    ``dtype`` (an output row count not a multiple of the threads', an odd count of words): equal in bfloat16 but
    where the fp32 sum sits at a rounding boundary, within fp32 rounding in float32."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 26, generator=generator).to(dtype)
    bias = torch.randn(37, generator=generator).to(dtype)
    found = []
    for count, added in ((1, None), (3, bias)):
        rows = torch.randn(count, 26, generator=generator).to(dtype)
        expected = rows.double() @ weight.double().t() + (added.double() if added is not None else 0.0)
        product = linear(rows, weight, added)
        found.append(product.dtype == dtype and torch.allclose(product.double(), expected.to(dtype).double(),
                                                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                                                               atol=1e-5))
    return all(found)


_CHECKS = {"select": _check_select, "select_grouped": _check_select_grouped, "scores": _check_scores,
           "weighted_sum": _check_weighted_sum, "dense_sum": _check_dense_sum,
           "head_dense_sum": _check_head_dense_sum, "attend_dense": _check_attend_dense, "top_k": _check_top_k,
           "linear": _check_linear}
