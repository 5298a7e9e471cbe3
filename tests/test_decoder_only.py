"""Decoder-only retrieval on tiny random models of every family: exact where it must be, selective where asked.

The invariants (unlimisum/decoder_only/):
- with k >= every far token and a window smaller than the prompt, reading the prompt in chunks
  gives the logits of one forward over the whole prompt (float64 models, 1e-5), in token and
  block mode, and greedy (and beam) generation after it equals plain generate() on the prompt;
- with k smaller, the logits agree until the first chunk with more than k far tokens, then not;
- generation steps attend to exactly the brute-force top-k per key-value head (max over the
  query group), the sinks, the window and the generated tokens, in one softmax;
- the store holds 2 x full layers x KV heads x head dim x element size bytes per prompt token.
"""

from __future__ import annotations

import pytest
import torch

from tests.tiny_decoders import DECODER_FAMILIES, VARIANTS, tiny_decoder
from unlimisum.config import DecoderOnlyConfig
from unlimisum.decoder_only import reading, selection
from unlimisum.decoder_only.cache import RetrievalLayer
from unlimisum.decoder_only.plan import plan_retrieval
from unlimisum.errors import UnsupportedModelError
from unlimisum.models.architectures import architecture_for
from unlimisum.search import kernels

N_PROMPT = 90
WINDOW = 16


