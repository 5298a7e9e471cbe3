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
  words (or fp32 numbers) are a multiple of 8; the top-k of each query is kept as it goes: a block's scores
  are compared with the current threshold 8 at a time (``_above``), those above it appended to a buffer of
  ``2 k`` candidates, and a full buffer is cut to little more than its k largest (``_cut``: a sample says
  where, one branch-free pass keeps them), which raises the threshold; ``scores``: the same pass, every
  score written;
- ``select_grouped``: ``select`` for grouped-query attention (decoder-only generation): every query head of a
  key-value head scores each block of its keys, and each row's (beam's) g scores of a key are reduced to their
  largest before the running top-k keeps them: one selection per row and key-value head, one pass;
- ``weighted_sum``: each query's chosen states read once (four at a time, their reads in flight together) and
  summed in fp32, no gathered copy; ``dense_sum``: weights [nq, N] times every state, each block of states met
  by every query while it is in cache; ``head_dense_sum``: the same per head over its own values [H, N, dh];
- ``attend_dense``: softmax(q K^T) V per head over its own keys and values in one pass, each block of keys
  scored, weighed under a running maximum and sum (the online softmax, its exp in vectors) and its values
  summed while in cache.

Every loop that reads rows one after another asks for the rows PREFETCH_BYTES ahead (``_prefetch``): some
cores' own prefetchers keep too few reads in flight to stream at the memory's speed while they compute.

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

import os
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from unlimisum.measurements import kernel_cache_folder

SCAN_DTYPES = (torch.bfloat16, torch.float32)  # float16 keys keep the torch kernels and faiss
BLOCK_ROWS = 1024  # rows scored before their scores are filtered: every query's block of scores stays in L1
# rows of values summed at a time, 8 numbers of each row after another: a tile's rows stay in L1 between them
# (measured, 300k rows of 64 bfloat16 values, 4 queries: 16-32 rows 13.5 ms, 64 rows 15.7, a block of 1024 21.5)
SUM_TILE_ROWS = 32
# how far ahead of the row being read the streaming loops ask for rows (``_prefetch``): a core's own hardware
# prefetcher keeps too few reads in flight on some machines (2-core Xeon VM, 300k bf16 keys of 12 heads x 64, two
# threads: 12.7 GB/s without, 2 KiB ahead 19.8, 4 KiB 21.4, 8 KiB 20.3, 16 KiB 19.9; its float32 sum: 19-23)
PREFETCH_BYTES = 4096
_CACHE_LINE = 64

try:
    import numba
    from llvmlite import ir as _llvm
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic
except ImportError:  # pragma: no cover - numba is a dependency; a broken install leaves the torch kernels
    numba = None

if numba is not None and "NUMBA_THREADING_LAYER" not in os.environ:
    # OpenMP first: torch's own runtime where torch loaded it (see above); numba's thread pool where it cannot
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


# numba chooses where a function's cache lives when the function is decorated (config.CACHE_DIR then): ours is
# set for this module's decorations only, and given back after them, so other numba code in the process keeps its
# own. Where the folder cannot be written the kernels are not cached at all (numba would fall back to the package).
_CACHED = numba is not None and _writable(kernel_cache_folder())
if numba is not None:
    _OTHERS_CACHE_DIR = numba.config.CACHE_DIR
    numba.config.CACHE_DIR = str(kernel_cache_folder()) if _CACHED else ""

# the fp32 rules the kernels may bend: reassociation (to sum with vector registers) and fused multiply-adds,
# never the ones that assume no infinities or NaNs (the threshold starts at -inf)
_FAST = {"reassoc", "contract", "nsz"}


def _compile(function: Callable) -> Callable:
    return numba.njit(nogil=True, cache=_CACHED, fastmath=_FAST)(function)


def _compile_parallel(function: Callable) -> Callable:
    return numba.njit(nogil=True, cache=_CACHED, fastmath=_FAST, parallel=True)(function)


