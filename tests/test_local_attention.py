"""LED's encoder self-attention computed in blocks equals transformers' own (sliding window + global tokens)."""

from __future__ import annotations

import pytest
import torch
from transformers import LEDConfig, LEDForConditionalGeneration

from unlimisum.models.local_attention import BlockedLocalSelfAttention, blocked_local_attention


def tiny_led(attention_window=8, layers=2, seed=0) -> LEDForConditionalGeneration:
    torch.manual_seed(seed)
    config = LEDConfig(vocab_size=97, d_model=32, encoder_layers=layers, decoder_layers=1,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                       max_encoder_position_embeddings=128, max_decoder_position_embeddings=32,
                       attention_window=attention_window, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    model = LEDForConditionalGeneration(config).eval()
    for module in model.modules():  # random biases and global projections unlike the local ones
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.normal_(module.bias, std=0.5)
    return model


def inputs(batch=3, length=53, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 97, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 40:] = 0  # right padding in one row
    mask[2, :3] = 0  # and left padding in another
    return ids, mask


@pytest.mark.parametrize("globals_", ["none", "first", "several"])
@pytest.mark.parametrize("window", [8, 16])
@pytest.mark.parametrize("query_block", [None, 5, 64])  # the default, one that divides nothing, one past the input
def test_blocked_encoder_equals_transformers(globals_, window, query_block):
    model = tiny_led(attention_window=window)
    ids, mask = inputs()
    kwargs = {}
    if globals_ != "none":
        global_mask = torch.zeros_like(ids)
        global_mask[:, 0] = 1
        if globals_ == "several":
            global_mask[0, [5, 17, 30]] = 1  # rows with different numbers of global tokens
            global_mask[2, 10] = 1
        kwargs["global_attention_mask"] = global_mask
    encoder = model.get_encoder()
    with torch.inference_mode():
        expected = encoder(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
        with blocked_local_attention(encoder) as wrappers:
            assert len(wrappers) == 2 and all(isinstance(w, BlockedLocalSelfAttention) for w in wrappers)
            for wrapper in wrappers:
                wrapper.query_block = query_block
            got = encoder(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state
    real = mask.bool()  # padded positions are free to differ: nothing reads them
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


def test_a_wrong_band_is_caught():
    """The comparison above is sharp: attending to one token too many on each side changes the output."""
    model = tiny_led(attention_window=8)
    ids, mask = inputs()
    encoder = model.get_encoder()
    with torch.inference_mode():
        expected = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        with blocked_local_attention(encoder) as wrappers:
            for wrapper in wrappers:
                wrapper.original.one_sided_attn_window_size += 1
            got = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            for wrapper in wrappers:
                wrapper.original.one_sided_attn_window_size -= 1
    assert (got[mask.bool()] - expected[mask.bool()]).abs().max() > 1e-3


def test_installed_for_the_block_only_never_stacked_and_the_original_serves_training():
    model = tiny_led()
    encoder = model.get_encoder()
    originals = [layer.self_attn.longformer_self_attn for layer in encoder.layers]
    with blocked_local_attention(encoder) as outer:
        with blocked_local_attention(encoder) as inner:
            assert inner == []  # already wrapped: nothing installed twice
        assert all(layer.self_attn.longformer_self_attn is w for layer, w in zip(encoder.layers, outer))
        encoder.train()  # training (dropout) and attention weights are the original's own computation
        ids, mask = inputs()
        out = encoder(input_ids=ids, attention_mask=mask, output_attentions=True)
        assert out.attentions is not None
        encoder.eval()
    assert [layer.self_attn.longformer_self_attn for layer in encoder.layers] == originals


def test_the_original_computes_in_training_and_the_blocks_in_inference():
    model = tiny_led()
    encoder = model.get_encoder()
    ids, mask = inputs()
    calls = []
    with blocked_local_attention(encoder) as wrappers:
        hooks = [w.original.register_forward_hook(lambda *args: calls.append(1)) for w in wrappers]
        with torch.no_grad():
            encoder.eval()
            encoder(input_ids=ids, attention_mask=mask)
            assert calls == []  # evaluation: the blocked computation only
            encoder.train()
            encoder(input_ids=ids, attention_mask=mask)
            assert len(calls) == 2  # training (dropout, gradients): each layer's original
        for hook in hooks:
            hook.remove()
    encoder.eval()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocked_encoder_in_16_bit_is_as_close_as_transformers_own(dtype):
    """In 16-bit, both round differently; the blocked encoder is no farther from the fp32 result than
    transformers' own 16-bit encoder is (with a margin of 2x for rounding order)."""
    model = tiny_led(attention_window=8)
    ids, mask = inputs()
    encoder = model.get_encoder()
    real = mask.bool()
    with torch.inference_mode():
        exact = encoder(input_ids=ids, attention_mask=mask).last_hidden_state[real]
        encoder.to(dtype)
        theirs = encoder(input_ids=ids, attention_mask=mask).last_hidden_state[real].float()
        with blocked_local_attention(encoder):
            ours = encoder(input_ids=ids, attention_mask=mask).last_hidden_state[real].float()
    encoder.float()
    assert ours.isfinite().all()
    assert (ours - exact).abs().max() <= 2 * (theirs - exact).abs().max() + torch.finfo(dtype).eps


def test_generate_after_blocked_encoding_is_the_models_own():
    model = tiny_led()
    ids, mask = inputs(batch=3, length=40)
    global_mask = torch.zeros_like(ids)
    global_mask[:, 0] = 1
    settings = dict(max_new_tokens=8, num_beams=2, do_sample=False, decoder_start_token_id=2)
    with torch.inference_mode():
        expected = model.generate(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask, **settings)
        with blocked_local_attention(model.get_encoder()):
            got = model.generate(input_ids=ids, attention_mask=mask, global_attention_mask=global_mask, **settings)
    assert torch.equal(got, expected)