def prompt_ids(n: int = N_PROMPT, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


def make_plan(n_prompt: int, *, window: int = WINDOW, k: int = 10_000, selection_mode: str = "tokens",
              max_new_tokens: int = 8, max_positions: int = 512, sinks: int | None = 4, dtype=torch.float64, **config):
    return plan_retrieval(prompt_tokens=n_prompt - 1, text_start=0, max_new_tokens=max_new_tokens,
                          max_positions=max_positions, window=window, retrieval_k=k, storage_dtype=dtype,
                          config=DecoderOnlyConfig(sinks=sinks, prefill_selection=selection_mode, **config))


def read(model, ids: torch.Tensor, plan, *, generate_kwargs: dict | None = None):
    """(prefill logits [N-1, V], generated ids or None, the cache) through unlimisum's reading."""
    architecture = architecture_for(model.config)
    with torch.no_grad(), reading.session(model, architecture, plan) as cache:
        logits = reading.prefill(model, cache, ids[:-1], logits=True)
        cache.finish_prefill()
        output = reading.generate(model, cache, ids, **generate_kwargs) if generate_kwargs else None
    return logits, output, cache


def plain_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


def plain_generate(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids.unsqueeze(0), attention_mask=torch.ones(1, ids.shape[0], dtype=torch.long), **kwargs)


@pytest.mark.parametrize("family", DECODER_FAMILIES + VARIANTS)
def test_chunked_prefill_and_greedy_generation_equal_the_plain_model(family):
    model = tiny_decoder(family).double()
    ids = prompt_ids()
    expected_logits = plain_logits(model, ids)
    greedy = dict(max_new_tokens=8, do_sample=False)
    expected = plain_generate(model, ids, **greedy)
    for mode in ("tokens", "blocks"):
        logits, output, cache = read(model, ids, make_plan(N_PROMPT, selection_mode=mode), generate_kwargs=greedy)
        torch.testing.assert_close(logits, expected_logits[:-1], rtol=1e-5, atol=1e-5)
        assert output.tolist() == expected.tolist()
    assert model.config._attn_implementation == "eager"  # the session put the model back as it was


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_beam_search_equals_plain_beam_search(family):
    model = tiny_decoder(family).double()
    ids = prompt_ids()
    beams = dict(max_new_tokens=6, num_beams=3, do_sample=False)
    _, output, _ = read(model, ids, make_plan(N_PROMPT), generate_kwargs=beams)
    assert output.tolist() == plain_generate(model, ids, **beams).tolist()


@pytest.mark.parametrize("mode, k", [("tokens", 20), ("blocks", 12)])
def test_with_k_below_the_far_tokens_logits_agree_until_the_first_chunk_with_more(mode, k):
    """Window 16, 4 sinks: chunk c (positions 16c..16c+15) has 16c - 20 far tokens, 28 for c = 3, the first chunk
    with more than k = 20 (tokens), or more than the one block of 16 that k = 12 asks for (blocks)."""
    model = tiny_decoder("llama").double()
    ids = prompt_ids()
    expected = plain_logits(model, ids)[:-1]
    logits, _, _ = read(model, ids, make_plan(N_PROMPT, k=k, selection_mode=mode))
    torch.testing.assert_close(logits[:48], expected[:48], rtol=1e-5, atol=1e-5)
    assert (logits[48:64] - expected[48:64]).abs().max() > 1e-3


def test_far_selection_equals_brute_force_under_the_kv_head_rule(monkeypatch):
    """decode_ids: [B, G, g, D] queries; slices of the store forced small so the running top-k merges slices."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 500, 16, generator=generator)  # [G, n, D]
    queries = torch.randn(2, 3, 4, 16, generator=generator)  # [B, G, g, D]
    monkeypatch.setattr(selection, "SCORE_BYTES", 2 * 4 * 4 * 60)  # 60 keys per slice
    choice = kernels.kernel_for(torch.device("cpu"), torch.float32, 16)
    got = selection.decode_ids(keys, queries, 25, choice)
    brute = torch.einsum("bghd,gnd->bghn", queries, keys).amax(dim=2).topk(25, dim=-1).indices
    assert torch.equal(got, brute)
    assert not torch.equal(brute, torch.einsum("bghd,gnd->bghn", queries, keys)[:, :, 0].topk(25, dim=-1).indices)


def test_a_generation_step_attends_to_sinks_window_tail_and_the_top_k_per_kv_head():
    """One RetrievalLayer fed random keys, values and queries, against one masked softmax over every stored token."""
    generator = torch.Generator().manual_seed(3)
    n_prompt, window, sinks, k, heads, kv_heads, dim = 61, 8, 3, 5, 4, 2, 8
    plan = make_plan(n_prompt + 1, window=window, k=k, sinks=sinks)
    layer = RetrievalLayer(plan)
    keys = torch.randn(1, kv_heads, n_prompt, dim, generator=generator, dtype=torch.float64)
    values = torch.randn(1, kv_heads, n_prompt, dim, generator=generator, dtype=torch.float64)
    for start in range(0, n_prompt, window):  # prefill, chunk by chunk (its output is checked elsewhere)
        chunk = slice(start, start + window)
        query = torch.randn(1, heads, keys[:, :, chunk].shape[2], dim, generator=generator, dtype=torch.float64)
        layer.update(keys[:, :, chunk], values[:, :, chunk])
        layer.attend(query, keys[:, :, chunk], values[:, :, chunk], 0.5, None)
    layer.finish_prefill()
    tail_keys = torch.randn(2, kv_heads, 3, dim, generator=generator, dtype=torch.float64)  # 2 beams, 3 tokens so far
    tail_values = torch.randn(2, kv_heads, 3, dim, generator=generator, dtype=torch.float64)
    layer.update(tail_keys[:, :, :2], tail_values[:, :, :2])
    layer.attend(torch.randn(2, heads, 2, dim, generator=generator, dtype=torch.float64),
                 tail_keys[:, :, :2], tail_values[:, :, :2], 0.5, None)
    layer.update(tail_keys[:, :, 2:], tail_values[:, :, 2:])
    query = torch.randn(2, heads, 1, dim, generator=generator, dtype=torch.float64)
    got = layer.attend(query, tail_keys[:, :, 2:], tail_values[:, :, 2:], 0.5, None)  # [B, 1, H, D]

    all_keys = torch.cat([keys.expand(2, -1, -1, -1), tail_keys], dim=2)  # [B, G, n + 3, D]
    all_values = torch.cat([values.expand(2, -1, -1, -1), tail_values], dim=2)
    grouped = query.view(2, kv_heads, heads // kv_heads, dim)  # [B, G, g, D]
    scores = torch.einsum("bghd,bgnd->bghn", grouped, all_keys) * 0.5
    far_start, far_end = sinks, n_prompt - window
    top = scores[..., far_start:far_end].amax(dim=2).topk(k, dim=-1).indices + far_start  # [B, G, k]
    visible = torch.zeros(2, kv_heads, all_keys.shape[2], dtype=torch.bool)
    visible[..., :sinks] = True
    visible[..., far_end:] = True
    visible.scatter_(2, top, True)
    weights = torch.softmax(scores.masked_fill(~visible.unsqueeze(2), float("-inf")), dim=-1)
    expected = torch.einsum("bghn,bgnd->bghd", weights, all_values).reshape(2, 1, heads, dim)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


def test_block_selection_equals_brute_force():
    """Blocks of 8 with 2 representatives (those that drew the most attention); a chunk picks ceil(k / 8) blocks per
    KV head by the mean over its queries of the best representative score over the query group."""
    generator = torch.Generator().manual_seed(5)
    kv_heads, group, dim, n = 2, 3, 8, 60
    keys = torch.randn(kv_heads, n, dim, generator=generator)
    received = torch.rand(kv_heads, n, generator=generator)
    index = selection.BlockIndex(block_size=8, representatives=2)
    index.add(0, keys[:, :36], received[:, :36])  # two additions: blocks end at 36 (a short block) and 60
    index.add(36, keys[:, 36:], received[:, 36:])
    assert index.starts == [0, 8, 16, 24, 32, 36, 44, 52] and index.ends == [8, 16, 24, 32, 36, 44, 52, 60]
    queries = torch.randn(1, kv_heads, group, 5, dim, generator=generator)
    ids, valid = index.select(queries, k=20)  # 3 blocks per KV head
    for head in range(kv_heads):
        totals = []
        for start, end in zip(index.starts, index.ends):
            reps = received[head, start:end].topk(min(2, end - start)).indices + start
            block_scores = torch.einsum("hcd,rd->hcr", queries[0, head], keys[head, reps])
            totals.append(block_scores.amax(dim=(0, 2)).sum())
        best = torch.stack(totals).topk(3).indices.tolist()
        expected = sorted(i for b in best for i in range(index.starts[b], index.ends[b]))
        assert sorted(ids[head][valid[head]].tolist()) == expected


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_store_bytes_follow_the_formula(family):
    """2 (keys, values) x full-attention layers x KV heads x head dim x bytes per number, per prompt token."""
    model = tiny_decoder(family)
    ids = prompt_ids()
    full_layers = sum(window is None for window in architecture_for(model.config).layer_windows(model.config))
    for dtype in (torch.bfloat16, torch.float32):
        _, _, cache = read(model, ids, make_plan(N_PROMPT, dtype=dtype, selection_mode="blocks"))
        per_token = 2 * full_layers * model.config.num_key_value_heads * 16 * torch.finfo(dtype).bits // 8
        assert cache.store_bytes == (N_PROMPT - 1) * per_token
    assert full_layers == (1 if family == "gemma2" else 2)


def test_a_model_whose_every_layer_slides_is_refused():
    from tests.tiny_decoders import tiny_decoder_config

    with pytest.raises(UnsupportedModelError, match="sliding window of 16 tokens"):
        architecture_for(tiny_decoder_config("mistral", sliding_window=16))
    # a window as long as the positions is full attention (Phi-3.5's 262,144 on 131,072 positions)
    assert architecture_for(tiny_decoder_config("phi3", sliding_window=512)).layer_windows(
        tiny_decoder_config("phi3", sliding_window=512)) == [None, None]


def test_an_unknown_decoder_only_type_names_the_supported_families():
    class Config:
        model_type = "gpt2"
        is_encoder_decoder = False

    with pytest.raises(UnsupportedModelError) as error:
        architecture_for(Config())
    message = str(error.value)
    assert "gpt2" in message and "bart" in message and "qwen2" in message and "gemma3_text" in message


def test_without_pinning_longrope_chunks_would_drift(monkeypatch):
    """phi3-longrope switches frequencies at 32 positions: unpinned, early chunks get the short ones and the logits
    leave the full forward's (which the pinned reading matches, above)."""
    from unlimisum.decoder_only import positions

    model = tiny_decoder("phi3-longrope").double()
    ids = prompt_ids()
    monkeypatch.setattr(positions, "needs_pinning", lambda config: False)
    logits, _, _ = read(model, ids, make_plan(N_PROMPT))
    assert (logits - plain_logits(model, ids)[:-1]).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "phi3-longrope", "llama-yarn", "gemma3_text"])