if numba is not None:

    @_intrinsic
    def _as_float(typingctx, bits):
        """The fp32 number whose bits are the uint32 ``bits`` (a reinterpretation, no conversion)."""
        signature = numba.types.float32(numba.types.uint32)

        def codegen(context, builder, _signature, args):
            return builder.bitcast(args[0], _llvm.FloatType())

        return signature, codegen

    _SHIFT = np.uint32(16)
    _UPPER = np.uint32(0xFFFF0000)

    # --- explicit vectors: LLVM's <8 x float>, which it maps onto whatever registers the machine has (one AVX2
    # register, two SSE or NEON ones, half an AVX-512 one). Written out because the loops numba generates for four
    # queries reduce each query's sum on its own, a dozen instructions a key each, and compare scores one by one.

    _LANES = 8
    _FLOAT = _llvm.FloatType()
    _WORD = _llvm.IntType(32)
    _FLOATS = _llvm.VectorType(_FLOAT, _LANES)
    _WORDS = _llvm.VectorType(_WORD, _LANES)
    _ONE = np.uint32(1)

    def _row_address(context, builder, array_type, array, row):
        """The address (i8*) of array[row, 0] of a 2-d array whose rows are contiguous (any row pitch)."""
        array = context.make_array(array_type)(context, builder, array)
        data = builder.bitcast(array.data, _llvm.IntType(8).as_pointer())
        pitch = _cgutils.unpack_tuple(builder, array.strides)[0]
        row = context.cast(builder, row[0], row[1], numba.types.intp)
        return builder.gep(data, [builder.mul(row, pitch)])

    def _load_lanes(builder, address, byte_offset, vector_type):
        pointer = builder.bitcast(builder.gep(address, [byte_offset]), vector_type.as_pointer())
        return builder.load(pointer, align=4)

    @_intrinsic
    def _prefetch(typingctx, rows, row, count):
        """Ask for the bytes of rows[row:row + count] PREFETCH_BYTES further on: in a loop that reads rows one
        after another, the rows it will read next, read into every level of the cache while this core works on
        these. Two cache lines in straight code (a row of 64 bfloat16 numbers, the common one), a loop only for
        the lines beyond them (a loop for every line cost 10 % of a scan whose keys were in the cache). A hint:
        an address past the end of the array is never read and never faults. rows 2-d, contiguous rows."""
        if not (isinstance(rows, numba.types.Array) and rows.ndim == 2):
            return None

        def codegen(context, builder, signature, args):
            rows_type, row_type, count_type = signature.args
            start = _row_address(context, builder, rows_type, args[0], (args[1], row_type))
            pitch = _cgutils.unpack_tuple(builder, context.make_array(rows_type)(context, builder, args[0]).strides)[0]
            count = context.cast(builder, args[2], count_type, numba.types.intp)
            lines = builder.udiv(builder.add(builder.mul(count, pitch), _llvm.Constant(pitch.type, _CACHE_LINE - 1)),
                                 _llvm.Constant(pitch.type, _CACHE_LINE))
            byte = _llvm.IntType(8).as_pointer()
            prefetch = _cgutils.get_or_insert_function(
                builder.module, _llvm.FunctionType(_llvm.VoidType(), [byte, _WORD, _WORD, _WORD]), "llvm.prefetch")
            ahead = builder.gep(start, [_llvm.Constant(pitch.type, PREFETCH_BYTES)])

            def line(index):  # a read (0), kept in every level of the cache (3), of data (1)
                address = builder.gep(ahead, [builder.mul(index, _llvm.Constant(pitch.type, _CACHE_LINE))])
                builder.call(prefetch, [address, _llvm.Constant(_WORD, 0), _llvm.Constant(_WORD, 3),
                                        _llvm.Constant(_WORD, 1)])

            line(_llvm.Constant(pitch.type, 0))
            line(_llvm.Constant(pitch.type, 1))
            with _cgutils.for_range(builder, lines, start=_llvm.Constant(pitch.type, 2)) as extra:
                line(extra.index)
            return context.get_dummy_value()

        return numba.types.none(rows, row, count), codegen

    def _splat(builder, value):
        """<value, value, .. value> (8 lanes)."""
        one = builder.insert_element(_llvm.Constant(_FLOATS, _llvm.Undefined), value, _llvm.Constant(_WORD, 0))
        return builder.shuffle_vector(one, _llvm.Constant(_FLOATS, _llvm.Undefined),
                                      _llvm.Constant(_WORDS, [0] * _LANES))

    def _widened_lanes(builder, address, byte_offset, bfloat16):
        """The 8 words (bfloat16: as their even dimensions and their odd ones) or fp32 numbers at address +
        byte_offset, as fp32 lanes."""
        if not bfloat16:
            return (_load_lanes(builder, address, byte_offset, _FLOATS),)
        words = _load_lanes(builder, address, byte_offset, _WORDS)
        return (builder.bitcast(builder.shl(words, _llvm.Constant(_WORDS, [16] * _LANES)), _FLOATS),
                builder.bitcast(builder.and_(words, _llvm.Constant(_WORDS, [-65536] * _LANES)),
                                _FLOATS))  # the even dimensions, the odd ones (-65536: 0xFFFF0000)

    def _multiply_add(builder, a, b, total):
        """a * b + total, fused where the machine has fused multiply-adds (``llvm.fmuladd``: never a libcall)."""
        function_type = _llvm.FunctionType(_FLOATS, [_FLOATS, _FLOATS, _FLOATS])
        function = _cgutils.get_or_insert_function(builder.module, function_type, f"llvm.fmuladd.v{_LANES}f32")
        return builder.call(function, [a, b, total])

    def _pair_sums(builder, a, b):
        """[a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (x86's vhaddps, in portable IR)."""
        first = _llvm.Constant(_WORDS, [0, 2, 8, 10, 4, 6, 12, 14])
        second = _llvm.Constant(_WORDS, [1, 3, 9, 11, 5, 7, 13, 15])
        return builder.fadd(builder.shuffle_vector(a, b, first), builder.shuffle_vector(a, b, second))

    def _four_totals(builder, sums):
        """The totals of four 8-lane sums, reduced together: three pairwise additions and one of the halves (one
        by one, each sum would take three shuffles and three additions of its own)."""
        paired = _pair_sums(builder, _pair_sums(builder, sums[0], sums[1]), _pair_sums(builder, sums[2], sums[3]))
        return [builder.fadd(builder.extract_element(paired, _llvm.Constant(_WORD, j)),
                             builder.extract_element(paired, _llvm.Constant(_WORD, j + 4))) for j in range(4)]

    def _dot_codegen(bfloat16: bool, count: int, keys_at_once: int):
        """The code of ``_dot_bf16`` / ``_dot_f32`` for ``count`` queries (2, 3 or 4) and ``keys_at_once`` keys (1
        or 2): each key's rows of 8 (32-bit words or fp32 numbers) loaded once, widened in registers and met by
        each query's lanes; the count sums of each key reduced together and stored into out[first + j, row + i].
        Two keys at once load each query's lanes once for both (a key's even and odd dimensions then go into one
        sum, so that the 2 x count sums stay in registers)."""

        def codegen(context, builder, signature, args):
            if bfloat16:
                keys_type, row_type, even_type, odd_type, first_type, out_type = signature.args
                keys, row, even, odd, first, out = args
                parts = ((even_type, even), (odd_type, odd))
            else:
                keys_type, row_type, queries_type, first_type, out_type = signature.args
                keys, row, queries, first, out = args
                parts = ((queries_type, queries),)
            row = context.cast(builder, row, row_type, numba.types.intp)
            rows = [builder.add(row, _llvm.Constant(row.type, i)) for i in range(keys_at_once)]
            key_rows = [_row_address(context, builder, keys_type, keys, (at, numba.types.intp)) for at in rows]
            width = _cgutils.unpack_tuple(builder, context.make_array(keys_type)(context, builder, keys).shape)[1]
            first = context.cast(builder, first, first_type, numba.types.intp)
            query_rows = [[_row_address(context, builder, part_type, part,
                                        (builder.add(first, _llvm.Constant(first.type, j)), numba.types.intp))
                           for j in range(count)] for part_type, part in parts]
            zero = _llvm.Constant(_FLOATS, [0.0] * _LANES)
            sum_parts = len(parts) if keys_at_once == 1 else 1  # [key][part][query]
            sums = [[[_cgutils.alloca_once_value(builder, zero) for _ in range(count)] for _ in range(sum_parts)]
                    for _ in rows]
            chunks = builder.udiv(width, _llvm.Constant(width.type, _LANES))
            with _cgutils.for_range(builder, chunks) as loop:
                offset = builder.mul(loop.index, _llvm.Constant(width.type, 4 * _LANES))  # bytes
                lanes = [_widened_lanes(builder, key, offset, bfloat16) for key in key_rows]
                for part in range(len(parts)):
                    for j in range(count):
                        query_lanes = _load_lanes(builder, query_rows[part][j], offset, _FLOATS)
                        for key, key_lanes in enumerate(lanes):
                            total = sums[key][min(part, sum_parts - 1)][j]
                            builder.store(_multiply_add(builder, key_lanes[part], query_lanes, builder.load(total)),
                                          total)
            for key, at in enumerate(rows):
                totals = [builder.load(sums[key][0][j]) for j in range(count)]
                if sum_parts == 2:
                    totals = [builder.fadd(totals[j], builder.load(sums[key][1][j])) for j in range(count)]
                totals = _four_totals(builder, totals + [zero] * (4 - count))[:count]  # fewer: reduced with zeros
                column = builder.mul(at, _llvm.Constant(at.type, 4))  # bytes into each row of out
                for j, total in enumerate(totals):
                    address = _row_address(context, builder, out_type, out,
                                           (builder.add(first, _llvm.Constant(first.type, j)), numba.types.intp))
                    builder.store(total, builder.bitcast(builder.gep(address, [column]), _FLOAT.as_pointer()))
            return context.get_dummy_value()

        return codegen

    def _rows_of(array, dtype) -> bool:
        return isinstance(array, numba.types.Array) and array.ndim == 2 and array.dtype == dtype

    def _dot_bf16_of(count: int, keys_at_once: int):
        """An intrinsic: out[first + j, row + i] = the fp32 score of key row + i of bfloat16 ``words`` [n, dh/2]
        (``_scores_bf16``'s layout) against query first + j of ``even``/``odd`` [nq, dh/2], j < ``count``, i <
        ``keys_at_once``; dh/2 a multiple of 8, rows contiguous."""

        def typer(typingctx, words, row, even, odd, first, out):
            if not (_rows_of(words, numba.types.uint32) and _rows_of(even, numba.types.float32)
                    and _rows_of(odd, numba.types.float32) and _rows_of(out, numba.types.float32)):
                return None
            return numba.types.none(words, row, even, odd, first, out), _dot_codegen(True, count, keys_at_once)

        return _intrinsic(typer)

    def _dot_f32_of(count: int, keys_at_once: int):
        """An intrinsic: out[first + j, row + i] = the fp32 score of key row + i of fp32 ``keys`` [n, dh] against
        query first + j of ``queries`` [nq, dh], j < ``count``, i < ``keys_at_once``; dh a multiple of 8, rows
        contiguous."""

        def typer(typingctx, keys, row, queries, first, out):
            if not (_rows_of(keys, numba.types.float32) and _rows_of(queries, numba.types.float32)
                    and _rows_of(out, numba.types.float32)):
                return None
            return numba.types.none(keys, row, queries, first, out), _dot_codegen(False, count, keys_at_once)

        return _intrinsic(typer)

    _dot_four_bf16, _dot_three_bf16, _dot_two_bf16 = (_dot_bf16_of(count, 1) for count in (4, 3, 2))
    _dot_four_f32, _dot_three_f32, _dot_two_f32 = (_dot_f32_of(count, 1) for count in (4, 3, 2))
    _pair_four_bf16, _pair_three_bf16, _pair_two_bf16 = (_dot_bf16_of(count, 2) for count in (4, 3, 2))
    _pair_four_f32, _pair_three_f32, _pair_two_f32 = (_dot_f32_of(count, 2) for count in (4, 3, 2))

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

    @_intrinsic
    def _above(typingctx, scores, row, start, floor):
        """A uint32 whose bit i says scores[row, start + i] > floor, for i < 8 (one compare of 8 lanes; a NaN is
        never above); scores [nq, m] fp32, rows contiguous."""
        if not _rows_of(scores, numba.types.float32):
            return None
        signature = numba.types.uint32(scores, row, start, numba.types.float32)

        def codegen(context, builder, _signature, args):
            scores_type, row_type, start_type, _ = _signature.args
            address = _row_address(context, builder, scores_type, args[0], (args[1], row_type))
            start_at = context.cast(builder, args[2], start_type, numba.types.intp)
            lanes = _load_lanes(builder, address, builder.mul(start_at, _llvm.Constant(start_at.type, 4)), _FLOATS)
            mask = builder.fcmp_ordered(">", lanes, _splat(builder, args[3]))
            return builder.zext(builder.bitcast(mask, _llvm.IntType(_LANES)), _WORD)

        return signature, codegen

    @_intrinsic
    def _lowest_bit(typingctx, bits):
        """The index of the lowest set bit of a nonzero uint32."""
        signature = numba.types.uint32(numba.types.uint32)

        def codegen(context, builder, _signature, args):
            return builder.cttz(args[0], _llvm.Constant(_llvm.IntType(1), 1))

        return signature, codegen

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
                _largest_first(kept[q], kept_ids[q], n, k)
            for j in range(min(n, k)):
                out_scores[q, j] = kept[q, j]
                out_ids[q, j] = kept_ids[q, j]
            for j in range(min(n, k), k):
                out_scores[q, j] = -np.inf
                out_ids[q, j] = 0

    @_compile
    def _scores_bf16(words, even, odd, out):
        """out [nq, n] = fp32 scores of queries (``even``/``odd`` [nq, dh/2] dimensions) against bfloat16 keys
        ``words`` [n, dh/2] uint32 (two keys' numbers a word: the even one in the lower half)."""
        n, half = words.shape
        queries = even.shape[0]
        first = 0
        # in explicit vectors four at a time, then the two or three after the last four (a group of 7: 4 + 3)
        while half % _LANES == 0 and queries - first >= 2:
            count = min(4, queries - first)
            for r in range(0, n - 1, 2):  # two keys at a time: each query's lanes loaded once for both
                if first == 0:  # later queries find the block in cache
                    _prefetch(words, r, 2)
                _pair_bf16(words, r, even, odd, first, count, out)
            if n % 2:
                _dot_bf16(words, n - 1, even, odd, first, count, out)
            first += count
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
            _add_four_f32(out, weights[j], weights[j + 1], weights[j + 2], weights[j + 3], states[ids[j]],
                          states[ids[j + 1]], states[ids[j + 2]], states[ids[j + 3]])
        for j in range(count - count % 4, count):
            _add_one_f32(out, weights[j], states[ids[j]])

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

    def _sum_codegen(bfloat16: bool, count: int):
        """The code of ``_sum_of(count)`` for ``count`` queries (1 to 4): for each 8 words (or fp32 numbers) of a
        row, the queries' sums in registers while every row's 8 are loaded once, widened and met by each query's
        weight; then added to out."""

        def codegen(context, builder, signature, args):
            values_type, weights_type, first_type, rows_type, out_type = signature.args
            values, weights, first, rows, out = args
            array = context.make_array(values_type)(context, builder, values)
            data = builder.bitcast(array.data, _llvm.IntType(8).as_pointer())
            width = _cgutils.unpack_tuple(builder, array.shape)[1]
            pitch = _cgutils.unpack_tuple(builder, array.strides)[0]
            first = context.cast(builder, first, first_type, numba.types.intp)
            rows = context.cast(builder, rows, rows_type, numba.types.intp)
            queries = [(builder.add(first, _llvm.Constant(first.type, j)), numba.types.intp) for j in range(count)]
            weight_rows = [builder.bitcast(_row_address(context, builder, weights_type, weights, query),
                                           _FLOAT.as_pointer()) for query in queries]
            out_rows = [_row_address(context, builder, out_type, out, query) for query in queries]
            parts = 2 if bfloat16 else 1
            sums = [[_cgutils.alloca_once(builder, _FLOATS) for _ in range(count)] for _ in range(parts)]
            zero = _llvm.Constant(_FLOATS, [0.0] * _LANES)
            chunks = builder.udiv(width, _llvm.Constant(width.type, _LANES))
            with _cgutils.for_range(builder, chunks) as chunk:
                offset = builder.mul(chunk.index, _llvm.Constant(width.type, 4 * _LANES))  # bytes
                for part_sums in sums:
                    for total in part_sums:
                        builder.store(zero, total)
                with _cgutils.for_range(builder, rows) as row:
                    address = builder.gep(data, [builder.mul(row.index, pitch)])
                    lanes = _widened_lanes(builder, address, offset, bfloat16)
                    for j in range(count):
                        weight = _splat(builder, builder.load(builder.gep(weight_rows[j], [row.index])))
                        for part, value_lanes in enumerate(lanes):
                            total = builder.load(sums[part][j])
                            builder.store(_multiply_add(builder, value_lanes, weight, total), sums[part][j])
                for part in range(parts):
                    at = builder.add(offset, builder.mul(width, _llvm.Constant(width.type, 4 * part)))
                    for j in range(count):
                        pointer = builder.bitcast(builder.gep(out_rows[j], [at]), _FLOATS.as_pointer())
                        builder.store(builder.fadd(builder.load(pointer, align=4), builder.load(sums[part][j])),
                                      pointer, align=4)
            return context.get_dummy_value()

        return codegen

    def _sum_of(count: int):
        """An intrinsic: out[first + j] += weights[first + j, :rows] @ values[:rows], j < ``count``, for bfloat16
        values [n, dv/2] uint32 (out [nq, dv]: the even dimensions, then the odd ones) or fp32 values [n, dv]
        (out [nq, dv]); dv/2 or dv a multiple of 8, rows contiguous."""

        def typer(typingctx, values, weights, first, rows, out):
            bfloat16 = _rows_of(values, numba.types.uint32)
            if not ((bfloat16 or _rows_of(values, numba.types.float32)) and _rows_of(weights, numba.types.float32)
                    and _rows_of(out, numba.types.float32)):
                return None
            return numba.types.none(values, weights, first, rows, out), _sum_codegen(bfloat16, count)

        return _intrinsic(typer)

    _sum_one, _sum_two, _sum_three, _sum_four = (_sum_of(count) for count in (1, 2, 3, 4))

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

    @_intrinsic
    def _largest(typingctx, scores, row, start, count):
        """The largest of scores[row, start:start + count - count % 8] (8 lanes at a time; -inf for none, NaNs
        passed over); scores [nq, m] fp32, rows contiguous."""
        if not _rows_of(scores, numba.types.float32):
            return None
        signature = numba.types.float32(scores, row, start, count)

        def codegen(context, builder, _signature, args):
            scores_type, row_type, start_type, count_type = _signature.args
            address = _row_address(context, builder, scores_type, args[0], (args[1], row_type))
            start = context.cast(builder, args[2], start_type, numba.types.intp)
            address = builder.gep(address, [builder.mul(start, _llvm.Constant(start.type, 4))])
            count = context.cast(builder, args[3], count_type, numba.types.intp)
            vector_max = _cgutils.get_or_insert_function(
                builder.module, _llvm.FunctionType(_FLOATS, [_FLOATS, _FLOATS]), f"llvm.maxnum.v{_LANES}f32")
            scalar_max = _cgutils.get_or_insert_function(
                builder.module, _llvm.FunctionType(_FLOAT, [_FLOAT, _FLOAT]), "llvm.maxnum.f32")
            largest = _cgutils.alloca_once_value(builder, _llvm.Constant(_FLOATS, [float("-inf")] * _LANES))
            with _cgutils.for_range(builder, builder.udiv(count, _llvm.Constant(count.type, _LANES))) as chunk:
                lanes = _load_lanes(builder, address, builder.mul(chunk.index, _llvm.Constant(count.type, 4 * _LANES)),
                                    _FLOATS)
                builder.store(builder.call(vector_max, [builder.load(largest), lanes]), largest)
            lanes = builder.load(largest)
            top = builder.extract_element(lanes, _llvm.Constant(_WORD, 0))
            for j in range(1, _LANES):
                top = builder.call(scalar_max, [top, builder.extract_element(lanes, _llvm.Constant(_WORD, j))])
            return top

        return signature, codegen

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

    numba.config.CACHE_DIR = _OTHERS_CACHE_DIR  # every kernel is decorated: other numba code keeps its own


