"""The key store per decoder layer (unlimisum/search/keys.py, head_kernels.py): the same attention as the
shared store and as ordinary cross-attention, built while encoding, in the cache, chosen by plan_key_store."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.conftest import ALL_FAMILIES
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.cli import app
from unlimisum.config import GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.document import Chapter, Document
from unlimisum.errors import ConfigError
from unlimisum.models import compat
from unlimisum.summarizer import Summarizer
from unlimisum.search import head_kernels, compiled, kernels
from unlimisum.unlimiformer.cache import EncodedCache
from unlimisum.search.datastore import DatastoreBuilder, plan_index
from unlimisum.search.keys import build_key_store, key_weights, value_weights
from unlimisum.search.placement import (
    KEY_STORE_MIN_TOKENS, IndexPlan, plan_key_store, validate_index_config,
)
from unlimisum.unlimiformer.retrieval import RetrievalCrossAttention, RetrievalSession, install, uninstall

TEXT = "The lighthouse keeper counted the ships that passed."
PER_LAYER = IndexConfig(kind="exact", device="cpu", storage_dtype="float32", key_store="per-layer")
SHARED = IndexConfig(kind="exact", device="cpu", storage_dtype="float32", key_store="shared")


def _keyed_store(states: torch.Tensor, loaded, storage_dtype: str = "float32", values: bool = False):
    """An exact store of ``states`` [N, d] with the model's per-layer keys (and ``values``)."""
    config = IndexConfig(kind="exact", device="cpu", storage_dtype=storage_dtype)
    builder = DatastoreBuilder(states.shape[0], states.shape[1], plan_index(*states.shape, config), config)
    builder.add(states)
    store = builder.finish()
    store.keys = build_key_store(store.states(), key_weights(loaded.model, loaded.architecture),
                                 value_weights=value_weights(loaded.model, loaded.architecture) if values else None)
    return store


def _encoder_states(loaded, text: str = TEXT) -> torch.Tensor:
    tokens = loaded.tokenizer([text], return_tensors="pt")
    extra = loaded.architecture.encoder_inputs(tokens.input_ids) if loaded.architecture.encoder_inputs else {}
    with torch.no_grad():
        return loaded.model.get_encoder()(input_ids=tokens.input_ids, **extra).last_hidden_state[0]  # [N, d]


def _summarizer(loaded, index: IndexConfig, k: int = 100_000, beams: int = 1, steps: int = 8, cache=None):
    generation = GenerationOptions(max_new_tokens=steps, min_new_tokens=steps, num_beams=beams, do_sample=False)
    return Summarizer(loaded, index=index, retrieval=RetrievalConfig(retrieval_k=k), generation=generation,
                      cache=cache)



