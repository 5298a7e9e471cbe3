"""Tensor Cache: bounded memory for the decoder's self-attention (seeds/tensor-cache.md, SPEC).

L1: a ring of the last W key/value pairs with exact softmax attention. L2: per head a matrix
A (d_k x d_v) written only by pairs evicted from L1, A <- λA + η k̂⊗v, read as q A and fused
through the output projection with a gate, y = local + sigmoid(g)·r.

    scan.py       tensor_cache_attention (exact parallel form), ..._chunked (linear in T)
    streaming.py  MemoryParams, MemoryState, extend (n tokens == n single steps)
    cache.py      TensorCache (a transformers Cache), retained_bytes
    self_attention.py  TensorCacheSelfAttention wrapper, one row per family for the self-attention
    session.py    tensor_cache(model, architecture, settings) context manager
    params.py     fitted λ, η, g and their safetensors file
    fit.py        fit_tensor_cache: learn λ, η, g of a frozen pretrained model
"""

from unlimisum.tensor_cache.cache import TensorCache, TensorCacheLayer, retained_bytes
from unlimisum.tensor_cache.params import TensorCacheParams, load_params, save_params
from unlimisum.tensor_cache.scan import tensor_cache_attention, tensor_cache_attention_chunked
from unlimisum.tensor_cache.session import TensorCacheSession, TensorCacheSettings, tensor_cache
from unlimisum.tensor_cache.streaming import MemoryParams, MemoryState, extend

__all__ = [
    "MemoryParams", "MemoryState", "TensorCache", "TensorCacheLayer", "TensorCacheParams", "TensorCacheSession",
    "TensorCacheSettings", "extend", "load_params", "retained_bytes", "save_params", "tensor_cache",
    "tensor_cache_attention", "tensor_cache_attention_chunked",
]
