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


# A chat template in the usual shape: BOS, one <|role|> ... <|end|> turn per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DECODER_SPECIALS = ["<|begin|>", "<|end|>", "<pad>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]


def build_decoder_tokenizer(folder, *, chat_template: bool | str = True, vocab_size: int = 320,
                            added_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer trained on SAMPLE_TEXT that puts a BOS before a text (and no EOS after);
    ``chat_template``: CHAT_TEMPLATE, none, or the template given; ``added_tokens``: added, not special (as
    Qwen3's ``<think>`` and ``<tool_call>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny_models import SAMPLE_TEXT

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=DECODER_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([SAMPLE_TEXT] * 20, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin|> $A", special_tokens=[("<|begin|>", tokenizer.token_to_id("<|begin|>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<pad>", unk_token="<unk>",
        extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"], model_max_length=1_000_000,
    )
    if added_tokens:
        from tokenizers import AddedToken

        fast.add_tokens([AddedToken(token, special=False, normalized=False) for token in added_tokens])
    if chat_template:
        fast.chat_template = chat_template if isinstance(chat_template, str) else CHAT_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def build_tiny_decoder_dir(folder, family: str = "qwen2", *, chat_template: bool | str = True,
                           max_positions: int = 4096, seed: int = 0, added_tokens: tuple[str, ...] = ()):
    """Save a tiny random ``family`` model and its tokenizer to ``folder`` (as a checkpoint on the hub is)."""
    tokenizer = build_decoder_tokenizer(folder, chat_template=chat_template, added_tokens=added_tokens)
    model = tiny_decoder(family, seed=seed, vocab_size=len(tokenizer), max_positions=max_positions,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    return folder