def test_fixed_distance_scores_are_the_models_own_at_that_distance(family):
    """A far key derotated at its position p, scored by the query turned from its position m to the distance:
    the model's own q . k with the query at the distance and the key at 0, whatever m and p; a sink at true
    position i scored by the query turned to distance + S: the model's own at that distance."""
    import sys

    from unlimisum.decoder_only.positions import PinnedRotary, Rotation
    from unlimisum.models import compat

    model = tiny_decoder(family).double()
    architecture = architecture_for(model.config)
    rotary = PinnedRotary(architecture.rotary(model), 512)  # what a session installs for longrope
    layer_type = {"layer_type": "full_attention"} if compat.rotary_takes_layer_type(architecture.rotary(model)) else {}
    apply_rotary = sys.modules[type(model).__module__].apply_rotary_pos_emb
    generator = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 1, 1, 16, generator=generator, dtype=torch.float64) for _ in range(2))

    def rotated(x, position):  # the model's post-rotary x at ``position``
        cos, sin = rotary(x, torch.tensor([[position]]), **layer_type)
        return apply_rotary(x, x, cos, sin)[0]

    rotation = Rotation(rotary, torch.device("cpu"), layer_type.get("layer_type"))
    distance, sinks = 40, 3
    expected = (rotated(q, distance) * rotated(k, 0)).sum()
    for m, p in [(300, 17), (500, 499), (100, 3)]:
        got = (rotation.turn(rotated(q, m), [m], distance) * rotation.derotate(rotated(k, p), [p])).sum()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for i in range(sinks):
        got = (rotation.turn(rotated(q, 450), [450], distance + sinks) * rotated(k, i)).sum()
        torch.testing.assert_close(got, (rotated(q, distance + sinks) * rotated(k, i)).sum(), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, (rotated(q, 300) * rotated(k, 17)).sum())  # the distance does matter


