"""Tiny random encoder-decoder models built from configs, with a locally trained tokenizer.

Nothing here touches the network: the tokenizer is a byte-level BPE trained on a few
paragraphs, and every model is built from a config with random weights and saved to a
folder, so the code under test loads it with the same ``from_pretrained`` it uses for
real checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoConfig, AutoModelForSeq2SeqLM, PreTrainedTokenizerFast

SAMPLE_TEXT = (
    "The lighthouse keeper counted the ships that passed in the night. "
    "Every morning she wrote their names in a blue book, and every evening she read them aloud. "
    "Chapter one begins with a storm; chapter two ends with a letter from the mainland. "
    "Numbers such as 1, 2, 3, 42 and 1999 appear in the text, as do commas, dots and quotes. "
    "A summary should be short, faithful and readable. "
)

# Special tokens of the two tokenizer styles: BART-like (<s> text </s>) and T5-like (text </s>).
BART_SPECIALS = {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>", "mask": "<mask>"}
T5_SPECIALS = {"pad": "<pad>", "eos": "</s>", "unk": "<unk>"}

T5_FAMILIES = {"t5", "mt5", "longt5"}


def build_tokenizer(folder: Path, *, style: str = "bart", vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on SAMPLE_TEXT and save it to ``folder``."""
    specials = BART_SPECIALS if style == "bart" else T5_SPECIALS
    order = ["bos", "pad", "eos", "unk", "mask"] if style == "bart" else ["pad", "eos", "unk"]
    special_list = [specials[name] for name in order]
    tokenizer = Tokenizer(models.BPE(unk_token=specials["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_list,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([SAMPLE_TEXT] * 20, trainer=trainer)
    eos_id = tokenizer.token_to_id(specials["eos"])
    if style == "bart":
        bos_id = tokenizer.token_to_id(specials["bos"])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{specials['bos']} $A {specials['eos']}",
            pair=f"{specials['bos']} $A {specials['eos']} $B {specials['eos']}",
            special_tokens=[(specials["bos"], bos_id), (specials["eos"], eos_id)],
        )
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {specials['eos']}",
            pair=f"$A {specials['eos']} $B {specials['eos']}",
            special_tokens=[(specials["eos"], eos_id)],
        )
    kwargs = {f"{name}_token": token for name, token in specials.items()}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=1_000_000, **kwargs)
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(folder)
    return fast


def tiny_config(model_type: str, tokenizer: PreTrainedTokenizerFast, *, window: int = 64, d_model: int = 32):
    """A 2+2-layer config of ``model_type`` whose encoder window is ``window`` tokens."""
    ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    vocab = len(tokenizer)
    if model_type in T5_FAMILIES:
        extra = {"encoder_attention_type": "local", "local_radius": 8} if model_type == "longt5" else {}
        return AutoConfig.for_model(
            model_type, vocab_size=vocab, d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model,
            num_layers=2, num_decoder_layers=2, num_heads=4, decoder_start_token_id=tokenizer.pad_token_id,
            dropout_rate=0.0, **ids, **extra,
        )
    common = dict(
        vocab_size=vocab, d_model=d_model, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        decoder_start_token_id=tokenizer.eos_token_id, **ids,
    )
    if model_type == "led":
        return AutoConfig.for_model(
            "led", max_encoder_position_embeddings=window, max_decoder_position_embeddings=window,
            attention_window=8, bos_token_id=tokenizer.bos_token_id, **common,
        )
    if model_type == "pegasus_x":
        return AutoConfig.for_model("pegasus_x", max_position_embeddings=window, block_size=8, num_global_tokens=4, **common)
    extra = {"bos_token_id": tokenizer.bos_token_id} if model_type in {"bart", "mbart"} else {}
    return AutoConfig.for_model(model_type, max_position_embeddings=window, **common, **extra)


def build_tiny_model(folder: Path, model_type: str = "bart", *, window: int = 64, d_model: int = 32, seed: int = 0) -> Path:
    """Save a tiny random ``model_type`` model and its tokenizer to ``folder``; return the folder."""
    style = "t5" if model_type in T5_FAMILIES else "bart"
    tokenizer = build_tokenizer(folder, style=style)
    torch.manual_seed(seed)
    config = tiny_config(model_type, tokenizer, window=window, d_model=d_model)
    model = AutoModelForSeq2SeqLM.from_config(config)
    model.eval()
    model.save_pretrained(folder)
    if model_type in T5_FAMILIES:
        # T5 has no position limit of its own; the tokenizer says how long a window is.
        config_path = folder / "tokenizer_config.json"
        data = json.loads(config_path.read_text())
        data["model_max_length"] = window
        config_path.write_text(json.dumps(data))
    return folder
