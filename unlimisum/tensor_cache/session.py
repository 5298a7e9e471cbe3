"""``with tensor_cache(model, architecture, settings) as session:`` — Tensor Cache for generate().

    with tensor_cache(model, "bart", TensorCacheSettings(window=64, params="tc.safetensors")) as session:
        output = model.generate(..., **session.generate_kwargs())   # a fresh cache per call
        stats = session.retained_bytes()                             # of the last cache

Installs the self-attention wrappers (unless already there), builds one fresh Tensor Cache per
generate() call, and leaves the model as it found it. Without a parameter file the gate is
closed exactly: bounded sliding-window attention, no L2 memory (``session.message`` says so).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterator

import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache

from unlimisum.models import compat
from unlimisum.models.architectures import Architecture
from unlimisum.errors import ConfigError
from unlimisum.tensor_cache.self_attention import resolve_architecture, wrapped_self_attention
from unlimisum.tensor_cache.cache import TensorCache, retained_bytes
from unlimisum.tensor_cache.params import TensorCacheParams, closed_layer_params, load_params
from unlimisum.tensor_cache.streaming import MemoryParams

DEFAULT_WINDOW = 256  # W when neither the settings nor a fitted file give one: a few sentences of summary


@dataclass(frozen=True)
class TensorCacheSettings:
    """How the decoder's self-attention memory is bounded."""

    # L1 window W in tokens (the current one included); None: the W the parameter file was fitted with,
    # else DEFAULT_WINDOW.
    window: int | None = None
    # Fitted λ, η, g: a file from `unlimisum tc fit` (or loaded TensorCacheParams). None closes the gate
    # exactly: plain sliding-window attention over the last W tokens.
    params: str | Path | TensorCacheParams | None = None

    def __post_init__(self):
        if self.window is not None and self.window < 1:
            raise ConfigError(f"--tc-window must be at least 1, got {self.window}")

    @property
    def gate_closed(self) -> bool:
        """True when no fitted parameters are given: the memory gate is closed (sliding window)."""
        return self.params is None

    @cached_property
    def loaded_params(self) -> TensorCacheParams | None:
        """The fitted parameters, read from the file on first use only (every generate() call needs them)."""
        if self.params is None or isinstance(self.params, TensorCacheParams):
            return self.params
        return load_params(self.params)


def effective_window(settings: TensorCacheSettings) -> int:
    """W under ``settings``: the explicit window, else the one the parameter file was fitted with, else the default."""
    if settings.window is not None:
        return settings.window
    params = settings.loaded_params
    return params.window if params is not None and params.window > 0 else DEFAULT_WINDOW


def describe(settings: TensorCacheSettings, window: int) -> str:
    """One line for the CLI: what the decoder's self-attention does under these settings."""
    if settings.gate_closed:
        return (
            f"Tensor Cache: no parameter file, gate closed: the decoder attends to its last {window} tokens "
            "(sliding window); fit one with `unlimisum tc fit` to add the L2 memory"
        )
    params = settings.loaded_params
    read = "its own projection" if params.memory_projection is not None else "the output projection (tied)"
    extras = [name for name, present in (("query maps", params.memory_query_map is not None),
                                         ("write gates", params.memory_write_gate is not None)) if present]
    fitted = f", with {' and '.join(extras)}" if extras else ""
    return f"Tensor Cache: window {window} tokens + L2 memory from {settings.params}, read through {read}{fitted}"


