"""The few-query scores in 16-lane vectors (llvm.WIDE, where numba compiles for AVX-512) are the 8-lane code's
scores bit for bit, so that a summary does not depend on the CPU it ran on. Both forms run on every machine
(LLVM splits 16 lanes into halves where it must), so each is compared here whatever the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numba
import numpy as np
import pytest
import torch

from unlimisum.search import llvm


def _bf16_scores(dot, keys_at_once):
    @numba.njit(nogil=True)
    def scores(words, even, odd, first, out):
        for r in range(0, words.shape[0] - keys_at_once + 1, keys_at_once):
            dot(words, r, even, odd, first, out)

    return scores


def _bf16_words(keys: torch.Tensor) -> np.ndarray:
    """[n, dh] bfloat16 keys as [n, dh/2] words, the even dimension in the lower half (``_scores_bf16``'s)."""
    return keys.contiguous().view(torch.int16).numpy().view(np.uint32)


@pytest.mark.parametrize("count, keys_at_once", [(2, 2), (3, 2), (4, 2), (1, 4), (2, 4), (3, 4), (4, 4)])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_bfloat16_scores_in_16_lanes_are_the_8_lane_scores_bit_for_bit(count, keys_at_once, head_dim):
    generator = torch.Generator().manual_seed(head_dim + 10 * count)
    keys = (torch.randn(24, head_dim, generator=generator) * 3).to(torch.bfloat16)
    queries = torch.randn(count + 1, head_dim, generator=generator)
    words = _bf16_words(keys)
    even, odd = (np.ascontiguousarray(queries[:, part::2].numpy()) for part in (0, 1))
    results = []
    for wide in (False, True):
        out = np.full((count + 1, 24), np.nan, np.float32)
        _bf16_scores(llvm._dot_bf16_of(count, keys_at_once, wide=wide), keys_at_once)(words, even, odd, 1, out)
        results.append(out)
    assert np.isnan(results[1][0]).all()  # query 0 is not among those asked
    np.testing.assert_array_equal(results[1].view(np.uint32), results[0].view(np.uint32))
    expected = (queries[1:].double() @ keys.double().T).numpy()
    np.testing.assert_allclose(results[1][1:], expected, rtol=1e-5, atol=1e-4)


def test_one_key_at_a_time_stays_in_8_lanes():
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 32, generator=generator).to(torch.bfloat16)
    queries = torch.randn(3, 32, generator=generator)
    words = _bf16_words(keys)
    even, odd = (np.ascontiguousarray(queries[:, part::2].numpy()) for part in (0, 1))
    out = np.zeros((3, 5), np.float32)
    _bf16_scores(llvm._dot_bf16_of(3, 1, wide=True), 1)(words, even, odd, 0, out)  # wide asks nothing of one key
    np.testing.assert_allclose(out, (queries.double() @ keys.double().T).numpy(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("features, wide", [("+avx2,+fma,+avx512f,+avx512bw", True), ("+avx2,+fma,-avx512f", False),
                                             ("", False)])
def test_the_16_lanes_follow_the_features_numba_compiles_for(features, wide):
    code = "from unlimisum.search import llvm; print(llvm.WIDE)"
    env = {**os.environ, "NUMBA_CPU_FEATURES": features}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == str(wide)
