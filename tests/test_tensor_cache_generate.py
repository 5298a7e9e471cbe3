"""Tensor Cache inside generate(): wrappers, Cache API, beam search, batches, regression guarantees."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicSlidingWindowLayer, EncoderDecoderCache

from tests.conftest import ALL_FAMILIES
from unlimisum.models.compat import encoder_outputs
from unlimisum.errors import ConfigError
from unlimisum.tensor_cache import (
    TensorCacheParams, TensorCacheSettings, load_params, retained_bytes, save_params, tensor_cache,
)
from unlimisum.tensor_cache.self_attention import (
    ParallelMemory, TensorCacheSelfAttention, install, installed_wrappers, uninstall,
)

TEXTS = ["The lighthouse keeper counted the ships that passed.", "Every morning she wrote their names."]
EXACT_FAMILIES = ["bart", "mbart", "pegasus", "marian", "blenderbot", "blenderbot-small", "plbart", "pegasus_x"]


def _encoded(loaded, texts=TEXTS):
    tokens = loaded.tokenizer(texts, return_tensors="pt", padding=True)
    extra = loaded.architecture.encoder_inputs(tokens.input_ids) if loaded.architecture.encoder_inputs else {}
    with torch.no_grad():
        states = loaded.model.get_encoder()(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, **extra)
    return states.last_hidden_state, tokens.attention_mask


def _generate(model, states, mask, steps, **kwargs):
    with torch.no_grad():
        return model.generate(
            encoder_outputs=encoder_outputs(states), attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, output_scores=True, output_logits=True, return_dict_in_generate=True, **kwargs,
        )


def _same_scores(a, b) -> bool:
    return len(a.scores) == len(b.scores) and all(torch.equal(x, y) for x, y in zip(a.scores, b.scores))


def _random_params(loaded, window: int, seed: int = 0, gate_heads: int = 1, projection: str = "tied") -> TensorCacheParams:
    """Open-gate parameters with distinct λ, η per head, so that reordering mistakes show; ``projection``
    "own": a random memory projection per layer, "from_out_proj": each layer's out_proj weight; a
    "+map" suffix adds a random query map per head (identity plus noise), a "+gate" suffix a random write gate."""
    with_gate = projection.endswith("+gate")
    projection = projection.removesuffix("+gate")
    projection, with_map = projection.removesuffix("+map"), projection.endswith("+map")
    torch.manual_seed(seed)
    wrappers = install(loaded.model, loaded.architecture)
    try:
        layers, heads, head_dim = len(wrappers), wrappers[0].num_heads, wrappers[0].head_dim
        weights = torch.stack([w._projection("output").weight.detach().clone() for w in wrappers])  # [L, d, H dh]
    finally:
        uninstall(loaded.model, loaded.architecture)
    decay_logit, write_logit = torch.randn(layers, heads) + 3.0, torch.randn(layers, heads)
    gate_logit = torch.randn(layers, gate_heads) + 1.0
    memory_projection = {"tied": None, "from_out_proj": weights, "own": torch.randn_like(weights) * weights.std()}[projection]
    query_map = torch.eye(head_dim) + 2.0 * torch.randn(layers, heads, head_dim, head_dim) if with_map else None
    write_gate = 3.0 * torch.randn(layers, heads, head_dim + 1) if with_gate else None  # the tiny models: H_kv = H
    return TensorCacheParams(
        decay_logit=decay_logit, write_logit=write_logit, gate_logit=gate_logit, window=window, normalize_read=False,
        memory_projection=memory_projection, memory_query_map=query_map, memory_write_gate=write_gate,
    )


def _teacher_forced_logprobs(loaded, params: TensorCacheParams, states, mask, sequences, window, chunk=None):
    """Log-probabilities of ``sequences`` from the parallel form (whole sequence at once, no cache; ``chunk``: the
    chunked form over blocks of that many tokens instead of the dense one)."""
    model = loaded.model
    with torch.no_grad():
        wrappers = install(model, loaded.architecture)
        try:
            heads = wrappers[0].num_heads
            for layer, wrapper in enumerate(wrappers):
                gate = params.gate_logit[layer]
                wrapper.parallel = ParallelMemory(
                    window=window, decay=torch.sigmoid(params.decay_logit[layer]),
                    write_rate=torch.sigmoid(params.write_logit[layer]),
                    gate_logit=gate if gate.numel() == heads else gate[0], normalize_read=params.normalize_read,
                    projection=None if params.memory_projection is None else params.memory_projection[layer],
                    query_map=None if params.memory_query_map is None else params.memory_query_map[layer],
                    write_gate=None if params.memory_write_gate is None else params.memory_write_gate[layer],
                    chunk=chunk,
                )
            logits = model(encoder_outputs=encoder_outputs(states), attention_mask=mask,
                           decoder_input_ids=sequences[:, :-1], use_cache=False).logits
        finally:
            uninstall(model, loaded.architecture)
    return torch.log_softmax(logits.float(), dim=-1)  # [B, T-1, V]


# --- wrapping -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_install_wraps_every_decoder_self_attention_and_uninstall_restores(tiny_loaded, model_type):
    loaded = tiny_loaded(model_type)
    model, row = loaded.model, loaded.architecture
    before = [id(m) for m in model.modules()]
    wrappers = install(model, row)
    try:
        assert len(wrappers) == len(row.decoder_layers(model))
        assert all(isinstance(w, TensorCacheSelfAttention) for w in installed_wrappers(model, row))
        with pytest.raises(RuntimeError, match="already installed"):
            install(model, row)
    finally:
        uninstall(model, row)
    assert [id(m) for m in model.modules()] == before
    assert installed_wrappers(model, row) == []


@pytest.mark.parametrize("model_type", ["bart", "t5", "led"])
def test_wrapper_without_a_tensor_cache_is_the_original(tiny_loaded, model_type):
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    plain = _generate(loaded.model, states, mask, 10)
    install(loaded.model, loaded.architecture)
    try:
        wrapped = _generate(loaded.model, states, mask, 10)
    finally:
        uninstall(loaded.model, loaded.architecture)
    assert _same_scores(plain, wrapped)


def test_unwrapped_model_refuses_a_tensor_cache(tiny_loaded):
    loaded = tiny_loaded("bart")
    states, mask = _encoded(loaded)
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=4)) as session:
        cache = session.new_cache()
    with pytest.raises(RuntimeError, match="not wrapped"):
        _generate(loaded.model, states, mask, 3, **{session.cache_argument: cache})


# --- regression guarantees ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_window_covering_the_summary_gives_the_unmodified_model(tiny_loaded, model_type):
    """W >= generated length: the memory never fills; greedy output equals the model without Tensor Cache."""
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    steps = 20
    plain = _generate(loaded.model, states, mask, steps)
    params = _random_params(loaded, window=steps + 1)  # an open gate: still nothing to read
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=steps + 1, params=params)) as session:
        cached = _generate(loaded.model, states, mask, steps, **session.generate_kwargs())
    assert torch.equal(plain.sequences, cached.sequences)
    if model_type in EXACT_FAMILIES + ["t5", "mt5", "longt5"]:
        assert _same_scores(plain, cached)  # same attention kernel, same keys: bit for bit
    else:  # LED computes its attention with its own kernel; ours is the plain softmax
        for a, b in zip(plain.scores, cached.scores):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("model_type", EXACT_FAMILIES)
def test_closed_gate_is_bit_for_bit_the_sliding_window_model(tiny_loaded, model_type):
    """No parameter file: exactly the model with transformers' own sliding-window cache."""
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    window, steps = 4, 30
    layers = len(loaded.architecture.decoder_layers(loaded.model))
    sliding = EncoderDecoderCache(Cache(layers=[DynamicSlidingWindowLayer(window) for _ in range(layers)]), DynamicCache())
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=window)) as session:
        assert session.gate_closed and "sliding window" in session.message
        cached = _generate(loaded.model, states, mask, steps, **session.generate_kwargs())
        reference = _generate(loaded.model, states, mask, steps, **{session.cache_argument: sliding})
    assert _same_scores(reference, cached)
    assert not _same_scores(_generate(loaded.model, states, mask, steps), cached)  # the window does matter