def sorted_search(keys: torch.Tensor, queries: torch.Tensor, k: int,
                  choice: head_kernels.HeadKernelChoice) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's top-k by ``head_select`` under ``choice``, rescored exactly in fp32 from the stored keys and
    sorted descending: (scores, ids) [H, nq, k'], k' = min(k, N)."""
    _, ids = head_kernels.head_select(keys, queries, min(k, keys.shape[1]), choice)
    heads = torch.arange(keys.shape[0]).view(-1, 1, 1)
    exact = torch.einsum("hqkd,hqd->hqk", keys[heads, ids].float(), queries.float())
    scores, order = exact.sort(dim=2, descending=True)
    return scores, ids.gather(2, order)

needs_faiss_scan = pytest.mark.skipif(not head_kernels.faiss_available(torch.float32),
                                      reason="this faiss cannot scan memory it does not own (faiss < 1.10)")
SCANS = [pytest.param("faiss", marks=needs_faiss_scan), "compiled"]  # numba is a dependency: the compiled scan runs


def _scan_every_store(monkeypatch, scanner: str) -> None:
    """Every key store selects with ``scanner``, whatever its length (the measured choice says from where)."""
    scan = head_kernels.HeadKernelChoice("float32", 1024, scanner=scanner, scan_min_rows=0, queries_per_head=10_000)
    monkeypatch.setattr(head_kernels, "kernel_for", lambda *args, **kwargs: scan)


# -- the keys ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["bart", "t5"])
def test_the_keys_are_the_stored_states_times_each_layers_key_projection_head_major(tiny_loaded, model_type):
    loaded = tiny_loaded(model_type)
    encoded = _summarizer(loaded, PER_LAYER).encode(Document.from_text(SAMPLE_TEXT * 2))
    store = encoded.store
    assert store.keys is not None and store.keys.n_tokens == store.n_tokens
    weights = key_weights(loaded.model, loaded.architecture)
    assert store.keys.layers == len(loaded.architecture.decoder_layers(loaded.model)) == len(weights)
    assert store.keys.values is not None  # k >= N: a dense step, whose key store keeps each layer's values too
    for layer, (weight, value_weight) in enumerate(zip(weights, value_weights(loaded.model, loaded.architecture))):
        expected = torch.einsum("nd,hed->hne", store.states().float(), weight.float())  # [H, N, dh], no bias
        torch.testing.assert_close(store.keys.layer(layer).float(), expected, rtol=1e-5, atol=1e-5)
        expected = torch.einsum("nd,hed->hne", store.states().float(), value_weight.float())  # no bias either
        torch.testing.assert_close(store.keys.layer_values(layer).float(), expected, rtol=1e-5, atol=1e-5)
        assert store.keys.layer(layer)[0].is_contiguous()  # each head's rows are one block
    assert store.keys.nbytes == store.keys.keys.numel() * 4 * 2
    chapter = store.view(5, 40)  # a chapter's view shares the keys and values of its tokens
    assert chapter.keys.n_tokens == 35 and chapter.keys.keys.data_ptr() == store.keys.keys[:, :, 5:].data_ptr()
    assert chapter.keys.values.data_ptr() == store.keys.values[:, :, 5:].data_ptr()
    top_k = _summarizer(loaded, PER_LAYER, k=6).encode(Document.from_text(SAMPLE_TEXT * 2)).store
    assert top_k.keys.values is None and top_k.keys.nbytes == top_k.keys.keys.numel() * 4  # top-k steps: keys only


def test_the_keys_are_the_same_built_while_encoding_and_rebuilt_from_the_states(tiny_loaded):
    loaded = tiny_loaded("bart")
    index = IndexConfig(kind="exact", device="cpu", key_store="per-layer")  # bfloat16 states and keys
    store = _summarizer(loaded, index).encode(Document.from_text(SAMPLE_TEXT * 3)).store
    rebuilt = build_key_store(store.states(), key_weights(loaded.model, loaded.architecture))
    assert store.keys.dtype == torch.bfloat16
    # projected from the same stored numbers: at most one rounding of the fp32 sums' last bits apart
    torch.testing.assert_close(store.keys.keys.float(), rebuilt.keys.float(), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("pays", [True, False], ids=["16-bit matmul pays", "16-bit matmul emulated"])
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
def test_a_16_bit_models_keys_are_projected_in_16_bits_only_where_that_pays(tiny_loaded, pays, weights_dtype,
                                                                            monkeypatch):
    """A model loaded in bfloat16 over a bfloat16 store: its keys and values come from a bfloat16 matmul where one
    was measured faster than fp32 (fp32 sums, one rounding: within a rounding of the fp32 projection), from the
    fp32 matmul otherwise and for fp32 weights; the support-by-removal's projection is the builder's, bit for bit."""
    from unlimisum.models import precision
    from unlimisum.search import keys
    from unlimisum.unlimiformer.removal import _project_into

    monkeypatch.setattr(precision, "cpu_speedup", lambda dtype=torch.bfloat16: 3.0 if pays else 0.05)
    matmuls = []
    project = keys.project
    monkeypatch.setattr(keys, "project", lambda states, weights, dtype: matmuls.append(dtype) or project(
        states, weights, dtype))
    loaded = tiny_loaded("bart")
    weights = [w.to(weights_dtype) for w in key_weights(loaded.model, loaded.architecture)]
    values = [w.to(weights_dtype) for w in value_weights(loaded.model, loaded.architecture)]
    states = torch.randn(37, weights[0].shape[2], generator=torch.Generator().manual_seed(0)).bfloat16()
    built = build_key_store(states, weights, value_weights=values, rows=16)  # in parts, as while encoding
    in_16_bits = pays and weights_dtype == torch.bfloat16
    assert matmuls and set(matmuls) == {torch.bfloat16 if in_16_bits else torch.float32}
    projection_dtype = keys.projection_dtype
    assert projection_dtype(weights, torch.bfloat16, "cpu") == (torch.bfloat16 if in_16_bits else torch.float32)
    assert projection_dtype(weights, torch.float32, "cpu") == torch.float32  # an fp32 store: fp32 keys
    for stored, projections in ((built.keys, weights), (built.values, values)):
        for layer, weight in enumerate(projections):
            heads, head_dim, dim = weight.shape
            wide = (states.float() @ weight.reshape(heads * head_dim, dim).float().T).view(-1, heads, head_dim)
            if in_16_bits:
                narrow = (states @ weight.reshape(heads * head_dim, dim).T).view(-1, heads, head_dim)
                assert torch.equal(stored[layer], narrow.transpose(0, 1))
            else:
                assert torch.equal(stored[layer], wide.transpose(0, 1).bfloat16())
            torch.testing.assert_close(stored[layer].float(), wide.transpose(0, 1), rtol=2**-8, atol=1e-6)
    again = build_key_store(states, weights, value_weights=values)
    again.keys.zero_(), again.values.zero_()
    rows = torch.tensor([3, 4, 20, 36])
    _project_into(again, rows, states[rows], {"keys": weights, "values": values})
    assert torch.equal(again.keys[:, :, rows], built.keys[:, :, rows])
    assert torch.equal(again.values[:, :, rows], built.values[:, :, rows])


# -- exactness --------------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [False, True], ids=["keys", "keys and values"])
@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_each_layer_with_per_layer_keys_equals_full_cross_attention(tiny_loaded, model_type, values, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded(model_type)
    states = _encoder_states(loaded)
    store = _keyed_store(states, loaded, values=values)
    hidden = torch.randn(2, 3, loaded.model.config.d_model, generator=torch.Generator().manual_seed(0))
    session = RetrievalSession([store], retrieval_k=10_000)
    try:
        for wrapper in install(loaded.model, loaded.architecture):
            with torch.no_grad():
                expected = wrapper.original(hidden, key_value_states=states.expand(2, -1, -1))[0]
                got = wrapper.attend(hidden, session)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        uninstall(loaded.model, loaded.architecture)


@pytest.mark.parametrize("values", [False, True], ids=["keys", "keys and values"])
@pytest.mark.parametrize("kernel", ["float32", "native", "compiled"])
def test_bfloat16_keys_at_k_above_n_equal_attention_over_the_stored_keys(tiny_loaded, kernel, values, monkeypatch):
    """16-bit: exactly attention over the keys (and values) as stored (rounded once), and the unmodified model
    within the documented precision (the native kernel also rounds the query and the scores to bfloat16)."""
    if kernel == "compiled":
        compiled_choice = head_kernels.HeadKernelChoice("compiled", 4096)
        monkeypatch.setattr(head_kernels, "kernel_for", lambda *args, **kwargs: compiled_choice)
    else:
        monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", kernel)
    loaded = tiny_loaded("bart")
    states = _encoder_states(loaded)
    store = _keyed_store(states, loaded, "bfloat16", values=values)
    hidden = torch.randn(1, 2, loaded.model.config.d_model, generator=torch.Generator().manual_seed(1))
    stored_states = store.states().float()
    try:
        for wrapper in install(loaded.model, loaded.architecture):
            attention = wrapper.original
            heads, head_dim = wrapper.num_heads, wrapper.head_dim
            with torch.no_grad():
                got = wrapper.attend(hidden, RetrievalSession([store], retrieval_k=10_000))
                q = attention.q_proj(hidden).view(2, heads, head_dim) * wrapper.scaling
                keys = store.keys.layer(wrapper.layer_index).float()  # [H, N, dh] as stored
                weights = torch.softmax(torch.einsum("the,hne->thn", q, keys), dim=-1)
                if values:  # as stored: each layer's values rounded once (the value bias added after the sum)
                    stored_values = store.keys.layer_values(wrapper.layer_index).float().transpose(0, 1)
                    layer_values = stored_values + attention.v_proj.bias.view(heads, head_dim)  # [N, H, dh]
                else:
                    layer_values = attention.v_proj(stored_states).view(-1, heads, head_dim)  # [N, H, dh]
                mixed = torch.einsum("thn,nhe->the", weights, layer_values).reshape(1, 2, -1)
                expected = attention.out_proj(mixed)
                unmodified = attention(hidden, key_value_states=states.unsqueeze(0))[0]
            tight = 3e-2 if kernel == "native" else 1e-4
            torch.testing.assert_close(got, expected, rtol=tight, atol=tight)
            torch.testing.assert_close(got, unmodified, rtol=5e-2, atol=5e-2)
    finally:
        uninstall(loaded.model, loaded.architecture)


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
def test_per_layer_and_shared_stores_pick_the_same_top_k(tiny_loaded, storage_dtype, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    store = _keyed_store(_encoder_states(loaded), loaded, storage_dtype)
    wrapper = install(loaded.model, loaded.architecture)[1]
    try:
        attention, heads, head_dim = wrapper.original, wrapper.num_heads, wrapper.head_dim
        hidden = torch.randn(3, loaded.model.config.d_model, generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            q = attention.q_proj(hidden).view(3, heads, head_dim) * wrapper.scaling  # [nq, H, dh]
            w_k = attention.k_proj.weight.view(heads, head_dim, -1)
            shared_scores, shared_ids = store.search(torch.einsum("qhe,hed->qhd", q, w_k).reshape(-1, store.dim), 7)
            choice = store.keys.choice(store.dim)
            scores, ids = sorted_search(store.keys.layer(1), q.permute(1, 0, 2), 7, choice)  # [H, nq, 7]
        shared_ids = shared_ids.view(3, heads, 7).permute(1, 0, 2)
        shared_scores = shared_scores.view(3, heads, 7).permute(1, 0, 2)
        if storage_dtype == "float32":
            assert torch.equal(ids.sort(dim=2).values, shared_ids.sort(dim=2).values)
        else:  # a winner may differ only where true scores tie within the keys' one rounding: every winner of
            # either store is within that rounding of the true k-th score (the stored states, in fp64)
            exact = torch.einsum("qhd,nd->hqn", torch.einsum("qhe,hed->qhd", q.double(), w_k.double()),
                                 store.states().double())  # [H, nq, N]
            kth = exact.topk(7, dim=2).values[:, :, -1:]
            tolerance = 2**-7 * exact.abs().amax(dim=2, keepdim=True)
            for winners in (ids, shared_ids):
                assert exact.gather(2, winners).ge(kth - tolerance).all()
            assert (shared_scores[:, :, -1:] - scores[:, :, -1:]).abs().le(tolerance).all()
        torch.testing.assert_close(scores, shared_scores, rtol=2**-7 if storage_dtype != "float32" else 1e-5,
                                   atol=1e-3 if storage_dtype != "float32" else 1e-5)
    finally:
        uninstall(loaded.model, loaded.architecture)


@pytest.mark.parametrize("beams", [1, 3])
def test_one_window_at_k_above_n_gives_what_the_unmodified_model_gives(tiny_loaded, beams, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    summarizer = _summarizer(loaded, PER_LAYER, beams=beams)
    encoded = summarizer.encode(Document.from_text(TEXT))
    assert len(encoded.windows) == 1 and encoded.store.keys is not None
    got = summarizer.generate([encoded.store]).token_ids
    tokens = loaded.tokenizer([TEXT], return_tensors="pt")
    with torch.no_grad():
        expected = loaded.model.generate(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                         max_new_tokens=8, min_new_tokens=8, num_beams=beams, do_sample=False)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("beams", [1, 2])
def test_many_windows_at_k_above_n_equal_the_decoder_reading_all_kept_states(tiny_loaded, beams, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    summarizer = _summarizer(loaded, PER_LAYER, beams=beams)
    encoded = summarizer.encode(Document.from_text(SAMPLE_TEXT * 3))
    assert len(encoded.windows) > 3
    got = summarizer.generate([encoded.store]).token_ids
    kept = encoded.store.states().float().unsqueeze(0)  # [1, N, d]
    with torch.no_grad():
        expected = loaded.model.generate(
            encoder_outputs=compat.encoder_outputs(kept), attention_mask=torch.ones(1, kept.shape[1], dtype=torch.long),
            max_new_tokens=8, min_new_tokens=8, num_beams=beams, do_sample=False,
        )
    assert torch.equal(got, expected)


@pytest.mark.parametrize("scan", [None, *SCANS])
@pytest.mark.parametrize("beams", [1, 2])
def test_per_layer_and_shared_give_the_same_summary_coverage_and_evidence(tiny_loaded, beams, scan, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    if scan:
        _scan_every_store(monkeypatch, scan)
    loaded = tiny_loaded("bart")
    document = Document.from_text(SAMPLE_TEXT * 3)
    shared = _summarizer(loaded, SHARED, k=6, beams=beams).summarize(document)
    per_layer = _summarizer(loaded, PER_LAYER, k=6, beams=beams).summarize(document)
    assert shared.stats.key_store == "shared" and shared.stats.key_store_bytes == 0
    assert per_layer.stats.key_store == "per-layer" and per_layer.stats.key_store_bytes > 0
    assert per_layer.token_ids == shared.token_ids
    assert [s.share for s in per_layer.coverage] == pytest.approx([s.share for s in shared.coverage], abs=1e-5)
    assert len(per_layer.evidence) == len(shared.evidence) > 0
    for mine, theirs in zip(per_layer.evidence, shared.evidence):
        assert [(s.start_char, s.end_char) for s in mine.sources] == [(s.start_char, s.end_char) for s in theirs.sources]
        assert mine.support == pytest.approx(theirs.support, abs=1e-4)  # the ablation hides the same passages


@pytest.mark.parametrize("beams", [1, 2])
def test_keys_with_values_at_top_k_give_the_summary_coverage_evidence_and_support_of_keys_alone(tiny_loaded, beams,
                                                                                               tmp_path, monkeypatch):
    """Where the plan keeps each layer's values for top-k steps, generation, the evidence reading and the support
    readings sum them instead of the states: the same summary, passages and support (within float rounding)."""
    from unlimisum.search import placement

    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    document = Document.from_text(SAMPLE_TEXT * 3)
    keys_alone = _summarizer(loaded, PER_LAYER, k=6, beams=beams).summarize(document)
    monkeypatch.setattr(placement, "KEY_STORE_MIN_TOKENS", 1)  # a tiny input, planned as a long one
    pays = head_kernels.ValueSums(projection_seconds=1e-9, step_seconds=1e-3, reading_seconds=1e-2)
    monkeypatch.setattr(head_kernels, "value_sums_for", lambda *args, **kwargs: pays)
    summed = []
    values_path = head_kernels.gathered_values
    monkeypatch.setattr(head_kernels, "gathered_values", lambda *args, **kwargs: summed.append(1) or values_path(
        *args, **kwargs))
    cache = EncodedCache(tmp_path)
    with_values = _summarizer(loaded, PER_LAYER, k=6, beams=beams, cache=cache).summarize(document)
    assert summed  # the values were read
    assert with_values.stats.key_store_values and not keys_alone.stats.key_store_values
    assert with_values.stats.key_store_bytes == 2 * keys_alone.stats.key_store_bytes
    assert with_values.token_ids == keys_alone.token_ids
    assert [s.share for s in with_values.coverage] == pytest.approx([s.share for s in keys_alone.coverage], abs=1e-5)
    assert len(with_values.evidence) == len(keys_alone.evidence) > 0
    for mine, theirs in zip(with_values.evidence, keys_alone.evidence):
        assert [(s.start_char, s.end_char) for s in mine.sources] == [
            (s.start_char, s.end_char) for s in theirs.sources]
        assert mine.support == pytest.approx(theirs.support, abs=1e-4)
    # a cached book's keys are read from the entry, and its values built again where the plan keeps them
    encoded = _summarizer(loaded, PER_LAYER, k=6, beams=beams, cache=cache).encode(document)
    assert encoded.cached and encoded.store.keys.values is not None
    weights = value_weights(loaded.model, loaded.architecture)
    expected = torch.einsum("nd,hed->hne", encoded.store.states().float(), weights[0].float())
    torch.testing.assert_close(encoded.store.keys.layer_values(0), expected, rtol=1e-5, atol=1e-5)


def test_the_head_kernel_is_measured_for_the_runs_own_beams_and_k(tiny_loaded, monkeypatch):
    """Measured before the first step for what the steps ask (a measurement for one query and k=1 would choose
    for the wrong work, and each process kept the first it made for every later one)."""
    asked = []
    measured = head_kernels.kernel_for
    monkeypatch.setattr(head_kernels, "kernel_for", lambda *args, **kwargs: asked.append(
        (kwargs["queries_per_head"], kwargs["k"])) or measured(*args, **kwargs))
    _summarizer(tiny_loaded("bart"), PER_LAYER, k=6, beams=2).summarize(Document.from_text(SAMPLE_TEXT * 3))
    assert asked[0] == (2, 6) and {k for _, k in asked} == {6}  # prepared for the beams; the reread reads one row
    assert measured("cpu", torch.float32, 16, 4, 4, queries_per_head=1, k=8) is not measured(
        "cpu", torch.float32, 16, 4, 4, queries_per_head=3, k=8)  # kept apart within a process too


@pytest.mark.parametrize("scan", [None, *SCANS])
def test_chapter_summaries_read_views_of_the_keys(tiny_loaded, scan, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    if scan:  # a chapter's keys start inside the book's: the scan reads them at their offset
        _scan_every_store(monkeypatch, scan)
    loaded = tiny_loaded("bart")
    document = Document(title="Two", chapters=(Chapter("One", SAMPLE_TEXT * 2), Chapter("Two", SAMPLE_TEXT)), source="two.txt")
    shared = _summarizer(loaded, SHARED, k=6).summarize(document, per_chapter=True)
    per_layer = _summarizer(loaded, PER_LAYER, k=6).summarize(document, per_chapter=True)
    assert len(per_layer.chapters) == 2
    for mine, theirs in zip(per_layer.chapters, shared.chapters):
        assert mine.stats.key_store == "per-layer" and mine.token_ids == theirs.token_ids
        assert mine.stats.key_store_bytes < per_layer.stats.key_store_bytes  # the chapter's view of the keys


def test_generating_with_keys_leaves_the_model_as_it_found_it(tiny_loaded):
    loaded = tiny_loaded("bart")
    model, architecture = loaded.model, loaded.architecture
    originals = [layer.encoder_attn for layer in architecture.decoder_layers(model)]
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    summarizer = _summarizer(loaded, PER_LAYER, k=4)
    summarizer.generate([summarizer.encode(Document.from_text(SAMPLE_TEXT)).store])
    assert [layer.encoder_attn for layer in architecture.decoder_layers(model)] == originals
    assert not any(isinstance(layer.encoder_attn, RetrievalCrossAttention) for layer in architecture.decoder_layers(model))
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())


# -- the cache --------------------------------------------------------------------------------------


def test_a_cache_hit_reads_the_stored_keys_or_rebuilds_them(tiny_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    document = Document.from_text(SAMPLE_TEXT * 3)
    fresh = _summarizer(loaded, PER_LAYER, k=6).summarize(document)

    with_keys = EncodedCache(tmp_path / "with")
    first = _summarizer(loaded, PER_LAYER, k=6, cache=with_keys).summarize(document)
    (entry,) = [path for path in (tmp_path / "with").iterdir() if not path.name.startswith(".")]
    assert (entry / "keys.bin").stat().st_size == first.stats.key_store_bytes
    assert json.loads((entry / "meta.json").read_text())["keys"]["layers"] == 2
    encoded = _summarizer(loaded, PER_LAYER, k=6, cache=with_keys).encode(document)
    assert encoded.cached and encoded.store.keys is not None
    stored = torch.from_numpy(np.fromfile(entry / "keys.bin", dtype=np.float32)).view(encoded.store.keys.keys.shape)
    assert torch.equal(stored, encoded.store.keys.keys)  # the entry's keys, read as they are
    second = _summarizer(loaded, PER_LAYER, k=6, cache=with_keys).summarize(document)
    assert second.stats.cached and second.stats.key_store == "per-layer"

    without_keys = EncodedCache(tmp_path / "without")  # an entry a shared-store run wrote
    _summarizer(loaded, SHARED, k=6, cache=without_keys).summarize(document)
    (entry,) = [path for path in (tmp_path / "without").iterdir() if not path.name.startswith(".")]
    assert not (entry / "keys.bin").exists() and json.loads((entry / "meta.json").read_text())["keys"] is None
    rebuilt = _summarizer(loaded, PER_LAYER, k=6, cache=without_keys).summarize(document)
    assert rebuilt.stats.cached and rebuilt.stats.key_store == "per-layer"
    assert fresh.token_ids == first.token_ids == second.token_ids == rebuilt.token_ids


def test_a_dense_cache_hit_reads_the_stored_keys_and_builds_the_values(tiny_loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    document = Document.from_text(SAMPLE_TEXT * 3)
    cache = EncodedCache(tmp_path)
    fresh = _summarizer(loaded, PER_LAYER, cache=cache).summarize(document)  # k >= N: keys and values
    assert fresh.stats.key_store_values and not fresh.stats.cached
    (entry,) = [path for path in tmp_path.iterdir() if not path.name.startswith(".")]
    assert (entry / "keys.bin").stat().st_size == fresh.stats.key_store_bytes // 2  # the cache keeps the keys
    encoded = _summarizer(loaded, PER_LAYER, cache=cache).encode(document)
    stored = torch.from_numpy(np.fromfile(entry / "keys.bin", dtype=np.float32)).view(encoded.store.keys.keys.shape)
    assert encoded.cached and torch.equal(stored, encoded.store.keys.keys)
    weights = value_weights(loaded.model, loaded.architecture)
    expected = torch.einsum("nd,hed->hne", encoded.store.states().float(), weights[1].float())
    torch.testing.assert_close(encoded.store.keys.layer_values(1), expected, rtol=1e-5, atol=1e-5)
    again = _summarizer(loaded, PER_LAYER, cache=cache).summarize(document)
    assert again.stats.cached and again.stats.key_store_values and again.token_ids == fresh.token_ids


def test_keys_over_the_cache_cap_are_left_out_of_the_entry(tmp_path):
    states, ids = torch.randn(100, 8), torch.arange(100)
    keys = torch.randn(2, 2, 100, 4)
    from unlimisum.unlimiformer.cache import CacheKey

    key = CacheKey("t", "m", "tok", 64, 0.5, "float32", "float32", "cpu")
    meta = {"title": "t", "source": "s", "windows": [[0, 100]]}
    capped = EncodedCache(tmp_path / "capped", max_bytes=states.numel() * 4 + 800 + keys.numel() * 4 - 1)
    assert not capped.keys_fit(states.numel() * 4 + 800, keys.numel() * 4)
    capped.store(key, states, ids, meta, keys=keys)
    assert capped.load(key).keys is None
    roomy = EncodedCache(tmp_path / "roomy")
    roomy.store(key, states, ids, meta, keys=keys)
    assert torch.equal(roomy.load(key).keys, keys)


@pytest.mark.parametrize("damage", [{"layers": 0, "heads": 2, "head_dim": 4, "crc32": 0}, {"layers": 2}, "keys"])
def test_an_entry_whose_keys_field_is_wrong_is_reported_and_removed(tmp_path, damage):
    from unlimisum.unlimiformer.cache import CacheKey

    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    key = CacheKey("t", "m", "tok", 64, 0.5, "float32", "float32", "cpu")
    folder = cache.store(key, torch.randn(10, 4), torch.arange(10), {"title": "t", "source": "s", "windows": [[0, 10]]},
                         keys=torch.randn(2, 2, 10, 4))
    meta = json.loads((folder / "meta.json").read_text())
    meta["keys"] = damage
    (folder / "meta.json").write_text(json.dumps(meta))
    assert cache.load(key) is None and not folder.exists()
    assert len(warnings) == 1 and "'keys'" in warnings[0]


# -- the policy and the measurement -----------------------------------------------------------------

EXACT_CPU = IndexPlan("exact", "cpu", "")
BIG = KEY_STORE_MIN_TOKENS * 4


@pytest.mark.parametrize("config, index, tokens, free, speedup, expected", [
    (IndexConfig(key_store="shared"), EXACT_CPU, BIG, 2**40, 9.0, "shared"),
    (IndexConfig(), IndexPlan("ivf", "cpu", ""), BIG, 2**40, 9.0, "shared"),
    (IndexConfig(), EXACT_CPU, KEY_STORE_MIN_TOKENS - 1, 2**40, 9.0, "shared"),
    (IndexConfig(), EXACT_CPU, BIG, 2 * BIG * 768 * 2 * 7 - 1, 9.0, "shared"),  # store + 6 layers: over half
    (IndexConfig(), EXACT_CPU, BIG, 2 * BIG * 768 * 2 * 7, 9.0, "per-layer"),
    (IndexConfig(), EXACT_CPU, BIG, 2**40, 1.1, "shared"),  # measured, but not enough faster for L x the memory
    (IndexConfig(key_store="per-layer"), EXACT_CPU, 10, 0, 0.1, "per-layer"),
])
def test_plan_key_store(config, index, tokens, free, speedup, expected):
    asked = []
    plan = plan_key_store(tokens, 768, 6, 12, 64, config, index, free_bytes=free,
                          speedup=lambda: asked.append(1) or speedup)
    assert plan.kind == expected and plan.reason
    assert plan.nbytes == (tokens * 6 * 768 * 2 if expected == "per-layer" else 0)
    # the measurement is asked only when everything else allows the keys under auto
    assert len(asked) == (1 if config.key_store == "auto" and index.kind == "exact" and tokens >= KEY_STORE_MIN_TOKENS
                          and free >= 2 * tokens * 768 * 2 * 7 else 0)


def test_the_key_store_is_weighed_for_the_support_readings_where_they_are_read(monkeypatch):
    """On a CPU without 16-bit units the key store was no faster for a step's query per head (0.96x) while a
    support reading's 32 queries per head read all of Moby-Dick 2.6x longer than generation on the shared store:
    with support on, the plan weighs both (placement.with_support)."""
    from unlimisum.search import head_kernels, placement

    assert placement.with_support(2.0, 2.0) == pytest.approx(2.0)  # the same speedup either way
    assert placement.with_support(0.96, 6.0) == pytest.approx(3 / (1 / 0.96 + 2 / 6.0))
    asked = []

    def kernel_for(device, dtype, dim, heads, head_dim, *, queries_per_head=1, k=1024, compiled_kernels=False):
        asked.append(queries_per_head)
        return head_kernels.HeadKernelChoice("float32", 1024, speedup=0.96 if queries_per_head == 1 else 6.0)

    monkeypatch.setattr(head_kernels, "kernel_for", kernel_for)
    generation_only = plan_key_store(BIG, 768, 6, 12, 64, IndexConfig(), EXACT_CPU, free_bytes=2**40)
    assert generation_only.kind == "shared" and asked == [1]
    assert generation_only.reason == ("shared store: per-layer keys measured 0.96x its speed here, under the 1.2x "
                                      "their memory needs")
    asked.clear()
    with_readings = plan_key_store(BIG, 768, 6, 12, 64, IndexConfig(), EXACT_CPU, free_bytes=2**40, support=True)
    assert with_readings.kind == "per-layer" and asked == [1, placement.READING_QUERIES_PER_HEAD]
    assert "measured 2.18x the shared store's speed with the support readings" in with_readings.reason


@pytest.mark.parametrize("free, values", [(2 * BIG * 768 * 2 * 13, True), (2 * BIG * 768 * 2 * 13 - 1, False)])
def test_a_dense_steps_key_store_keeps_the_values_where_they_fit(free, values):
    """k >= N: the store, the keys and the values within the budget keep the values (twice the keys' bytes)."""
    for config in (IndexConfig(), IndexConfig(key_store="per-layer")):
        plan = plan_key_store(BIG, 768, 6, 12, 64, config, EXACT_CPU, retrieval_k=BIG, free_bytes=free,
                              speedup=lambda: 9.0)
        assert plan.kind == "per-layer" and plan.values == values
        assert plan.nbytes == BIG * 6 * 768 * 2 * (2 if values else 1)
        assert ("keys and values" in plan.reason) == values and ("not the values" in plan.reason) != values
    top_k = plan_key_store(BIG, 768, 6, 12, 64, IndexConfig(), EXACT_CPU, retrieval_k=BIG - 1, free_bytes=2**40,
                           speedup=lambda: 9.0)
    assert top_k.kind == "per-layer" and not top_k.values and top_k.nbytes == BIG * 6 * 768 * 2


@pytest.mark.parametrize("config", [IndexConfig(), IndexConfig(key_store="per-layer")])
def test_top_k_steps_keep_the_values_where_their_saving_exceeds_their_projection(config):
    """At top-k steps the values cost BIG x 6 projections and save 6 layers' sums at each of the summary's steps and
    (with support) its readings, one a READING_TOKENS tokens: kept where that saving is larger and they fit."""
    from unlimisum.search import placement
    from unlimisum.search.head_kernels import ValueSums

    cost = BIG * 6 * 1e-6  # 1 us a token and layer

    def plan(tokens: int, support: bool = False, free: int = 2**40, n_tokens: int = BIG, step: float = 1e-3,
             reading: float = 0.0):
        asked.clear()
        return plan_key_store(n_tokens, 768, 6, 12, 64, config, EXACT_CPU, free_bytes=free, speedup=lambda: 9.0,
                              support=support, summary_tokens=tokens,
                              value_sums=lambda: asked.append(1) or ValueSums(1e-6, step, reading))

    asked = []
    paying = cost / (6 * 1e-3)  # the steps whose saving equals the cost
    kept = plan(int(paying) + 1)
    assert kept.kind == "per-layer" and kept.values and kept.nbytes == 2 * BIG * 6 * 768 * 2 and asked
    assert "top-k steps sum each head's values" in kept.reason and "keys and values" in kept.reason
    assert not plan(int(paying) - 1).values and asked
    # with support, each reading's saving counts too: what the steps alone do not pay, the readings do
    readings_pay = plan(int(paying) // 2, support=True, step=1e-3, reading=2e-3 * placement.READING_TOKENS)
    assert readings_pay.values and "and their support" in readings_pay.reason
    assert not plan(int(paying) // 2, step=1e-3, reading=2e-3 * placement.READING_TOKENS).values
    # nothing measured where the values cannot be kept: no summary length, a short input, or over the budget
    assert not plan(0).values and not asked
    assert not plan(10**9, n_tokens=KEY_STORE_MIN_TOKENS - 1).values and not asked
    store_and_both = 2 * BIG * 768 * 2 * 13  # twice (the budget's half) the store, the keys and the values
    assert not plan(10**9, free=store_and_both - 1).values and not asked
    assert plan(10**9, free=store_and_both).values and asked


def test_per_layer_keys_are_exact_search_only():
    with pytest.raises(ConfigError, match="per-layer key store is searched exactly"):
        validate_index_config(IndexConfig(kind="ivf", key_store="per-layer"))
    with pytest.raises(ConfigError, match="key_store must be one of"):
        validate_index_config(IndexConfig(key_store="everywhere"))
    # auto above exact_max_tokens is approximate, unless the per-layer keys were asked for
    assert plan_index(2_000_000, 8, IndexConfig(device="cpu")).kind == "ivf"
    assert plan_index(2_000_000, 8, IndexConfig(device="cpu", key_store="per-layer")).kind == "exact"


def _scanners_available(monkeypatch, *scanners: str) -> None:
    """Only ``scanners`` can read the keys in the measurement (``calibrate_heads``)."""
    monkeypatch.setattr(head_kernels, "faiss_available", lambda dtype: "faiss" in scanners)
    monkeypatch.setattr(compiled, "usable", lambda keys, kernel="select": "compiled" in scanners)


def test_the_measurement_chooses_the_fastest_head_kernel_and_says_its_speedup(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    _scanners_available(monkeypatch)
    seconds = {"shared": 0.030, "float32/256": 0.020, "float32/1024": 0.010, "float32/4096": 0.015, "native": 0.5}
    timed = []
    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    choice = head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, rows=512, long_rows=4096, shared=shared,
                                          time_one=lambda name, run: timed.append(name) or seconds[name])
    assert (choice.scores, choice.block_rows, choice.scanner, choice.scan_min_rows) == ("float32", 1024, None, None)
    assert choice.speedup == pytest.approx(3.0) and "3.00x" in choice.reason
    assert set(timed) == set(seconds)  # without a scan, nothing at a second length
    assert timed.count("native") == 1  # 50x the leader on its first call: clearly the loser, not timed again
    assert timed.count("float32/1024") == head_kernels.MEASURE_REPEATS + 1
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "native")
    forced = head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, rows=512, long_rows=4096, shared=shared,
                                          time_one=lambda name, run: seconds[name])
    assert forced.scores == "native" and "forced" in forced.reason and forced.scanner is None


def test_the_compiled_head_kernel_is_chosen_where_it_is_fastest(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    _scanners_available(monkeypatch, "compiled")
    seconds = {"shared": 0.030, "float32/256": 0.020, "float32/1024": 0.010, "float32/4096": 0.015, "native": 0.5,
               "compiled": 0.006, "compiled scan": 0.012, "float32/1024 long": 0.08, "compiled long": 0.048,
               "compiled scan long": 0.1}
    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    choice = head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, rows=512, long_rows=4096, shared=shared,
                                          time_one=lambda name, run: seconds[name])
    assert (choice.scores, choice.block_rows, choice.scanner) == ("compiled", 4096, None)  # the scan lost twice
    assert choice.speedup == pytest.approx(5.0) and "per-head compiled scores" in choice.reason


@pytest.mark.parametrize("scanner", ["faiss", "compiled"])
@pytest.mark.parametrize("scan, scan_long, expected_from", [
    (0.008, 0.060, 512),  # faster at the first length already: from there on
    (0.020, 0.040, 2048),  # 2x slower at 512 tokens, 2x faster at 8 x 512: they meet at sqrt(8) x 512 = 1,448
    # tokens, rounded up to a multiple of 1,024
    (0.020, 0.100, None),  # slower at both lengths: never
    (0.030, 0.001, None),  # 3x slower at 512 tokens: not raced at the second length (LONG_RACE_MAX_RATIO)
])
def test_a_scan_takes_over_from_the_length_where_it_is_measured_faster(monkeypatch, scanner, scan, scan_long,
                                                                       expected_from):
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    _scanners_available(monkeypatch, scanner)
    seconds = {"shared": 0.030, "float32/256": 0.020, "float32/1024": 0.010, "float32/4096": 0.015, "native": 0.5,
               "compiled": 0.5, f"{scanner} scan": scan, "float32/1024 long": 0.080, f"{scanner} scan long": scan_long}
    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    timed = []
    choice = head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, rows=512, long_rows=4096, shared=shared,
                                          time_one=lambda name, run: timed.append(name) or seconds[name])
    assert choice.scores == "float32" and choice.scan_min_rows == expected_from
    assert (f"{scanner} scan long" in timed) == (scan > 0.010 and scan <= head_kernels.LONG_RACE_MAX_RATIO * 0.010)
    assert choice.scanner == (scanner if expected_from else None)
    assert choice.speedup == pytest.approx(0.030 / min(0.010, scan))
    assert (f"the {scanner} scan selecting" in choice.reason) == (expected_from is not None)
    keys, one, two = torch.zeros(4, 2000, 8), torch.zeros(4, 1, 8), torch.zeros(4, 2, 8)
    assert choice.selects_with_scan(keys, one) == (expected_from is not None and 2000 >= expected_from)
    # measured for one query per head: faiss's scan makes a pass per query, not used for more; the compiled one
    # meets every query of a head in each block of keys, and serves any number (a reading's 16-64)
    assert choice.selects_with_scan(keys, two) == (scanner == "compiled" and expected_from is not None
                                                   and 2000 >= expected_from)


def test_where_the_keys_go_into_the_lanes_is_measured_before_the_race_times_the_scan(monkeypatch):
    """A first call of the scan for 8 queries a head takes this machine's compiled.tiled_from (a quarter of a
    second, once): taken inside a timed call, it would make the compiled kernels lose the race."""
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    _scanners_available(monkeypatch, "compiled")
    events = []
    monkeypatch.setattr(compiled, "measure_before_timing",
                        lambda keys, queries_per_head: events.append(("tiled_from", keys.shape, queries_per_head)))
    seconds = {"shared": 0.030, "float32/256": 0.020, "float32/1024": 0.010, "float32/4096": 0.015, "native": 0.5,
               "compiled": 0.006, "compiled scan": 0.004}
    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, queries_per_head=8, rows=512, long_rows=4096,
                                 shared=shared, time_one=lambda name, run: events.append(name) or seconds[name])
    assert events[0] == ("tiled_from", (4, 512, 8), 8) and len(events) > 1


