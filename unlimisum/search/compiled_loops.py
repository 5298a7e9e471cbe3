"""The loops of the compiled kernels (numba): each kernel's loop for bfloat16 and for fp32 numbers, and the
drivers that spread them over threads (``numba.prange``): one call for all heads, queries or blocks of states.
The scores they take of blocks of keys come from score_loops.py. compiled.py says what each kernel computes and
calls the drivers; llvm.py has the instructions numba would not emit; jit.py how they are compiled and cached.
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
from unlimisum.search.jit import callee as _callee
from unlimisum.search.jit import parallel_driver as _parallel_driver
from unlimisum.search.llvm import (_LANES, _ONE, _SHIFT, _UPPER, _above, _as_float, _largest, _lowest_bit, _prefetch,
    _prefetch_row, _sum_four, _sum_one, _sum_three, _sum_two)
from unlimisum.search.score_loops import _scores_bf16, _scores_f32
from unlimisum.search.top_k_loops import SAMPLE_MIN, _k_largest, _largest_first, _sampled_floor

BLOCK_ROWS = 1024  # rows scored before their scores are filtered: every query's block of scores stays in L1
# rows of values summed at a time, 8 numbers of each row after another: a tile's rows stay in L1 between them
# (measured, 300k rows of 64 bfloat16 values, 4 queries: 16-32 rows 13.5 ms, 64 rows 15.7, a block of 1024 21.5)
SUM_TILE_ROWS = 32
# states per block of the blocked sums: the sums of a thread's queries meet each block's states while they are in
# cache (measured at 16k states, 192-384 queries of 1,024: 512 states 6.3/9.7 ms, 1,024 5.7/9.3, 4,096 6.0/10.0)
SUM_BLOCK_SHIFT = 10
# keys a scan scores first, evenly apart, for a floor that each query's k best reach (as the compiled top-k's
# sample): its candidates are then about 1.5 k, not the k ln(n / k) a threshold rising from -inf lets through,
# with a cut at every 2 k (the scan of 100k keys for 128 queries a head spent as long keeping as scoring) ...
SCAN_SAMPLE_KEYS = 1_024
# ... at a rank this many deviations above the sample's expected count among the k best: a floor too high, which
# costs a second pass, about once in 3.5 million queries
SCAN_SAMPLE_DEVIATIONS = 5.0
GATHER_AHEAD = 16  # ids ahead whose rows a gathered sum asks for (``_prefetch_row``) while it adds the ones before

jit.begin_decorations()


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
def _capacity(k):
    """Candidates a query's buffer holds: 2 k, and a full block more (``_keep`` cuts it where a block might not fit)."""
    return 2 * k + BLOCK_ROWS


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _candidates(queries, k):
    """A block's scores [nq, BLOCK_ROWS], the candidates and their ids [nq, ``_capacity(k)``], how many each
    query holds, and each query's threshold (none yet)."""
    return (np.empty((queries, BLOCK_ROWS), np.float32), np.empty((queries, _capacity(k)), np.float32),
            np.empty((queries, _capacity(k)), np.int64), np.zeros(queries, np.int64),
            np.full(queries, -np.inf, np.float32))


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _scan_sample(n, k):
    """(keys a scan of n keys for each query's k best samples first, the rank among their scores of its floor):
    (0, 0) where too few keys, or a floor that would keep half of them."""
    spread = min(SCAN_SAMPLE_KEYS, n // 4)
    if spread < SAMPLE_MIN:
        return 0, 0
    expected = spread * k / n  # about Poisson: the sampled keys among a query's k best
    rank = min(spread, int(np.ceil(expected + SCAN_SAMPLE_DEVIATIONS * np.sqrt(expected))) + 2)
    if 2 * rank > spread:
        return 0, 0
    return spread, rank


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _sampled_rows(rows, spread):
    """rows (2 i + 1) n // (2 spread) of rows [n, w], i < spread: evenly apart, in a [spread, w] copy."""
    n, width = rows.shape
    sample = np.empty((spread, width), rows.dtype)
    for i in range(spread):
        row = ((2 * i + 1) * n) // (2 * spread)
        for d in range(width):
            sample[i, d] = rows[row, d]
    return sample


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _sampled_floors(sampled, rank, threshold):
    """Each query's threshold (its candidates: the scores above it) just below its floor from ``sampled`` [nq,
    spread] (``top_k_loops._sampled_floor``: at least ``rank`` of them reach it); -> those floors, -inf where
    the sample gave none."""
    queries, spread = sampled.shape
    floors = np.full(queries, -np.inf, np.float32)
    for q in range(queries):
        floor = _sampled_floor(sampled[q], spread, rank)
        if floor > -np.inf:
            floors[q] = floor
            threshold[q] = np.nextafter(floor, np.float32(-np.inf))  # a score equal to the floor is kept
    return floors


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _misjudged(floors, held, threshold, k):
    """Whether a sampled floor left a query fewer than k candidates (its k best may lie below it): those start
    again from -inf, every other query's threshold goes to +inf (it holds its own)."""
    again = False
    for q in range(held.shape[0]):
        if floors[q] > -np.inf and held[q] < k:
            held[q] = 0
            threshold[q] = -np.inf
            again = True
        else:
            threshold[q] = np.inf
    return again


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _blocks_bf16(words, even, odd, k, tiled_from, block, kept, kept_ids, held, threshold):
    n = words.shape[0]
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_bf16(words[start:start + count], even, odd, block[:, :count], tiled_from)
        _keep(block, start, count, kept, kept_ids, held, threshold, k)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _blocks_f32(keys, queries, k, block, kept, kept_ids, held, threshold):
    n = keys.shape[0]
    for start in range(0, n, BLOCK_ROWS):
        count = min(BLOCK_ROWS, n - start)
        _scores_f32(keys[start:start + count], queries, block[:, :count])
        _keep(block, start, count, kept, kept_ids, held, threshold, k)


@_compile
def _select_bf16(words, even, odd, k, tiled_from, out_scores, out_ids):
    """out_scores/out_ids [nq, k] = each query's k best bfloat16 keys (``_scores_bf16``'s layout), no order: the
    thresholds start at a floor from a sample of the keys (``_scan_sample``), the blocks are scored and kept, and
    the few queries the sample misjudged are scanned again from -inf."""
    queries = even.shape[0]
    block, kept, kept_ids, held, threshold = _candidates(queries, k)
    spread, rank = _scan_sample(words.shape[0], k)
    floors = np.full(queries, -np.inf, np.float32)
    if spread:
        sampled = np.empty((queries, spread), np.float32)
        _scores_bf16(_sampled_rows(words, spread), even, odd, sampled[:, :spread], tiled_from)  # as the blocks'
        floors = _sampled_floors(sampled, rank, threshold)
    for again in range(2):  # again only where the sample misjudged a query (one call: its code compiled once)
        _blocks_bf16(words, even, odd, k, tiled_from, block, kept, kept_ids, held, threshold)
        if again or not _misjudged(floors, held, threshold, k):
            break
    _finish(kept, kept_ids, held, k, out_scores, out_ids)


@_compile
def _select_f32(keys, queries, k, out_scores, out_ids):
    """``_select_bf16`` for fp32 keys [n, dh]."""
    nq = queries.shape[0]
    block, kept, kept_ids, held, threshold = _candidates(nq, k)
    spread, rank = _scan_sample(keys.shape[0], k)
    floors = np.full(nq, -np.inf, np.float32)
    if spread:
        sampled = np.empty((nq, spread), np.float32)
        _scores_f32(_sampled_rows(keys, spread), queries, sampled[:, :spread])
        floors = _sampled_floors(sampled, rank, threshold)
    for again in range(2):  # again only where the sample misjudged a query (one call: its code compiled once)
        _blocks_f32(keys, queries, k, block, kept, kept_ids, held, threshold)
        if again or not _misjudged(floors, held, threshold, k):
            break
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
def _attend_dense_bf16(key_words, value_words, even, odd, tiled_from, kept, block_peaks, peak, total, out):
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
        _scores_bf16(key_words[start:start + count], even, odd, weights, tiled_from)
        _softmax_block(scores, first, count, peak, total, out)
        if keep:
            for q in range(queries):  # not a slice: numba would compile its shape error's message
                block_peaks[q, start // BLOCK_ROWS] = peak[q]
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
            for q in range(count_queries):
                block_peaks[q, start // BLOCK_ROWS] = peak[q]
        rows = values[start:start + count]
        if values.shape[1] % _LANES == 0:
            _sum_rows(rows, weights, count, out)
        else:
            _add_dense_sums_f32(rows, weights, out)
    _normalise(total, out)


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
# head h's keys are rows[h * pitch:h * pitch + n] (``_head_rows``); a bfloat16 driver's queries (even, odd) are
# followed by the count of them a head from which its scores put the keys in the lanes (compiled.tiled_from).
# Each calls its kernels by address (jit.callee: each compiled once, not again into its driver), here with the
# numba types of the arguments the drivers pass.
_u32, _f32, _i64 = numba.types.uint32, numba.types.float32, numba.types.int64
_WORDS, _ROWS, _IDS, _VIEW = _u32[:, ::1], _f32[:, ::1], _i64[:, ::1], _f32[:, :]
_call_select_bf16 = _callee(_select_bf16, _WORDS, _ROWS, _ROWS, _i64, _i64, _ROWS, _IDS)
_call_scores_bf16 = _callee(_scores_bf16, _WORDS, _ROWS, _ROWS, _VIEW, _i64)
_call_select_f32 = _callee(_select_f32, _ROWS, _ROWS, _i64, _ROWS, _IDS)
_call_scores_f32 = _callee(_scores_f32, _ROWS, _ROWS, _VIEW)
_call_sums_bf16 = _callee(_sums_bf16, _WORDS, _i64[::1], _f32[::1], _f32[::1], _f32[::1])
_call_sums_f32 = _callee(_sums_f32, _ROWS, _i64[::1], _f32[::1], _f32[::1])
_call_sums_blocked_bf16 = _callee(_sums_blocked, _WORDS, _IDS, _ROWS, _ROWS, _ROWS)
_call_sums_blocked_f32 = _callee(_sums_blocked, _ROWS, _IDS, _ROWS, _ROWS, _ROWS)
_call_dense_sums_bf16 = _callee(_dense_sums_bf16, _WORDS, _VIEW, _ROWS, _ROWS)  # a part of the rows' weights
_call_dense_sums_f32 = _callee(_dense_sums_f32, _ROWS, _VIEW, _ROWS)
_call_head_sums_bf16 = _callee(_dense_sums_bf16, _WORDS, _ROWS, _ROWS, _ROWS)  # a head's weights
_call_head_sums_f32 = _callee(_dense_sums_f32, _ROWS, _ROWS, _ROWS)
_call_attend_bf16 = _callee(_attend_dense_bf16, _WORDS, _WORDS, _ROWS, _ROWS, _i64, _ROWS, _ROWS, _f32[::1],
                            _f32[::1], _ROWS)
_call_attend_f32 = _callee(_attend_dense_f32, _ROWS, _ROWS, _ROWS, _ROWS, _ROWS, _f32[::1], _f32[::1], _ROWS)


# one driver scores (k == 0: every score into ``out``) or selects (each query's top k) per head: one parallel
# function to compile for both, and ``_scores_*`` with one signature (``out`` as the select's blocks, 'A')


@_parallel_driver(_call_select_bf16, _call_scores_bf16)
def _scan_heads_bf16(words, heads, pitch, n, even, odd, tiled_from, k, out_scores, out_ids, out, select, scores):
    for h in numba.prange(heads):
        rows = words[h * pitch:h * pitch + n]
        if k == 0:
            _call_scores_bf16(scores, (rows, even[h], odd[h], out[h][:, :n], tiled_from))
        else:
            _call_select_bf16(select, (rows, even[h], odd[h], k, tiled_from, out_scores[h], out_ids[h]))


@_parallel_driver(_call_select_f32, _call_scores_f32)
def _scan_heads_f32(keys, heads, pitch, n, queries, k, out_scores, out_ids, out, select, scores):
    for h in numba.prange(heads):
        rows = keys[h * pitch:h * pitch + n]
        if k == 0:
            _call_scores_f32(scores, (rows, queries[h], out[h][:, :n]))
        else:
            _call_select_f32(select, (rows, queries[h], k, out_scores[h], out_ids[h]))


@_parallel_driver(_call_sums_bf16)
def _sums_queries_bf16(words, ids, weights, even, odd, sums):
    for q in numba.prange(ids.shape[0]):
        _call_sums_bf16(sums, (words, ids[q], weights[q], even[q], odd[q]))


@_parallel_driver(_call_sums_f32)
def _sums_queries_f32(states, ids, weights, out, sums):
    for q in numba.prange(ids.shape[0]):
        _call_sums_f32(sums, (states, ids[q], weights[q], out[q]))


# the blocked sums' driver: the queries in ``parts`` consecutive shares, one a thread


@_parallel_driver(_call_sums_blocked_bf16)
def _sums_blocked_parts_bf16(words, ids, weights, even, odd, parts, sums):
    nq = ids.shape[0]
    for part in numba.prange(parts):
        share = slice((part * nq) // parts, ((part + 1) * nq) // parts)
        _call_sums_blocked_bf16(sums, (words, ids[share], weights[share], even[share], odd[share]))


@_parallel_driver(_call_sums_blocked_f32)
def _sums_blocked_parts_f32(states, ids, weights, out, second, parts, sums):
    nq = ids.shape[0]
    for part in numba.prange(parts):
        share = slice((part * nq) // parts, ((part + 1) * nq) // parts)
        _call_sums_blocked_f32(sums, (states, ids[share], weights[share], out[share], second[share]))


@_parallel_driver(_call_dense_sums_bf16)
def _dense_sums_parts_bf16(words, weights, bounds, even, odd, sums):
    for part in numba.prange(len(bounds) - 1):
        rows = slice(bounds[part], bounds[part + 1])
        _call_dense_sums_bf16(sums, (words[rows], weights[:, rows], even[part], odd[part]))


@_parallel_driver(_call_dense_sums_f32)
def _dense_sums_parts_f32(states, weights, bounds, out, sums):
    for part in numba.prange(len(bounds) - 1):
        rows = slice(bounds[part], bounds[part + 1])
        _call_dense_sums_f32(sums, (states[rows], weights[:, rows], out[part]))


@_parallel_driver(_call_head_sums_bf16)
def _dense_sums_heads_bf16(words, heads, pitch, n, weights, even, odd, sums):
    """even, odd [H, nq, dh/2] = weights [H, nq, n] @ each head's bfloat16 values (head h's are
    words[h * pitch:h * pitch + n], ``_head_rows``), the heads spread over the threads."""
    for h in numba.prange(heads):
        _call_head_sums_bf16(sums, (words[h * pitch:h * pitch + n], weights[h], even[h], odd[h]))


@_parallel_driver(_call_head_sums_f32)
def _dense_sums_heads_f32(values, heads, pitch, n, weights, out, sums):
    """``_dense_sums_heads_bf16`` for fp32 values: out [H, nq, dh]."""
    for h in numba.prange(heads):
        _call_head_sums_f32(sums, (values[h * pitch:h * pitch + n], weights[h], out[h]))


@_parallel_driver(_call_attend_bf16)
def _attend_dense_heads_bf16(key_words, value_words, heads, key_pitch, value_pitch, n, even, odd, tiled_from,
                             kept, block_peaks, peak, total, out, attend):
    for h in numba.prange(heads):
        _call_attend_bf16(attend, (key_words[h * key_pitch:h * key_pitch + n],
                                   value_words[h * value_pitch:h * value_pitch + n], even[h], odd[h], tiled_from,
                                   kept[h], block_peaks[h], peak[h], total[h], out[h]))


@_parallel_driver(_call_attend_f32)
def _attend_dense_heads_f32(keys, values, heads, key_pitch, value_pitch, n, queries, kept, block_peaks, peak,
                            total, out, attend):
    for h in numba.prange(heads):
        _call_attend_f32(attend, (keys[h * key_pitch:h * key_pitch + n], values[h * value_pitch:h * value_pitch + n],
                                  queries[h], kept[h], block_peaks[h], peak[h], total[h], out[h]))


jit.end_decorations()
