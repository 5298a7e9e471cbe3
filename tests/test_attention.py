"""Retrieval cross-attention equals ordinary cross-attention when search is exact and k >= N."""

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from unlimisum.models.architectures import ARCHITECTURES, architecture_for, supported_model_types
from unlimisum.search import kernels
from unlimisum.unlimiformer.retrieval import RetrievalCrossAttention, RetrievalSession, install, retrieval, uninstall
from unlimisum.config import IndexConfig
from unlimisum.search.datastore import DatastoreBuilder, plan_index
from unlimisum.errors import UnsupportedModelError

TEXT = "The lighthouse keeper counted the ships that passed."


def _store(states: torch.Tensor, storage_dtype: str = "float32"):
    config = IndexConfig(kind="exact", device="cpu", storage_dtype=storage_dtype)
    builder = DatastoreBuilder(states.shape[0], states.shape[1], plan_index(states.shape[0], states.shape[1], config), config)
    builder.add(states)
    return builder.finish()


def _encode(loaded, texts):
    tokens = loaded.tokenizer(texts, return_tensors="pt", padding=True)
    extra = loaded.architecture.encoder_inputs(tokens.input_ids) if loaded.architecture.encoder_inputs else {}
    with torch.no_grad():
        states = loaded.model.get_encoder()(
            input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, **extra
        ).last_hidden_state
    return states, tokens.attention_mask


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
@pytest.mark.parametrize("storage_dtype", ["float32", "float16"])
def test_each_layer_equals_full_cross_attention(tiny_loaded, model_type, storage_dtype, monkeypatch):
    # the wrapper's algebra, to float32 rounding: exact fp32 scores (the 16-bit score kernel's own
    # precision is tested in test_datastore.py)
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded(model_type)
    states, _ = _encode(loaded, [TEXT])
    store = _store(states[0], storage_dtype)
    # compare against attention over the very states the store holds
    reference_states = states.to(store.storage_dtype).float()
    torch.manual_seed(0)
    hidden = torch.randn(1, 3, loaded.model.config.d_model)
    session = RetrievalSession([store], retrieval_k=10_000)
    try:
        wrappers = install(loaded.model, loaded.architecture)
        assert len(wrappers) == len(loaded.architecture.decoder_layers(loaded.model))
        for wrapper in wrappers:
            with torch.no_grad():
                expected = wrapper.original(hidden, key_value_states=reference_states)[0]
                got = wrapper.attend(hidden, session)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        uninstall(loaded.model, loaded.architecture)


@pytest.mark.parametrize("model_type", ALL_FAMILIES)
def test_padded_batch_of_documents_equals_the_full_model(tiny_loaded, model_type):
    """Two documents of different lengths: padding is never retrieved, logits match the unmodified model."""
    loaded = tiny_loaded(model_type)
    model = loaded.model
    states, mask = _encode(loaded, [TEXT, TEXT[:20]])
    decoder_ids = torch.tensor([[model.config.decoder_start_token_id, 5, 7, 9]] * 2)
    with torch.no_grad():
        expected = model(encoder_outputs=(states,), attention_mask=mask, decoder_input_ids=decoder_ids).logits
        stores = [_store(states[i][mask[i].bool()]) for i in range(2)]
        stand_in = torch.zeros(2, 1, model.config.d_model)
        with retrieval(model, loaded.architecture, RetrievalSession(stores, retrieval_k=10_000)):
            got = model(
                encoder_outputs=(stand_in,), attention_mask=torch.ones(2, 1, dtype=torch.long),
                decoder_input_ids=decoder_ids,
            ).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_small_k_attends_to_the_top_scoring_tokens_only(tiny_loaded):
    loaded = tiny_loaded("bart")
    states, _ = _encode(loaded, [TEXT])
    states = states[0]
    store = _store(states)
    hidden = torch.randn(1, 1, loaded.model.config.d_model)
    wrapper = install(loaded.model, loaded.architecture)[0]
    try:
        attn = wrapper.original
        heads, head_dim = wrapper.num_heads, wrapper.head_dim
        with torch.no_grad():
            got = wrapper.attend(hidden, RetrievalSession([store], retrieval_k=3))
            q = attn.q_proj(hidden).view(heads, head_dim)
            keys = attn.k_proj(states).view(-1, heads, head_dim)
            values = attn.v_proj(states).view(-1, heads, head_dim)
            scores = torch.einsum("he,nhe->hn", q, keys) * attn.scaling
            top = scores.topk(3, dim=-1).indices  # [H, 3]
            mixed = torch.stack(
                [torch.softmax(scores[h, top[h]], -1) @ values[top[h], h] for h in range(heads)]
            )  # [H, dh]
            expected = attn.out_proj(mixed.reshape(1, 1, -1))
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    finally:
        uninstall(loaded.model, loaded.architecture)