class TensorCacheSession:
    """Fresh caches for generate() and the retained bytes of the last one."""

    def __init__(self, layer_params: list[MemoryParams], settings: TensorCacheSettings, window: int,
                 wrappers: list[nn.Module], cache_argument: str = "cache"):
        self.layer_params = layer_params
        self.cache_argument = cache_argument  # generate()'s name for the cache: `cache` (5.x), `past_key_values` before
        self.settings = settings
        self.window = window
        self.wrappers = wrappers
        self.message = describe(settings, window)
        self.last_cache: EncoderDecoderCache | None = None

    @property
    def gate_closed(self) -> bool:
        return self.settings.gate_closed

    def new_cache(self) -> EncoderDecoderCache:
        """An empty cache for one generate() call (TensorCache for self-attention, DynamicCache for cross)."""
        self.last_cache = TensorCache(self.layer_params).for_generate()
        return self.last_cache

    def generate_kwargs(self) -> dict:
        """Keyword arguments to add to ``model.generate(...)``: a fresh cache under the name generate() takes."""
        return {self.cache_argument: self.new_cache()}

    def retained_bytes(self) -> int:
        """Bytes of self-attention state the last cache retains (0 before any)."""
        return retained_bytes(self.last_cache) if self.last_cache is not None else 0


def model_layer_params(model: nn.Module, wrappers: list[nn.Module], settings: TensorCacheSettings) -> tuple[list[MemoryParams], int]:
    """Per-layer MemoryParams for ``model`` under ``settings``, and the window used."""
    params = settings.loaded_params
    window = effective_window(settings)
    heads, head_dim = wrappers[0].num_heads, wrappers[0].head_dim
    kv_heads = wrappers[0]._projection("key").out_features // head_dim
    dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    device = next(model.parameters()).device
    if params is None:
        return closed_layer_params(len(wrappers), kv_heads, window, dtype, device), window
    model_type = getattr(model.config, "model_type", "")
    source = settings.params if not isinstance(settings.params, TensorCacheParams) else None
    if params.model_type and params.model_type != model_type:
        raise ConfigError(
            f"the Tensor Cache file was fitted on a {params.model_type} model ({params.model_name or 'unnamed'}), "
            f"not on this {model_type} model; fit one for it with `unlimisum tc fit`",
            source=source,
        )
    if params.num_layers != len(wrappers) or params.decay_logit.shape[1] != kv_heads:
        raise ConfigError(
            f"the Tensor Cache file was fitted for {params.num_layers} layers x {params.decay_logit.shape[1]} heads "
            f"({params.model_type or 'unknown model'}); this {model_type} decoder has {len(wrappers)} x {kv_heads}",
            source=source,
        )
    if params.memory_projection is not None:
        expected = tuple(wrappers[0]._projection("output").weight.shape)
        if tuple(params.memory_projection.shape[1:]) != expected:
            raise ConfigError(
                f"the Tensor Cache file's memory projection is {tuple(params.memory_projection.shape[1:])} per layer; "
                f"this {model_type} decoder's output projection is {expected}",
                source=source,
            )
    if params.memory_query_map is not None and tuple(params.memory_query_map.shape[1:]) != (heads, head_dim, head_dim):
        raise ConfigError(
            f"the Tensor Cache file's query map is {tuple(params.memory_query_map.shape[1:])} per layer; "
            f"this {model_type} decoder has {heads} heads of {head_dim}",
            source=source,
        )
    if params.memory_write_gate is not None and tuple(params.memory_write_gate.shape[1:]) != (kv_heads, head_dim + 1):
        raise ConfigError(
            f"the Tensor Cache file's write gate is {tuple(params.memory_write_gate.shape[1:])} per layer; "
            f"this {model_type} decoder has {kv_heads} key heads of {head_dim} (expected ({kv_heads}, {head_dim + 1}))",
            source=source,
        )
    return params.layer_params(heads, window, dtype, device), window


@contextmanager
def tensor_cache(model: nn.Module, architecture: Architecture | str,
                 settings: TensorCacheSettings = TensorCacheSettings()) -> Iterator[TensorCacheSession]:
    """Within the block, ``session.generate_kwargs()`` makes generate() use a Tensor Cache.

    ``architecture``: the model's row from unlimisum.models.architectures, or its model_type. Works
    together with the retrieval cross-attention (install that as usual), with greedy and beam
    search and batches. Leaves the model as it found it.
    """
    row = resolve_architecture(architecture)
    with wrapped_self_attention(model, row) as wrappers:
        layer_params, window = model_layer_params(model, wrappers, settings)
        yield TensorCacheSession(layer_params, settings, window, wrappers, compat.cache_argument(model))