def test_attention_mass_per_key_is_summed_block_by_block(monkeypatch):
    """parts.attend over three layouts, its queries split into blocks of 2 (SCORE_BYTES forced small): the output
    and the mass each key drew (summed over the query group and the queries; per query for per_query keys) equal
    one softmax over every key at once."""
    from unlimisum.decoder_only import parts

    generator = torch.Generator().manual_seed(4)
    b, kv_heads, group, n_queries, dim = 2, 2, 3, 7, 8
    queries = torch.randn(b, kv_heads, group, n_queries, dim, generator=generator, dtype=torch.float64)
    shared = [torch.randn(kv_heads, 5, dim, generator=generator, dtype=torch.float64) for _ in range(2)]
    batched = [torch.randn(b, kv_heads, 4, dim, generator=generator, dtype=torch.float64) for _ in range(2)]
    per_query = [torch.randn(b, kv_heads, n_queries, 3, dim, generator=generator, dtype=torch.float64) for _ in range(2)]
    mask = torch.rand(n_queries, 4, generator=generator) > 0.3
    mask[:, 0] = True
    layout_parts = [parts.Part(*shared, "shared"), parts.Part(*batched, "batched", mask=mask),
                    parts.Part(*per_query, "per_query")]
    monkeypatch.setattr(parts, "SCORE_BYTES", 2 * b * kv_heads * group * 12 * 4)  # 2 queries per block
    mass = []
    got = parts.attend(queries, layout_parts, 0.3, 2.0, mass)

    scores = torch.cat([
        torch.einsum("bghcd,gnd->bghcn", queries, shared[0]),
        torch.einsum("bghcd,bgnd->bghcn", queries, batched[0]),
        torch.einsum("bghcd,bgcnd->bghcn", queries, per_query[0]),
    ], dim=-1) * 0.3
    visible = torch.cat([torch.ones(n_queries, 5, dtype=torch.bool), mask, torch.ones(n_queries, 3, dtype=torch.bool)], 1)
    capped = (torch.tanh(scores / 2.0) * 2.0).masked_fill(~visible, float("-inf"))  # soft-capped, then masked
    weights = torch.softmax(capped, dim=-1)  # [B, G, g, C, 12]
    w_shared, w_batched, w_query = weights.split([5, 4, 3], dim=-1)
    expected = (torch.einsum("bghcn,gnd->bghcd", w_shared, shared[1])
                + torch.einsum("bghcn,bgnd->bghcd", w_batched, batched[1])
                + torch.einsum("bghcn,bgcnd->bghcd", w_query, per_query[1]))
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(mass[0], w_shared.sum(dim=(2, 3)), rtol=1e-10, atol=1e-10)  # [B, G, 5]
    torch.testing.assert_close(mass[1], w_batched.sum(dim=(2, 3)), rtol=1e-10, atol=1e-10)  # [B, G, 4]
    torch.testing.assert_close(mass[2], w_query.sum(dim=2), rtol=1e-10, atol=1e-10)  # [B, G, C, 3]


