"""The parallel drivers call their kernels at addresses given at run time (unlimisum/search/jit.py ``callee``),
so that numba does not link, optimise and emit a kernel's code again into each driver that calls it (most of a
first run's compile): the kernel's own result, none of its code in the driver, other argument types refused."""

from __future__ import annotations

import re

import numba
import numpy as np
import pytest
from numba.core.errors import TypingError

from unlimisum.search import jit

_f32 = numba.types.float32


@numba.njit(nogil=True)
def _count_above(row, floor, out):
    """out[:held] = the numbers of row above floor, in order; -> held (a kernel that writes and returns)."""
    held = 0
    for value in row:
        if value > floor:
            out[held] = value
            held += 1
    return held


_call_count_above = jit.callee(_count_above, _f32[::1], _f32, _f32[::1], returns=numba.types.int64)


@numba.njit(nogil=True, parallel=True)
def _rows_above_by_address(rows, floor, out, held, count_above):
    for r in numba.prange(rows.shape[0]):
        held[r] = _call_count_above(count_above, (rows[r], floor, out[r]))


@numba.njit(nogil=True, parallel=True)
def _rows_above_by_name(rows, floor, out, held):
    for r in numba.prange(rows.shape[0]):
        held[r] = _count_above(rows[r], floor, out[r])


def _rows():
    rows = np.random.default_rng(0).standard_normal((5, 37)).astype(np.float32)
    return rows, np.zeros_like(rows), np.zeros(5, np.int64)


def test_a_kernel_called_at_its_address_gives_what_it_gives_called_by_name():
    rows, out, held = _rows()
    _rows_above_by_address(rows, np.float32(0.5), out, held, _call_count_above.address())
    by_name, held_by_name = np.zeros_like(rows), np.zeros(5, np.int64)
    _rows_above_by_name(rows, np.float32(0.5), by_name, held_by_name)
    assert held.tolist() == held_by_name.tolist() == (rows > 0.5).sum(axis=1).tolist()
    assert np.array_equal(out, by_name)


def test_the_driver_holds_none_of_its_kernels_code_where_a_call_by_name_links_it_in():
    rows, out, held = _rows()
    _rows_above_by_address(rows, np.float32(0.5), out, held, _call_count_above.address())
    _rows_above_by_name(rows, np.float32(0.5), out, held)
    kernel = _count_above.overloads[_call_count_above.address.signature].fndesc.llvm_func_name
    (by_address,) = _rows_above_by_address.overloads.values()
    (by_name,) = _rows_above_by_name.overloads.values()
    assert kernel not in by_address.library.get_llvm_str()
    assert re.search(rf"define [^\n]*@{re.escape(kernel)}\(", by_name.library.get_llvm_str())  # emitted again


def test_a_call_of_other_argument_types_is_refused_not_made():
    """The kernel at the address was compiled for the callee's types: float64 rows would be read as float32."""

    @numba.njit
    def wrong(rows, out, count_above):
        return _call_count_above(count_above, (rows[0], np.float32(0.0), out))

    with pytest.raises(TypingError):
        wrong(np.zeros((2, 3)), np.zeros(3, np.float32), _call_count_above.address())


def test_a_driver_passes_its_kernels_addresses_after_its_own_arguments():
    from unlimisum.search import compiled_loops

    driver = compiled_loops._sums_queries_f32
    assert isinstance(driver, jit.Driver) and driver.calls == (compiled_loops._call_sums_f32,)
    states = np.random.default_rng(1).standard_normal((50, 16)).astype(np.float32)
    ids, weights = np.array([[3, 7, 7], [0, 49, 1]]), np.array([[0.5, 1.0, 2.0], [1.0, 1.0, -1.0]], np.float32)
    out = np.empty((2, 16), np.float32)
    driver(states, ids, weights, out)
    np.testing.assert_allclose(out, np.einsum("qk,qkd->qd", weights, states[ids]), rtol=1e-6, atol=1e-6)
