"""Exactness beyond the defaults of tiny models: attention biases, and inputs of many windows.

Tiny random models have all-zero attention biases, so bias handling needs its own test; and a
multi-window input at k >= N must equal the unmodified decoder reading the concatenated kept
states (DESIGN.md: the exactness property every change must keep).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.tiny_models import SAMPLE_TEXT
from unlimisum.models import compat
from unlimisum.unlimiformer.retrieval import RetrievalSession, install
from unlimisum.config import GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.search.datastore import DatastoreBuilder, plan_index
from unlimisum.models import LoadedModel
from unlimisum.summarizer import Summarizer

EXACT = IndexConfig(kind="exact", device="cpu", storage_dtype="float32")


def _store(states: torch.Tensor):
    builder = DatastoreBuilder(states.shape[0], states.shape[1], plan_index(*states.shape, EXACT), EXACT)
    builder.add(states)
    return builder.finish()


def _with_random_biases(loaded) -> LoadedModel:
    """A copy of the model whose cross-attention projections all have large random biases."""
    model = copy.deepcopy(loaded.model)
    site = loaded.architecture.cross_attention
    generator = torch.Generator().manual_seed(7)
    for layer in loaded.architecture.decoder_layers(model):
        parent, attribute = site.locate(layer)
        attention = getattr(parent, attribute)
        for role in ("query", "key", "value", "output"):
            projection = getattr(attention, getattr(site, role))
            assert projection.bias is not None
            with torch.no_grad():
                projection.bias.copy_(torch.randn(projection.bias.shape, generator=generator) * 2.0)
    return LoadedModel(model, loaded.tokenizer, loaded.architecture, loaded.name)


@pytest.mark.parametrize("model_type", ["bart", "pegasus", "led", "marian"])
def test_biases_of_every_projection_are_handled(tiny_loaded, model_type, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = _with_random_biases(tiny_loaded(model_type))
    tokens = loaded.tokenizer(["The lighthouse keeper counted the ships that passed."], return_tensors="pt")
    extra = loaded.architecture.encoder_inputs(tokens.input_ids) if loaded.architecture.encoder_inputs else {}
    with torch.no_grad():
        states = loaded.model.get_encoder()(input_ids=tokens.input_ids, **extra).last_hidden_state
    session = RetrievalSession([_store(states[0])], retrieval_k=10_000)
    hidden = torch.randn(1, 3, loaded.model.config.d_model, generator=torch.Generator().manual_seed(1))
    for wrapper in install(loaded.model, loaded.architecture):
        with torch.no_grad():
            expected = wrapper.original(hidden, key_value_states=states)[0]
            got = wrapper.attend(hidden, session)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("biases", [False, True])
def test_many_windows_at_k_above_n_equal_the_decoder_reading_all_kept_states(tiny_loaded, biases, monkeypatch):
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    if biases:
        loaded = _with_random_biases(loaded)
    steps = 10
    generation = GenerationOptions(max_new_tokens=steps, min_new_tokens=steps, num_beams=1, do_sample=False)
    summarizer = Summarizer(loaded, index=EXACT, retrieval=RetrievalConfig(retrieval_k=100_000), generation=generation)
    encoded = summarizer.encode(_document(SAMPLE_TEXT * 3))
    assert len(encoded.windows) > 3 and encoded.n_tokens > 3 * loaded.max_source_length
    got = summarizer.generate([encoded.store]).token_ids
    kept = encoded.store.states().float().unsqueeze(0)  # [1, N, d]: every kept state, in input order
    with torch.no_grad():
        expected = loaded.model.generate(
            encoder_outputs=compat.encoder_outputs(kept), attention_mask=torch.ones(1, kept.shape[1], dtype=torch.long),
            max_new_tokens=steps, min_new_tokens=steps, num_beams=1, do_sample=False,
        )
    assert torch.equal(got, expected)


def _document(text: str):
    from unlimisum.document import Document

    return Document.from_text(text)