def test_the_faster_of_the_two_scans_is_raced(monkeypatch):
    monkeypatch.delenv("UNLIMISUM_SCORE_KERNEL", raising=False)
    _scanners_available(monkeypatch, "faiss", "compiled")
    seconds = {"shared": 0.030, "float32/256": 0.020, "float32/1024": 0.010, "float32/4096": 0.015, "native": 0.5,
               "compiled": 0.5, "faiss scan": 0.009, "compiled scan": 0.007}
    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    choice = head_kernels.calibrate_heads("cpu", torch.bfloat16, 32, 4, 8, rows=512, long_rows=4096, shared=shared,
                                          time_one=lambda name, run: seconds[name])
    assert (choice.scanner, choice.scan_min_rows) == ("compiled", 512)
    assert choice.speedup == pytest.approx(0.030 / 0.007)


def test_every_head_kernel_gives_the_brute_force_top_k_and_attention():
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(3, 700, 8, generator=generator)  # [H, N, dh] fp32: exact for every kernel
    states = torch.randn(700, 16, generator=generator)
    queries = torch.randn(3, 2, 8, generator=generator)
    reference = torch.einsum("hqd,hnd->hqn", queries, keys)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    for choice in (head_kernels.HeadKernelChoice("float32", 64), head_kernels.HeadKernelChoice("native", 256),
                   head_kernels.HeadKernelChoice("compiled", 256)):
        torch.testing.assert_close(head_kernels.head_scores(keys, queries, choice), reference)
        scores, ids = sorted_search(keys, queries, 5, choice)
        expected_scores, expected_ids = reference.topk(5, dim=2)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(scores, expected_scores)
        coverage = torch.zeros(700)
        got = head_kernels.head_attend(keys, states, queries, 5, choice, shared, coverage)
        expected = torch.einsum("hqk,hqkd->hqd", torch.softmax(expected_scores, -1), states[expected_ids])
        torch.testing.assert_close(got, expected)
        assert coverage.sum().item() == pytest.approx(6.0)
        dense = head_kernels.head_attend(keys, states, queries, 700, choice, shared)
        torch.testing.assert_close(dense, torch.softmax(reference, -1) @ states)


