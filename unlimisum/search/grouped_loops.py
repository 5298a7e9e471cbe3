"""The grouped select's loops (numba; compiled.py ``select_grouped``, decoder-only generation under grouped-query
attention): the g query heads that share a key-value head make one selection for it, each key scored by the
largest of their g scores, a running top-k per row (beam) over blocks of the head's keys (compiled_loops.py's
``_keep``).

A key-value head is one thread's work, so a model with fewer of them than the machine has threads (Gemma 3 1B has
one, Qwen2.5 0.5B-3B two) left the other cores idle: each head's keys are scanned in ``parts_of`` parts, every
part on a thread of its own keeping its candidates as the whole scan does (blocks and cuts from -inf), and a
head's parts' candidates merged. A part starts at a multiple of BLOCK_ROWS, so its blocks are the whole scan's
blocks: every score is the sum the unsplit scan computes, and the k best of a head's candidates from all its
parts are its k best. Where scores tie at the k-th, which of the tied keys are kept may follow the parts, as it
follows the kernel a machine's race chooses (compiled.py: ties are broken arbitrarily, as ``torch.topk`` does).
One parallel driver per dtype serves one part a head as well; the part's scan and the merge are compiled once.
"""

from __future__ import annotations

import numba
import numpy as np

from unlimisum.search import jit
from unlimisum.search.compiled_loops import BLOCK_ROWS, _capacity, _finish, _keep
from unlimisum.search.jit import CACHED as _CACHED
from unlimisum.search.jit import kernel as _compile
from unlimisum.search.jit import callee, parallel_driver
from unlimisum.search.score_loops import _scores_bf16, _scores_f32

# keys a part holds at least: a part shorter than a few blocks spends more in its first blocks (every score a
# candidate until its buffer first fills) and in the merge than its thread saves
PART_MIN_KEYS = 8 * BLOCK_ROWS