@pytest.mark.parametrize("model_type, projection", [("bart", "tied"), ("t5", "tied"), ("led", "tied"),
                                                     ("bart", "own"), ("t5", "own+map"), ("bart", "own+map+gate")])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_matches_the_parallel_form(tiny_loaded, model_type, projection, num_beams):
    """Open gate, batch of 2, greedy and beam search: every chosen token's log-probability during
    generate() equals the teacher-forced parallel form on the returned sequence (so the memory
    follows its beam through reorder_cache); with the memory read through out_proj or its own projection."""
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    window, steps = 3, 24
    params = _random_params(loaded, window, seed=1, projection=projection)
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=window, params=params)) as session:
        out = _generate(loaded.model, states, mask, steps, num_beams=num_beams, num_return_sequences=num_beams,
                        length_penalty=0.0, **session.generate_kwargs())
        cache = session.last_cache
    assert cache.get_seq_length() == steps  # tokens seen, not tokens kept
    rows_out = out.sequences.shape[0]
    beam_indices = getattr(out, "beam_indices", None)
    if beam_indices is None:  # greedy: every row produced its own tokens
        beam_indices = torch.arange(rows_out)[:, None].expand(rows_out, len(out.logits))
    during = torch.zeros(rows_out, len(out.logits))  # log p of each chosen token, from generate()'s raw logits
    valid = torch.zeros(rows_out, len(out.logits), dtype=torch.bool)
    for b in range(rows_out):
        for s in range(len(out.logits)):
            source = int(beam_indices[b, s])
            if source >= 0:
                during[b, s] = torch.log_softmax(out.logits[s][source].float(), -1)[out.sequences[b, s + 1]]
                valid[b, s] = True
    rows = torch.arange(rows_out) // num_beams
    logprobs = _teacher_forced_logprobs(loaded, params, states[rows], mask[rows], out.sequences, window)
    chosen = logprobs.gather(-1, out.sequences[:, 1:, None])[..., 0]  # [B, T-1]
    assert valid.sum() >= steps
    torch.testing.assert_close(during[valid], chosen[:, : during.shape[1]][valid], rtol=1e-4, atol=1e-4)

