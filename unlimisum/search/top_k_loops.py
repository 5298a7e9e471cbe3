"""The loops of the compiled top-k (numba): each row of scores' k largest, in no order, without sorting the row.

A support reading scores 16-64 queries per head against every key at once (a batched matmul in 16 bits where the
CPU has the units), and then wants each row's k best: ``torch.topk`` took 14 ms for 192 rows of 16,384 scores at
k = 1,024 on two threads (EPYC Zen 4), this 2.9 ms. Per row here:

1. **a floor from a sample**: ``spread`` scores evenly apart; the floor is the ``sample_rank``-th largest of
   them (found with bins, below), low enough that the row's k best lie at or above it but about once in 30,000
   rows (the number of sampled scores among a row's k best is about Poisson, mean spread * k / n); masked
   scores (-inf: a support reading's hidden tokens) are left out of the sample;
2. one branch-free pass copies the scores at or above the floor, and their columns, into a buffer of the whole
   row's length that each thread keeps for all its rows (about 1.5 k of them; a NaN is never below a floor, so
   it is among them if the row holds one); too few (the sample misjudged) drops the floor to -inf and copies
   again;
3. **the exact k**: the candidates go into ``BINS`` bins between their least and largest (a score's bin never
   falls as it rises); every candidate in a bin above the k-th's is kept, and the k-th's own bin (a few scores)
   is cut with a quickselect.

Steps 2 and 3 write without branching (a branch per score or candidate, taken at random, costs more than the
writes it saves): 384 rows of 16,384 scores at k = 1,024 took 6.6 ms on two threads of an EPYC Zen 2 with a
counting pass and branches, now 4.9 (one thread, per row: the floor 7.5 µs, the copy 12.3, the exact k of about
1,600 candidates 12.4 with a branch per candidate, 5.8 without).

A row holding a NaN, or fewer than k scores at all, is flagged for the caller instead (``torch.topk`` orders NaN
above every number; compiled.top_k gives such rows to it). The scan of compiled_loops.py ends each query's
candidates with step 3 too (``_k_largest``). compiled.py says when this runs; jit.py how it is compiled and
cached.
"""

from __future__ import annotations

import numba
import numpy as np

from unlimisum.search import jit
from unlimisum.search.jit import CACHED as _CACHED
from unlimisum.search.jit import callee, parallel_driver

BINS = 256  # bins of a row's candidates: about 1.5 k / 256 scores share the k-th's bin
SAMPLE_SCORES = 1_024  # scores of a row sampled for its floor (at most a quarter of the row)
SAMPLE_MIN = 64  # a row too short for this many samples starts from -inf

