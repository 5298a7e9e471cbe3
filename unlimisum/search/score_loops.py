"""The loops that score queries against keys (numba): fp32 scores of bfloat16 keys (two numbers a 32-bit word,
widened in registers) or fp32 ones, a few queries at a time against one, two or four keys, or, from a count of
queries this machine measured (compiled.tiled_from), many against a tile of keys in the lanes. The scan, the
dense attention and the grouped select of compiled_loops.py score their blocks with these; llvm.py has the
instructions numba would not emit; jit.py how they are compiled and cached.
"""

from __future__ import annotations

import numba
import numpy as np

from unlimisum.search import jit
from unlimisum.search.jit import CACHED as _CACHED
from unlimisum.search.jit import kernel as _compile
from unlimisum.search.llvm import (_LANES, _SHIFT, _UPPER, TILE_KEYS, WIDE, _as_float, _dot_four_bf16,
    _dot_four_f32, _dot_three_bf16, _dot_three_f32, _dot_two_bf16, _dot_two_f32, _key_tile_bf16, _pair_four_bf16,
    _pair_four_f32, _pair_three_bf16, _pair_three_f32, _pair_two_bf16, _pair_two_f32, _prefetch, _quad_four_bf16,
    _quad_one_bf16, _quad_three_bf16, _quad_two_bf16, _tile_scores_one, _tile_scores_two)

# queries from which bfloat16 keys are scored with the keys in the lanes (``_scores_tiled_bf16``) where nothing
# else is asked: fewer keep the few-query sums below on every machine (4 queries measured 0.8x on an EPYC Zen 2);
# from here on, where the keys go into the lanes is measured per machine (compiled.tiled_from: from 8 queries on
# the EPYC Zen 2, 1.17x; from 32 on a Zen 4, 64 as AVX2, where 8 queries ran 1.3-1.7x slower in the lanes)
TILED_MIN_QUERIES = 8

jit.begin_decorations()


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _dot_bf16(words, row, even, odd, first, count, out):
    """``_dot_bf16_of(count, 1)`` for a count of 2, 3 or 4 (so that one loop serves them)."""
    if count == 4:
        _dot_four_bf16(words, row, even, odd, first, out)
    elif count == 3:
        _dot_three_bf16(words, row, even, odd, first, out)
    else:
        _dot_two_bf16(words, row, even, odd, first, out)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _pair_bf16(words, row, even, odd, first, count, out):
    """``_dot_bf16_of(count, 2)``: keys row and row + 1."""
    if count == 4:
        _pair_four_bf16(words, row, even, odd, first, out)
    elif count == 3:
        _pair_three_bf16(words, row, even, odd, first, out)
    else:
        _pair_two_bf16(words, row, even, odd, first, out)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _quad_bf16(words, row, even, odd, first, count, out):
    """``_dot_bf16_of(count, 4)``: keys row to row + 3."""
    if count == 4:
        _quad_four_bf16(words, row, even, odd, first, out)
    elif count == 3:
        _quad_three_bf16(words, row, even, odd, first, out)
    else:
        _quad_two_bf16(words, row, even, odd, first, out)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _dot_f32(keys, row, queries, first, count, out):
    """``_dot_f32_of(count, 1)`` for a count of 2, 3 or 4."""
    if count == 4:
        _dot_four_f32(keys, row, queries, first, out)
    elif count == 3:
        _dot_three_f32(keys, row, queries, first, out)
    else:
        _dot_two_f32(keys, row, queries, first, out)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _pair_f32(keys, row, queries, first, count, out):
    """``_dot_f32_of(count, 2)``: keys row and row + 1."""
    if count == 4:
        _pair_four_f32(keys, row, queries, first, out)
    elif count == 3:
        _pair_three_f32(keys, row, queries, first, out)
    else:
        _pair_two_f32(keys, row, queries, first, out)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _tile_scores(tile, even, odd, first, count, out, column):
    """``_tile_scores_of(count)`` for a count of 1 or 2."""
    if count == 2:
        _tile_scores_two(tile, even, odd, first, out, column)
    else:
        _tile_scores_one(tile, even, odd, first, out, column)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _scores_tiled_bf16(words, even, odd, out):
    """``_scores_bf16`` with the keys in the lanes: each tile of TILE_KEYS keys transposed once, then met by
    every query, two at a time; the last keys in a tile of their own padded with zeros (dh/2 a multiple of 8)."""
    n, half = words.shape
    queries = even.shape[0]
    tile = np.empty((2 * half, TILE_KEYS), np.float32)
    whole = n - n % TILE_KEYS
    for r in range(0, whole, TILE_KEYS):
        _prefetch(words, r, TILE_KEYS)
        _key_tile_bf16(words, r, tile)
        for first in range(0, queries, 2):
            _tile_scores(tile, even, odd, first, min(2, queries - first), out, r)
    if whole < n:
        padded = np.zeros((TILE_KEYS, half), np.uint32)
        for r in range(whole, n):
            for d in range(half):
                padded[r - whole, d] = words[r, d]
        last = np.empty((queries, TILE_KEYS), np.float32)
        _key_tile_bf16(padded, 0, tile)
        for first in range(0, queries, 2):
            _tile_scores(tile, even, odd, first, min(2, queries - first), last, 0)
        for q in range(queries):
            for r in range(whole, n):
                out[q, r] = last[q, r - whole]


