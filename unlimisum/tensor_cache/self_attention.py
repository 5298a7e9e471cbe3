"""TensorCacheSelfAttention: wraps a decoder self-attention module to read and write a Tensor Cache.

The wrapper holds the original module as the child ``original`` and reuses its projections; it
is installed and removed with setattr and refuses to stack (the same rules as the retrieval
cross-attention). It acts only

* when the cache passed to the layer holds a TensorCache (streaming, inside generate()), or
* when ``parallel`` is set (fitting: a whole teacher-forced sequence, no cache);

otherwise it is the original module, unchanged. Local attention goes through the model's own
attention kernel (eager/sdpa, with T5's relative position bias for the actual positions), so
with the gate closed the result is bit-for-bit the model with a sliding-window cache.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from unlimisum.models import compat, wrapping
from unlimisum.models.architectures import Architecture, architecture_named
from unlimisum.tensor_cache.cache import find_tensor_cache
from unlimisum.tensor_cache.scan import tensor_cache_attention, tensor_cache_attention_chunked
from unlimisum.tensor_cache.streaming import band_mask


def resolve_architecture(architecture: Architecture | str) -> Architecture:
    """An Architecture row, given the row itself, its name ('BART') or a model_type ('bart')."""
    return architecture if isinstance(architecture, Architecture) else architecture_named(architecture)


@dataclass
class ParallelMemory:
    """What the wrapper needs to run a whole sequence with the parallel form (fitting)."""

    window: int
    decay: torch.Tensor  # λ per KV head [H_kv] (may require grad)
    write_rate: torch.Tensor  # η per KV head [H_kv]
    gate_logit: torch.Tensor | None  # g, [] or [H]; None: gate closed (sliding window baseline)
    normalize_keys: bool = True
    normalize_read: bool = True
    projection: torch.Tensor | None = None  # [d_model, H d_v] the memory read's own projection (may require grad); None: tied
    query_map: torch.Tensor | None = None  # [H, dh, dh]: the memory is read with M_h q (may require grad); None: q
    write_gate: torch.Tensor | None = None  # [H_kv, dh + 1]: strength of each written key (may require grad); None: 1
    chunk: int | None = None  # the exact chunked form over blocks of this many tokens (linear in T); None: dense O(T²)


def memory_output(read: torch.Tensor, gate: torch.Tensor, projection: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """γ · memory_projection(r): read [B, H, n, d_v], gate γ per query head [H], projection [d_model, H d_v]
    -> [B, n, d_model] in ``dtype`` (the product is taken in the read's dtype, float32 for 16-bit models)."""
    rows, heads, steps, _ = read.shape
    gated = read * gate.to(read.dtype)[None, :, None, None]  # [B, H, n, d_v]
    merged = gated.transpose(1, 2).reshape(rows, steps, -1)  # [B, n, H d_v]
    return nn.functional.linear(merged, projection.to(read.dtype)).to(dtype)


class TensorCacheSelfAttention(nn.Module):
    """Wraps one decoder self-attention module; the original stays as the child ``original``."""

    def __init__(self, original: nn.Module, architecture: Architecture, layer_index: int,
                 bias_source: nn.Module | None = None):
        super().__init__()
        self.original = original
        self.architecture = architecture
        self.layer_index = layer_index
        site = architecture.self_attention
        self.num_heads = getattr(original, site.heads_attribute)
        self.head_dim = getattr(original, site.head_dim_attribute)
        self.scaling = float(getattr(original, "scaling", architecture.default_scaling(self.head_dim)))
        self.parallel: ParallelMemory | None = None
        # T5: the module holding the relative position table (the first layer's); not a child, to keep
        # the module tree unchanged.
        self.__dict__["_bias_source"] = bias_source
        module = sys.modules.get(type(original).__module__)
        self._eager = getattr(module, "eager_attention_forward", None)  # None: the family has no attention interface

    def _projection(self, role: str) -> nn.Linear:
        return getattr(self.original, getattr(self.architecture.self_attention, role))

    def forward(self, *args, **kwargs):
        hidden_states = args[0] if args else kwargs["hidden_states"]
        cache = compat.cache_from_kwargs(kwargs)
        tensor_cache = find_tensor_cache(cache)
        if tensor_cache is not None:
            mask = kwargs.get("attention_mask", kwargs.get("mask"))
            return self.architecture.pack_output(self.stream(hidden_states, tensor_cache, mask), kwargs)
        if self.parallel is not None:
            return self.architecture.pack_output(self.whole_sequence(hidden_states, self.parallel), kwargs)
        return self.original(*args, **kwargs)

    def _qkv(self, hidden_states: torch.Tensor):
        rows, steps, _ = hidden_states.shape
        shape = (rows, steps, -1, self.head_dim)
        q = self._projection("query")(hidden_states).view(shape).transpose(1, 2)  # [B, H, n, dh]
        k = self._projection("key")(hidden_states).view(shape).transpose(1, 2)  # [B, H_kv, n, dh]
        v = self._projection("value")(hidden_states).view(shape).transpose(1, 2)  # [B, H_kv, n, dh]
        return q, k, v

    def position_bias(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor | None:
        """T5 relative position bias for the actual positions: [n], [m] -> [1, H, n, m] (None for other families)."""
        source = self.__dict__["_bias_source"]
        if source is None:
            return None
        relative = key_positions[None, :] - query_positions[:, None]  # [n, m]
        buckets = source._relative_position_bucket(
            relative, bidirectional=False, num_buckets=source.relative_attention_num_buckets,
            max_distance=source.relative_attention_max_distance,
        )
        return source.relative_attention_bias(buckets).permute(2, 0, 1).unsqueeze(0)  # [1, H, n, m]

    def stream(self, hidden_states: torch.Tensor, cache, given_mask) -> torch.Tensor:
        """One decoding call with the TensorCache: [B, n, d_model] -> [B, n, d_model]."""
        layer = cache.layers[self.layer_index]
        q, k, v = self._qkv(hidden_states)
        attend = _LocalAttention(self, layer.params.window, given_mask)
        rows, steps = hidden_states.shape[:2]
        merge = lambda heads: heads.transpose(1, 2).reshape(rows, steps, -1).to(hidden_states.dtype)  # noqa: E731
        if layer.params.projection is None:  # tied: out_proj(local + γ r)
            return self._projection("output")(merge(layer.extend(q, k, v, self.scaling, attend=attend)))
        local, read = layer.extend_parts(q, k, v, self.scaling, attend=attend)  # [B, H, n, dh]
        out = self._projection("output")(merge(local))
        if read is None:
            return out
        return out + memory_output(read, layer.params.gate, layer.params.projection, out.dtype)

    def whole_sequence(self, hidden_states: torch.Tensor, memory: ParallelMemory) -> torch.Tensor:
        """The parallel form over a whole sequence (no cache): [B, T, d_model] -> [B, T, d_model]."""
        q, k, v = (x.transpose(1, 2) for x in self._qkv(hidden_states))  # [B, T, H, dh]
        arguments = (q, k, v, memory.window, memory.decay, memory.write_rate, memory.gate_logit, memory.normalize_keys,
                     memory.normalize_read)
        options = dict(scale=self.scaling, return_parts=True, query_map=memory.query_map, write_gate=memory.write_gate)
        if memory.chunk is None:
            positions = torch.arange(q.shape[1], device=q.device)
            out, local, read = tensor_cache_attention(*arguments, score_bias=self.position_bias(positions, positions),
                                                      **options)  # [B, T, H, dh] each
        else:
            out, local, read = tensor_cache_attention_chunked(*arguments, chunk=memory.chunk,
                                                              score_bias=self.position_bias, **options)
        rows, steps = hidden_states.shape[:2]
        output = self._projection("output")
        if memory.projection is None or memory.gate_logit is None:  # tied, or the gate closed
            return output(out.reshape(rows, steps, -1).to(hidden_states.dtype))
        gate = torch.sigmoid(memory.gate_logit.to(read.dtype)).expand(self.num_heads)  # [H]
        projected = memory_output(read.transpose(1, 2), gate, memory.projection, hidden_states.dtype)
        return output(local.reshape(rows, steps, -1).to(hidden_states.dtype)) + projected


class _LocalAttention:
    """Local (L1) attention of one call through the model's own attention kernel."""

    def __init__(self, wrapper: TensorCacheSelfAttention, window: int, given_mask):
        self.wrapper, self.window, self.given_mask = wrapper, window, given_mask

    def __call__(self, q, keys, values, query_positions, key_positions) -> torch.Tensor:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        wrapper, window, given = self.wrapper, self.window, self.given_mask
        steps = q.shape[2]
        visible = min(keys.shape[2], window - 1 + steps)  # the keys any query of the block may see
        keys, values, key_positions = keys[:, :, -visible:], values[:, :, -visible:], key_positions[-visible:]
        bias = wrapper.position_bias(query_positions, key_positions)  # [1, H, n, m] or None
        if wrapper._eager is None:  # a family without an attention interface (LED): plain softmax
            from unlimisum.tensor_cache.streaming import local_attention

            return local_attention(q, keys, values, band_mask(query_positions, key_positions, window), wrapper.scaling, bias)
        if steps == 1 and (given is None or given.shape[-1] == visible):
            mask = given  # what the decoder built from get_mask_sizes: the same as for a sliding-window cache
        else:
            allowed = band_mask(query_positions, key_positions, window)  # [n, m]
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(~allowed, torch.finfo(q.dtype).min)[None, None]  # [1, 1, n, m]
        original = wrapper.original
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(original.config._attn_implementation, wrapper._eager)
        extra = {"position_bias": bias} if wrapper.architecture.relative_position_bias else {}
        out, _ = interface(original, q, keys, values, mask, dropout=0.0, scaling=wrapper.scaling, **extra)
        return out.transpose(1, 2)  # [B, n, H, dh] -> [B, H, n, dh]


def _wrap(model: nn.Module, row: Architecture):
    """The wrapper factory; T5-like wrappers share the first layer's relative position table."""
    bias_source = None
    if row.relative_position_bias:
        for layer in row.decoder_layers(model):
            parent, attribute = row.self_attention.locate(layer)
            module = getattr(parent, attribute)
            module = getattr(module, "original", module)
            if getattr(module, "has_relative_attention_bias", False):
                bias_source = module
                break
    return lambda original, index: TensorCacheSelfAttention(original, row, index, bias_source)


def install(model: nn.Module, architecture: Architecture | str) -> list[TensorCacheSelfAttention]:
    """Wrap every decoder self-attention of ``model``; refuse to wrap twice."""
    row = resolve_architecture(architecture)
    return wrapping.install(model, row, row.self_attention, TensorCacheSelfAttention, _wrap(model, row))


def uninstall(model: nn.Module, architecture: Architecture | str) -> None:
    """Put every original self-attention module back."""
    row = resolve_architecture(architecture)
    wrapping.uninstall(model, row, row.self_attention, TensorCacheSelfAttention)


def installed_wrappers(model: nn.Module, architecture: Architecture | str) -> list[TensorCacheSelfAttention]:
    """The wrappers currently installed on ``model`` (empty when none)."""
    row = resolve_architecture(architecture)
    return wrapping.installed(model, row, row.self_attention, TensorCacheSelfAttention)


@contextmanager
def wrapped_self_attention(model: nn.Module, architecture: Architecture | str) -> Iterator[list[TensorCacheSelfAttention]]:
    """Within the block the decoder's self-attention is wrapped (installed here if not yet there)."""
    row = resolve_architecture(architecture)
    with wrapping.wrapped(model, row, row.self_attention, TensorCacheSelfAttention, _wrap(model, row)) as wrappers:
        try:
            yield wrappers
        finally:
            for wrapper in wrappers:
                wrapper.parallel = None
