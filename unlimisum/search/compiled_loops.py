"""The loops of the compiled kernels (numba): each kernel's loop for bfloat16 and for fp32 numbers, and the
drivers that spread them over threads (``numba.prange``): one call for all heads, queries or blocks of states.
compiled.py says what each kernel computes and calls the drivers; llvm.py has the instructions numba would not
emit; jit.py how they are compiled and cached.
"""

from __future__ import annotations

import numba
import numba.extending
import numpy as np

from unlimisum.search import jit
from unlimisum.search.jit import CACHED as _CACHED
from unlimisum.search.jit import FAST as _FAST
from unlimisum.search.jit import kernel as _compile
from unlimisum.search.jit import parallel_kernel as _compile_parallel
from unlimisum.search.llvm import (_LANES, _ONE, _SHIFT, _UPPER, _above, _as_float, _dot_four_bf16, _dot_four_f32,
    _dot_three_bf16, _dot_three_f32, _dot_two_bf16, _dot_two_f32, _largest, _lowest_bit, _pair_four_bf16,
    _pair_four_f32, _pair_three_bf16, _pair_three_f32, _pair_two_bf16, _pair_two_f32, _prefetch, _prefetch_row,
    _quad_one_bf16, _sum_four, _sum_one, _sum_three, _sum_two, TILE_KEYS, _key_tile_bf16, _tile_scores_one,
    _tile_scores_two)
from unlimisum.search.top_k_loops import _k_largest, _largest_first

