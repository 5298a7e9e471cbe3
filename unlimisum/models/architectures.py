"""One row per model family: where the decoder's attentions live and how they compute.

The retrieval wrapper (unlimiformer/retrieval.py) and the Tensor Cache wrapper (tensor_cache/self_attention.py)
read only what a row tells them, so supporting a new encoder-decoder family means adding a
row here, and nothing else. Decoder-only families have their own rows (decoder_architectures.py);
``architecture_for`` returns either kind, told apart by ``row.kind``.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, ClassVar, ContextManager

import torch
from torch import nn

from unlimisum.models import compat
from unlimisum.models.kept_rows import last_layer_rows
from unlimisum.models.local_attention import blocked_local_attention
from unlimisum.models.decoder_architectures import BY_MODEL_TYPE as _DECODER_ONLY, DecoderOnlyArchitecture
from unlimisum.errors import UnsupportedModelError

# A tokenizer's model_max_length above this is transformers' "no limit" sentinel, not a limit.
_NO_TOKENIZER_LIMIT = 1_000_000


def _bart_like_output(attn_output: torch.Tensor, kwargs: dict) -> tuple:
    return attn_output, None  # (output, attention weights)


def _led_output(attn_output: torch.Tensor, kwargs: dict) -> tuple:
    return attn_output, None, compat.cache_from_kwargs(kwargs)  # (output, weights, cache)


def _t5_output(attn_output: torch.Tensor, kwargs: dict) -> tuple:
    return attn_output, None, None  # (output, position bias, weights): every wrapped layer needs no bias passed on


def _led_encoder_inputs(input_ids: torch.Tensor) -> dict:
    # led-base-book-summary and the LED paper put global attention on the first token of the input.
    global_attention_mask = torch.zeros_like(input_ids)
    global_attention_mask[:, 0] = 1
    return {"global_attention_mask": global_attention_mask}


@dataclass(frozen=True)
class AttentionSite:
    """Where one decoder attention module sits in a layer, and what its parts are called."""

    path: str  # dotted path from a decoder layer to the module
    query: str = "q_proj"
    key: str = "k_proj"
    value: str = "v_proj"
    output: str = "out_proj"
    heads_attribute: str = "num_heads"
    head_dim_attribute: str = "head_dim"

    def locate(self, layer: nn.Module) -> tuple[nn.Module, str]:
        """The module that holds the attention, and the attribute name it is under."""
        *parents, attribute = self.path.split(".")
        parent = layer
        for name in parents:
            parent = parent[int(name)] if name.isdigit() else getattr(parent, name)
        return parent, attribute


_T5_NAMES = dict(query="q", key="k", value="v", output="o", heads_attribute="n_heads",
                 head_dim_attribute="key_value_proj_dim")


@dataclass(frozen=True)
class Architecture:
    """One model family: where its decoder attentions live and how they compute."""

    kind: ClassVar[str] = "seq2seq"
    name: str
    model_types: tuple[str, ...]
    layers_attribute: str  # the decoder's list of layers: decoder.<layers_attribute>
    cross_attention: AttentionSite  # wrapped for retrieval
    self_attention: AttentionSite  # wrapped for the Tensor Cache
    default_scaling: Callable[[int], float]  # head_dim -> scaling, used when a module has no `scaling`
    pack_output: Callable[[torch.Tensor, dict], tuple] = field(repr=False)  # the attention's return tuple
    relative_position_bias: bool  # T5-like: self-attention scores get a relative position bias
    source_length_attribute: str | None  # config attribute with the encoder's maximum source length
    default_source_length: int  # when neither the config nor the tokenizer gives a limit
    encoder_inputs: Callable[[torch.Tensor], dict] | None = field(default=None, repr=False)
    # encoder -> context manager within which the encoder computes the same states faster (wrapped modules)
    fast_encoding: Callable[[nn.Module], ContextManager] | None = field(default=None, repr=False)
    # where the encoder layers' norms sit: "post" (BART) or "pre" (mBART, PEGASUS); either way the last layer
    # may run on a window's kept rows alone (models/kept_rows.py). None: the last layer runs whole.
    encoder_layer_norm: str | None = None

    def encoding(self, encoder: nn.Module) -> ContextManager:
        """The context the whole input is encoded in: ``fast_encoding`` when the family has one."""
        return self.fast_encoding(encoder) if self.fast_encoding is not None else nullcontext()

    @property
    def kept_rows(self) -> Callable[[nn.Module, int, int], ContextManager] | None:
        """(encoder, start, stop) -> the context within which the encoder returns only rows ``[start, stop)``
        of each sequence, its last layer computing those alone; None where the family's last layer runs whole."""
        if self.encoder_layer_norm is None:
            return None
        pre_norm = self.encoder_layer_norm == "pre"
        return lambda encoder, start, stop: last_layer_rows(encoder.layers, start, stop, pre_norm)

    def max_source_length(self, config, tokenizer=None) -> int:
        """The encoder's own window: the config's limit, narrowed by the tokenizer's when it has one."""
        limits = []
        if self.source_length_attribute is not None:
            value = getattr(config, self.source_length_attribute, None)
            if value:
                limits.append(int(value))
        tokenizer_limit = getattr(tokenizer, "model_max_length", None) if tokenizer is not None else None
        if tokenizer_limit and tokenizer_limit < _NO_TOKENIZER_LIMIT:
            limits.append(int(tokenizer_limit))
        return min(limits) if limits else self.default_source_length

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The decoder's layers, in order."""
        return getattr(model.get_decoder(), self.layers_attribute)


