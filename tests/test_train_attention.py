"""Training-time attention: exactness at k >= N, gradients into encoder and decoder, what k < N changes."""

from __future__ import annotations

import pytest
import torch

from unlimisum.training.attention import TrainingCrossAttention, TrainingSession, encode_long, training_attention
from unlimisum.models.wrapping import installed

WINDOW = 64


def _fresh(tiny_model_dir, family="bart"):
    from unlimisum.config import ModelConfig
    from unlimisum.models import load_model

    loaded = load_model(ModelConfig(name=str(tiny_model_dir(family)), device="cpu", dtype="float32"))
    loaded.model.train()
    return loaded


def _batch(loaded, n_tokens=150, seed=0):
    generator = torch.Generator().manual_seed(seed)
    vocab = loaded.model.config.vocab_size
    input_ids = torch.randint(5, vocab, (2, n_tokens), generator=generator)  # [B, L]
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, n_tokens - 40 :] = 0  # the second example is shorter: padding must not leak in
    labels = torch.randint(5, vocab, (2, 12), generator=generator)  # [B, T]
    return input_ids, attention_mask, labels


def _loss_and_grads(loaded, batch, mode=None, top_k=None, seed=0):
    """Loss and every parameter's gradient; mode None: the unmodified model on the same encoded states."""
    model, architecture = loaded.model, loaded.architecture
    model.zero_grad(set_to_none=True)
    input_ids, attention_mask, labels = batch
    states, mask = encode_long(model, architecture, input_ids, attention_mask, WINDOW, 0.5)
    inputs = dict(encoder_outputs=(states,), attention_mask=mask.long(), labels=labels)
    if mode is None:
        loss = model(**inputs).loss
        loss.backward()
    else:
        with training_attention(model, architecture) as wrappers:
            session = TrainingSession(states, mask, mode, top_k, torch.Generator().manual_seed(seed))
            for wrapper in wrappers:
                wrapper.session = session
            loss = model(**inputs).loss
            loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


@pytest.mark.parametrize("family", ["bart", "t5"])
@pytest.mark.parametrize("mode", ["retrieval", "random"])
def test_k_at_least_n_equals_full_cross_attention(tiny_model_dir, family, mode):
    loaded = _fresh(tiny_model_dir, family)
    batch = _batch(loaded)
    reference_loss, reference = _loss_and_grads(loaded, batch)
    loss, grads = _loss_and_grads(loaded, batch, mode, top_k=10_000)
    torch.testing.assert_close(loss, reference_loss)
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("mode", ["retrieval", "random"])
def test_gradient_reaches_encoder_and_decoder(tiny_model_dir, mode):
    loaded = _fresh(tiny_model_dir)
    _, grads = _loss_and_grads(loaded, _batch(loaded), mode, top_k=8)

    def norm(part):
        return sum(g.norm() for name, g in grads.items() if part in name)

    assert norm("encoder.layers.0.") > 0  # through the selected states into the first encoder layer
    assert norm("encoder_attn.k_proj") > 0 and norm("encoder_attn.v_proj") > 0
    assert norm("decoder.layers.0.self_attn") > 0


@pytest.mark.parametrize("mode", ["retrieval", "random"])
def test_small_k_differs_from_full_attention(tiny_model_dir, mode):
    loaded = _fresh(tiny_model_dir)
    batch = _batch(loaded)
    reference_loss, _ = _loss_and_grads(loaded, batch)
    loss, _ = _loss_and_grads(loaded, batch, mode, top_k=4)
    assert abs(loss.item() - reference_loss.item()) > 1e-4


def test_random_picks_are_real_states_and_fixed_per_layer():
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 10:] = False
    session = TrainingSession(torch.zeros(2, 30, 8), mask, "random", 16, torch.Generator().manual_seed(0))
    indices, real = session.random_picks(0, heads=4)  # [B, H, k]
    assert indices.shape == (2, 4, 16)
    assert real[0].all() and real[1].sum(-1).tolist() == [10] * 4  # the short example has only 10 states
    assert (indices[1][real[1]] < 10).all()
    assert len(set(indices[0, 0].tolist())) == 16  # k distinct states, no repeats
    again, _ = session.random_picks(0, heads=4)
    assert torch.equal(again, indices)  # a recomputation (gradient checkpointing) sees the same picks
    other, _ = session.random_picks(1, heads=4)
    assert not torch.equal(other, indices)  # each layer draws its own


def test_retrieval_picks_the_top_k_of_each_head(tiny_model_dir):
    """k < N: the wrapper equals full attention restricted (by hand) to each query's top-k scores."""
    loaded = _fresh(tiny_model_dir)
    model = loaded.model.eval()
    layer = loaded.architecture.decoder_layers(model)[0]
    original = layer.encoder_attn
    wrapper = TrainingCrossAttention(original, loaded.architecture, 0)
    torch.manual_seed(0)
    states, hidden = torch.randn(1, 40, 32), torch.randn(1, 5, 32)  # [B, N, d], [B, T, d]
    session = TrainingSession(states, torch.ones(1, 40, dtype=torch.bool), "retrieval", 6)
    out = wrapper.attend(hidden, session)  # [B, T, d]
    heads, dh = wrapper.num_heads, wrapper.head_dim
    q = original.q_proj(hidden).view(1, 5, heads, dh).transpose(1, 2)
    k = original.k_proj(states).view(1, 40, heads, dh).transpose(1, 2)
    v = original.v_proj(states).view(1, 40, heads, dh).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) * wrapper.scaling  # [1, H, T, N]
    top = scores.topk(6, dim=-1)
    probs = torch.softmax(top.values, dim=-1)  # [1, H, T, 6]
    picked_v = v[:, :, None].expand(-1, -1, 5, -1, -1).gather(3, top.indices[..., None].expand(-1, -1, -1, -1, dh))
    expected = original.out_proj((probs[..., None] * picked_v).sum(3).transpose(1, 2).reshape(1, 5, heads * dh))
    torch.testing.assert_close(out, expected)


def test_wrappers_leave_no_trace(tiny_model_dir):
    loaded = _fresh(tiny_model_dir)
    names = list(loaded.model.state_dict())
    with training_attention(loaded.model, loaded.architecture) as wrappers:
        assert len(wrappers) == 2
        assert any(".original." in name for name in loaded.model.state_dict())
    assert list(loaded.model.state_dict()) == names
    assert installed(loaded.model, loaded.architecture, loaded.architecture.cross_attention, TrainingCrossAttention) == []


def test_attention_dropout_follows_the_models_mode(tiny_model_dir):
    """Wrappers installed while the model is in eval mode apply no dropout: validation losses repeat."""
    loaded = _fresh(tiny_model_dir)
    for module in loaded.model.modules():
        if isinstance(getattr(module, "dropout", None), float):
            module.dropout = 0.5  # the tiny models have none; a real checkpoint has 0.1
    loaded.model.eval()
    model, architecture = loaded.model, loaded.architecture
    input_ids, attention_mask, labels = _batch(loaded)
    losses = []
    with torch.no_grad():
        states, mask = encode_long(model, architecture, input_ids, attention_mask, WINDOW, 0.5)
        for _ in range(3):
            with training_attention(model, architecture) as wrappers:
                session = TrainingSession(states, mask, "retrieval", 8, torch.Generator().manual_seed(0))
                for wrapper in wrappers:
                    wrapper.session = session
                losses.append(float(model(encoder_outputs=(states,), attention_mask=mask.long(), labels=labels).loss))
    assert losses[0] == losses[1] == losses[2]