def test_retained_state_is_constant_in_generated_tokens(tiny_loaded):
    loaded = tiny_loaded("t5")  # relative positions: no position limit
    states, mask = _encoded(loaded)
    params = _random_params(loaded, window=16)
    sizes = {}
    for steps in (64, 512):
        with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=16, params=params)) as session:
            _generate(loaded.model, states, mask, steps, **session.generate_kwargs())
            sizes[steps] = session.retained_bytes()
            assert session.last_cache.get_seq_length() == steps
    assert sizes[64] == sizes[512] > 0
    full_sizes = {}
    for steps in (64, 512):  # the ordinary cache, for contrast, grows with the summary
        full = EncoderDecoderCache(DynamicCache(), DynamicCache())
        _generate(loaded.model, states, mask, steps, **{session.cache_argument: full})
        full_sizes[steps] = retained_bytes(full)
    assert full_sizes[512] > 7 * full_sizes[64]
    assert sizes[512] < full_sizes[512]


def test_retrieval_and_tensor_cache_together(tiny_loaded):
    """Unlimiformer cross-attention + Tensor Cache: W >= length equals retrieval alone, greedy and beams."""
    from unlimisum.unlimiformer.retrieval import RetrievalSession, retrieval
    from unlimisum.config import IndexConfig
    from unlimisum.search.datastore import DatastoreBuilder, plan_index

    loaded = tiny_loaded("bart")
    states, mask = _encoded(loaded)
    config = IndexConfig(kind="exact", device="cpu", storage_dtype="float32")
    stores = []
    for row in range(states.shape[0]):
        kept = states[row][mask[row].bool()]
        builder = DatastoreBuilder(kept.shape[0], kept.shape[1], plan_index(kept.shape[0], kept.shape[1], config), config)
        builder.add(kept)
        stores.append(builder.finish())
    stand_in = torch.zeros(len(stores), 1, loaded.model.config.d_model)
    ones = torch.ones(len(stores), 1, dtype=torch.long)
    steps = 16
    for beams in (1, 2):
        with retrieval(loaded.model, loaded.architecture, RetrievalSession(stores, retrieval_k=1000)):
            alone = _generate(loaded.model, stand_in, ones, steps, num_beams=beams)
            with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=steps + 1)) as session:
                both = _generate(loaded.model, stand_in, ones, steps, num_beams=beams, **session.generate_kwargs())
            params = _random_params(loaded, window=4)
            with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=4, params=params)) as session:
                bounded = _generate(loaded.model, stand_in, ones, steps, num_beams=beams, **session.generate_kwargs())
        # the same open-gate Tensor Cache over ordinary cross-attention to every encoded state
        with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=4, params=params)) as session:
            reference = _generate(loaded.model, states, mask, steps, num_beams=beams, **session.generate_kwargs())
        assert torch.equal(alone.sequences, both.sequences)
        assert torch.equal(bounded.sequences, reference.sequences)
        for got, expected in zip(bounded.scores, reference.scores):
            finite = expected.isfinite()
            torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-4)


