"""The loops of the compiled matrix-vector products (numba): a generation step's few rows times a linear layer's
weight, the weight read from memory once, at the memory's speed.

A greedy step multiplies one row by every weight of the decoder and by the output projection: the step streams
the model's weights, and the products are the step's largest cost. torch's products of one row run far below the
memory's speed on some CPUs: on an EPYC Zen 4 (2 cores, a float32 sum streaming 28 GB/s) every form of a bfloat16
product of 1 to 32 rows (``F.linear``, ``x @ w.T``, ``w @ x.T``) streamed its weight at 8-16 GB/s, a float32 one
at 11-24, so that bfloat16 weights, half the bytes, gave a step nothing. Here each thread takes a consecutive
share of the weight's rows and meets each row with every input row while it is in cache; the inner loop is one
fused multiply-add per number, vectorised by LLVM (its sum reassociated, ``jit.FAST``), a bfloat16 weight read as
32-bit words of two numbers (compiled.py: the word shifted left by 16 bits is the even one, the word with its
lower half cleared the odd one). That loop read bart-base's weights at 27-33 GB/s in bfloat16 there.

compiled.py's ``linear`` says what runs; projections.py races it against torch's forms per machine.
"""

from __future__ import annotations

import numba
import numpy as np

from unlimisum.search import jit
from unlimisum.search.jit import callee as _callee
from unlimisum.search.jit import kernel as _compile
from unlimisum.search.jit import parallel_driver as _parallel_driver
from unlimisum.search.llvm import _as_float

_SHIFT = np.uint32(16)
_UPPER = np.uint32(0xFFFF0000)
_ONE = np.uint32(1)
_HALF = np.uint32(0x7FFF)  # fp32 -> bfloat16, to nearest: add just under half the dropped part, and its lowest kept bit
_MAGNITUDE = np.uint32(0x7FFFFFFF)
_INFINITY = np.uint32(0x7F800000)
_NAN = np.uint16(0x7FC0)  # the NaN torch rounds every NaN to

jit.begin_decorations()


@_compile
def _linear_part_bf16(words, rows, bias, out, first, last):
    """Outputs first..last of out [R, O] = rows [R, I] times the weight [O, I] transposed, plus ``bias`` [O] fp32
    (or [0]: none), all bfloat16 but the bias: the weight read as words [O, I / 2] uint32, the rows and out as
    their uint16 bits; each number summed in fp32 and rounded to the nearest bfloat16 (ties to even, as torch
    rounds)."""
    pairs = words.shape[1]
    count = rows.shape[0]
    widened = np.empty((count, 2 * pairs), np.float32)  # the rows in fp32, once a share
    for r in range(count):
        for j in range(2 * pairs):
            widened[r, j] = _as_float(np.uint32(rows[r, j]) << _SHIFT)
    cell = np.empty(1, np.float32)  # a sum's bits, read through a uint32 view of it
    bits = cell.view(np.uint32)
    for o in range(first, last):
        for r in range(count):
            total = np.float32(0.0)
            for j in range(pairs):
                word = words[o, j]
                total += (_as_float(word << _SHIFT) * widened[r, 2 * j]
                          + _as_float(word & _UPPER) * widened[r, 2 * j + 1])
            if bias.shape[0]:
                total += bias[o]
            cell[0] = total
            word = bits[0]
            if word & _MAGNITUDE > _INFINITY:  # NaN
                out[r, o] = _NAN
            else:
                out[r, o] = np.uint16((word + _HALF + ((word >> _SHIFT) & _ONE)) >> _SHIFT)


@_compile
def _linear_part_f32(weight, rows, bias, out, first, last):
    """``_linear_part_bf16`` for fp32 numbers: outputs first..last of out [R, O] fp32."""
    width = weight.shape[1]
    for o in range(first, last):
        for r in range(rows.shape[0]):
            total = np.float32(0.0)
            for j in range(width):
                total += weight[o, j] * rows[r, j]
            if bias.shape[0]:
                total += bias[o]
            out[r, o] = total


# the drivers: the weight's rows in ``parts`` consecutive shares, one a thread, each share's loop called by
# address (jit.callee)
_u16, _f32, _i64 = numba.types.uint16, numba.types.float32, numba.types.int64
_call_part_bf16 = _callee(_linear_part_bf16, numba.types.uint32[:, ::1], _u16[:, ::1], _f32[::1], _u16[:, ::1], _i64,
                          _i64)
_call_part_f32 = _callee(_linear_part_f32, _f32[:, ::1], _f32[:, ::1], _f32[::1], _f32[:, ::1], _i64, _i64)


@_parallel_driver(_call_part_bf16)
def _linear_rows_bf16(words, rows, bias, out, parts, part_kernel):
    """out [R, O] = rows [R, I] times the weight [O, I] transposed, plus ``bias`` (``_linear_part_bf16``)."""
    outputs = words.shape[0]
    for part in numba.prange(parts):
        _call_part_bf16(part_kernel, (words, rows, bias, out, (part * outputs) // parts,
                                      ((part + 1) * outputs) // parts))


@_parallel_driver(_call_part_f32)
def _linear_rows_f32(weight, rows, bias, out, parts, part_kernel):
    """``_linear_rows_bf16`` for fp32 numbers (``_linear_part_f32``)."""
    outputs = weight.shape[0]
    for part in numba.prange(parts):
        _call_part_f32(part_kernel, (weight, rows, bias, out, (part * outputs) // parts,
                                     ((part + 1) * outputs) // parts))


jit.end_decorations()
