"""The attention function unlimisum registers with transformers: every layer's attention, routed to its cache layer.

transformers computes each layer's queries, keys and values (projections, norms, rotary), updates the
Cache, and then calls the attention function named by ``config._attn_implementation`` from its
``AttentionInterface``. unlimisum registers ``ATTENTION_NAME`` there; within ``reading()`` the model
uses it and the function hands the layer's queries to the ``RetrievalCache`` being read, whose layer
``module.layer_idx`` has just stored this call's keys and values (cache.py). No forward is patched.

No attention mask is built for it (the name is not in transformers' mask interface, which then passes
None; a release that passed the 2-D padding mask instead would have it checked here): the cache layers
know every key's position and mask causally themselves. Each layer checks that the keys it is handed
are those its update() just stored, so a forward that went through another cache fails loudly.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch
from torch import nn

from unlimisum.search import kernels

ATTENTION_NAME = "unlimisum_retrieval"

_ACTIVE: ContextVar = ContextVar("unlimisum_retrieval_cache", default=None)


def retrieval_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask, scaling: float | None = None, dropout: float = 0.0,
                        softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: query [B, H, C, D], key/value [B, G, C, D] ->
    ([B, C, H, D], None)."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError(f"the '{ATTENTION_NAME}' attention runs only while unlimisum reads a prompt")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise RuntimeError("unlimisum's decoder-only retrieval reads unpadded prompts only")
    scaling = scaling if scaling is not None else module.scaling
    return cache.layers[module.layer_idx].attend(query, key, value, scaling, softcap), None


def check_updated(updated: torch.Tensor | None, key: torch.Tensor) -> None:
    """RuntimeError unless ``key`` views the same memory as what the layer's update() just stored: else the
    model's forward went through another cache (generate() dropped or replaced unlimisum's), whose keys the
    retrieval would not see."""
    same = updated is not None and updated.data_ptr() == key.data_ptr() and updated.shape == key.shape \
        and updated.stride() == key.stride()
    if not same:
        raise RuntimeError("the model attended without updating unlimisum's retrieval cache (was it replaced "
                           "during generate()?); its output would be wrong")


def register() -> None:
    """Make ``ATTENTION_NAME`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, retrieval_attention)


@contextmanager
def reading(model: nn.Module, cache) -> Iterator[None]:
    """Within the block, every attention of ``model`` reads through ``cache``; the model is restored after."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    token = _ACTIVE.set(cache)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        model.set_attn_implementation(previous)
        kernels.release_scratch()  # the steps' buffers: not held while the process does something else