BLOCK_ROWS = 1024  # rows scored before their scores are filtered: every query's block of scores stays in L1
# rows of values summed at a time, 8 numbers of each row after another: a tile's rows stay in L1 between them
# (measured, 300k rows of 64 bfloat16 values, 4 queries: 16-32 rows 13.5 ms, 64 rows 15.7, a block of 1024 21.5)
SUM_TILE_ROWS = 32
# states per block of the blocked sums: the sums of a thread's queries meet each block's states while they are in
# cache (measured at 16k states, 192-384 queries of 1,024: 512 states 6.3/9.7 ms, 1,024 5.7/9.3, 4,096 6.0/10.0)
SUM_BLOCK_SHIFT = 10
# queries from which bfloat16 keys are scored with the keys in the lanes (``_scores_tiled_bf16``; measured 0.8x
# for 4 queries, 1.17x for 8)
TILED_MIN_QUERIES = 8
GATHER_AHEAD = 16  # ids ahead whose rows a gathered sum asks for (``_prefetch_row``) while it adds the ones before

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
def _cut(scores, ids, n, k, room):
    """Drop most of scores[:n] (and their ids) below their k largest: -> (how many are left, k to ``room``; a
    floor that at least k of them reach). A sample of the scores says where about 5k/4 of them lie above, a
    count checks it, and one pass keeps those (no branch to mispredict); where the sample misjudged (fewer
    than k, or more than ``room``: ties), a quickselect cuts to exactly k. Whatever is dropped has at least k
    kept scores at or above it: not one of the top k is lost."""
    sample = np.empty(64, np.float32)
    for i in range(64):
        sample[i] = scores[(i * n) // 64]
    for i in range(1, 64):  # an insertion sort: numba's np.sort costs seconds of every first compile
        value = sample[i]
        j = i - 1
        while j >= 0 and sample[j] > value:
            sample[j + 1] = sample[j]
            j -= 1
        sample[j + 1] = value
    floor = sample[max(0, 64 - (80 * k + n - 1) // n)]  # 64 - ceil(64 * 1.25 k / n) of 64, ascending
    reaching = 0
    for i in range(n):
        reaching += scores[i] >= floor
    if reaching < k or reaching > room:
        _largest_first(scores, ids, n, k)
        floor = scores[0]
        for j in range(1, k):
            floor = min(floor, scores[j])
        return k, floor
    left = 0
    for i in range(n):
        score = scores[i]
        scores[left] = score
        ids[left] = ids[i]
        left += score >= floor
    return left, floor


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _keep(block, start, count, kept, kept_ids, held, threshold, k):
    """Append the block's scores above each query's threshold to its candidates; cut a full buffer down to
    little more than the k largest (``_cut``), and raise the threshold."""
    queries, capacity = kept.shape
    for q in range(queries):
        floor = threshold[q]
        n = held[q]
        r = 0
        while r + _LANES <= count:  # eight scores compared at once; the few above the floor taken bit by bit
            above = _above(block, q, r, floor)
            while above != 0:
                j = r + _lowest_bit(above)
                kept[q, n] = block[q, j]
                kept_ids[q, n] = start + j
                n += 1
                above &= above - _ONE
            r += _LANES
        for j in range(r, count):
            if block[q, j] > floor:
                kept[q, n] = block[q, j]
                kept_ids[q, n] = start + j
                n += 1
        room = capacity - block.shape[1]  # a full block more must fit
        if n > room:
            n, threshold[q] = _cut(kept[q], kept_ids[q], n, k, room)
        held[q] = n


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _finish(kept, kept_ids, held, k, out_scores, out_ids):
    """Each query's k best candidates into out_scores/out_ids [nq, k]. A score of -inf or NaN is never a
    candidate: where fewer than k were found, the rest say so, -inf with id 0 (weight 0 in any softmax)."""
    for q in range(kept.shape[0]):
        n = held[q]
        if n > k:
            _k_largest(kept[q], kept_ids[q], n, k, out_scores[q], out_ids[q])
            continue
        for j in range(n):
            out_scores[q, j] = kept[q, j]
            out_ids[q, j] = kept_ids[q, j]
        for j in range(n, k):
            out_scores[q, j] = -np.inf
            out_ids[q, j] = 0


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
def _scores_bf16(words, even, odd, out):
    """out [nq, n] = fp32 scores of queries (``even``/``odd`` [nq, dh/2] dimensions) against bfloat16 keys
    ``words`` [n, dh/2] uint32 (two keys' numbers a word: the even one in the lower half). Each score is the same
    sum wherever its query sits among the others."""
    n, half = words.shape
    queries = even.shape[0]
    if half % _LANES == 0 and queries >= TILED_MIN_QUERIES:
        _scores_tiled_bf16(words, even, odd, out)
        return
    first = 0
    # in explicit vectors four at a time, then the two or three after the last four (a group of 7: 4 + 3), or the
    # one after them against four keys at a time
    while half % _LANES == 0 and queries - first >= 2:
        count = min(4, queries - first)
        for r in range(0, n - 1, 2):  # two keys at a time: each query's lanes loaded once for both
            if first == 0:  # later queries find the block in cache
                _prefetch(words, r, 2)
            _pair_bf16(words, r, even, odd, first, count, out)
        if n % 2:
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
        for r in range(0, n - 1, 2):
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


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _candidates(queries, k):
    """A block's scores [nq, BLOCK_ROWS], the candidates and their ids [nq, 2 k + BLOCK_ROWS], how many each
    query holds, and each query's threshold (none yet)."""
    return (np.empty((queries, BLOCK_ROWS), np.float32), np.empty((queries, 2 * k + BLOCK_ROWS), np.float32),
            np.empty((queries, 2 * k + BLOCK_ROWS), np.int64), np.zeros(queries, np.int64),
            np.full(queries, -np.inf, np.float32))


@_compile
def _select_bf16(words, even, odd, k, out_scores, out_ids):
    """out_scores/out_ids [nq, k] = each query's k best bfloat16 keys (``_scores_bf16``'s layout), no order."""
    n = words.shape[0]
    block, kept, kept_ids, held, threshold = _candidates(even.shape[0], k)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_bf16(words[start:start + count], even, odd, block[:, :count])
        _keep(block, start, count, kept, kept_ids, held, threshold, k)
    _finish(kept, kept_ids, held, k, out_scores, out_ids)


@_compile
def _select_f32(keys, queries, k, out_scores, out_ids):
    """``_select_bf16`` for fp32 keys [n, dh]."""
    n = keys.shape[0]
    block, kept, kept_ids, held, threshold = _candidates(queries.shape[0], k)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_f32(keys[start:start + count], queries, block[:, :count])
        _keep(block, start, count, kept, kept_ids, held, threshold, k)
    _finish(kept, kept_ids, held, k, out_scores, out_ids)

# --- the grouped select (decoder-only generation, grouped-query attention): the g query heads that share a
# key-value head make one selection for it, each key scored by the largest of their g scores


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
def _select_grouped_bf16(words, even, odd, group, k, out_scores, out_ids):
    """out_scores/out_ids [B, k] = each row's k best bfloat16 keys (``_scores_bf16``'s layout) by the largest
    score of its ``group`` queries (``even``/``odd`` [B * group, dh/2], ``_group_max``'s order), no order."""
    n = words.shape[0]
    scored = np.empty((even.shape[0], BLOCK_ROWS), np.float32)  # [B * group, BLOCK_ROWS]
    block, kept, kept_ids, held, threshold = _candidates(even.shape[0] // group, k)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_bf16(words[start:start + count], even, odd, scored[:, :count])
        _group_max(scored, group, count, block)
        _keep(block, start, count, kept, kept_ids, held, threshold, k)
    _finish(kept, kept_ids, held, k, out_scores, out_ids)


@_compile
def _select_grouped_f32(keys, queries, group, k, out_scores, out_ids):
    """``_select_grouped_bf16`` for fp32 keys [n, dh], queries [B * group, dh]."""
    n = keys.shape[0]
    scored = np.empty((queries.shape[0], BLOCK_ROWS), np.float32)  # [B * group, BLOCK_ROWS]
    block, kept, kept_ids, held, threshold = _candidates(queries.shape[0] // group, k)
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_f32(keys[start:start + count], queries, scored[:, :count])
        _group_max(scored, group, count, block)
        _keep(block, start, count, kept, kept_ids, held, threshold, k)
    _finish(kept, kept_ids, held, k, out_scores, out_ids)


@numba.njit(nogil=True, cache=_CACHED, inline="always", fastmath=_FAST)
def _add_four_bf16(total_even, total_odd, w0, w1, w2, w3, r0, r1, r2, r3):
    """total_even, total_odd [d/2] += w0 r0 + w1 r1 + w2 r2 + w3 r3 for bfloat16 rows r0..r3 [d/2] uint32."""
    for i in range(total_even.shape[0]):
        x0, x1, x2, x3 = r0[i], r1[i], r2[i], r3[i]
        total_even[i] += ((w0 * _as_float(x0 << _SHIFT) + w1 * _as_float(x1 << _SHIFT))
                          + (w2 * _as_float(x2 << _SHIFT) + w3 * _as_float(x3 << _SHIFT)))
        total_odd[i] += ((w0 * _as_float(x0 & _UPPER) + w1 * _as_float(x1 & _UPPER))
                         + (w2 * _as_float(x2 & _UPPER) + w3 * _as_float(x3 & _UPPER)))


@numba.njit(nogil=True, cache=_CACHED, inline="always", fastmath=_FAST)
def _add_one_bf16(total_even, total_odd, weight, row):
    for i in range(total_even.shape[0]):
        total_even[i] += weight * _as_float(row[i] << _SHIFT)
        total_odd[i] += weight * _as_float(row[i] & _UPPER)


@numba.njit(nogil=True, cache=_CACHED, inline="always", fastmath=_FAST)
def _add_four_f32(total, w0, w1, w2, w3, r0, r1, r2, r3):
    """total [d] += w0 r0 + w1 r1 + w2 r2 + w3 r3 for fp32 rows r0..r3 [d]."""
    for i in range(total.shape[0]):
        total[i] += (w0 * r0[i] + w1 * r1[i]) + (w2 * r2[i] + w3 * r3[i])


@numba.njit(nogil=True, cache=_CACHED, inline="always", fastmath=_FAST)
def _add_one_f32(total, weight, row):
    for i in range(total.shape[0]):
        total[i] += weight * row[i]


@_compile
def _sums_bf16(words, ids, weights, even, odd):
    """even, odd [d/2] = sum_j weights[j] * state ids[j] of bfloat16 states ``words`` [N, d/2] uint32
    (``_scores_bf16``'s layout), its even and odd dimensions, summed in fp32: four states at a time (their
    reads in flight together), into one query's sums in cache."""
    count = ids.shape[0]
    even[:] = 0.0
    odd[:] = 0.0
    for j in range(0, count - count % 4, 4):
        if j + GATHER_AHEAD + 4 <= count:  # the rows a few ids on, their reads in flight meanwhile
            _prefetch_row(words, ids[j + GATHER_AHEAD])
            _prefetch_row(words, ids[j + GATHER_AHEAD + 1])
            _prefetch_row(words, ids[j + GATHER_AHEAD + 2])
            _prefetch_row(words, ids[j + GATHER_AHEAD + 3])
        _add_four_bf16(even, odd, weights[j], weights[j + 1], weights[j + 2], weights[j + 3], words[ids[j]],
                       words[ids[j + 1]], words[ids[j + 2]], words[ids[j + 3]])
    for j in range(count - count % 4, count):
        _add_one_bf16(even, odd, weights[j], words[ids[j]])


@_compile
def _sums_f32(states, ids, weights, out):
    """out [d] = sum_j weights[j] * states[ids[j]] for fp32 states [N, d] (``_sums_bf16``'s order)."""
    count = ids.shape[0]
    out[:] = 0.0
    for j in range(0, count - count % 4, 4):
        if j + GATHER_AHEAD + 4 <= count:
            _prefetch_row(states, ids[j + GATHER_AHEAD])
            _prefetch_row(states, ids[j + GATHER_AHEAD + 1])
            _prefetch_row(states, ids[j + GATHER_AHEAD + 2])
            _prefetch_row(states, ids[j + GATHER_AHEAD + 3])
        _add_four_f32(out, weights[j], weights[j + 1], weights[j + 2], weights[j + 3], states[ids[j]],
                      states[ids[j + 1]], states[ids[j + 2]], states[ids[j + 3]])
    for j in range(count - count % 4, count):
        _add_one_f32(out, weights[j], states[ids[j]])


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _by_block(ids, blocks, starts, order):
    """order[starts[b]:starts[b + 1]] = the positions j of ``ids`` whose state lies in block b (ids[j] >>
    SUM_BLOCK_SHIFT), in their order: a counting sort (starts [blocks + 1], zeroed)."""
    for j in range(ids.shape[0]):
        starts[(ids[j] >> SUM_BLOCK_SHIFT) + 1] += 1
    for b in range(blocks):
        starts[b + 1] += starts[b]
    place = starts[:blocks].copy()
    for j in range(ids.shape[0]):
        b = ids[j] >> SUM_BLOCK_SHIFT
        order[place[b]] = j
        place[b] += 1


def _add_four_to(first, second, w0, w1, w2, w3, r0, r1, r2, r3):
    """first (and second) += w0 r0 + w1 r1 + w2 r2 + w3 r3: ``_add_four_bf16`` into the even and odd sums for
    bfloat16 rows, ``_add_four_f32`` into ``first`` for fp32 ones (``second`` unused); compiled code only. One loop
    then serves both dtypes (``_sums_blocked``: measured 0.5 s more to compile for each than a twin per dtype)."""
    raise NotImplementedError


def _add_one_to(first, second, weight, row):
    """``_add_four_to`` for one row."""
    raise NotImplementedError


@numba.extending.overload(_add_four_to, inline="always")
def _add_four_to_rows(first, second, w0, w1, w2, w3, r0, r1, r2, r3):
    if r0.dtype == numba.types.uint32:
        return lambda first, second, w0, w1, w2, w3, r0, r1, r2, r3: _add_four_bf16(first, second, w0, w1, w2,
                                                                                     w3, r0, r1, r2, r3)
    return lambda first, second, w0, w1, w2, w3, r0, r1, r2, r3: _add_four_f32(first, w0, w1, w2, w3, r0, r1, r2,
                                                                                r3)


@numba.extending.overload(_add_one_to, inline="always")
def _add_one_to_row(first, second, weight, row):
    if row.dtype == numba.types.uint32:
        return lambda first, second, weight, row: _add_one_bf16(first, second, weight, row)
    return lambda first, second, weight, row: _add_one_f32(first, weight, row)


@_compile
def _sums_blocked(rows, ids, weights, first, second):
    """``_sums_bf16`` / ``_sums_f32`` for every query of ids/weights [nq, k] at once: block by block of the states,
    each query's states in the block summed (four at a time) while the block is in cache, so that a state many
    queries chose is read from memory once (each query's states in block order, then as given). Bfloat16 states
    ``rows`` [N, d/2] uint32 (``_scores_bf16``'s layout) into ``first``/``second`` [nq, d/2], their even and odd
    dimensions; fp32 states [N, d] into ``first`` [nq, d] (``second`` [nq, 0])."""
    nq, k = ids.shape
    blocks = (rows.shape[0] >> SUM_BLOCK_SHIFT) + 1
    starts = np.zeros((nq, blocks + 1), np.int32)
    order = np.empty((nq, k), np.int32)
    for q in range(nq):
        _by_block(ids[q], blocks, starts[q], order[q])
        first[q, :] = 0.0
        second[q, :] = 0.0
    for b in range(blocks):
        for q in range(nq):
            chosen_rows, weight, chosen = ids[q], weights[q], order[q]
            j, last = starts[q, b], starts[q, b + 1]
            while j + 4 <= last:
                j0, j1, j2, j3 = chosen[j], chosen[j + 1], chosen[j + 2], chosen[j + 3]
                _add_four_to(first[q], second[q], weight[j0], weight[j1], weight[j2], weight[j3],
                             rows[chosen_rows[j0]], rows[chosen_rows[j1]], rows[chosen_rows[j2]],
                             rows[chosen_rows[j3]])
                j += 4
            for j in range(j, last):
                _add_one_to(first[q], second[q], weight[chosen[j]], rows[chosen_rows[chosen[j]]])


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _add_dense_sums_bf16(words, weights, even, odd):
    """even, odd [nq, d/2] += weights [nq, n] @ the bfloat16 states ``words`` [n, d/2] (``_sums_bf16``'s
    layout): four states at a time, every query's sums taken while they are in cache."""
    n = words.shape[0]
    for r in range(0, n - n % 4, 4):
        _prefetch(words, r, 4)
        for q in range(weights.shape[0]):
            _add_four_bf16(even[q], odd[q], weights[q, r], weights[q, r + 1], weights[q, r + 2],
                           weights[q, r + 3], words[r], words[r + 1], words[r + 2], words[r + 3])
    for r in range(n - n % 4, n):
        for q in range(weights.shape[0]):
            _add_one_bf16(even[q], odd[q], weights[q, r], words[r])


@_compile
def _dense_sums_bf16(words, weights, even, odd):
    """even, odd [nq, d/2] = weights [nq, n] @ the bfloat16 states ``words`` [n, d/2]."""
    even[:] = 0.0
    odd[:] = 0.0
    _add_dense_sums_bf16(words, weights, even, odd)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _add_dense_sums_f32(states, weights, out):
    """out [nq, d] += weights [nq, n] @ fp32 states [n, d] (``_add_dense_sums_bf16``'s order)."""
    n = states.shape[0]
    for r in range(0, n - n % 4, 4):
        _prefetch(states, r, 4)
        for q in range(weights.shape[0]):
            _add_four_f32(out[q], weights[q, r], weights[q, r + 1], weights[q, r + 2], weights[q, r + 3],
                          states[r], states[r + 1], states[r + 2], states[r + 3])
    for r in range(n - n % 4, n):
        for q in range(weights.shape[0]):
            _add_one_f32(out[q], weights[q, r], states[r])


@_compile
def _dense_sums_f32(states, weights, out):
    """out [nq, d] = weights [nq, n] @ fp32 states [n, d]."""
    out[:] = 0.0
    _add_dense_sums_f32(states, weights, out)


@_compile_parallel
def _dense_sums_heads_bf16(words, heads, pitch, n, weights, even, odd):
    """even, odd [H, nq, dh/2] = weights [H, nq, n] @ each head's bfloat16 values (head h's are
    words[h * pitch:h * pitch + n], ``_head_rows``), the heads spread over the threads."""
    for h in numba.prange(heads):
        _dense_sums_bf16(words[h * pitch:h * pitch + n], weights[h], even[h], odd[h])


@_compile_parallel
def _dense_sums_heads_f32(values, heads, pitch, n, weights, out):
    """``_dense_sums_heads_bf16`` for fp32 values: out [H, nq, dh]."""
    for h in numba.prange(heads):
        _dense_sums_f32(values[h * pitch:h * pitch + n], weights[h], out[h])


# --- dense attention in one pass (``attend_dense``): each block of a head's keys scored, its softmax weights
# taken under running maxima and sums (flash attention's online softmax), and its values summed, while the
# block's scores are in cache: no [nq, N] scores written, no softmax pass of their own


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _sum_rows(values, weights, rows, out):
    """out [nq, dv] += weights [nq, :rows] @ values[:rows]: bfloat16 values [., dv/2] uint32 (out: the even
    dimensions, then the odd ones) or fp32 values [., dv]; SUM_TILE_ROWS rows at a time, four queries at a
    time (``_sum_of``; dv/2 or dv a multiple of 8)."""
    queries = weights.shape[0]
    for start in range(0, rows, SUM_TILE_ROWS):
        tile = min(SUM_TILE_ROWS, rows - start)
        tile_rows, tile_weights = values[start:start + tile], weights[:, start:start + tile]
        _prefetch(tile_rows, 0, tile)
        for first in range(0, queries, 4):
            count = min(4, queries - first)
            if count == 4:
                _sum_four(tile_rows, tile_weights, first, tile, out)
            elif count == 3:
                _sum_three(tile_rows, tile_weights, first, tile, out)
            elif count == 2:
                _sum_two(tile_rows, tile_weights, first, tile, out)
            else:
                _sum_one(tile_rows, tile_weights, first, tile, out)


_EXP_FLOOR = np.float32(-87.0)  # kernels.EXP_FLOOR: a weight below e^-87 of the largest is raised to it
_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH = np.float32(0.693359375)  # ln 2 in two parts (Cody and Waite): n * high is exact for |n| < 2^15
_LN2_LOW = np.float32(-2.12194440e-4)
_HALF = np.float32(0.5)
_BIAS = np.int32(127)  # fp32's exponent bias
_MANTISSA = np.uint32(23)  # fp32's mantissa bits


# without reassociation: it would fold the two-part reduction x - n high - n low back into one rounding
@numba.njit(nogil=True, cache=_CACHED, fastmath={"contract"})
def _exp(x):
    """exp(max(x, -87)) of a float32 x <= 0, within 2 ulp of the true value (Cephes' expf: 2^n times a
    degree-7 polynomial of x - n ln 2, |x - n ln 2| <= ln 2 / 2); branch-free, so that a loop of it runs in
    vectors. A NaN gives a NaN."""
    x = max(x, _EXP_FLOOR)
    whole = np.floor(x * _LOG2E + _HALF)  # n, -125 .. 0
    r = x - whole * _LN2_HIGH - whole * _LN2_LOW
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * _as_float(np.uint32(np.int32(whole) + _BIAS) << _MANTISSA)  # times 2^n


@numba.njit(nogil=True, cache=_CACHED, inline="always", fastmath=_FAST)
def _softmax_block(scores, first, count, peak, total, sums):
    """scores [nq, first:first + count] -> exp(score - peak), each query's ``peak`` raised to the block's
    largest score first and its running ``total`` and ``sums`` [nq, w] rescaled to it (the online softmax:
    every weight relative to the largest score so far); the block's weights added to ``total``. ``scores``
    C-contiguous: a loop over a row of it runs in vectors (over a view of columns it would not)."""
    for q in range(scores.shape[0]):
        top = max(peak[q], _largest(scores, q, first, count))
        for j in range(first + count - count % _LANES, first + count):
            top = max(top, scores[q, j])
        if top > peak[q]:  # also the first block, whose peak is -inf: everything rescaled to 0
            scale = _exp(peak[q] - top)
            total[q] *= scale
            for i in range(sums.shape[1]):
                sums[q, i] *= scale
            peak[q] = top
        top = peak[q]
        weights = np.float32(0.0)
        row = scores[q, first:first + count]  # indices from 0: no negative index to wrap, so in vectors
        for j in range(count):
            weight = _exp(row[j] - top)
            row[j] = weight
            weights += weight
        total[q] += weights


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _normalise(total, sums):
    """Each query's sums [nq, w] divided by its total weight (zeros where it is not a positive number)."""
    for q in range(total.shape[0]):
        if total[q] > 0 and np.isfinite(total[q]):
            scale = np.float32(1.0) / total[q]
            for i in range(sums.shape[1]):
                sums[q, i] *= scale
        else:
            sums[q, :] = 0.0


@_compile
def _attend_dense_bf16(key_words, value_words, even, odd, kept, block_peaks, peak, total, out):
    """out [nq, dv] = softmax(queries K^T) V, its even dimensions then its odd ones: bfloat16 keys and
    values ``key_words`` [n, dh/2], ``value_words`` [n, dv/2] uint32 (``_scores_bf16``'s layout), queries
    ``even``/``odd`` [nq, dh/2]; a block of BLOCK_ROWS keys at a time, scored, weighed and summed in cache.
    ``peak``, ``total`` [nq]: each query's largest score and its weights' sum relative to it. Where ``kept``
    is [nq, n] (not [nq, 0]), each block's weights are left there, relative to the peak of their block,
    ``block_peaks`` [nq, blocks] (``_coverage``)."""
    n = key_words.shape[0]
    queries = even.shape[0]
    keep = kept.shape[1] > 0
    block = np.empty((queries, BLOCK_ROWS), np.float32)
    half = value_words.shape[1]
    peak[:] = -np.inf
    total[:] = 0.0
    out[:] = 0.0
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        scores, first = (kept, start) if keep else (block, 0)
        weights = scores[:, first:first + count]
        _scores_bf16(key_words[start:start + count], even, odd, weights)
        _softmax_block(scores, first, count, peak, total, out)
        if keep:
            block_peaks[:, start // BLOCK_ROWS] = peak
        rows = value_words[start:start + count]
        if half % _LANES == 0:
            _sum_rows(rows, weights, count, out)
        else:
            _add_dense_sums_bf16(rows, weights, out[:, :half], out[:, half:])
    _normalise(total, out)


@_compile
def _attend_dense_f32(keys, values, queries, kept, block_peaks, peak, total, out):
    """``_attend_dense_bf16`` for fp32 keys [n, dh] and values [n, dv]: out [nq, dv]."""
    n = keys.shape[0]
    count_queries = queries.shape[0]
    keep = kept.shape[1] > 0
    block = np.empty((count_queries, BLOCK_ROWS), np.float32)
    peak[:] = -np.inf
    total[:] = 0.0
    out[:] = 0.0
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        scores, first = (kept, start) if keep else (block, 0)
        weights = scores[:, first:first + count]
        _scores_f32(keys[start:start + count], queries, weights)
        _softmax_block(scores, first, count, peak, total, out)
        if keep:
            block_peaks[:, start // BLOCK_ROWS] = peak
        rows = values[start:start + count]
        if values.shape[1] % _LANES == 0:
            _sum_rows(rows, weights, count, out)
        else:
            _add_dense_sums_f32(rows, weights, out)
    _normalise(total, out)


@_compile_parallel
def _attend_dense_heads_bf16(key_words, value_words, heads, key_pitch, value_pitch, n, even, odd, kept,
                             block_peaks, peak, total, out):
    for h in numba.prange(heads):
        _attend_dense_bf16(key_words[h * key_pitch:h * key_pitch + n],
                           value_words[h * value_pitch:h * value_pitch + n], even[h], odd[h], kept[h],
                           block_peaks[h], peak[h], total[h], out[h])


@_compile_parallel
def _attend_dense_heads_f32(keys, values, heads, key_pitch, value_pitch, n, queries, kept, block_peaks, peak,
                            total, out):
    for h in numba.prange(heads):
        _attend_dense_f32(keys[h * key_pitch:h * key_pitch + n], values[h * value_pitch:h * value_pitch + n],
                          queries[h], kept[h], block_peaks[h], peak[h], total[h], out[h])


@_compile_parallel
def _coverage(kept, block_peaks, peak, total, coverage):
    """coverage [n] = the sum of every head's and query's softmax weights: ``kept`` [H, nq, n], each block's
    relative to its block_peaks [H, nq, blocks], rescaled to the query's peak and divided by its total [H, nq]
    (a query with no positive total adds nothing); the blocks spread over the threads."""
    heads, queries, n = kept.shape
    for b in numba.prange(block_peaks.shape[2]):
        start = b * BLOCK_ROWS
        count = min(BLOCK_ROWS, n - start)
        coverage[start:start + count] = 0.0
        for h in range(heads):
            for q in range(queries):
                if total[h, q] > 0 and np.isfinite(total[h, q]):
                    scale = _exp(block_peaks[h, q, b] - peak[h, q]) / total[h, q]
                    for j in range(start, start + count):
                        coverage[j] += kept[h, q, j] * scale

# the drivers: one call for all heads (or queries, or blocks of states), spread over the threads by prange;
# head h's keys are rows[h * pitch:h * pitch + n] (``_head_rows``)

# one driver scores (k == 0: every score into ``out``) or selects (each query's top k) per head: one parallel
# function to compile for both, and ``_scores_*`` with one signature (``out`` as the select's blocks, 'A')


@_compile_parallel
def _scan_heads_bf16(words, heads, pitch, n, even, odd, k, out_scores, out_ids, out):
    for h in numba.prange(heads):
        rows = words[h * pitch:h * pitch + n]
        if k == 0:
            _scores_bf16(rows, even[h], odd[h], out[h][:, :n])
        else:
            _select_bf16(rows, even[h], odd[h], k, out_scores[h], out_ids[h])


@_compile_parallel
def _scan_heads_f32(keys, heads, pitch, n, queries, k, out_scores, out_ids, out):
    for h in numba.prange(heads):
        rows = keys[h * pitch:h * pitch + n]
        if k == 0:
            _scores_f32(rows, queries[h], out[h][:, :n])
        else:
            _select_f32(rows, queries[h], k, out_scores[h], out_ids[h])


@_compile_parallel
def _sums_queries_bf16(words, ids, weights, even, odd):
    for q in numba.prange(ids.shape[0]):
        _sums_bf16(words, ids[q], weights[q], even[q], odd[q])


@_compile_parallel
def _sums_queries_f32(states, ids, weights, out):
    for q in numba.prange(ids.shape[0]):
        _sums_f32(states, ids[q], weights[q], out[q])


# the blocked sums' driver: the queries in ``parts`` consecutive shares, one a thread


@_compile_parallel
def _sums_blocked_parts(rows, ids, weights, first, second, parts):
    nq = ids.shape[0]
    for part in numba.prange(parts):
        share = slice((part * nq) // parts, ((part + 1) * nq) // parts)
        _sums_blocked(rows, ids[share], weights[share], first[share], second[share])


@_compile_parallel
def _dense_sums_parts_bf16(words, weights, bounds, even, odd):
    for part in numba.prange(len(bounds) - 1):
        rows = slice(bounds[part], bounds[part + 1])
        _dense_sums_bf16(words[rows], weights[:, rows], even[part], odd[part])


@_compile_parallel
def _dense_sums_parts_f32(states, weights, bounds, out):
    for part in numba.prange(len(bounds) - 1):
        rows = slice(bounds[part], bounds[part + 1])
        _dense_sums_f32(states[rows], weights[:, rows], out[part])

# the grouped select's drivers: out_scores/out_ids [G, B, k], each key-value head's on a thread


@_compile_parallel
def _select_grouped_heads_bf16(words, heads, pitch, n, even, odd, group, k, out_scores, out_ids):
    for h in numba.prange(heads):
        _select_grouped_bf16(words[h * pitch:h * pitch + n], even[h], odd[h], group, k, out_scores[h],
                             out_ids[h])


@_compile_parallel
def _select_grouped_heads_f32(keys, heads, pitch, n, queries, group, k, out_scores, out_ids):
    for h in numba.prange(heads):
        _select_grouped_f32(keys[h * pitch:h * pitch + n], queries[h], group, k, out_scores[h], out_ids[h])


jit.end_decorations()
