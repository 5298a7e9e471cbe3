"""A model's prefill attends through torch's flash kernel (decoder_only/flash.py), to parts.attend's precision.

The float32 path (parts.attend) is the reference: the same chunks, parts and masks, every score in
float32. The flash path must give the same attention to the model's precision (16 bits, or float32's
order of summation), the same attention mass per local key to ~1e-4 (block representatives are chosen
by it), and so the same blocks.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_decoders import tiny_decoder
from unlimisum.config import DecoderOnlyConfig
from unlimisum.decoder_only import cache as cache_module, flash, parts, reading
from unlimisum.decoder_only.parts import Part, causal
from unlimisum.decoder_only.plan import plan_retrieval
from unlimisum.models.architectures import architecture_for

pytestmark = pytest.mark.skipif(flash._kernel() is None, reason="this torch has no CPU flash-attention kernel")


def _random_parts(generator, *, shared_queries: bool, dtype=torch.bfloat16):
    heads, group, n_queries, dim = 2, 3, 24, 16
    def r(*shape):
        return (torch.randn(*shape, generator=generator) * 2).to(dtype)
    q = r(1, heads, group, n_queries, dim)
    own = None if shared_queries else r(1, heads, group, n_queries, dim)
    valid = torch.rand(1, heads, 1, 1, 10, generator=generator) > 0.3
    valid[..., 0] = True
    local_mask = causal(40, n_queries, 40 - 16, 16 + n_queries, "cpu")
    return q, [
        Part(r(heads, 4, dim), r(heads, 4, dim), "shared", queries=own),  # sinks
        Part(r(heads, 10, dim), r(heads, 10, dim), "shared", mask=valid, queries=own),  # far blocks, padded
        Part(r(heads, 16 + n_queries, dim), r(heads, 16 + n_queries, dim), "shared", mask=local_mask),  # window
    ]


@pytest.mark.parametrize("shared_queries", [True, False], ids=["true positions", "fixed distance"])
def test_flash_attend_equals_float32_attention_and_its_mass(monkeypatch, shared_queries):
    monkeypatch.setattr(flash, "_mass_float32", None)  # a causal window's mass comes from the kernel
    q, chunk_parts = _random_parts(torch.Generator().manual_seed(0), shared_queries=shared_queries)
    mass = []
    expected = parts.attend(q, chunk_parts, 0.25, None, mass)
    got, got_mass = flash.attend(q, chunk_parts, 0.25, mass_part=2)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 2 * 2**-8 * scale  # two 16-bit roundings at most
    torch.testing.assert_close(got_mass, mass[2].sum(dim=0), rtol=1e-4, atol=1e-6)


def test_mass_under_a_mask_that_is_not_causal_falls_back_to_float32_scores():
    generator = torch.Generator().manual_seed(1)
    q, chunk_parts = _random_parts(generator, shared_queries=True)
    odd = torch.rand(24, 40, generator=generator) > 0.5
    odd[:, 0] = True
    chunk_parts[2] = Part(chunk_parts[2].keys, chunk_parts[2].values, "shared", mask=odd)
    mass = []
    parts.attend(q, chunk_parts, 0.25, None, mass)
    _, got_mass = flash.attend(q, chunk_parts, 0.25, mass_part=2)
    torch.testing.assert_close(got_mass, mass[2].sum(dim=0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("before", [16, 0], ids=["a window before the chunk", "the chunk alone"])
def test_a_window_said_by_its_causal_tail_attends_as_its_mask_does(monkeypatch, before, dtype):
    """The prefill's window is the keys before the chunk (seen by all) and the chunk's own (seen causally): said
    by ``causal_tail``, the flash kernel reads it in its causal mode with no mask; the attention and the mass
    are those of the same part with the mask spelt out."""
    monkeypatch.setattr(flash, "_mass_float32", None)  # the mass comes from the kernel
    q, chunk_parts = _random_parts(torch.Generator().manual_seed(4), shared_queries=True, dtype=dtype)
    n_queries = q.shape[3]
    window = chunk_parts[2]
    keys, values = window.keys[:, 16 - before:], window.values[:, 16 - before:]
    masked = [*chunk_parts[:2], Part(keys, values, "shared", mask=causal(40, n_queries, 40 - before, before + n_queries,
                                                                         "cpu"))]
    tailed = [*chunk_parts[:2], Part(keys, values, "shared", causal_tail=n_queries)]
    mass, tailed_mass = [], []
    expected = parts.attend(q, masked, 0.25, None, mass)
    assert torch.equal(parts.attend(q, tailed, 0.25, None, tailed_mass), expected)
    assert torch.equal(tailed_mass[2], mass[2])
    got, got_mass = flash.attend(q, tailed, 0.25, mass_part=2)
    rounding = 2**-8 if dtype == torch.bfloat16 else 2**-20  # float32: the order of summation only
    assert (got - expected).abs().max() <= 2 * rounding * expected.abs().max()
    torch.testing.assert_close(got_mass, mass[2].sum(dim=0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("tailed", [True, False], ids=["causal tail", "causal mask"])
@pytest.mark.parametrize("mass_keys", [None, 0, 9, 16, 30, 40])
def test_a_float32_models_mass_comes_from_products_for_the_keys_asked(monkeypatch, tailed, mass_keys):
    """A float32 model's local mass by matrix products (blocks of 5 keys here: blocks straddle the window's end
    and the chunk's own triangle): parts.attend's to float32 precision for the keys asked, 0 for the others."""
    monkeypatch.setattr(flash, "_mass_float32", None)
    monkeypatch.setattr(flash, "_split", None)  # the kernel's way is not taken either
    monkeypatch.setattr(flash, "MASS_BLOCK_KEYS", 5)
    q, chunk_parts = _random_parts(torch.Generator().manual_seed(11), shared_queries=True, dtype=torch.float32)
    n_queries = q.shape[3]
    local = chunk_parts[2]  # a window of 16 keys, then the chunk's own 24
    if tailed:
        local = Part(local.keys, local.values, "shared", causal_tail=n_queries)
    mass = []
    parts.attend(q, chunk_parts, 0.25, None, mass)
    expected = mass[2].sum(dim=0)  # [G, 40]
    _, got = flash.attend(q, chunk_parts[:2] + [local], 0.25, mass_part=2, mass_keys=mass_keys)
    needed = expected.shape[1] if mass_keys is None else mass_keys
    torch.testing.assert_close(got[:, :needed], expected[:, :needed], rtol=1e-5, atol=1e-6)
    assert not got[:, needed:].any()


def test_a_query_that_sees_none_of_a_calls_keys_takes_nothing_from_it():
    """Far blocks all padding for a head, no sinks, no window before the chunk: the kernel's call over the far
    keys sees nothing for that head (its log-sum-exp -inf); the chunk's own keys are all it attends to."""
    generator = torch.Generator().manual_seed(5)
    q, chunk_parts = _random_parts(generator, shared_queries=True)
    n_queries = q.shape[3]
    far = chunk_parts[1]
    nothing = torch.zeros_like(far.mask)
    nothing[:, 1] = True  # the second head sees its far keys, the first none
    own = Part(chunk_parts[2].keys[:, 16:], chunk_parts[2].values[:, 16:], "shared", causal_tail=n_queries)
    tested = [Part(far.keys, far.values, "shared", mask=nothing), own]
    expected = parts.attend(q, tested, 0.25)
    got, _ = flash.attend(q, tested, 0.25)
    assert torch.isfinite(got).all()
    assert (got - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()


def _read(model, ids, plan):
    with torch.inference_mode(), reading.session(model, architecture_for(model.config), plan) as cache:
        logits = reading.prefill(model, cache, ids, logits=True)
    return logits.float(), cache


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("max_positions", [512, 64], ids=["true positions", "fixed distance"])
def test_a_prefill_reads_through_the_flash_kernel_as_the_float32_path_does(monkeypatch, max_positions, dtype):
    """Window 16, k 16: chunks from the fourth on select one block of 16 among several, by the mass."""
    model = tiny_decoder("llama").to(dtype)
    ids = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(3))
    plan = plan_retrieval(prompt_tokens=ids.shape[0], text_start=0, max_new_tokens=4, max_positions=max_positions,
                          window=16, retrieval_k=16, storage_dtype=torch.bfloat16,
                          config=DecoderOnlyConfig(sinks=4, block_size=16, block_representatives=2))
    assert plan.true_positions == (max_positions == 512)
    calls = []
    real = flash.attend
    monkeypatch.setattr(flash, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, cache = _read(model, ids, plan)
    assert len(calls) == 2 * -(-ids.shape[0] // 16)  # every chunk of both layers
    monkeypatch.setattr(flash, "usable", lambda *a: False)
    expected, reference = _read(model, ids, plan)
    first, reference_first = cache.retrieval_layers[0], reference.retrieval_layers[0]
    leaving = cache_module.leaving_keys(plan, 0)  # the keys that leave the window: only theirs is needed
    assert leaving == 96
    received, expected_received = first.received[:, :leaving], reference_first.received[:, :leaving]
    if plan.true_positions or dtype == torch.float32:  # the same keys and queries: the mass to float32
        # precision, the same blocks
        torch.testing.assert_close(received, expected_received, rtol=1e-4, atol=1e-5)
        assert torch.equal(first.blocks.rep_keys, reference_first.blocks.rep_keys)
    else:  # turned queries and re-rotated window keys are rounded to 16 bits, as the model's own are
        torch.testing.assert_close(received, expected_received, rtol=3e-2, atol=3e-2)
    scale = expected.abs().max()
    # 16-bit hidden states through 2 layers; float32 ones differ by the order of summation
    assert (logits - expected).abs().max() <= (0.05 if dtype == torch.bfloat16 else 1e-4) * scale


def test_the_mass_of_keys_that_never_leave_the_window_is_not_computed(monkeypatch):
    """Only keys that leave the window while the prompt is read need the attention they draw (their block's
    representatives are chosen by it): the last chunks' windows skip it, and the prompt reads the same."""
    model = tiny_decoder("llama").to(torch.bfloat16)
    ids = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(6))
    plan = plan_retrieval(prompt_tokens=ids.shape[0], text_start=0, max_new_tokens=4, max_positions=512,
                          window=16, retrieval_k=16, storage_dtype=torch.bfloat16,
                          config=DecoderOnlyConfig(sinks=4, block_size=16, block_representatives=2))
    masses = []
    real = flash.attend
    monkeypatch.setattr(flash, "attend", lambda q, p, s, mass_part=None, mass_keys=None:
                        masses.append(mass_part is not None) or real(q, p, s, mass_part, mass_keys))
    logits, cache = _read(model, ids, plan)
    # 7 chunks of 16, chunk c's window from max(16 (c - 1), 0): the last one's from 80, which no key leaves;
    # every chunk runs through both layers
    assert masses == [True] * 12 + [False] * 2
    monkeypatch.setattr(cache_module, "leaving_keys", lambda plan, first_local: plan.prompt_tokens)
    everywhere, full = _read(model, ids, plan)
    assert torch.equal(logits, everywhere)
    first, reference = cache.retrieval_layers[0], full.retrieval_layers[0]
    assert torch.equal(first.received[:, :80], reference.received[:, :80])