# -- where a user meets it ----------------------------------------------------------------------------


def test_the_cli_option_the_done_line_and_the_json_stats(loader, tiny_model_dir, tmp_path):
    book = tmp_path / "book.txt"
    book.write_text(SAMPLE_TEXT * 2, encoding="utf-8")
    runner = CliRunner()
    base = ["summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu", "--max-new-tokens", "4"]
    result = runner.invoke(app, [*base, "--key-store", "per-layer", "--json", str(book)])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout.splitlines()[0])["stats"]
    assert stats["key_store"] == "per-layer" and stats["key_store_bytes"] > 0
    assert stats["key_store_values"] is False and stats["retrieval_k"] < stats["input_tokens"]  # top-k steps
    assert "per-layer keys" in result.stderr and "per-layer keys and values" not in result.stderr
    dense = runner.invoke(app, [*base, "--key-store", "per-layer", "--retrieval-k", "100000", "--json", str(book)])
    assert dense.exit_code == 0, dense.output
    dense_stats = json.loads(dense.stdout.splitlines()[0])["stats"]
    assert dense_stats["key_store_values"] is True and dense_stats["key_store_bytes"] == 2 * stats["key_store_bytes"]
    assert "per-layer keys and values" in dense.stderr
    shared = runner.invoke(app, [*base, "--key-store", "shared", "--json", str(book)])
    assert json.loads(shared.stdout.splitlines()[0])["stats"]["key_store"] == "shared"
    assert "per-layer keys" not in shared.stderr
    wrong = runner.invoke(app, [*base, "--key-store", "per-layer", "--index", "ivf", str(book)])
    assert wrong.exit_code != 0 and "per-layer key store is searched exactly" in wrong.stderr