# --- parameter file -------------------------------------------------------------------------------


def test_parameter_file_round_trip_and_errors(tmp_path, tiny_loaded):
    loaded = tiny_loaded("bart")
    params = _random_params(loaded, window=8, gate_heads=4)
    path = save_params(params, tmp_path / "tc.safetensors")
    again = load_params(path)
    for name in ("decay_logit", "write_logit", "gate_logit"):
        torch.testing.assert_close(getattr(again, name), getattr(params, name))
    assert (again.window, again.normalize_read, again.lag) == (8, False, 0)
    with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=path)) as session:
        assert session.window == 8 and not session.gate_closed and str(path) in session.message
    wrong = TensorCacheParams.initial(num_layers=5, kv_heads=4, window=8)
    with pytest.raises(ConfigError, match="fitted for 5 layers"):
        with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=wrong)):
            pass
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="not a Tensor Cache parameter file"):
        load_params(tmp_path / "bad.safetensors")
    with pytest.raises(ConfigError, match="not found"):
        load_params(tmp_path / "missing.safetensors")
    assert installed_wrappers(loaded.model, loaded.architecture) == []


@pytest.mark.parametrize("model_type, projection", [("bart", "tied"), ("t5", "tied"), ("bart", "own"),
                                                     ("bart", "own+map"), ("t5", "tied+map"), ("t5", "own+gate")])
def test_multi_token_calls_equal_the_parallel_form(tiny_loaded, model_type, projection):
    """Prefill of several tokens, then uneven chunks, through the cache: the same logits as the parallel form."""
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    window = 5
    params = _random_params(loaded, window, seed=2, projection=projection)
    torch.manual_seed(0)
    sequence = torch.randint(3, loaded.model.config.vocab_size, (2, 31))
    expected = _teacher_forced_logprobs(loaded, params, states, mask, sequence, window)  # [B, 30, V]
    pieces = []
    with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(window=window, params=params)) as session:
        cache = session.new_cache()
        start = 0
        for size in (7, 1, 3, 12, 1, 6):
            with torch.no_grad():
                logits = loaded.model(encoder_outputs=encoder_outputs(states), attention_mask=mask,
                                      decoder_input_ids=sequence[:, start:start + size],
                                      **{session.cache_argument: cache}, use_cache=True).logits
            pieces.append(torch.log_softmax(logits.float(), dim=-1))
            start += size
            assert cache.get_seq_length() == start
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=1e-4, atol=1e-4)
    if params.memory_query_map is not None:  # the map is read by both forms: without it the logits differ
        unmapped = _teacher_forced_logprobs(loaded, replace(params, memory_query_map=None), states, mask, sequence, window)
        assert (unmapped - expected).abs().max() > 1e-3  # 10x the tolerance of the equality above
    if params.memory_write_gate is not None:  # and so is the write gate
        ungated = _teacher_forced_logprobs(loaded, replace(params, memory_write_gate=None), states, mask, sequence, window)
        assert (ungated - expected).abs().max() > 1e-3


