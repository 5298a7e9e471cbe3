"""The LLVM instructions the compiled loops (compiled_loops.py, score_loops.py) use that numba does not emit from
Python code, each a numba intrinsic written in LLVM IR, each with why:

- ``_as_float``: an fp32 number from the bits of a uint32 (a bfloat16 number widened is its bits shifted):
  nopython mode has no scalar bit cast (``np.float32(bits)`` converts the value);
- ``_prefetch``: ``llvm.prefetch`` of the rows PREFETCH_BYTES ahead: numba has no prefetch, and some cores'
  own prefetchers keep too few reads in flight to stream at the memory's speed while they compute;
- ``_dot_*`` / ``_pair_*`` / ``_quad_one_bf16``: two to four queries against one or two keys, or one query
  against four bfloat16 keys, in explicit 8-lane vectors with fused multiply-adds, four sums reduced together:
  the loops numba generates reduce each sum on its own, a dozen instructions a key each;
- ``_key_tile_bf16`` / ``_tile_scores_*``: many queries against bfloat16 keys with the keys in the lanes: a tile of
  TILE_KEYS keys transposed once (8 x 8 blocks of words in registers) and widened into a small fp32 buffer, then
  every query's numbers broadcast against it, its scores summed in the lanes, one vector store per 8 keys: the
  per-key reduction of the two- to four-query sums above costs as much as their multiplies, and the tile's
  transposition is shared by all the queries;
- ``_sum_*``: one to four queries' weighted sums of a tile of rows kept in 8-lane registers across the rows:
  numba's loop writes each partial sum back to memory between rows;
- ``_above`` and ``_lowest_bit``: eight scores compared with a threshold in one instruction, the result a bit
  mask, and its lowest set bit (``cttz``): numba compares scores one by one and has no count of trailing zeros;
- ``_largest``: the largest of a row's scores 8 lanes at a time (``llvm.maxnum``, NaNs passed over): numba's
  ``max`` loop is not vectorized;
- ``call_at_of``: a call of a compiled kernel at an address given at run time (``jit.callee``): numba calls a
  kernel it knows by name only, linking the kernel's code into the caller's to be optimised and emitted again.

The vectors are LLVM's <8 x float>, which it maps onto whatever registers the machine has (one AVX2 register,
two SSE or NEON ones, half an AVX-512 one). Where numba compiles for AVX-512 (``WIDE``), the few-query scores of
two or four keys put two keys' 8 lanes side by side in <16 x float>: each lane does what it does in 8 lanes, so
the scores are the same, bit for bit, on every machine.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir as _llvm
from numba.core import cgutils as _cgutils
from numba.extending import intrinsic as _intrinsic

# how far ahead of the row being read the streaming loops ask for rows (``_prefetch``): a core's own hardware
# prefetcher keeps too few reads in flight on some machines (2-core Xeon VM, 300k bf16 keys of 12 heads x 64, two
# threads: 12.7 GB/s without, 2 KiB ahead 19.8, 4 KiB 21.4, 8 KiB 20.3, 16 KiB 19.9; its float32 sum: 19-23)
PREFETCH_BYTES = 4096
_CACHE_LINE = 64


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
_WIDE_FLOATS = _llvm.VectorType(_FLOAT, 2 * _LANES)
_WIDE_WORDS = _llvm.VectorType(_WORD, 2 * _LANES)
_ONE = np.uint32(1)


def _compiles_for_avx512() -> bool:
    """Whether numba compiles for a machine with AVX-512 (the features it takes: NUMBA_CPU_FEATURES, or the
    host's)."""
    from numba.core import codegen, config

    features = config.CPU_FEATURES if config.CPU_FEATURES is not None else codegen.get_host_cpu_features()
    return "+avx512f" in features.split(",")


# where numba compiles for AVX-512, the few-query scores of two or four keys hold two keys side by side in 16-lane
# vectors, each lane the very arithmetic of the 8-lane code (the same scores, bit for bit): half the instructions.
# On a 2-core EPYC Zen 5 (full-width AVX-512), 300k bfloat16 keys of 12 heads x 64: the scan of 4 queries a head
# 1.34x faster, of 8 queries 1.55x; chosen by the features, not raced (not measured on a Zen 4 or an Intel CPU)
WIDE = _compiles_for_avx512()


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
def _prefetch_row(typingctx, rows, row):
    """Ask for the first cache lines of rows[row], up to four (a row of 64 bfloat16 or fp32 numbers whole): in a
    loop that gathers rows by id, the row it will read a few ids later, its read in flight while this core works
    on the ones before it (a gathered row is too short for the hardware to see a stream). A hint: an id past
    the end is never read and never faults. rows 2-d, contiguous rows."""
    if not (isinstance(rows, numba.types.Array) and rows.ndim == 2):
        return None

    def codegen(context, builder, signature, args):
        rows_type, row_type = signature.args
        start = _row_address(context, builder, rows_type, args[0], (args[1], row_type))
        pitch = _cgutils.unpack_tuple(builder, context.make_array(rows_type)(context, builder, args[0]).strides)[0]
        byte = _llvm.IntType(8).as_pointer()
        prefetch = _cgutils.get_or_insert_function(
            builder.module, _llvm.FunctionType(_llvm.VoidType(), [byte, _WORD, _WORD, _WORD]), "llvm.prefetch")

        def line(index):  # a read (0), kept in every level of the cache (3), of data (1)
            address = builder.gep(start, [_llvm.Constant(pitch.type, index * _CACHE_LINE)])
            builder.call(prefetch, [address, _llvm.Constant(_WORD, 0), _llvm.Constant(_WORD, 3),
                                    _llvm.Constant(_WORD, 1)])

        line(0)
        line(1)
        with builder.if_then(builder.icmp_unsigned(">", pitch, _llvm.Constant(pitch.type, 2 * _CACHE_LINE))):
            line(2)
            line(3)
        return context.get_dummy_value()

    return numba.types.void(rows, row), codegen


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


def _widened(builder, words):
    """Words of two bfloat16 numbers (a vector of any lanes) as fp32 lanes: the even dimensions, the odd ones."""
    lanes = words.type.count
    floats = _llvm.VectorType(_FLOAT, lanes)
    return (builder.bitcast(builder.shl(words, _llvm.Constant(words.type, [16] * lanes)), floats),
            builder.bitcast(builder.and_(words, _llvm.Constant(words.type, [-65536] * lanes)),
                            floats))  # -65536: 0xFFFF0000


def _widened_lanes(builder, address, byte_offset, bfloat16):
    """The 8 words (bfloat16: as their even dimensions and their odd ones) or fp32 numbers at address +
    byte_offset, as fp32 lanes."""
    if not bfloat16:
        return (_load_lanes(builder, address, byte_offset, _FLOATS),)
    return _widened(builder, _load_lanes(builder, address, byte_offset, _WORDS))


def _multiply_add(builder, a, b, total):
    """a * b + total (vectors of any lanes), fused where the machine has fused multiply-adds (``llvm.fmuladd``:
    never a libcall)."""
    lanes = a.type.count
    function_type = _llvm.FunctionType(a.type, [a.type, a.type, a.type])
    function = _cgutils.get_or_insert_function(builder.module, function_type, f"llvm.fmuladd.v{lanes}f32")
    return builder.call(function, [a, b, total])


def _side_by_side(builder, low, high):
    """One vector of 16 lanes: the 8 of ``low``, then the 8 of ``high``."""
    return builder.shuffle_vector(low, high, _llvm.Constant(_WIDE_WORDS, list(range(2 * _LANES))))


def _pair_sums(builder, a, b):
    """[a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] of each 8 lanes (x86's vhaddps, in portable IR)."""
    lanes = a.type.count

    def picks(pattern):  # the 8-lane pattern (a's lanes 0-7, b's 8-15) in each 8 lanes
        return _llvm.Constant(_llvm.VectorType(_WORD, lanes), [
            half * _LANES + i if i < _LANES else lanes + half * _LANES + i - _LANES
            for half in range(lanes // _LANES) for i in pattern])

    return builder.fadd(builder.shuffle_vector(a, b, picks([0, 2, 8, 10, 4, 6, 12, 14])),
                        builder.shuffle_vector(a, b, picks([1, 3, 9, 11, 5, 7, 13, 15])))


def _four_totals(builder, sums):
    """The totals of four sums of 8 lanes, reduced together: three pairwise additions and one of the halves (one
    by one, each sum would take three shuffles and three additions of its own); lane m of the vector returned
    (m < 4) is sums[m]'s total. Sums of 16 lanes are two 8-lane sums side by side: lane 8 + m is then the total
    of sums[m]'s upper 8 lanes, each total the same sum as in 8 lanes."""
    paired = _pair_sums(builder, _pair_sums(builder, sums[0], sums[1]), _pair_sums(builder, sums[2], sums[3]))
    lanes = paired.type.count
    upper = builder.shuffle_vector(paired, _llvm.Constant(paired.type, _llvm.Undefined), _llvm.Constant(
        _llvm.VectorType(_WORD, lanes), [half * _LANES + 4 + i % 4 for half in range(lanes // _LANES)
                                         for i in range(_LANES)]))
    return builder.fadd(paired, upper)


def _dot_codegen(bfloat16: bool, count: int, keys_at_once: int, wide: bool):
    """The code of ``_dot_bf16`` / ``_dot_f32`` for ``count`` queries (1 to 4) and ``keys_at_once`` keys (1, 2
    or 4): each key's rows of 8 (32-bit words or fp32 numbers) loaded once, widened in registers and met by
    each query's lanes; the keys_at_once x count sums reduced four at a time and stored into out[first + j,
    row + i]. Several keys at once load each query's lanes once for all (a key's even and odd dimensions then go
    into one sum, so that the sums stay in registers); one query against four keys reduces the four keys' sums
    together (one by one, each would take three shuffles and three additions of its own). ``wide`` (bfloat16
    keys, two or four): two keys' 8 lanes side by side in each 16-lane vector, met by the query's lanes twice
    over, each lane the same sum as in 8 lanes; the halves then reduced as 8 lanes are."""
    pairs = keys_at_once // 2 if wide else 0  # one key: none

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
        if pairs:  # [pair][query], 16 lanes
            wide_zero = _llvm.Constant(_WIDE_FLOATS, [0.0] * 2 * _LANES)
            sums = [[_cgutils.alloca_once_value(builder, wide_zero) for _ in range(count)] for _ in range(pairs)]
        else:
            sums = [[[_cgutils.alloca_once_value(builder, zero) for _ in range(count)] for _ in range(sum_parts)]
                    for _ in rows]
        chunks = builder.udiv(width, _llvm.Constant(width.type, _LANES))
        with _cgutils.for_range(builder, chunks) as loop:
            offset = builder.mul(loop.index, _llvm.Constant(width.type, 4 * _LANES))  # bytes
            if pairs:
                words = [_load_lanes(builder, key, offset, _WORDS) for key in key_rows]
                lanes = [_widened(builder, _side_by_side(builder, words[2 * pair], words[2 * pair + 1]))
                         for pair in range(pairs)]
            else:
                lanes = [_widened_lanes(builder, key, offset, bfloat16) for key in key_rows]
            for part in range(len(parts)):
                for j in range(count):
                    query_lanes = _load_lanes(builder, query_rows[part][j], offset, _FLOATS)
                    if pairs:
                        query_lanes = _side_by_side(builder, query_lanes, query_lanes)
                    for key, key_lanes in enumerate(lanes):
                        total = sums[key][j] if pairs else sums[key][min(part, sum_parts - 1)][j]
                        builder.store(_multiply_add(builder, key_lanes[part], query_lanes, builder.load(total)),
                                      total)
        if pairs:  # [(a sum, the (key, query) of its lower 8 lanes, then of its upper 8)]
            members = [(builder.load(sums[pair][j]), [(2 * pair, j), (2 * pair + 1, j)])
                       for pair in range(pairs) for j in range(count)]
            zero = _llvm.Constant(_WIDE_FLOATS, [0.0] * 2 * _LANES)
        else:
            members = []
            for key in range(keys_at_once):
                for j in range(count):
                    total = builder.load(sums[key][0][j])
                    if sum_parts == 2:
                        total = builder.fadd(total, builder.load(sums[key][1][j]))
                    members.append((total, [(key, j)]))
        for group in range(0, len(members), 4):  # each key's queries together
            grouped = members[group:group + 4]
            totals = _four_totals(builder, [total for total, _ in grouped] + [zero] * (4 - len(grouped)))
            for m, (_, keys_of) in enumerate(grouped):
                for half, (key, j) in enumerate(keys_of):
                    total = builder.extract_element(totals, _llvm.Constant(_WORD, half * _LANES + m))
                    column = builder.mul(rows[key], _llvm.Constant(rows[key].type, 4))  # bytes into out's row
                    address = _row_address(context, builder, out_type, out,
                                           (builder.add(first, _llvm.Constant(first.type, j)), numba.types.intp))
                    builder.store(total, builder.bitcast(builder.gep(address, [column]), _FLOAT.as_pointer()))
        return context.get_dummy_value()

    return codegen


def _rows_of(array, dtype) -> bool:
    return isinstance(array, numba.types.Array) and array.ndim == 2 and array.dtype == dtype


def _dot_bf16_of(count: int, keys_at_once: int, wide: bool = WIDE):
    """An intrinsic: out[first + j, row + i] = the fp32 score of key row + i of bfloat16 ``words`` [n, dh/2]
    (``_scores_bf16``'s layout) against query first + j of ``even``/``odd`` [nq, dh/2], j < ``count``, i <
    ``keys_at_once``; dh/2 a multiple of 8, rows contiguous. ``wide``: in 16-lane vectors where keys_at_once > 1
    (the same scores)."""

    def typer(typingctx, words, row, even, odd, first, out):
        if not (_rows_of(words, numba.types.uint32) and _rows_of(even, numba.types.float32)
                and _rows_of(odd, numba.types.float32) and _rows_of(out, numba.types.float32)):
            return None
        return numba.types.none(words, row, even, odd, first, out), _dot_codegen(True, count, keys_at_once, wide)

    return _intrinsic(typer)


def _dot_f32_of(count: int, keys_at_once: int):
    """An intrinsic: out[first + j, row + i] = the fp32 score of key row + i of fp32 ``keys`` [n, dh] against
    query first + j of ``queries`` [nq, dh], j < ``count``, i < ``keys_at_once``; dh a multiple of 8, rows
    contiguous. In 8 lanes also where WIDE: 16 lanes measured 0.9x for fp32 keys on the EPYC Zen 5."""

    def typer(typingctx, keys, row, queries, first, out):
        if not (_rows_of(keys, numba.types.float32) and _rows_of(queries, numba.types.float32)
                and _rows_of(out, numba.types.float32)):
            return None
        return numba.types.none(keys, row, queries, first, out), _dot_codegen(False, count, keys_at_once, False)

    return _intrinsic(typer)


_dot_four_bf16, _dot_three_bf16, _dot_two_bf16 = (_dot_bf16_of(count, 1) for count in (4, 3, 2))
_dot_four_f32, _dot_three_f32, _dot_two_f32 = (_dot_f32_of(count, 1) for count in (4, 3, 2))
_pair_four_bf16, _pair_three_bf16, _pair_two_bf16 = (_dot_bf16_of(count, 2) for count in (4, 3, 2))
_pair_four_f32, _pair_three_f32, _pair_two_f32 = (_dot_f32_of(count, 2) for count in (4, 3, 2))
_quad_one_bf16 = _dot_bf16_of(1, 4)  # one query, four keys (bfloat16 keys: for fp32 ones measured slower)
_quad_four_bf16, _quad_three_bf16, _quad_two_bf16 = (_dot_bf16_of(count, 4) for count in (4, 3, 2))

# --- many queries against a tile of keys in the lanes (``_scores_bf16`` from the count compiled.tiled_from measured)

# keys per tile: five 8-lane vectors of each query's scores, two queries at a time (ten sums in registers), and the
# tile's transposition shared by all the queries (EPYC Zen 2, 16,384 keys x 12 heads, two threads, against the
# two-keys-four-queries sums: 8 queries 1.17x, 16 1.25x, 32 1.28x, 64 1.64x, 128 1.80x; tiles of 16 to 64 keys
# and 1 to 4 queries at a time measured slower, 4 queries 0.8x)
TILE_KEYS = 40
_TILE_VECTORS = TILE_KEYS // _LANES


def _transposed(builder, rows):
    """The 8 x 8 transpose of eight 8-lane vectors: result j holds lane j of each row, in row order (three
    rounds of eight two-vector shuffles, which x86 does as unpack, shuffle and 128-bit permute)."""
    def shuffle(a, b, lanes):
        return builder.shuffle_vector(a, b, _llvm.Constant(_WORDS, lanes))

    pairs = []
    for a in range(0, 8, 2):  # [r_a0, r_b0, r_a1, r_b1 | r_a4, r_b4, r_a5, r_b5] and the 2, 3, 6, 7 lanes
        pairs += [shuffle(rows[a], rows[a + 1], [0, 8, 1, 9, 4, 12, 5, 13]),
                  shuffle(rows[a], rows[a + 1], [2, 10, 3, 11, 6, 14, 7, 15])]
    quads = []
    for left, right in ((0, 2), (4, 6)):  # four rows' lane j in each 128-bit half
        for part in (left, left + 1):
            quads += [shuffle(pairs[part], pairs[right + part - left], [0, 1, 8, 9, 4, 5, 12, 13]),
                      shuffle(pairs[part], pairs[right + part - left], [2, 3, 10, 11, 6, 7, 14, 15])]
    columns = [None] * 8
    for j in range(4):  # rows 0-3's halves beside rows 4-7's
        columns[j] = shuffle(quads[j], quads[j + 4], [0, 1, 2, 3, 8, 9, 10, 11])
        columns[j + 4] = shuffle(quads[j], quads[j + 4], [4, 5, 6, 7, 12, 13, 14, 15])
    return columns


@_intrinsic
def _key_tile_bf16(typingctx, words, row, tile):
    """tile[2 d + p, i] = dimension 2 d + p of key row + i (p = 0 even, 1 odd), fp32, i < TILE_KEYS: bfloat16
    ``words`` [n, dh/2] uint32 (``_scores_bf16``'s layout, dh/2 a multiple of 8, rows row .. row + TILE_KEYS - 1
    there) transposed, each word of 8 keys' 8 words after one 8 x 8 transpose in registers; tile [dh, TILE_KEYS]
    fp32, rows contiguous."""
    if not (_rows_of(words, numba.types.uint32) and _rows_of(tile, numba.types.float32)):
        return None

    def codegen(context, builder, signature, args):
        words_type, row_type, tile_type = signature.args
        row = context.cast(builder, args[1], row_type, numba.types.intp)
        width = _cgutils.unpack_tuple(builder, context.make_array(words_type)(context, builder, args[0]).shape)[1]
        key_rows = [_row_address(context, builder, words_type, args[0],
                                 (builder.add(row, _llvm.Constant(row.type, i)), numba.types.intp))
                    for i in range(TILE_KEYS)]
        tile = context.make_array(tile_type)(context, builder, args[2])
        tile_data = builder.bitcast(tile.data, _llvm.IntType(8).as_pointer())
        tile_pitch = _cgutils.unpack_tuple(builder, tile.strides)[0]
        shift, upper = _llvm.Constant(_WORDS, [16] * _LANES), _llvm.Constant(_WORDS, [-65536] * _LANES)
        with _cgutils.for_range(builder, builder.udiv(width, _llvm.Constant(width.type, _LANES))) as chunk:
            offset = builder.mul(chunk.index, _llvm.Constant(width.type, 4 * _LANES))  # bytes into a key's row
            for vector in range(_TILE_VECTORS):
                columns = _transposed(builder, [_load_lanes(builder, key_rows[vector * _LANES + i], offset, _WORDS)
                                                for i in range(_LANES)])
                for j, column in enumerate(columns):  # word chunk * 8 + j of the 8 keys
                    word = builder.add(builder.mul(chunk.index, _llvm.Constant(width.type, _LANES)),
                                       _llvm.Constant(width.type, j))
                    widened = (builder.shl(column, shift), builder.and_(column, upper))  # even, odd dimension
                    for part, lanes in enumerate(widened):
                        tile_row = builder.add(builder.mul(word, _llvm.Constant(width.type, 2)),
                                               _llvm.Constant(width.type, part))
                        at = builder.add(builder.mul(tile_row, tile_pitch),
                                         _llvm.Constant(tile_pitch.type, 4 * _LANES * vector))
                        builder.store(builder.bitcast(lanes, _FLOATS),
                                      builder.bitcast(builder.gep(tile_data, [at]), _FLOATS.as_pointer()), align=4)
        return context.get_dummy_value()

    return numba.types.none(words, row, tile), codegen


def _tile_scores_codegen(count: int):
    """The code of ``_tile_scores_of(count)``: each query's TILE_KEYS sums in _TILE_VECTORS registers, every
    dimension's two numbers (even, then odd) broadcast and multiplied into them in order, so that a score is
    the same sum whichever query or tile it is computed in."""

    def codegen(context, builder, signature, args):
        tile_type, even_type, odd_type, first_type, out_type, column_type = signature.args
        tile_value, even, odd, first, out, column = args
        tile = context.make_array(tile_type)(context, builder, tile_value)
        tile_data = builder.bitcast(tile.data, _llvm.IntType(8).as_pointer())
        tile_pitch = _cgutils.unpack_tuple(builder, tile.strides)[0]
        half = _cgutils.unpack_tuple(builder, context.make_array(even_type)(context, builder, even).shape)[1]
        first = context.cast(builder, first, first_type, numba.types.intp)
        column = context.cast(builder, column, column_type, numba.types.intp)
        queries = [(builder.add(first, _llvm.Constant(first.type, j)), numba.types.intp) for j in range(count)]
        numbers = [[builder.bitcast(_row_address(context, builder, part_type, part, query), _FLOAT.as_pointer())
                    for query in queries] for part_type, part in ((even_type, even), (odd_type, odd))]
        zero = _llvm.Constant(_FLOATS, [0.0] * _LANES)
        sums = [[_cgutils.alloca_once_value(builder, zero) for _ in range(_TILE_VECTORS)] for _ in range(count)]
        with _cgutils.for_range(builder, half) as word:
            lanes = []  # [part][vector]: the tile's row 2 word + part
            for part in range(2):
                tile_row = builder.add(builder.mul(word.index, _llvm.Constant(half.type, 2)),
                                       _llvm.Constant(half.type, part))
                start = builder.mul(tile_row, tile_pitch)
                lanes.append([_load_lanes(builder, tile_data, builder.add(start, _llvm.Constant(
                    start.type, 4 * _LANES * vector)), _FLOATS) for vector in range(_TILE_VECTORS)])
            for j in range(count):
                even_number, odd_number = (_splat(builder, builder.load(builder.gep(numbers[part][j], [word.index])))
                                           for part in range(2))
                for vector in range(_TILE_VECTORS):
                    total = _multiply_add(builder, even_number, lanes[0][vector], builder.load(sums[j][vector]))
                    builder.store(_multiply_add(builder, odd_number, lanes[1][vector], total), sums[j][vector])
        for j, query in enumerate(queries):
            address = _row_address(context, builder, out_type, out, query)
            for vector in range(_TILE_VECTORS):
                at = builder.mul(builder.add(column, _llvm.Constant(column.type, _LANES * vector)),
                                 _llvm.Constant(column.type, 4))  # bytes into the row of out
                builder.store(builder.load(sums[j][vector]),
                              builder.bitcast(builder.gep(address, [at]), _FLOATS.as_pointer()), align=4)
        return context.get_dummy_value()

    return codegen


def _tile_scores_of(count: int):
    """An intrinsic: out[first + j, column + i] = the fp32 score of the tile's key i (``_key_tile_bf16``) against
    query first + j of ``even``/``odd`` [nq, dh/2], i < TILE_KEYS, j < ``count``; tile [dh, TILE_KEYS] fp32,
    rows contiguous."""

    def typer(typingctx, tile, even, odd, first, out, column):
        if not (_rows_of(tile, numba.types.float32) and _rows_of(even, numba.types.float32)
                and _rows_of(odd, numba.types.float32) and _rows_of(out, numba.types.float32)):
            return None
        return numba.types.none(tile, even, odd, first, out, column), _tile_scores_codegen(count)

    return _intrinsic(typer)


_tile_scores_one, _tile_scores_two = (_tile_scores_of(count) for count in (1, 2))


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


# --- a compiled kernel called at an address given at run time (jit.callee)


def call_at_of(signature: tuple, returns):
    """An intrinsic: ``call(address, arguments)`` calls the compiled kernel whose entry is at ``address`` (an
    int64: ``jit.callee``'s ``call.address()``) with the tuple ``arguments``, their numba types ``signature`` (the
    kernel's, which returns ``returns``). A call with other types does not type: the kernel at the address was
    compiled for these."""

    def codegen(context, builder, _signature, args):
        function_type = context.call_conv.get_function_type(returns, signature)
        entry = builder.inttoptr(args[0], function_type.as_pointer())
        values = _cgutils.unpack_tuple(builder, args[1], len(signature))
        status, result = context.call_conv.call_function(builder, entry, returns, signature, values)
        with _cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return result

    def typer(typingctx, address, arguments):
        if not (isinstance(address, numba.types.Integer) and isinstance(arguments, numba.types.BaseTuple)
                and tuple(arguments.types) == tuple(signature)):
            return None
        return returns(address, arguments), codegen

    return _intrinsic(typer)