def test_info_says_which_key_store_and_its_bytes(tiny_model_dir):
    result = CliRunner().invoke(app, ["info", "--tokens", "1000", "-m", str(tiny_model_dir("bart")),
                                      "--key-store", "per-layer", "--index", "exact"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.strip().startswith("key store:"))
    assert "per-layer" in line and "2 layers x 4 heads" in line
    auto = CliRunner().invoke(app, ["info", "--tokens", "1000", "-m", str(tiny_model_dir("bart")), "--json"])
    plan = json.loads(auto.stdout)["plan"]
    assert plan["key_store"] == "shared" and plan["key_store_bytes"] == 0
    assert f"{KEY_STORE_MIN_TOKENS:,}" in plan["key_store_reason"]


@needs_faiss_scan
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_faiss_scan_gives_the_brute_force_top_k_of_the_keys_where_they_are(dtype):
    generator = torch.Generator().manual_seed(6)
    book = torch.randn(3, 2000, 8, generator=generator).to(dtype)  # [H, N, dh]
    keys = book[:, 700:1900]  # a chapter's view: each head's rows contiguous, at an offset into the book's
    queries = torch.randn(3, 2, 8, generator=generator)
    reference = torch.einsum("hqd,hnd->hqn", queries, keys.float())
    scores, ids = head_kernels.faiss_select(keys, queries, 9)
    expected = reference.topk(9, dim=2)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(scores, expected.values)  # fp32 sums of the stored keys, in another order
    assert head_kernels.faiss_select(keys, queries, 5000)[1].shape == (3, 2, 1200)  # k beyond N: every key
    _assert_the_scan_attends_as_the_kernels_do("faiss", keys, queries, ids, generator)


def _assert_the_scan_attends_as_the_kernels_do(scanner: str, keys, queries, ids, generator) -> None:
    """head_attend and head_retrieve (with each query's best ``ids`` hidden) give the same with ``scanner`` as with
    the float32 kernel, within fp32 rounding of scores summed in another order (it grows with dh)."""
    tolerance = {"rtol": 1.3e-6, "atol": 1e-5 * max(1.0, keys.shape[2] / 16)}
    n = keys.shape[1]
    scan = head_kernels.HeadKernelChoice("float32", 256, scanner=scanner, scan_min_rows=0,
                                         queries_per_head=queries.shape[1])
    plain = head_kernels.HeadKernelChoice("float32", 256)
    states = torch.randn(n, 16, generator=generator)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    torch.testing.assert_close(head_kernels.head_attend(keys, states, queries, 9, scan, shared),
                               head_kernels.head_attend(keys, states, queries, 9, plain, shared), **tolerance)
    hidden = torch.zeros(n, dtype=torch.bool)
    hidden[ids[:, :, :4].reshape(-1)] = True  # the best of every query hidden
    got = head_kernels.head_retrieve(keys, states, queries, 9, scan, shared, exclude=hidden)
    want = head_kernels.head_retrieve(keys, states, queries, 9, plain, shared, exclude=hidden)
    assert torch.equal(got[0].sort(dim=2).values, want[0].sort(dim=2).values) and not hidden[got[0]].any()
    torch.testing.assert_close(got[2], want[2], **tolerance)


@pytest.fixture(params=["lanes", "sums"])
def many_queries(request, monkeypatch):
    """Each way of scoring many queries against bfloat16 keys, where a machine takes one of them from a count it
    measured (compiled.tiled_from): the keys in the lanes from 8 queries a head, or four queries at a time up to
    TILED_ALWAYS."""
    tiled_from = 8 if request.param == "lanes" else compiled.TILED_ALWAYS
    monkeypatch.setattr(compiled, "tiled_from", lambda head_dim: tiled_from)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 4 at a time, then 2 or 3 at once, or 1 (4 keys at once); from a measured count, bfloat16 keys in the lanes
@pytest.mark.parametrize("queries_per_head", [1, 6, 7, 9, 16])
@pytest.mark.parametrize("head_dim", [16, 24, 80])  # bf16's 8-word vectors: 1, none (12 words: the loop), 5
def test_the_compiled_scan_gives_the_brute_force_top_k_and_scores(dtype, queries_per_head, head_dim, many_queries):
    generator = torch.Generator().manual_seed(7)
    book = torch.randn(3, 6000, head_dim, generator=generator).to(dtype)  # [H, N, dh]
    # a chapter's view at an offset: 5,203 rows, several blocks and many cuts at k=9, the last block's 83 scores
    # compared 8 at a time and then 3 one by one
    keys = book[:, 700:5903]
    queries = torch.randn(3, queries_per_head, head_dim, generator=generator)
    reference = torch.einsum("hqd,hnd->hqn", queries, keys.float())
    torch.testing.assert_close(compiled.scores(keys, queries), reference)
    scores, ids = compiled.select(keys, queries, 9)
    scores, order = scores.sort(dim=2, descending=True)  # the scan's top-k comes in no order
    expected = reference.topk(9, dim=2)
    assert torch.equal(ids.gather(2, order), expected.indices)
    torch.testing.assert_close(scores, expected.values)  # fp32 sums of the stored keys, in another order
    every_score, every_id = compiled.select(keys, queries, 10_000)  # k beyond N: every key once
    assert every_id.shape == (3, queries_per_head, 5203)
    assert torch.equal(every_id.sort(dim=2).values, torch.arange(5203).expand(3, queries_per_head, -1))
    torch.testing.assert_close(every_score.sort(dim=2).values, reference.sort(dim=2).values)
    _assert_the_scan_attends_as_the_kernels_do("compiled", keys, queries, expected.indices, generator)


@pytest.mark.parametrize("n", [5, 40, 1037, 2600])  # less than a tile of 40 keys, one, tiles and a padded one
def test_many_queries_score_a_query_alike_wherever_it_sits_among_them(n, many_queries):
    """Many queries a head are scored with bfloat16 keys in the lanes, two queries at a time and a last one
    alone, or four at a time and the three after: either way the same query gets the same scores, bit for bit,
    wherever it sits, in the scores and in the scan's blocks (a support reading's two rows rely on it)."""
    generator = torch.Generator().manual_seed(11)
    book = torch.randn(2, n + 30, 64, generator=generator).to(torch.bfloat16)
    keys = book[:, 30:]  # a chapter's view at an offset
    queries = torch.randn(2, 11, 64, generator=generator) * torch.tensor([1.0, 4.0]).view(2, 1, 1)
    queries[:, 5] = queries[:, 10] = queries[:, 0]  # first of a pair, second of one, the last one alone
    scores = compiled.scores(keys, queries)
    reference = torch.einsum("hqd,hnd->hqn", queries.double(), keys.double()).float()
    torch.testing.assert_close(scores, reference, rtol=1e-5, atol=2e-5)
    assert torch.equal(scores[:, 5], scores[:, 0]) and torch.equal(scores[:, 10], scores[:, 0])
    k = min(n, 9)
    chosen, ids = compiled.select(keys, queries, k)
    chosen, order = chosen.sort(dim=2, descending=True)
    assert torch.equal(chosen, scores.topk(k, dim=2).values)  # the scan's blocks sum every score alike
    assert torch.equal(ids.gather(2, order)[:, 5], ids.gather(2, order)[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("queries_per_head", [1, 9])
def test_the_compiled_scan_starts_again_where_its_sampled_floor_was_too_high(dtype, queries_per_head,
                                                                             many_queries):
    """The scan's thresholds start at a floor from a sample of the keys; keys where only the sampled ones score
    (the others far below) leave fewer than k at or above it, and the scan goes again from -inf for them."""
    n, k = 8192, 100
    spread = 1024  # compiled_loops.SCAN_SAMPLE_KEYS, at most n // 4
    sampled = [((2 * i + 1) * n) // (2 * spread) for i in range(spread)]
    keys = torch.zeros(2, n, 16)
    keys[:, :, 0] = -1000.0
    keys[:, sampled, 0] = (torch.arange(spread, dtype=torch.float32) - 768).clamp(min=-500)  # the last 256: 0-255
    keys = keys.to(dtype)
    queries = torch.zeros(2, queries_per_head, 16)
    queries[:, :, 0] = 1.0
    scores, ids = compiled.select(keys, queries, k)
    best = torch.tensor(sampled[-k:])
    assert torch.equal(ids.sort(dim=2).values, best.expand(2, queries_per_head, k))
    best_scores = keys[:, best, 0].float().unsqueeze(1)  # [2, 1, k]
    assert torch.equal(scores.sort(dim=2).values, best_scores.expand(-1, queries_per_head, -1))
    no_floor = compiled.select(keys[:, :200], queries, k)[1]  # too few keys to sample: from -inf at once
    assert no_floor.shape == (2, queries_per_head, k) and (no_floor < 200).all()


@pytest.mark.parametrize("k", [1, 9, 700])
def test_the_compiled_scan_keeps_the_top_k_when_every_cut_misjudges(k):
    """Scores that grow along the store (every block beats the running floor: a cut at every block), and scores
    that all tie (the sampled floor equals every candidate)."""
    rows = torch.arange(6000, dtype=torch.float32)
    growing = torch.stack([rows, rows.flip(0)]).unsqueeze(2) * torch.tensor([1.0, 0.0])  # [H=2, N, dh=2]
    queries = torch.tensor([[[1.0, 0.0]], [[1.0, 0.0]]])  # [H, 1, dh]: head 0's best keys last, head 1's first
    scores, ids = compiled.select(growing, queries, k)
    assert torch.equal(ids[0, 0].sort().values, torch.arange(6000 - k, 6000))
    assert torch.equal(ids[1, 0].sort().values, torch.arange(k))
    assert torch.equal(scores[0, 0].sort().values, torch.arange(6000 - k, 6000, dtype=torch.float32))
    tied = torch.ones(1, 6000, 2)
    scores, ids = compiled.select(tied, queries[:1], k)
    assert ids[0, 0].unique().numel() == k and torch.equal(scores, torch.ones(1, 1, k))


def test_the_compiled_scan_leaves_keys_it_cannot_read_to_torch():
    odd = torch.randn(2, 50, 7).to(torch.bfloat16)  # [H, n, dh]: an odd dh has no whole 32-bit words
    assert compiled.usable(torch.randn(2, 50, 8).to(torch.bfloat16)) and compiled.usable(torch.randn(2, 50, 7))
    assert not compiled.usable(odd) and not compiled.usable(torch.randn(2, 50, 8).half())
    queries = torch.randn(2, 3, 7)
    choice = head_kernels.HeadKernelChoice("compiled", 16, scanner="compiled", scan_min_rows=0, queries_per_head=3)
    assert not choice.selects_with_scan(odd, queries)
    reference = torch.einsum("hqd,hnd->hqn", queries, odd.float())
    torch.testing.assert_close(head_kernels.head_scores(odd, queries, choice), reference)  # the float32 kernel
    assert torch.equal(sorted_search(odd, queries, 4, choice)[1], reference.topk(4, dim=2).indices)
    empty = compiled.select(torch.randn(2, 0, 8), torch.randn(2, 3, 8), 4)
    assert empty[0].shape == empty[1].shape == (2, 3, 0)


def test_a_search_beyond_the_scores_budget_goes_in_slices_with_the_same_top_k(monkeypatch):
    generator = torch.Generator().manual_seed(4)
    keys, queries = torch.randn(2, 5000, 8, generator=generator), torch.randn(2, 3, 8, generator=generator)
    monkeypatch.setattr(kernels, "MAX_SCORE_BYTES", 2 * 3 * 4 * 700)  # slices of 700 keys
    scores, ids = sorted_search(keys, queries, 20, head_kernels.HeadKernelChoice("float32", 256))
    expected = torch.einsum("hqd,hnd->hqn", queries, keys).topk(20, dim=2)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(scores, expected.values)


def test_retrieve_says_what_each_head_attended_to_and_hides_excluded_tokens():
    generator = torch.Generator().manual_seed(5)
    keys, states = torch.randn(2, 300, 8, generator=generator), torch.randn(300, 16, generator=generator)
    queries = torch.randn(2, 3, 8, generator=generator)
    choice = head_kernels.HeadKernelChoice("float32", 64)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    reference = torch.einsum("hqd,hnd->hqn", queries, keys)
    ids, weights, attended = head_kernels.head_retrieve(keys, states, queries, 6, choice, shared)
    best = reference.topk(6, dim=2).indices
    assert torch.equal(ids.sort(dim=2).values, best.sort(dim=2).values)  # in no particular order
    torch.testing.assert_close(attended, head_kernels.head_attend(keys, states, queries, 6, choice, shared))
    hidden = torch.zeros(300, dtype=torch.bool)
    hidden[best[0, 0, :3]] = True  # the three best of one query: hidden from every query
    ids, weights, attended = head_kernels.head_retrieve(keys, states, queries, 6, choice, shared, exclude=hidden)
    expected = reference.masked_fill(hidden, float("-inf")).topk(6, dim=2)
    order = ids.argsort(dim=2)
    ids, weights = ids.gather(2, order), weights.gather(2, order)
    by_id = expected.indices.argsort(dim=2)
    assert torch.equal(ids, expected.indices.gather(2, by_id)) and not hidden[ids].any()
    torch.testing.assert_close(weights, torch.softmax(expected.values, dim=2).gather(2, by_id))
    torch.testing.assert_close(attended, torch.einsum("hqk,hqkd->hqd", weights, states[ids]))


@pytest.mark.parametrize("alike", [True, False], ids=["the groups' queries alike", "each group its own"])
@pytest.mark.parametrize("kernel", ["float32", "native", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scan", [False, True], ids=["scores", "scan"])
def test_groups_of_queries_each_with_its_mask_attend_as_each_alone(alike, kernel, dtype, scan, monkeypatch):
    """A support reading's rows in one call (``head_attend_masked``): each group of queries gets a top-k of the
    kernel's scores without its masked tokens (nothing hidden, a few, many) and their softmax-weighted states,
    what ``head_attend`` with its own mask gives (where no two scores tie); with every mask empty, alike groups
    are the same numbers bit for bit. By the scores' matrix with the masked columns at -inf, or by the scan."""
    if scan:
        _scan_every_store(monkeypatch, "compiled")
    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(2, 400, 8, generator=generator).to(dtype)
    states = torch.randn(400, 16, generator=generator).to(dtype)
    group = torch.randn(2, 5, 8, generator=generator)
    queries = torch.cat([group] * 3 if alike else [group, torch.randn(2, 10, 8, generator=generator)], dim=1)
    choice = (head_kernels.HeadKernelChoice("float32", 1024, scanner="compiled", scan_min_rows=0,
                                            queries_per_head=10_000) if scan else
              head_kernels.HeadKernelChoice(kernel, 64))
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    best = torch.einsum("hqd,hnd->hqn", group, keys.float()).topk(6, dim=2).indices
    few, many = torch.zeros(400, dtype=torch.bool), torch.rand(400, generator=generator) < 0.3
    few[best[0, 0, :3]] = True  # the three best of one query
    masks = [torch.zeros(400, dtype=torch.bool), few, many]
    scores, ids = head_kernels._select_masked(keys, queries, 6, choice, masks)
    attended = head_kernels.head_attend_masked(keys, states, queries, 6, choice, shared, masks)
    assert scores.shape == ids.shape == (2, 15, 6) and attended.shape == (2, 15, 16)
    weights = torch.softmax(scores, dim=2)
    torch.testing.assert_close(attended, torch.einsum("hqk,hqkd->hqd", weights, states.float()[ids]))
    for index, (mask, part) in enumerate(zip(masks, queries.chunk(3, dim=1))):
        rows = slice(5 * index, 5 * (index + 1))
        exact = head_kernels.head_scores(keys, part, head_kernels.HeadKernelChoice(
            "float32" if scan else kernel, 64)).masked_fill(mask, float("-inf"))  # [H, 5, N], the kernel's
        torch.testing.assert_close(scores[:, rows], exact.gather(2, ids[:, rows]))
        assert not mask[ids[:, rows]].any()
        others = exact.scatter(2, ids[:, rows], float("-inf"))
        assert (scores[:, rows].amin(dim=2) >= others.amax(dim=2)).all()  # a top-k, whichever of any ties
        if dtype == torch.float32:  # no ties: the very states
            alone = head_kernels.head_attend(keys, states, part, 6, choice, shared, exclude=mask)
            torch.testing.assert_close(attended[:, rows], alone)
    assert not torch.equal(attended[:, :5], attended[:, 5:10])  # the mask of the second group changed it
    nothing = [torch.zeros(400, dtype=torch.bool)] * 3
    attended = head_kernels.head_attend_masked(keys, states, queries, 6, choice, shared, nothing)
    if alike:
        assert torch.equal(attended[:, :5], attended[:, 5:10]) and torch.equal(attended[:, :5], attended[:, 10:])
    with pytest.raises(ValueError, match="equal groups"):
        head_kernels.head_attend_masked(keys, states, queries[:, :14], 6, choice, shared, nothing)


def _dense_layer(seed: int, n: int = 300):
    """keys [2, n, 8], states [n, 16], each head's values [2, n, 8] = the states times its value projection,
    queries [2, 3, 8]."""
    generator = torch.Generator().manual_seed(seed)
    keys, states = torch.randn(2, n, 8, generator=generator), torch.randn(n, 16, generator=generator)
    w_v = torch.randn(2, 8, 16, generator=generator)  # [H, dh, d]
    values = torch.einsum("nd,hed->hne", states, w_v)
    return keys, states, w_v, values, torch.randn(2, 3, 8, generator=generator)


@pytest.mark.parametrize("kernel", ["float32", "compiled"])
def test_a_dense_step_over_each_layers_values_is_the_dense_step_over_the_states_projected(kernel, monkeypatch):
    keys, states, w_v, values, queries = _dense_layer(6)
    choice = head_kernels.HeadKernelChoice(kernel, 64)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    over_states, over_values = torch.zeros(300), torch.zeros(300)
    expected = torch.einsum("hqd,hed->hqe", head_kernels.head_attend(keys, states, queries, 300, choice, shared,
                                                                     over_states), w_v)
    got = head_kernels.head_attend(keys, states, queries, 300, choice, shared, over_values, values=values)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(over_values, over_states)  # the same weights counted as coverage
    monkeypatch.setattr(head_kernels, "DENSE_SCORE_BYTES", 300 * 4)  # one head's query's scores at a time
    torch.testing.assert_close(head_kernels.head_attend(keys, states, queries, 300, choice, shared, values=values),
                               expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["float32", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_top_k_step_over_each_layers_values_is_the_top_k_step_over_the_states_projected(kernel, dtype):
    """k < N: each head's k chosen values summed are its chosen states summed, then projected (the same ids and
    weights, the same coverage); in a chapter's view of the values too, and with tokens hidden."""
    keys, states, w_v, values, queries = _dense_layer(8)
    keys, states = keys.to(dtype), states.to(dtype)
    # as a key store holds them: projected from the stored states, head-major, each head's rows contiguous
    values = torch.einsum("nd,hed->hne", states.float(), w_v).to(dtype).contiguous()
    exact_values = values.float()
    choice = head_kernels.HeadKernelChoice(kernel, 64)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    tight = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    hidden = torch.zeros(300, dtype=torch.bool)
    hidden[[4, 50, 51, 200]] = True
    for rows in (slice(0, 300), slice(40, 240)):  # the whole store, and a chapter's view
        over_states, over_values = torch.zeros(rows.stop - rows.start), torch.zeros(rows.stop - rows.start)
        layer_keys, layer_states, layer_values = keys[:, rows], states[rows], values[:, rows]
        got = head_kernels.head_attend(layer_keys, layer_states, queries, 20, choice, shared, over_values,
                                       values=layer_values)
        assert got.shape == (2, 3, 8)
        ids, weights, _ = head_kernels.head_retrieve(layer_keys, layer_states, queries, 20, choice, shared)
        heads = torch.arange(2).view(2, 1, 1)
        by_hand = torch.einsum("hqk,hqke->hqe", weights, exact_values[:, rows][heads, ids])
        torch.testing.assert_close(got, by_hand, **tight)
        through_states = head_kernels.head_attend(layer_keys, layer_states, queries, 20, choice, shared,
                                                  over_states)
        torch.testing.assert_close(got, torch.einsum("hqd,hed->hqe", through_states, w_v), **tight)
        torch.testing.assert_close(over_values, over_states)  # the same weights counted as coverage
        mask = hidden[rows]
        got_ids, got_weights, got = head_kernels.head_retrieve(layer_keys, layer_states, queries, 20, choice,
                                                               shared, mask, values=layer_values)
        ids, weights, attended = head_kernels.head_retrieve(layer_keys, layer_states, queries, 20, choice, shared,
                                                            mask)
        assert torch.equal(got_ids, ids) and torch.equal(got_weights, weights) and not mask[got_ids].any()
        torch.testing.assert_close(got, torch.einsum("hqd,hed->hqe", attended, w_v), **tight)
        two = torch.cat([queries, queries], dim=1)  # two groups of rows, the second with tokens hidden
        masked = head_kernels.head_attend_masked(layer_keys, layer_states, two, 20, choice, shared,
                                                 [torch.zeros_like(mask), mask], values=layer_values)
        alone = [head_kernels.head_attend(layer_keys, layer_states, queries, 20, choice, shared, values=layer_values,
                                          exclude=exclude) for exclude in (torch.zeros_like(mask), mask)]
        torch.testing.assert_close(masked, torch.cat(alone, dim=1), rtol=1e-6, atol=1e-6)


def test_retrieve_over_each_layers_values_says_what_each_head_attended_to_and_hides_excluded_tokens():
    keys, states, w_v, values, queries = _dense_layer(7, n=40)
    choice = head_kernels.HeadKernelChoice("float32", 64)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)
    hidden = torch.zeros(40, dtype=torch.bool)
    hidden[[3, 17, 30]] = True
    for exclude in (None, hidden):
        ids, weights, attended = head_kernels.head_retrieve(keys, states, queries, 40, choice, shared, exclude)
        got_ids, got_weights, got = head_kernels.head_retrieve(keys, states, queries, 40, choice, shared, exclude,
                                                               values=values)
        assert got.shape == (2, 3, 8) and got_ids.shape == got_weights.shape == (2, 3, 40)
        torch.testing.assert_close(got, torch.einsum("hqd,hed->hqe", attended, w_v), rtol=1e-5, atol=1e-5)
        # every token's weight (the hidden ones weighing nothing), as the states' path says, whatever the order
        torch.testing.assert_close(got_weights.gather(2, got_ids.argsort(dim=2)), weights.gather(2, ids.argsort(dim=2)))
        assert torch.equal(got_ids.sort(dim=2).values, torch.arange(40).expand(2, 3, 40))
    # the values' path lists every token in descending weight: the hidden ones last, weighing nothing
    assert got_weights[:, :, -3:].eq(0).all() and hidden[got_ids[:, :, -3:]].all()


@pytest.mark.parametrize("heads,queries,n,budget,threads", [
    (12, 4, 1000, 8 * 2**20, 2),  # all at once
    (12, 4, 1000, 4 * 1000 * 4, 2),  # one head's queries fit: a block of two heads (one a thread)
    (12, 4, 1000, 1000 * 4, 2),  # one query fits: two heads a block, a query at a time
    (12, 1, 1000, 3 * 1000 * 4, 4),  # three heads fit, four threads: four heads a block
    (5, 3, 1000, 10, 8),  # nothing fits: one query of every head (as many heads as there are)
])
def test_a_dense_step_goes_in_blocks_that_cover_every_head_and_query_once(heads, queries, n, budget, threads,
                                                                        monkeypatch):
    monkeypatch.setattr(head_kernels, "DENSE_SCORE_BYTES", budget)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    covered = torch.zeros(heads, queries, dtype=torch.long)
    for head, part in head_kernels.dense_blocks(heads, queries, n):
        covered[head, part] += 1
        block = len(range(heads)[head]) * len(range(queries)[part]) * n * 4
        fitting_queries = max(1, min(queries, budget // (n * 4)))
        assert block <= max(budget, min(threads, heads) * fitting_queries * n * 4)  # the budget, or a head a thread
    assert covered.eq(1).all()


@pytest.mark.parametrize("kernel", ["float32", "compiled"])
@pytest.mark.parametrize("budget", [300 * 4, 3 * 300 * 4, 2**30])
def test_a_dense_step_in_blocks_gives_what_it_gives_at_once(kernel, budget, monkeypatch):
    """head_attend (with and without each head's values, coverage counted) and head_retrieve (hidden tokens
    included) give the same whatever blocks of heads and queries their scores go in."""
    generator = torch.Generator().manual_seed(8)
    keys, states = torch.randn(6, 300, 8, generator=generator), torch.randn(300, 16, generator=generator)
    values = torch.randn(6, 300, 8, generator=generator)
    queries = torch.randn(6, 3, 8, generator=generator)
    hidden = torch.zeros(300, dtype=torch.bool)
    hidden[[4, 50, 299]] = True
    choice = head_kernels.HeadKernelChoice(kernel, 64)
    shared = kernels.KernelChoice("float32", 128, False, 1e-9, 1e-9)

    def step():
        over_values, over_states = torch.zeros(300), torch.zeros(300)
        return (head_kernels.head_attend(keys, states, queries, 300, choice, shared, over_values, values=values),
                over_values,
                head_kernels.head_attend(keys, states, queries, 300, choice, shared, over_states), over_states,
                *head_kernels.head_retrieve(keys, states, queries, 300, choice, shared, hidden, values=values))

    expected = step()
    monkeypatch.setattr(head_kernels, "DENSE_SCORE_BYTES", budget)
    got = step()
    for found, wanted in zip(got, expected):
        torch.testing.assert_close(found, wanted, rtol=1e-5, atol=1e-6)
    reference = torch.softmax(torch.einsum("hqd,hnd->hqn", queries, keys), dim=2)
    torch.testing.assert_close(got[0], torch.einsum("hqn,hnd->hqd", reference, values), rtol=1e-5, atol=1e-5)


def test_what_values_cost_and_save_is_each_timing_at_its_best_per_token_and_per_layer():
    """ValueSums from the timings (every one timed at each turn, none dropped as a race's loser): the projection
    per token of its block, the saving of a step and of a reading as the states' sums less the values'."""
    seconds = {"projection": [0.50, 0.40, 0.41, 0.45], "step states": [0.004, 0.003, 0.003, 0.003],
               "step values": [0.001, 0.0005, 0.0006, 0.0005], "reading states": [0.02, 0.012, 0.013, 0.012],
               "reading values": [0.01, 0.004, 0.005, 0.004]}
    calls = {name: 0 for name in seconds}

    def time_one(name, run):
        run()  # the candidates run: the gathers and the projection as a store does them
        calls[name] += 1
        return seconds[name][calls[name] - 1]

    shared = kernels.KernelChoice("float32", 512, False, 1e-9, 1e-9)
    sums = head_kernels.calibrate_values("cpu", torch.bfloat16, 32, 4, 8, queries_per_head=2, reading_queries=8,
                                         k=16, rows=512, compiled_kernels=False, time_one=time_one, shared=shared)
    assert calls == {name: head_kernels.MEASURE_REPEATS + 1 for name in seconds}  # the slow projection too
    assert sums.projection_seconds == pytest.approx(0.40 / 512)  # a block of every row here (512 < 4,096)
    assert sums.step_seconds == pytest.approx(0.003 - 0.0005) and sums.reading_seconds == pytest.approx(0.008)
    assert "2 per head" in sums.reason and "8 per head" in sums.reason