def _row(name, model_types, **overrides) -> Architecture:
    bart_like = dict(
        layers_attribute="layers", cross_attention=AttentionSite("encoder_attn"),
        self_attention=AttentionSite("self_attn"), default_scaling=lambda head_dim: head_dim**-0.5,
        pack_output=_bart_like_output, relative_position_bias=False,
        source_length_attribute="max_position_embeddings", default_source_length=1024,
    )
    bart_like.update(overrides)
    return Architecture(name=name, model_types=tuple(model_types), **bart_like)


_T5_ROW = dict(
    layers_attribute="block", cross_attention=AttentionSite("layer.1.EncDecAttention", **_T5_NAMES),
    self_attention=AttentionSite("layer.0.SelfAttention", **_T5_NAMES),
    default_scaling=lambda head_dim: 1.0,  # T5 does not scale its dot products
    pack_output=_t5_output, relative_position_bias=True, source_length_attribute=None,
)

ARCHITECTURES: tuple[Architecture, ...] = (
    _row("BART", ["bart"], encoder_layer_norm="post"),
    _row("mBART", ["mbart"], encoder_layer_norm="pre"),
    _row("PEGASUS", ["pegasus"], encoder_layer_norm="pre"),
    _row("Marian", ["marian"], default_source_length=512, encoder_layer_norm="post"),
    _row("Blenderbot", ["blenderbot"], default_source_length=128, encoder_layer_norm="pre"),
    _row("Blenderbot-small", ["blenderbot-small"], default_source_length=128, encoder_layer_norm="post"),
    _row("PLBART", ["plbart"], encoder_layer_norm="post"),
    _row(
        "LED", ["led"], pack_output=_led_output, source_length_attribute="max_encoder_position_embeddings",
        default_source_length=16384, encoder_inputs=_led_encoder_inputs, fast_encoding=blocked_local_attention,
    ),
    _row("PEGASUS-X", ["pegasus_x"], default_source_length=16384),
    _row("T5", ["t5", "mt5"], default_source_length=512, **_T5_ROW),
    _row("LongT5", ["longt5"], default_source_length=4096, **_T5_ROW),
)

_BY_MODEL_TYPE = {model_type: row for row in ARCHITECTURES for model_type in row.model_types}


def supported_model_types() -> list[str]:
    """Every ``config.model_type`` with a row in a table: encoder-decoder and decoder-only."""
    return sorted({*_BY_MODEL_TYPE, *_DECODER_ONLY})


def _supported() -> str:
    return (", ".join(sorted(_BY_MODEL_TYPE)) + "; decoder-only: " + ", ".join(sorted(_DECODER_ONLY)))


def architecture_named(name: str) -> Architecture | DecoderOnlyArchitecture:
    """The row for a row name ('BART', 'Qwen2') or a model type ('bart', 'qwen2')."""
    for row in (*ARCHITECTURES, *_DECODER_ONLY.values()):
        if name == row.name or name in row.model_types:
            return row
    raise UnsupportedModelError(f"model type '{name}' is not supported; unlimisum supports " + _supported())


def architecture_for(config) -> Architecture | DecoderOnlyArchitecture:
    """The table row for a model config; UnsupportedModelError names the type and the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in _DECODER_ONLY:
        row = _DECODER_ONLY[model_type]
        row.layer_windows(config)  # a model without full-attention layers is refused here, before its weights
        return row
    if not getattr(config, "is_encoder_decoder", False) and model_type not in _BY_MODEL_TYPE:
        raise UnsupportedModelError(
            f"model type '{model_type}' is neither an encoder-decoder model nor a decoder-only family unlimisum "
            "knows; unlimisum supports " + _supported()
        )
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedModelError(f"model type '{model_type}' is not supported; unlimisum supports "
                                    + _supported()) from None
