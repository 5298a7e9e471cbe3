"""Tiny random decoder-only models of every family unlimisum's decoder-only retrieval supports.

Two layers, hidden size 64, 4 query heads sharing 2 key-value heads (grouped-query attention),
head dim 16; the families' own twists are kept: Qwen3 and Gemma 3 normalise queries and keys,
Gemma 2 soft-caps its scores and alternates sliding and full layers, Gemma 3 has a sliding
layer with its own rotary base, Phi-3 packs q, k, v in one projection. Variants exercise
rotary kinds: ``phi3-longrope`` (partial rotary, frequencies that switch at 32 positions) and
``llama-yarn`` (an attention factor on cos and sin).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

DECODER_FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3_text"]
VARIANTS = ["phi3-longrope", "llama-yarn"]
VOCAB = 96
SLIDING_WINDOW = 12  # Gemma's sliding layers: shorter than every test prompt


def tiny_decoder_config(family: str, *, max_positions: int = 512, vocab_size: int = VOCAB, **overrides):
    """A 2-layer config of ``family`` (or a variant in VARIANTS)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, attention_dropout=0.0,
    )
    model_type = family.split("-")[0]
    if family == "phi3-longrope":
        rotary_half = int(16 * 0.5) // 2
        common.update(original_max_position_embeddings=32, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0] * rotary_half, "long_factor": [3.0 + i for i in range(rotary_half)],
            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 32})
        common.pop("head_dim")
    elif family == "llama-yarn":
        common.update(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": max_positions // 4})
    elif model_type == "phi3":
        common.pop("head_dim")
    elif model_type == "gemma2":
        common.update(query_pre_attn_scalar=16, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                      sliding_window=SLIDING_WINDOW, layer_types=["sliding_attention", "full_attention"])
    elif model_type == "gemma3_text":
        common.update(query_pre_attn_scalar=16, sliding_window=SLIDING_WINDOW,
                      layer_types=["sliding_attention", "full_attention"])
    common.update(overrides)
    return AutoConfig.for_model(model_type, **common)


def tiny_decoder(family: str, *, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny random model of ``family`` in eval mode, float32, its weights' spread widened so that
    attention is far from uniform (random init at std 0.02 makes every score nearly equal).

    Eager attention: the reference every test compares with (transformers 5.15 gives Gemma 2 SDPA,
    which drops its soft-capping)."""
    torch.manual_seed(seed)
    config = tiny_decoder_config(family, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 2 and "embed" not in name:
                parameter.normal_(0.0, 0.25)
    return model