@pytest.mark.parametrize("model_type, projection", [("bart", "tied"), ("t5", "own+map+gate"), ("bart", "own+gate")])
def test_the_chunked_whole_sequence_form_equals_the_dense_one(tiny_loaded, model_type, projection):
    """What fitting runs, in chunks (7 tokens: uneven against 30) and dense: the same log-probabilities."""
    loaded = tiny_loaded(model_type)
    states, mask = _encoded(loaded)
    params = _random_params(loaded, 5, seed=4, projection=projection)
    sequence = torch.randint(3, loaded.model.config.vocab_size, (2, 31), generator=torch.Generator().manual_seed(1))
    dense = _teacher_forced_logprobs(loaded, params, states, mask, sequence, 5)
    torch.testing.assert_close(_teacher_forced_logprobs(loaded, params, states, mask, sequence, 5, chunk=7), dense,
                               rtol=1e-5, atol=1e-5)


def test_an_identity_query_map_reads_as_no_map(tiny_loaded):
    loaded = tiny_loaded("bart")
    states, mask = _encoded(loaded)
    params = _random_params(loaded, window=4, seed=3, projection="own+map")
    identity = replace(params, memory_query_map=torch.eye(params.memory_query_map.shape[-1]).expand_as(params.memory_query_map).clone())
    sequence = torch.randint(3, loaded.model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_teacher_forced_logprobs(loaded, identity, states, mask, sequence, 4),
                               _teacher_forced_logprobs(loaded, replace(params, memory_query_map=None), states, mask, sequence, 4),
                               rtol=1e-6, atol=1e-6)


FORMAT_1_FILE = Path(__file__).resolve().parent / "fixtures" / "tensor_cache" / "params-format1.safetensors"


def test_own_projection_round_trip_and_shape_check(tmp_path, tiny_loaded):
    loaded = tiny_loaded("bart")
    params = _random_params(loaded, window=8, projection="own")
    again = load_params(save_params(params, tmp_path / "tc.safetensors"))
    assert again.projection == "own"
    torch.testing.assert_close(again.memory_projection, params.memory_projection)
    with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=again)) as session:
        assert "its own projection" in session.message
        assert all(p.projection is not None for p in session.layer_params)
    wrong = replace(params, memory_projection=params.memory_projection[:, :, :-4])
    with pytest.raises(ConfigError, match="memory projection is"):
        with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=wrong)):
            pass
    assert installed_wrappers(loaded.model, loaded.architecture) == []