def _threads() -> int:
    """torch's thread count, as numba may run it (numba's pool is sized once, from the CPU count)."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(threads)
    return threads


# --- the public functions ------------------------------------------------------------------------


def _head_rows(keys: torch.Tensor) -> tuple[np.ndarray, int]:
    """(rows [(H - 1) * pitch + n, w], pitch): keys [H, n, dh] as the kernels read them, head h's keys being
    rows[h * pitch:h * pitch + n]: bfloat16 as [.., dh/2] uint32 words, fp32 as they are. Each head's rows where
    they lie when they are contiguous (a chapter's view of a book's keys: its rows at an offset into each
    head's block), else a copy."""
    heads, n, head_dim = keys.shape
    if not (keys.stride(2) == 1 and keys.stride(1) == head_dim and keys.stride(0) % head_dim == 0
            and (heads == 1 or keys.stride(0) >= n * head_dim)):
        keys = keys.contiguous()
    pitch = keys.stride(0) // head_dim if heads > 1 else n
    rows = torch.as_strided(keys, ((heads - 1) * pitch + n, head_dim), (head_dim, 1))  # no copy
    if keys.dtype == torch.bfloat16:
        return rows.view(torch.int32).numpy().view(np.uint32), pitch
    return rows.numpy(), pitch


def _split_queries(queries: torch.Tensor, dtype: torch.dtype) -> tuple[np.ndarray, ...]:
    """queries [H, nq, dh] as the kernels read them: fp32, for bfloat16 keys split in even and odd dimensions."""
    queries = queries.detach().to("cpu", torch.float32)
    if dtype == torch.bfloat16:
        return queries[..., 0::2].contiguous().numpy(), queries[..., 1::2].contiguous().numpy()
    return (queries.contiguous().numpy(),)


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
    kernel(rows, heads, pitch, n, *_split_queries(queries, keys.dtype), k, scores.numpy(), ids.numpy(),
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
    key_rows, pitch = _head_rows(keys)
    kernel = _select_grouped_heads_bf16 if keys.dtype == torch.bfloat16 else _select_grouped_heads_f32
    _threads()
    kernel(key_rows, heads, pitch, n, *_split_queries(per_head, keys.dtype), group, k, scores.numpy(), ids.numpy())
    return scores.transpose(0, 1), ids.transpose(0, 1)  # [B, G, k]


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
    kernel(rows, heads, pitch, n, *_split_queries(queries, keys.dtype), 0, np.empty((heads, nq, 0), np.float32),
           np.empty((heads, nq, 0), np.int64), out.numpy())
    return out


def weighted_sum(states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[nq, d] fp32 = sum_j weights[q, j] * states[ids[q, j]], summed in fp32 from the stored numbers: states
    [N, d] (CPU, ``SCAN_DTYPES``; bfloat16 needs an even d), ids [nq, k] int64, weights [nq, k]. One read of each
    chosen state, widened in registers: no gathered copy (``usable_states``)."""
    nq, dim = ids.shape[0], states.shape[1]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= states.shape[0]):  # the kernels do not check
        raise IndexError(f"state ids outside 0..{states.shape[0] - 1}")
    ids = ids.to(torch.long).contiguous().numpy()
    weights = weights.detach().to(torch.float32).contiguous().numpy()
    _threads()
    if states.dtype == torch.bfloat16:
        words = states.contiguous().view(torch.int32).numpy().view(np.uint32)  # [N, d/2]
        even = np.empty((nq, dim // 2), np.float32)
        odd = np.empty((nq, dim // 2), np.float32)
        _sums_queries_bf16(words, ids, weights, even, odd)
        return torch.from_numpy(np.stack((even, odd), axis=2).reshape(nq, dim))
    out = np.empty((nq, dim), np.float32)
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
                                 *_split_queries(queries, keys.dtype), weights, block_peaks, peak, total, out)
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


# --- which kernels run here: each compiled when a run first needs it, and checked against torch -----------------

KERNELS = ("select", "select_grouped", "scores", "weighted_sum", "dense_sum", "head_dense_sum", "attend_dense")
# seconds each kernel took to compile from an empty cache (one dtype; a 2-core EPYC Zen 4 at 2.6 GHz, numba 0.68),
# for the estimate the display shows while a first run waits for them (select and scores share one driver: the
# first of the two takes the time); loading a compiled one takes ~0.1 s
COMPILE_SECONDS = {"select": 6.5, "select_grouped": 4.5, "scores": 0.5, "weighted_sum": 1.0, "dense_sum": 1.7,
                   "head_dense_sum": 1.5, "attend_dense": 9.5}

_READY: dict[tuple[str, torch.dtype], bool] = {}
_LOCKS: dict[tuple[str, torch.dtype], threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def usable_states(states: torch.Tensor, kernel: str = "weighted_sum") -> bool:
    """Whether ``kernel`` (``weighted_sum`` or ``dense_sum``) can read these states [N, d] here."""
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
    key = (kernel, dtype)
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
    return [kernel for kernel in kernels if (kernel, dtype) not in _READY]


def warm(kernels: Iterable[str], dtype: torch.dtype) -> threading.Thread | None:
    """Compile (or load) ``kernels`` for ``dtype`` in a thread of their own, so that they are ready when a run first
    calls them (a book being encoded meanwhile; measured on 2 cores: a 12 s encode took 20 s beside 12 s of
    compiling, where one after the other take 24 s). The thread, or None when there is nothing to do."""
    missing = pending(kernels, dtype)
    if not missing:
        return None
    thread = threading.Thread(target=lambda: [ready(kernel, dtype) for kernel in missing],
                              name="unlimisum-compile", daemon=True)
    thread.start()
    return thread


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
    [2, 300, 32] (16 words a key: the explicit vectors), queries [2, 7, 32] (four at a time, then three)."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 700, 8, generator=generator).to(dtype)
    queries = torch.randn(3, 2, 8, generator=generator)
    wide = torch.randn(2, 300, 32, generator=generator).to(dtype)
    wide_queries = torch.randn(2, 7, 32, generator=generator)
    return keys, queries, wide, wide_queries


def _scores_of(keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    return torch.einsum("hqd,hnd->hqn", queries, keys.float())


def _check_select(dtype: torch.dtype) -> bool:
    keys, queries, wide, wide_queries = _small_keys(dtype)
    found = []
    for k, q in ((keys, queries), (wide, wide_queries)):
        scores, ids = select(k, q, 5)
        scores, order = scores.sort(dim=2, descending=True)
        expected = _scores_of(k, q).topk(5, dim=2)
        found.append(torch.equal(ids.gather(2, order), expected.indices)
                     and torch.allclose(scores, expected.values, atol=1e-4))
    return all(found)


def _check_select_grouped(dtype: torch.dtype) -> bool:
    keys, queries, _, _ = _small_keys(dtype)
    scores, ids = select_grouped(keys, queries.unsqueeze(0), 5)  # [1, 3, 5]: 3 KV heads of 2 query heads each
    expected = _scores_of(keys, queries).amax(dim=1).topk(5, dim=1)  # [3, 5]: the largest of each head's 2 scores
    scores, order = scores[0].sort(dim=1, descending=True)
    return torch.equal(ids[0].gather(1, order), expected.indices) and torch.allclose(scores, expected.values,
                                                                                     atol=1e-4)


def _check_scores(dtype: torch.dtype) -> bool:
    keys, queries, wide, wide_queries = _small_keys(dtype)
    return all(torch.allclose(scores(k, q), _scores_of(k, q), atol=1e-4)
               for k, q in ((keys, queries), (wide, wide_queries)))


def _check_weighted_sum(dtype: torch.dtype) -> bool:
    keys, _, _, _ = _small_keys(dtype)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, keys.shape[1], (2, 5), generator=generator)
    weights = torch.rand(2, 5, generator=generator)
    expected = torch.einsum("qk,qkd->qd", weights, keys[0].float()[ids])
    return torch.allclose(weighted_sum(keys[0], ids, weights), expected, atol=1e-4)


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


_CHECKS = {"select": _check_select, "select_grouped": _check_select_grouped, "scores": _check_scores,
           "weighted_sum": _check_weighted_sum, "dense_sum": _check_dense_sum,
           "head_dense_sum": _check_head_dense_sum, "attend_dense": _check_attend_dense}