def test_uninstall_restores_modules_and_state_dict(tiny_loaded):
    loaded = tiny_loaded("bart")
    model, architecture = loaded.model, loaded.architecture
    originals = [layer.encoder_attn for layer in architecture.decoder_layers(model)]
    keys = list(model.state_dict())
    install(model, architecture)
    assert all(isinstance(layer.encoder_attn, RetrievalCrossAttention) for layer in architecture.decoder_layers(model))
    assert list(model.state_dict()) != keys
    with pytest.raises(RuntimeError, match="already installed"):
        install(model, architecture)
    uninstall(model, architecture)
    assert [layer.encoder_attn for layer in architecture.decoder_layers(model)] == originals
    assert list(model.state_dict()) == keys


def test_retrieval_context_leaves_the_model_as_it_found_it(tiny_loaded):
    loaded = tiny_loaded("t5")
    model, architecture = loaded.model, loaded.architecture
    keys = list(model.state_dict())
    states, _ = _encode(loaded, [TEXT])
    with retrieval(model, architecture, RetrievalSession([_store(states[0])], retrieval_k=8)):
        assert list(model.state_dict()) != keys
    assert list(model.state_dict()) == keys


def test_the_steps_buffers_are_freed_when_the_retrieval_block_ends(tiny_loaded):
    # a dense step's reused weights can hold up to MAX_SCORE_BYTES: not kept once generation is over
    loaded = tiny_loaded("bart")
    model = loaded.model
    states, _ = _encode(loaded, [TEXT])
    decoder_ids = torch.tensor([[model.config.decoder_start_token_id, 5, 7]])
    with retrieval(model, loaded.architecture, RetrievalSession([_store(states[0])], retrieval_k=10_000)):
        with torch.no_grad():
            model(encoder_outputs=(torch.zeros(1, 1, model.config.d_model),),
                  attention_mask=torch.ones(1, 1, dtype=torch.long), decoder_input_ids=decoder_ids)
        kernels._scratch("a step's buffer", 1024, 4, torch.float32, torch.device("cpu"))
        assert kernels._SCRATCH.buffers
    assert not kernels._SCRATCH.buffers


def test_wrapper_without_session_is_the_original(tiny_loaded):
    loaded = tiny_loaded("bart")
    model = loaded.model
    tokens = loaded.tokenizer([TEXT], return_tensors="pt")
    decoder_ids = torch.tensor([[model.config.decoder_start_token_id, 5, 7]])
    with torch.no_grad():
        expected = model(**tokens, decoder_input_ids=decoder_ids).logits
        install(model, loaded.architecture)
        try:
            got = model(**tokens, decoder_input_ids=decoder_ids).logits
        finally:
            uninstall(model, loaded.architecture)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_unsupported_model_type_names_itself_and_the_supported_ones():
    class Config:
        model_type = "gpt2"
        is_encoder_decoder = False

    with pytest.raises(UnsupportedModelError) as error:
        architecture_for(Config())
    assert "gpt2" in str(error.value) and "bart" in str(error.value) and "t5" in str(error.value)


def test_every_table_row_is_tested():
    from tests.tiny_decoders import DECODER_FAMILIES
    from unlimisum.models.decoder_architectures import DECODER_ONLY_ARCHITECTURES

    tested = set(ALL_FAMILIES)
    assert {t for row in ARCHITECTURES for t in row.model_types} == tested
    assert {t for row in DECODER_ONLY_ARCHITECTURES for t in row.model_types} == set(DECODER_FAMILIES)
    assert set(supported_model_types()) == tested | set(DECODER_FAMILIES)


@pytest.mark.parametrize(
    "model_type, expected", [("bart", 64), ("led", 64), ("t5", 64), ("pegasus_x", 64)]
)
def test_max_source_length_is_read_per_family(tiny_loaded, model_type, expected):
    assert tiny_loaded(model_type).max_source_length == expected