def parts_of(heads: int, n: int, threads: int) -> int:
    """How many parts each of ``heads`` heads of ``n`` keys is scanned in on ``threads`` threads: enough for a
    part a thread, each of at least PART_MIN_KEYS keys; 1 where the heads occupy every thread (more parts than
    threads cost their merge: 2 key-value heads in 8 parts on 2 threads measured 0.86-0.98x)."""
    if heads >= threads:
        return 1
    return max(1, min(-(-threads // heads), n // PART_MIN_KEYS))


jit.begin_decorations()


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _group_max(scored, group, count, out):
    """out [B, :count] = the largest of each row's ``group`` scores: scored [B * group, :count], row b's
    queries b * group .. b * group + group - 1."""
    for b in range(out.shape[0]):
        first = b * group
        for r in range(count):
            out[b, r] = scored[first, r]
        for j in range(first + 1, first + group):
            for r in range(count):
                out[b, r] = max(out[b, r], scored[j, r])


@_compile
def _grouped_part_bf16(words, even, odd, group, k, tiled_from, first, kept, kept_ids, held):
    """Each row's candidates among bfloat16 keys ``words`` [n, dh/2] (``_scores_bf16``'s layout), numbered from
    ``first``, by the largest score of its ``group`` queries (``even``/``odd`` [B * group, dh/2], ``_group_max``'s
    order): appended to kept/kept_ids [B, ``_capacity(k)``], ``held`` [B] of them each, cut as they fill."""
    n = words.shape[0]
    rows = kept.shape[0]
    scored = np.empty((even.shape[0], BLOCK_ROWS), np.float32)  # [B * group, BLOCK_ROWS]
    block = np.empty((rows, BLOCK_ROWS), np.float32)
    threshold = np.full(rows, -np.inf, np.float32)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_bf16(words[start:start + count], even, odd, scored[:, :count], tiled_from)
        _group_max(scored, group, count, block)
        _keep(block, first + start, count, kept, kept_ids, held, threshold, k)


@_compile
def _grouped_part_f32(keys, queries, group, k, first, kept, kept_ids, held):
    """``_grouped_part_bf16`` for fp32 keys [n, dh], queries [B * group, dh]."""
    n = keys.shape[0]
    rows = kept.shape[0]
    scored = np.empty((queries.shape[0], BLOCK_ROWS), np.float32)
    block = np.empty((rows, BLOCK_ROWS), np.float32)
    threshold = np.full(rows, -np.inf, np.float32)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_f32(keys[start:start + count], queries, scored[:, :count])
        _group_max(scored, group, count, block)
        _keep(block, first + start, count, kept, kept_ids, held, threshold, k)


@_compile
def _merged(kept, kept_ids, held, k, out_scores, out_ids):
    """out_scores/out_ids [B, k] = each row's k best of its parts' candidates ``kept``/``kept_ids`` [P, B, c],
    ``held`` [P, B] of them each, in no order (``_finish``: -inf with id 0 where fewer than k)."""
    parts, rows, _ = kept.shape
    values, ids, count = kept[0], kept_ids[0], held[0]
    if parts > 1:
        width = 0
        for b in range(rows):
            total = 0
            for p in range(parts):
                total += held[p, b]
            width = max(width, total)
        values = np.empty((rows, width), np.float32)
        ids = np.empty((rows, width), np.int64)
        count = np.zeros(rows, np.int64)
        for b in range(rows):
            n = 0
            for p in range(parts):
                for j in range(held[p, b]):
                    values[b, n] = kept[p, b, j]
                    ids[b, n] = kept_ids[p, b, j]
                    n += 1
            count[b] = n
    _finish(values, ids, count, k, out_scores, out_ids)  # one call: its inlined code compiled once


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _part_start(n, parts, part):
    """The first of n keys in part ``part`` of ``parts`` (n for ``part`` == parts): a multiple of BLOCK_ROWS."""
    if part == parts:
        return n
    return (n * part // parts) // BLOCK_ROWS * BLOCK_ROWS


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _part_buffers(units, rows, k):
    """Every unit's candidates, their ids [units, B, ``_capacity(k)``] and how many each row holds [units, B]
    (compiled_loops.py ``_candidates``' buffers, one set a unit)."""
    capacity = _capacity(k)
    return (np.empty((units, rows, capacity), np.float32), np.empty((units, rows, capacity), np.int64),
            np.zeros((units, rows), np.int64))


# the drivers: out_scores/out_ids [G, B, k]; head h's keys are rows[h * pitch:h * pitch + n] (compiled.py
# ``_head_rows``), each in ``parts`` parts, a part a thread, then each head's parts merged on a thread


# the kernels they call by address (jit.callee), with the numba types of the arguments they pass
_f32, _i64 = numba.types.float32, numba.types.int64
_call_part_bf16 = callee(_grouped_part_bf16, numba.types.uint32[:, ::1], _f32[:, ::1], _f32[:, ::1], _i64, _i64, _i64,
                         _i64, _f32[:, ::1], _i64[:, ::1], _i64[::1])
_call_part_f32 = callee(_grouped_part_f32, _f32[:, ::1], _f32[:, ::1], _i64, _i64, _i64, _f32[:, ::1], _i64[:, ::1],
                        _i64[::1])
_call_merged = callee(_merged, _f32[:, :, ::1], _i64[:, :, ::1], _i64[:, ::1], _i64, _f32[:, ::1], _i64[:, ::1])


@parallel_driver(_call_part_bf16, _call_merged)
def _select_grouped_heads_bf16(words, heads, pitch, n, even, odd, tiled_from, group, k, parts, out_scores,
                               out_ids, part_kernel, merged):
    kept, kept_ids, held = _part_buffers(heads * parts, even.shape[1] // group, k)
    for unit in numba.prange(heads * parts):
        h = unit // parts
        first = _part_start(n, parts, unit % parts)
        last = _part_start(n, parts, unit % parts + 1)
        _call_part_bf16(part_kernel, (words[h * pitch + first:h * pitch + last], even[h], odd[h], group, k,
                                      tiled_from, first, kept[unit], kept_ids[unit], held[unit]))
    for h in numba.prange(heads):
        units = slice(h * parts, (h + 1) * parts)
        _call_merged(merged, (kept[units], kept_ids[units], held[units], k, out_scores[h], out_ids[h]))


@parallel_driver(_call_part_f32, _call_merged)
def _select_grouped_heads_f32(keys, heads, pitch, n, queries, group, k, parts, out_scores, out_ids, part_kernel,
                              merged):
    kept, kept_ids, held = _part_buffers(heads * parts, queries.shape[1] // group, k)
    for unit in numba.prange(heads * parts):
        h = unit // parts
        first = _part_start(n, parts, unit % parts)
        last = _part_start(n, parts, unit % parts + 1)
        _call_part_f32(part_kernel, (keys[h * pitch + first:h * pitch + last], queries[h], group, k, first,
                                     kept[unit], kept_ids[unit], held[unit]))
    for h in numba.prange(heads):
        units = slice(h * parts, (h + 1) * parts)
        _call_merged(merged, (kept[units], kept_ids[units], held[units], k, out_scores[h], out_ids[h]))


jit.end_decorations()