@pytest.mark.parametrize("n_prompt", [30, 33])
def test_a_longrope_run_across_the_switch_keeps_its_cache_and_the_long_factors(n_prompt):
    """phi3-longrope switches to its long factors past 32 positions, and transformers' Phi-3 then drops the cache
    (prepare_inputs_for_generation) to recompute the sequence with them. A prompt of 33 tokens crosses at the
    first step, one of 30 after 3 generated tokens: the stored prompt must survive, read with the long factors
    from the start, as the model recomputing the whole sequence at every step with them (no cache, rotary
    pinned) does; for 33 that is the model's own generate()."""
    from unlimisum.decoder_only.positions import pinned_rotary

    model = tiny_decoder("phi3-longrope").double()
    ids = prompt_ids(n_prompt)
    greedy = dict(max_new_tokens=6, do_sample=False)
    _, output, _ = read(model, ids, make_plan(n_prompt, max_new_tokens=6), generate_kwargs=greedy)
    with pinned_rotary(model, architecture_for(model.config), n_prompt + 5):
        recomputed = plain_generate(model, ids, use_cache=False, **greedy)
    assert output.tolist() == recomputed.tolist()
    if n_prompt == 33:
        assert output.tolist() == plain_generate(model, ids, **greedy).tolist()


def test_a_forward_through_another_cache_fails_loudly(monkeypatch):
    """Were generate() to drop unlimisum's cache (as Phi-3 does with a truthy one when longrope switches), the model
    would store its keys elsewhere while the retrieval reads the stale store: that must be an error, not a summary."""
    from unlimisum.decoder_only.cache import RetrievalCache

    monkeypatch.setattr(RetrievalCache, "__bool__", lambda self: True)
    model = tiny_decoder("phi3-longrope").double()
    with pytest.raises(RuntimeError, match="without updating unlimisum's retrieval cache"):
        read(model, prompt_ids(30), make_plan(30, max_new_tokens=6), generate_kwargs=dict(max_new_tokens=6,
                                                                                           do_sample=False))
    layer = RetrievalLayer(make_plan(N_PROMPT))
    keys = torch.randn(1, 2, 4, 16, dtype=torch.float64)
    layer.update(keys, keys)
    with pytest.raises(RuntimeError, match="without updating"):
        layer.attend(torch.randn(1, 4, 4, 16, dtype=torch.float64), keys.clone(), keys, 0.25, None)


def test_the_steps_buffers_are_freed_when_the_reading_ends():
    model = tiny_decoder(DECODER_FAMILIES[0]).double()
    ids = prompt_ids()
    architecture = architecture_for(model.config)
    with torch.no_grad(), reading.session(model, architecture, make_plan(N_PROMPT)) as cache:
        reading.prefill(model, cache, ids[:-1])
        kernels._scratch("a step's buffer", 1024, 4, torch.float32, torch.device("cpu"))
        assert kernels._SCRATCH.buffers
    assert not kernels._SCRATCH.buffers


def test_without_a_window_a_prompt_that_fits_is_its_own_window_read_in_chunks():
    def plan(prompt_tokens, window=None):
        return plan_retrieval(prompt_tokens=prompt_tokens, text_start=0, max_new_tokens=100, max_positions=32_768,
                              window=window, retrieval_k=1024, config=DecoderOnlyConfig())

    fits = plan(16_000)
    assert fits.exact and (fits.window, fits.chunk, fits.fixed_distance) == (16_000, 4096, None)
    short = plan(1_000)
    assert short.exact and (short.window, short.chunk) == (4096, 4096)  # at least the default window
    beyond = plan(40_000)
    assert not beyond.exact and (beyond.window, beyond.chunk, beyond.fixed_distance) == (4096, 4096, 4096)
    asked = plan(16_000, window=2048)
    assert not asked.exact and (asked.window, asked.chunk) == (2048, 2048)