def test_query_map_round_trip_shape_check_and_a_format_2_file(tmp_path, tiny_loaded):
    """Format 3 and later store the query maps; a format 2 file (own projection, no map) still loads without one."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    loaded = tiny_loaded("bart")
    params = _random_params(loaded, window=8, projection="own+map")
    path = save_params(params, tmp_path / "tc.safetensors")
    with safe_open(str(path), framework="pt") as file:
        assert file.metadata()["format"] == "unlimisum-tensor-cache/4"
    again = load_params(path)
    torch.testing.assert_close(again.memory_query_map, params.memory_query_map)
    with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=again)) as session:
        assert all(p.query_map is not None for p in session.layer_params)
    wrong = replace(params, memory_query_map=params.memory_query_map[:, :, :-1, :-1])
    with pytest.raises(ConfigError, match="query map is"):
        with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=wrong)):
            pass
    with safe_open(str(path), framework="pt") as file:  # the same file as format 2 wrote it: no map
        tensors = {name: file.get_tensor(name) for name in file.keys() if name != "memory_query_map"}
        metadata = {**file.metadata(), "format": "unlimisum-tensor-cache/2"}
    save_file(tensors, str(tmp_path / "format2.safetensors"), metadata=metadata)
    old = load_params(tmp_path / "format2.safetensors")
    assert old.memory_query_map is None and old.projection == "own"
    torch.testing.assert_close(old.memory_projection, params.memory_projection)


def test_write_gate_round_trip_shape_checks_and_a_format_3_file(tmp_path, tiny_loaded):
    """Format 4 stores the write gates; a format 3 file (map, no gate) still loads without one; a gate of the wrong
    shape is refused when the file is read and when it meets a model."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    loaded = tiny_loaded("bart")
    params = _random_params(loaded, window=8, projection="own+map+gate")
    path = save_params(params, tmp_path / "tc.safetensors")
    again = load_params(path)
    torch.testing.assert_close(again.memory_write_gate, params.memory_write_gate)
    with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=again)) as session:
        assert all(p.write_gate is not None for p in session.layer_params)
        assert "with query maps and write gates" in session.message
    wrong = replace(params, memory_write_gate=params.memory_write_gate[:, :, :-1])
    with pytest.raises(ConfigError, match="write gate is"):
        with tensor_cache(loaded.model, "bart", TensorCacheSettings(params=wrong)):
            pass
    with safe_open(str(path), framework="pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}
        metadata = file.metadata()
    save_file({**tensors, "memory_write_gate": tensors["memory_write_gate"][:, :1].contiguous()}, str(tmp_path / "bad.safetensors"),
              metadata=metadata)
    with pytest.raises(ConfigError, match="memory_write_gate of shape"):
        load_params(tmp_path / "bad.safetensors")
    save_file({name: t for name, t in tensors.items() if name != "memory_write_gate"}, str(tmp_path / "format3.safetensors"),
              metadata={**metadata, "format": "unlimisum-tensor-cache/3"})
    old = load_params(tmp_path / "format3.safetensors")
    assert old.memory_write_gate is None
    torch.testing.assert_close(old.memory_query_map, params.memory_query_map)


def test_a_write_gate_at_zero_writes_every_key_as_without_one(tiny_loaded):
    loaded = tiny_loaded("t5")
    states, mask = _encoded(loaded)
    params = _random_params(loaded, window=4, seed=3, projection="own+gate")
    zero = replace(params, memory_write_gate=torch.zeros_like(params.memory_write_gate))
    sequence = torch.randint(3, loaded.model.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_teacher_forced_logprobs(loaded, zero, states, mask, sequence, 4),
                       _teacher_forced_logprobs(loaded, replace(params, memory_write_gate=None), states, mask, sequence, 4))


def test_a_projection_from_out_proj_behaves_as_the_tied_memory_and_another_one_does_not(tiny_loaded):
    """A fresh own projection (a copy of out_proj) gives the tied model's scores; a different one changes them."""
    loaded = tiny_loaded("bart")
    states, mask = _encoded(loaded)
    window, steps = 3, 20
    scores = {}
    for projection in ("tied", "from_out_proj", "own"):
        params = _random_params(loaded, window, seed=3, projection=projection)
        with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(params=params)) as session:
            scores[projection] = _generate(loaded.model, states, mask, steps, **session.generate_kwargs()).scores
    for tied, copied in zip(scores["tied"], scores["from_out_proj"]):
        torch.testing.assert_close(copied, tied, rtol=1e-5, atol=1e-5)
    assert not all(torch.allclose(a, b, atol=1e-3) for a, b in zip(scores["tied"], scores["own"]))


def test_a_format_1_file_still_loads_and_reads_through_out_proj(tmp_path, tiny_loaded):
    """tests/fixtures/tensor_cache/params-format1.safetensors was written by unlimisum before format 2
    (commit 770f9bc); it loads as a tied memory and drives generate() exactly as the same numbers in today's format."""
    from safetensors import safe_open

    with safe_open(str(FORMAT_1_FILE), framework="pt") as file:
        assert file.metadata()["format"] == "unlimisum-tensor-cache/1"
    old = load_params(FORMAT_1_FILE)
    assert (old.projection, old.window, old.normalize_read, old.model_type) == ("tied", 4, True, "bart")
    assert old.decay_logit.shape == (2, 4) and old.gate_logit.shape == (2, 1)
    resaved = load_params(save_params(old, tmp_path / "tc.safetensors"))
    loaded = tiny_loaded("bart")
    states, mask = _encoded(loaded)
    outputs = []
    for path in (FORMAT_1_FILE, tmp_path / "tc.safetensors"):
        with tensor_cache(loaded.model, loaded.architecture, TensorCacheSettings(params=path)) as session:
            assert session.window == 4 and "tied" in session.message
            outputs.append(_generate(loaded.model, states, mask, 12, **session.generate_kwargs()))
    assert resaved.projection == "tied" and _same_scores(*outputs)


def test_a_newer_format_is_refused_with_an_upgrade_hint(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "tc.safetensors"
    save_file({name: torch.zeros(2, 1) for name in ("decay_logit", "write_logit", "gate_logit")}, str(path),
              metadata={"format": "unlimisum-tensor-cache/99"})
    with pytest.raises(ConfigError, match="newer format.*upgrade unlimisum"):
        load_params(path)