@_compile
def _scores_bf16(words, even, odd, out, tiled_from):
    """out [nq, n] = fp32 scores of queries (``even``/``odd`` [nq, dh/2] dimensions) against bfloat16 keys
    ``words`` [n, dh/2] uint32 (two keys' numbers a word: the even one in the lower half), with the keys in the
    lanes from ``tiled_from`` queries on. Each score is the same sum wherever its query sits among the others."""
    n, half = words.shape
    queries = even.shape[0]
    if half % _LANES == 0 and queries >= max(tiled_from, TILED_MIN_QUERIES):
        _scores_tiled_bf16(words, even, odd, out)
        return
    first = 0
    # in explicit vectors four at a time, then the two or three after the last four (a group of 7: 4 + 3), or the
    # one after them against four keys at a time
    while half % _LANES == 0 and queries - first >= 2:
        count = min(4, queries - first)
        r = 0
        if WIDE:  # four keys at a time in 16 lanes: as many sums in flight as in 8 lanes
            while r + 4 <= n:
                if first == 0:
                    _prefetch(words, r, 4)
                _quad_bf16(words, r, even, odd, first, count, out)
                r += 4
        while r + 2 <= n:  # two keys at a time: each query's lanes loaded once for both
            if first == 0:  # later queries find the block in cache
                _prefetch(words, r, 2)
            _pair_bf16(words, r, even, odd, first, count, out)
            r += 2
        if r < n:
            _dot_bf16(words, n - 1, even, odd, first, count, out)
        first += count
    # one query (a greedy step's): four keys at a time (measured 1.26x at 16k keys, as fast at 300k, where memory
    # bounds it; for fp32 keys 0.8x: those keep the loop numba writes)
    if half % _LANES == 0 and queries - first == 1:
        for r in range(0, n - 3, 4):
            if first == 0:
                _prefetch(words, r, 4)
            _quad_one_bf16(words, r, even, odd, first, out)
        for r in range(n - n % 4, n):
            total = np.float32(0.0)
            for d in range(half):
                word = words[r, d]
                total += _as_float(word << _SHIFT) * even[first, d] + _as_float(word & _UPPER) * odd[first, d]
            out[first, r] = total
        first += 1
    while first + 4 <= queries:  # four queries at a time: each word widened once for the four
        for r in range(n):
            if first == 0:
                _prefetch(words, r, 1)
            t0 = np.float32(0.0)
            t1 = np.float32(0.0)
            t2 = np.float32(0.0)
            t3 = np.float32(0.0)
            for d in range(half):
                word = words[r, d]
                low = _as_float(word << _SHIFT)
                high = _as_float(word & _UPPER)
                t0 += low * even[first, d] + high * odd[first, d]
                t1 += low * even[first + 1, d] + high * odd[first + 1, d]
                t2 += low * even[first + 2, d] + high * odd[first + 2, d]
                t3 += low * even[first + 3, d] + high * odd[first + 3, d]
            out[first, r] = t0
            out[first + 1, r] = t1
            out[first + 2, r] = t2
            out[first + 3, r] = t3
        first += 4
    for q in range(first, queries):
        for r in range(n):
            if q == 0:
                _prefetch(words, r, 1)
            total = np.float32(0.0)
            for d in range(half):
                word = words[r, d]
                total += _as_float(word << _SHIFT) * even[q, d] + _as_float(word & _UPPER) * odd[q, d]
            out[q, r] = total


@_compile
def _scores_f32(keys, queries, out):
    """out [nq, n] = fp32 scores of queries [nq, dh] against fp32 keys [n, dh]."""
    n, dim = keys.shape
    first = 0
    while dim % _LANES == 0 and queries.shape[0] - first >= 2:  # as ``_scores_bf16``: 4, then 2 or 3
        count = min(4, queries.shape[0] - first)
        for r in range(0, n - 1, 2):  # in 8 lanes also where WIDE (16 lanes measured 0.9x for fp32 keys)
            if first == 0:
                _prefetch(keys, r, 2)
            _pair_f32(keys, r, queries, first, count, out)
        if n % 2:
            _dot_f32(keys, n - 1, queries, first, count, out)
        first += count
    for q in range(first, queries.shape[0]):
        for r in range(n):
            if q == 0:
                _prefetch(keys, r, 1)
            total = np.float32(0.0)
            for d in range(dim):
                total += keys[r, d] * queries[q, d]
            out[q, r] = total


jit.end_decorations()
