"""The encoder's last layer on a window's kept rows alone (unlimisum/models/kept_rows.py): the same states as
the whole layer's rows, for every family whose row says it may, and fewer rows through its feed-forward block."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import ALL_FAMILIES
from unlimisum.models.architectures import architecture_named
from unlimisum.models.kept_rows import last_layer_rows
from unlimisum.unlimiformer.encoding import encode_windows, plan_windows

KEPT_ROWS_FAMILIES = [family for family in ALL_FAMILIES if architecture_named(family).kept_rows is not None]


def test_the_bart_like_families_run_their_last_layer_on_the_kept_rows():
    assert KEPT_ROWS_FAMILIES == ["bart", "mbart", "pegasus", "marian", "blenderbot", "blenderbot-small", "plbart"]


def _kept_states(encoder, input_ids, plan, kept_rows, batch_size: int) -> torch.Tensor:
    chunks: list[torch.Tensor] = []
    encode_windows(encoder, input_ids, plan, chunks.append, batch_size=batch_size, kept_rows=kept_rows)
    return torch.cat(chunks)


def _rows_through_last_feed_forward(encoder, run) -> list[int]:
    """Rows each call of the encoder's last layer's fc1 saw while ``run()`` ran."""
    seen: list[int] = []
    handle = encoder.layers[-1].fc1.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[-2]))
    try:
        run()
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("model_type", KEPT_ROWS_FAMILIES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_kept_rows_give_the_whole_layers_states(tiny_loaded, model_type, batch_size):
    loaded = tiny_loaded(model_type)
    encoder, kept_rows = loaded.model.get_encoder(), loaded.architecture.kept_rows
    last = encoder.layers[-1]
    torch.manual_seed(3)
    input_ids = torch.randint(5, 200, (300,))
    plan = plan_windows(len(input_ids), 64, 0.5)
    whole = _kept_states(encoder, input_ids, plan, None, batch_size)
    rows = _rows_through_last_feed_forward(
        encoder, lambda: _kept_states(encoder, input_ids, plan, kept_rows, batch_size))
    kept = _kept_states(encoder, input_ids, plan, kept_rows, batch_size)
    assert kept.shape == whole.shape == (300, loaded.model.config.d_model)
    torch.testing.assert_close(kept, whole, rtol=1e-6, atol=1e-6)
    # the middle windows keep half of their 64 rows; a batch with the first or last window keeps 48 of them
    assert max(rows) <= 48 and sum(rows) < 64 * plan.n_windows * 0.7
    assert encoder.layers[-1] is last  # the original layer is back


@pytest.mark.parametrize("model_type", ["bart", "pegasus"])
def test_the_norms_order_matters(tiny_loaded, model_type):
    """A row naming the wrong order would give other states: the test above can fail."""
    loaded = tiny_loaded(model_type)
    encoder = loaded.model.get_encoder()
    torch.manual_seed(4)
    input_ids = torch.randint(5, 200, (1, 64))
    with torch.inference_mode():
        whole = encoder(input_ids=input_ids).last_hidden_state[:, 16:48]
        wrong = loaded.architecture.encoder_layer_norm != "pre"
        with last_layer_rows(encoder.layers, 16, 48, pre_norm=wrong):
            other = encoder(input_ids=input_ids).last_hidden_state
        with last_layer_rows(encoder.layers, 16, 48, pre_norm=not wrong):
            right = encoder(input_ids=input_ids).last_hidden_state
    torch.testing.assert_close(right, whole, rtol=1e-6, atol=1e-6)
    assert (other - whole).abs().max() > 1e-3


def test_eager_attention_slices_the_masks_query_rows(tiny_model_dir):
    """With eager attention the encoder passes a [B, 1, S, S] mask: its kept query rows are taken."""
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir("bart"), attn_implementation="eager").eval()
    encoder = model.get_encoder()
    torch.manual_seed(5)
    input_ids = torch.randint(5, 200, (200,))
    plan = plan_windows(len(input_ids), 64, 0.5)
    kept_rows = architecture_named("bart").kept_rows
    torch.testing.assert_close(_kept_states(encoder, input_ids, plan, kept_rows, 2),
                               _kept_states(encoder, input_ids, plan, None, 2), rtol=1e-6, atol=1e-6)


def test_a_document_encoder_runs_the_last_layer_on_the_kept_rows(tiny_loaded):
    """The path a summary takes (DocumentEncoder.encode_windows) hands the family's kept rows on."""
    from unlimisum.config import EncodingConfig
    from unlimisum.unlimiformer.encoder import DocumentEncoder

    loaded = tiny_loaded("bart")
    encoder = DocumentEncoder(loaded, EncodingConfig(), plan=None, progress=lambda event: None)
    input_ids = torch.randint(5, 200, (200,))
    plan = plan_windows(200, 64, 0.5)
    kept: list[torch.Tensor] = []
    rows = _rows_through_last_feed_forward(
        loaded.model.get_encoder(), lambda: encoder.encode_windows(input_ids, plan, kept.append, batch_size=1))
    assert rows and max(rows) < 64 and torch.cat(kept).shape[0] == 200


@pytest.mark.parametrize("model_type", ["bart", "pegasus"])
def test_kept_rows_in_bfloat16(tiny_loaded, model_type):
    """The default path on a CPU with 16-bit units encodes in bfloat16: the kept rows agree there too."""
    import copy

    encoder = copy.deepcopy(tiny_loaded(model_type).model.get_encoder()).to(torch.bfloat16)
    kept_rows = architecture_named(model_type).kept_rows
    torch.manual_seed(6)
    input_ids = torch.randint(5, 200, (250,))
    plan = plan_windows(len(input_ids), 64, 0.5)
    kept = _kept_states(encoder, input_ids, plan, kept_rows, 2)
    whole = _kept_states(encoder, input_ids, plan, None, 2)
    assert kept.dtype == torch.bfloat16
    torch.testing.assert_close(kept, whole)  # bfloat16's own tolerance