jit.begin_decorations()


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _largest_first(scores, ids, n, k):
    """Reorder scores[:n] (and ids with them) so that their k largest come first, in no order (quickselect)."""
    low, high = 0, n - 1
    while low < high:
        pivot = scores[(low + high) // 2]
        i, j = low, high
        while i <= j:
            while scores[i] > pivot:
                i += 1
            while scores[j] < pivot:
                j -= 1
            if i <= j:
                scores[i], scores[j] = scores[j], scores[i]
                ids[i], ids[j] = ids[j], ids[i]
                i += 1
                j -= 1
        if k - 1 <= j:
            high = j
        elif k - 1 >= i:
            low = i
        else:
            break


@numba.njit(nogil=True, cache=_CACHED)
def sample_rank(spread, n, k):
    """Which of a row's ``spread`` sampled scores, counted from the largest, is its floor: the count of sampled
    scores among the row's k best is about Poisson with mean spread * k / n; its mean plus four deviations, and
    two, is reached about once in 30,000 rows."""
    expected = spread * k / n
    return min(spread, int(np.ceil(expected + 4.0 * np.sqrt(expected))) + 2)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _binned(values, count, low, high, bins):
    """bins[i] = the bin of values[i] (finite, in [low, high]) among BINS between low and high; -> how many in
    each bin [BINS]."""
    held = np.zeros(BINS, np.int64)
    span = high - low
    scale = np.float32(BINS) / span if span > 0 else np.float32(0.0)
    for i in range(count):
        b = max(0, min(int((values[i] - low) * scale), BINS - 1))  # in range whatever the arithmetic
        bins[i] = b
        held[b] += 1
    return held


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _bin_of_rank(held, rank):
    """(the bin holding the rank-th largest, how many lie in the bins above it)."""
    above = 0
    b = BINS - 1
    while b > 0 and above + held[b] < rank:
        above += held[b]
        b -= 1
    return b, above


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _finite_span(values, count):
    """(least, largest, whether both are finite numbers and so is the span between them) of values[:count]."""
    low = np.float32(np.inf)
    high = np.float32(-np.inf)
    numbers = True
    for i in range(count):
        value = values[i]
        numbers &= value == value
        low = min(low, value)
        high = max(high, value)
    # compared, not np.isfinite: under the kernels' fast-math flags LLVM folds isfinite(x) to true
    finite = numbers and count > 0 and low > -np.inf and high - low <= np.finfo(np.float32).max
    return low, high, finite


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _sampled_floor(row, spread, rank):
    """A floor that at least ``rank`` of ``spread`` scores of the row, evenly apart, reach: the least score in the
    rank-th largest one's bin. A sampled -inf (a masked score, never among a row's k best) is left out of the
    sample, which changes no rank above it; -inf where fewer than ``rank`` are left or another is not a finite
    number."""
    n = row.shape[0]
    sample = np.empty(spread, np.float32)
    held = 0
    # column (2 i + 1) n // (2 spread), stepped by its quotient and remainder: no division per sample
    parts = 2 * spread
    column, remainder = n // parts, n % parts
    step, extra = (2 * n) // parts, (2 * n) % parts
    for _ in range(spread):
        value = row[column]
        sample[held] = value
        held += not value == -np.inf
        column += step
        remainder += extra
        if remainder >= parts:
            remainder -= parts
            column += 1
    low, high, finite = _finite_span(sample, held)
    if not finite or held < rank:
        return np.float32(-np.inf)
    bins = np.empty(held, np.int32)
    b, _ = _bin_of_rank(_binned(sample, held, low, high, bins), rank)
    floor = high
    for i in range(held):
        if bins[i] >= b:
            floor = min(floor, sample[i])
    return floor


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _copy_to(values, ids, count, out_values, out_ids, first):
    """out_values/out_ids[first:first + count] = values/ids[:count]. A loop, not a slice assignment: numba compiles
    a slice assignment's error message (its shapes formatted as text): 3.5 s of a first run's 25 s compiling."""
    for j in range(count):
        out_values[first + j] = values[j]
        out_ids[first + j] = ids[j]


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _k_largest(values, ids, count, k, out_values, out_ids):
    """The k largest of values[:count] (no NaN; count >= k) and their ids into out_values/out_ids [k], in no
    order: bins between the least and largest, every one above the k-th's bin kept and that bin cut with a
    quickselect; a quickselect of them all where infinities leave no bins between them (values and ids
    reordered)."""
    low, high, finite = _finite_span(values, count)
    if not finite:
        _largest_first(values, ids, count, k)
        _copy_to(values, ids, k, out_values, out_ids, 0)
        return
    bins = np.empty(count, np.int32)
    in_bin = _binned(values, count, low, high, bins)
    b, above = _bin_of_rank(in_bin, k)
    cut_values = np.empty(in_bin[b] + 1, np.float32)  # the k-th's bin, and one more for the branch-free writes
    cut_ids = np.empty(in_bin[b] + 1, np.int64)
    kept = 0
    cut = 0
    # branch-free, as _at_least: every candidate written to both, the next over it unless it belongs there (a
    # branch per candidate, taken at random, cost half the selection); out has room: above < k
    for i in range(count):
        value, column, its_bin = values[i], ids[i], bins[i]
        out_values[kept] = value
        out_ids[kept] = column
        kept += its_bin > b
        cut_values[cut] = value
        cut_ids[cut] = column
        cut += its_bin == b
    wanted = k - above
    if wanted < cut:
        _largest_first(cut_values, cut_ids, cut, wanted)
    _copy_to(cut_values, cut_ids, wanted, out_values, out_ids, above)


@numba.njit(nogil=True, cache=_CACHED, inline="always")
def _at_least(row, floor, values, ids):
    """values/ids[:count] = the scores of the row at or above ``floor`` (and any NaN) and their columns, in
    column order; -> count. Branch-free: every score is written, the next one over it where it falls short;
    values/ids hold the row's length and one more."""
    held = 0
    for i in range(row.shape[0]):
        value = row[i]
        values[held] = value
        ids[held] = i
        held += not value < floor
    return held


# not inlined into _top_k_rows' parallel loop: numba's parallel passes over the inlined body added 5 s to the
# kernel's compile (python -m bench.compile_time); a call a row costs nothing measurable
@numba.njit(nogil=True, cache=_CACHED)
def _row_top_k(row, k, spread, rank, values, ids, out_values, out_ids):
    """The row's k largest scores and their columns into out_values/out_ids [k], in no order (values/ids: the
    candidates' buffer, the row's length and one more); -> False (nothing written) where the row holds a NaN or
    fewer than k scores."""
    floor = _sampled_floor(row, spread, rank) if spread else np.float32(-np.inf)
    count = 0
    for _ in range(2):  # again only where the sample misjudged (one call: its code compiled once)
        count = _at_least(row, floor, values, ids)
        if count >= k or not floor > -np.inf:
            break
        floor = np.float32(-np.inf)
    if count < k:
        return False
    for i in range(count):  # a NaN is never below the floor: among the candidates if in the row
        if values[i] != values[i]:
            return False
    _k_largest(values, ids, count, k, out_values, out_ids)
    return True


_f32, _i64 = numba.types.float32, numba.types.int64
_call_row_top_k = callee(_row_top_k, _f32[::1], _i64, _i64, _i64, _f32[::1], _i64[::1], _f32[::1], _i64[::1],
                         returns=numba.types.boolean)  # by address (jit.callee)


@parallel_driver(_call_row_top_k)
def _top_k_rows(scores, k, parts, out_values, out_ids, done, row_top_k):
    """out_values/out_ids [rows, k] = each row of scores [rows, n] fp32's k largest (``_row_top_k``), the rows in
    ``parts`` consecutive shares, one a thread, each with its candidates' buffer; done[r] = 0 where row r was left
    to the caller."""
    rows, n = scores.shape
    spread = min(SAMPLE_SCORES, n // 4)
    rank = sample_rank(spread, n, k) if spread >= SAMPLE_MIN else spread
    if spread < SAMPLE_MIN or 2 * rank > spread:  # a floor that keeps half the row saves nothing
        spread = 0
    for part in numba.prange(parts):
        values = np.empty(n + 1, np.float32)  # a branch-free copy writes one beyond the last it keeps
        ids = np.empty(n + 1, np.int64)
        for r in range((part * rows) // parts, ((part + 1) * rows) // parts):
            done[r] = _call_row_top_k(row_top_k, (scores[r], k, spread, rank, values, ids, out_values[r],
                                                  out_ids[r]))


jit.end_decorations()
