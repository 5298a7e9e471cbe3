"""Tensor Cache maths: parallel form, chunked form and streaming agree with each other and vectors.npz."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from unlimisum.tensor_cache.scan import tensor_cache_attention, tensor_cache_attention_chunked
from unlimisum.tensor_cache.streaming import MemoryParams, MemoryState, extend, settled_memory

# The Tensor Cache specification's reference test vectors (a copy; see tests/fixtures/tensor_cache/README.md).
VECTORS = Path(__file__).resolve().parent / "fixtures" / "tensor_cache" / "vectors.npz"


def _cases():
    data = np.load(VECTORS)
    return list(range(int(data["n_cases"])))


def _case(n: int, dtype=torch.float64) -> dict:
    data = np.load(VECTORS)
    case = {key: torch.from_numpy(data[f"case{n}_{key}"]).to(dtype) for key in
            ("q", "k", "v", "lam", "eta", "g", "out", "local", "mem", "A", "z")}
    case["W"] = int(data[f"case{n}_W"])
    case["normalize_keys"], case["normalize_read"], case["lag"] = (int(x) for x in data[f"case{n}_flags"])
    case["manifest"] = json.loads(str(data["manifest"]))[n]
    return case


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.norm()
    return float((got - expected).norm() / scale) if scale > 0 else float(got.norm())


def _args(case):
    return (case["q"], case["k"], case["v"], case["W"], case["lam"], case["eta"], case["g"],
            bool(case["normalize_keys"]), bool(case["normalize_read"]))


def _params(case) -> MemoryParams:
    return MemoryParams(
        window=case["W"], decay=case["lam"], write_rate=case["eta"], gate=torch.sigmoid(case["g"]),
        normalize_keys=bool(case["normalize_keys"]), normalize_read=bool(case["normalize_read"]), lag=case["lag"],
    )


def _stream(case, block_sizes=None):
    """Token by token (or in the given blocks) through the streaming extend: out [T, H, d], final state."""
    q, k, v = (case[name].transpose(0, 1)[None] for name in ("q", "k", "v"))  # [1, H, T, d]
    params = _params(case)
    T, H, d = case["q"].shape
    state = MemoryState.empty(1, H, d, d, params, q.dtype, q.device)
    outs, start = [], 0
    for size in block_sizes or [1] * T:
        block = slice(start, start + size)
        out, state = extend(state, q[:, :, block], k[:, :, block], v[:, :, block], params, d**-0.5)
        outs.append(out)
        start += size
    assert start == T
    return torch.cat(outs, dim=2)[0].transpose(0, 1), state


@pytest.mark.parametrize("n", _cases())
def test_parallel_form_matches_vectors_in_float64(n):
    case = _case(n)
    out, local, read = tensor_cache_attention(*_args(case), lag=case["lag"], return_parts=True)
    assert _relative(out, case["out"]) < 1e-12
    assert _relative(local, case["local"]) < 1e-12
    assert _relative(read, case["mem"]) < 1e-12


@pytest.mark.parametrize("n", _cases())
def test_parallel_form_matches_vectors_in_float32(n):
    case = _case(n, torch.float32)
    out = tensor_cache_attention(*_args(case), lag=case["lag"])
    assert _relative(out.double(), _case(n)["out"]) < 2e-6


@pytest.mark.parametrize("n", _cases())
def test_streaming_token_by_token_matches_vectors(n):
    case = _case(n)
    out, state = _stream(case)
    assert _relative(out, case["out"]) < 1e-12
    memory, normalizer = settled_memory(state, _params(case))  # A, z after the last step
    if case["A"].norm() > 0:
        assert _relative(memory[0], case["A"]) < 1e-12
    else:
        torch.testing.assert_close(memory[0], case["A"])
    if case["normalize_read"] and case["z"].norm() > 0:
        assert _relative(normalizer[0], case["z"]) < 1e-12


@pytest.mark.parametrize("n", _cases())
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_form_matches_vectors(n, chunk):
    case = _case(n)
    out = tensor_cache_attention_chunked(*_args(case), lag=case["lag"], chunk=chunk)
    assert _relative(out, case["out"]) < 1e-12


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_multi_token_blocks_equal_single_steps(data):
    """Prefill and any split into blocks equals token-by-token steps (float64, 1e-12)."""
    n = data.draw(st.sampled_from(_cases()))
    case = _case(n)
    T = case["q"].shape[0]
    sizes = []
    while sum(sizes) < T:
        sizes.append(data.draw(st.integers(1, T - sum(sizes))))
    steps, _ = _stream(case)
    blocks, _ = _stream(case, sizes)
    assert _relative(blocks, steps) < 1e-12


def test_streaming_equals_parallel_in_float32_with_grouped_heads():
    """4 query heads reading 2 KV heads; float32 streaming vs parallel to float32 rounding."""
    torch.manual_seed(0)
    T, H, H_kv, d, W = 300, 4, 2, 16, 24
    q, k, v = torch.randn(T, H, d), torch.randn(T, H_kv, d), torch.randn(T, H_kv, d)
    lam, eta, g = torch.tensor([0.99, 0.9]), torch.tensor([0.3, 0.6]), torch.randn(H)
    parallel = tensor_cache_attention(q, k, v, W, lam, eta, g, normalize_read=True)
    params = MemoryParams(window=W, decay=lam, write_rate=eta, gate=torch.sigmoid(g), normalize_read=True)
    state = MemoryState.empty(1, H_kv, d, d, params, torch.float32, "cpu")
    outs = []
    for t in range(T):
        out, state = extend(state, q[None, t:t + 1].transpose(1, 2), k[None, t:t + 1].transpose(1, 2),
                            v[None, t:t + 1].transpose(1, 2), params, d**-0.5)
        outs.append(out)
    streaming = torch.cat(outs, dim=2)[0].transpose(0, 1)
    assert _relative(streaming, parallel) < 2e-6
    chunked = tensor_cache_attention_chunked(q, k, v, W, lam, eta, g, normalize_read=True, chunk=32)
    assert _relative(chunked, parallel) < 2e-6


def test_a_16_bit_stream_keeps_its_memory_in_float32():
    """bfloat16 queries, keys and values (a 16-bit model): A and z stay float32, the decoding steps and a
    block call agree with the float32 parallel form of the same (rounded) inputs to bfloat16 precision."""
    torch.manual_seed(1)
    T, H, d, W = 80, 2, 16, 8
    q, k, v = (torch.randn(T, H, d).bfloat16() for _ in range(3))
    lam, eta, g = torch.tensor([0.98, 0.9]), torch.tensor([0.4, 0.7]), torch.randn(H)
    expected = tensor_cache_attention(q.float(), k.float(), v.float(), W, lam, eta, g, normalize_read=True)
    params = MemoryParams(window=W, decay=lam, write_rate=eta, gate=torch.sigmoid(g), normalize_read=True)
    for blocks in ([1] * T, [T // 2, T // 2]):
        state = MemoryState.empty(1, H, d, d, params, torch.bfloat16, "cpu")
        outs, start = [], 0
        for size in blocks:
            block = slice(start, start + size)
            out, state = extend(state, q[None, block].transpose(1, 2), k[None, block].transpose(1, 2),
                                v[None, block].transpose(1, 2), params, d**-0.5)
            outs.append(out)
            start += size
        assert state.memory.dtype == state.normalizer.dtype == torch.float32 and outs[0].dtype == torch.bfloat16
        streamed = torch.cat(outs, dim=2)[0].transpose(0, 1).float()
        assert _relative(streamed, expected) < 1e-2


def test_closed_gate_is_exactly_the_sliding_window():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 50, 2, 8), torch.randn(3, 50, 2, 8), torch.randn(3, 50, 2, 8)
    lam, eta = torch.tensor([0.9, 0.95]), torch.tensor([0.5, 0.5])
    out, local, _ = tensor_cache_attention(q, k, v, 6, lam, eta, None, return_parts=True)
    assert torch.equal(out, local)
    chunked = tensor_cache_attention_chunked(q, k, v, 6, lam, eta, None, chunk=7)
    torch.testing.assert_close(chunked, out)
    # a large negative logit is NOT closed: sigmoid(-10) > 0 still adds the memory read
    almost = tensor_cache_attention(q, k, v, 6, lam, eta, torch.full((2,), -10.0))
    assert not torch.equal(almost, out)


def test_window_covering_the_sequence_is_full_causal_attention():
    torch.manual_seed(2)
    T, H, d = 40, 2, 8
    q, k, v = torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64)
    out = tensor_cache_attention(q, k, v, T, torch.tensor([0.9, 0.9]), torch.tensor([0.5, 0.5]), torch.zeros(H))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, expected)


def test_window_one_reads_only_the_current_value_locally():
    torch.manual_seed(3)
    q, k, v = torch.randn(10, 1, 4), torch.randn(10, 1, 4), torch.randn(10, 1, 4)
    _, local, _ = tensor_cache_attention(q, k, v, 1, torch.tensor([0.9]), torch.tensor([0.5]), torch.zeros(1), return_parts=True)
    torch.testing.assert_close(local, v)


def test_gradients_reach_decay_write_rate_and_gate_and_agree_between_forms():
    torch.manual_seed(4)
    T, H, d, W = 64, 2, 8, 8
    q, k, v = torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64)
    target = torch.randn(T, H, d, dtype=torch.float64)
    grads = []
    for form in (tensor_cache_attention, lambda *a, **kw: tensor_cache_attention_chunked(*a, chunk=16, **kw)):
        a = torch.tensor([3.0, 2.0], dtype=torch.float64, requires_grad=True)
        b = torch.tensor([-1.0, 0.0], dtype=torch.float64, requires_grad=True)
        g = torch.tensor(-1.0, dtype=torch.float64, requires_grad=True)
        out = form(q, k, v, W, torch.sigmoid(a), torch.sigmoid(b), g, normalize_read=True)
        ((out - target) ** 2).sum().backward()
        grads.append(torch.cat([a.grad, b.grad, g.grad[None]]))
    assert all(grads[0].abs() > 0)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)


def test_memory_holds_only_evicted_tokens():
    """A query's read changes when a token at distance >= W changes, never when a token in its window does."""
    torch.manual_seed(5)
    T, H, d, W = 30, 1, 8, 5
    q, k, v = torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64), torch.randn(T, H, d, dtype=torch.float64)
    args = (W, torch.tensor([0.9], dtype=torch.float64), torch.tensor([0.5], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    _, _, read = tensor_cache_attention(q, k, v, *args, return_parts=True)
    t = 20
    for i, expect_change in ((t - W, True), (t - W + 1, False), (t, False)):
        v2 = v.clone()
        v2[i] += 1.0
        _, _, read2 = tensor_cache_attention(q, k, v2, *args, return_parts=True)
        assert (not torch.allclose(read2[t], read[t])) == expect_change, i


def _gated_inputs(seed: int, T: int = 120, H: int = 4, H_kv: int = 2, d: int = 8):
    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(T, heads, d, generator=generator, dtype=torch.float64) for heads in (H, H_kv, H_kv))
    write_gate = 2.0 * torch.randn(H_kv, d + 1, generator=generator, dtype=torch.float64)
    return q, k, v, write_gate


@pytest.mark.parametrize("normalize_read", [False, True])
def test_a_write_gate_scales_each_written_key_alike_in_every_form(normalize_read):
    """With a write gate, A holds η λ^(e_t − i) s_i k̂_i ⊗ v_i, s_i = 2 sigmoid(u·k̂_i + c): the parallel form equals
    that sum written out, token-by-token streaming and the chunked form (float64, grouped heads)."""
    q, k, v, write_gate = _gated_inputs(0)
    T, H, d = q.shape
    W, lam, eta, g = 6, torch.tensor([0.97, 0.9], dtype=torch.float64), torch.tensor([0.4, 0.7], dtype=torch.float64), torch.randn(H, dtype=torch.float64)
    out, local, read = tensor_cache_attention(q, k, v, W, lam, eta, g, normalize_read=normalize_read,
                                              write_gate=write_gate, return_parts=True)
    unit = k / (k.norm(dim=-1, keepdim=True) + 1e-5)  # [T, H_kv, d]
    strength = 2 * torch.sigmoid((unit * write_gate[:, :-1]).sum(-1) + write_gate[:, -1])  # [T, H_kv]
    expected = torch.zeros_like(read)
    for t in range(T):
        for h in range(H):
            kv = h // (H // k.shape[1])
            i = torch.arange(max(t - W + 1, 0))
            weights = eta[kv] * lam[kv] ** (t - W - i) * strength[i, kv] * (unit[i, kv] @ q[t, h])  # [t - W + 1]
            expected[t, h] = weights @ v[i, kv]
            if normalize_read and len(i):
                expected[t, h] /= weights.sum().abs().clamp(min=1.0)
    assert _relative(read, expected) < 1e-12
    params = MemoryParams(window=W, decay=lam, write_rate=eta, gate=torch.sigmoid(g), normalize_read=normalize_read,
                          write_gate=write_gate)
    state = MemoryState.empty(1, k.shape[1], d, d, params, q.dtype, q.device)
    outs = []
    for t in range(T):
        step, state = extend(state, *(x[None, t:t + 1].transpose(1, 2) for x in (q, k, v)), params, d**-0.5)
        outs.append(step)
    assert _relative(torch.cat(outs, dim=2)[0].transpose(0, 1), out) < 1e-12
    chunked = tensor_cache_attention_chunked(q, k, v, W, lam, eta, g, normalize_read=normalize_read, chunk=16,
                                             write_gate=write_gate)
    assert _relative(chunked, out) < 1e-12
    ungated = tensor_cache_attention(q, k, v, W, lam, eta, g, normalize_read=normalize_read)
    assert _relative(ungated, out) > 1e-3  # the gate does change what is read


def test_a_write_gate_at_zero_reads_as_none_and_gets_gradients_in_both_forms():
    q, k, v, write_gate = _gated_inputs(1, T=64, H=2, H_kv=2)
    W, lam, eta, g = 8, torch.tensor([0.95, 0.9], dtype=torch.float64), torch.tensor([0.5, 0.3], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    zero = torch.zeros_like(write_gate)
    assert torch.equal(tensor_cache_attention(q, k, v, W, lam, eta, g, write_gate=zero),
                       tensor_cache_attention(q, k, v, W, lam, eta, g))
    target = torch.randn_like(q)
    grads = []
    for form in (tensor_cache_attention, lambda *a, **kw: tensor_cache_attention_chunked(*a, chunk=16, **kw)):
        gate = write_gate.clone().requires_grad_(True)
        ((form(q, k, v, W, lam, eta, g, normalize_read=True, write_gate=gate) - target) ** 2).sum().backward()
        grads.append(gate.grad)
    assert grads[0].abs().min() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
