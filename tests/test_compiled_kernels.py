"""The compiled sums over the states (unlimisum/unlimiformer/compiled.py): the fp32 sums of the stored numbers,
as torch takes them from the widened states, for the gather of each query's top-k and for the dense pass (over
the states, or per head over a layer's values)."""

from __future__ import annotations

import pytest
import torch

from unlimisum.unlimiformer import compiled, kernels


def test_the_compiled_kernels_run_here():
    """numba is a dependency: where its kernels do not compile or disagree with torch, this fails (the tool would
    fall back to the torch kernels, slower on a CPU without 16-bit units)."""
    assert compiled.available(torch.bfloat16) and compiled.available(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 7, 64])  # 7: four states at a time, then three one by one
def test_the_weighted_sum_of_chosen_states_is_torchs_fp32_sum(dtype, k):
    generator = torch.Generator().manual_seed(1)
    book = torch.randn(900, 24, generator=generator).to(dtype)  # [N, d]
    states = book[100:700]  # a chapter's view
    ids = torch.randint(0, 600, (5, k), generator=generator)  # [nq, k], repeats included
    weights = torch.rand(5, k, generator=generator)
    expected = torch.einsum("qk,qkd->qd", weights, states.float()[ids])
    torch.testing.assert_close(compiled.weighted_sum(states, ids, weights), expected)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)  # widens: the path that calls it on a CPU
    torch.testing.assert_close(kernels.gathered_attention(states, ids, weights, shared.widens, False), expected)


def test_a_state_id_outside_the_store_is_refused_not_read():
    states = torch.randn(10, 8)
    with pytest.raises(IndexError, match="0..9"):
        compiled.weighted_sum(states, torch.tensor([[3, 10]]), torch.ones(1, 2))
    with pytest.raises(IndexError):
        compiled.weighted_sum(states, torch.tensor([[-1]]), torch.ones(1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 1027, 5000])  # fewer than four rows; a remainder; rows split among threads
def test_the_dense_sum_is_the_weights_times_the_widened_states(dtype, n):
    generator = torch.Generator().manual_seed(2)
    states = torch.randn(n, 16, generator=generator).to(dtype)
    weights = torch.softmax(torch.randn(6, n, generator=generator), dim=1)  # [nq, N]
    expected = weights @ states.float()
    torch.testing.assert_close(compiled.dense_sum(states, weights), expected)
    choice = kernels.KernelChoice("float32", 256, False, 1e-9, 1e-9)
    torch.testing.assert_close(kernels.dense_values(states, weights, choice), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [3, 1027])
def test_the_dense_sum_per_head_is_each_heads_weights_times_its_widened_values(dtype, n):
    generator = torch.Generator().manual_seed(3)
    book = torch.randn(5, n + 200, 8, generator=generator).to(dtype)  # [H, N, dh]
    values = book[:, 100:100 + n]  # a chapter's view: each head's rows at an offset into its block
    weights = torch.softmax(torch.randn(5, 3, n, generator=generator), dim=2)  # [H, nq, N]
    expected = torch.bmm(weights, values.float())
    torch.testing.assert_close(compiled.head_dense_sum(values, weights), expected)
    assert compiled.head_dense_sum(values, weights[:, :0]).shape == (5, 0, 8)


def test_the_states_it_cannot_read_stay_with_torch():
    assert compiled.usable_states(torch.randn(4, 8).bfloat16()) and compiled.usable_states(torch.randn(4, 7))
    assert not compiled.usable_states(torch.randn(4, 7).bfloat16())  # an odd width has no whole 32-bit words
    assert not compiled.usable_states(torch.randn(4, 8).half())
    states = torch.randn(40, 7).bfloat16()
    ids, weights = torch.randint(0, 40, (2, 5)), torch.rand(2, 5)
    torch.testing.assert_close(kernels.gathered_attention(states, ids, weights, True, False),
                               torch.einsum("qk,qkd->qd", weights, states.float()[ids]))
