"""Tensor Cache over a whole sequence at once (SPEC §4): the exact eviction-conditioned form.

At position t, L1 holds tokens t-W+1..t (softmax attention) and L2 holds exactly the tokens
i <= e_t = t - W - lag, each written once, decayed once per later write:

    D[h, t, i] = η_h λ_h^(e_t − i)  if i <= e_t, else 0
    R = ((Q K̂ᵀ) ⊙ D) V,    out = SWA_W(Q, K, V) + γ R

This is NOT the chunk-mean shortcut (which mixes keys and values of different tokens); it
equals token-by-token streaming to float rounding. ``tensor_cache_attention`` is the dense
O(T²) form (what fitting uses for T of a few thousand); ``tensor_cache_attention_chunked`` is
linear in T: the streaming extend of streaming.py applied chunk by chunk.
"""

from __future__ import annotations

from typing import Callable

import torch

from unlimisum.tensor_cache.streaming import (
    KEY_EPS, READ_EPS, MemoryParams, MemoryState, band_mask, extend_parts, fuse, local_attention, memory_queries,
    memory_read,
)


def _params(window, decay, write_rate, gate, normalize_keys, normalize_read, lag, read_eps, key_eps, dtype, heads,
            query_map=None, write_gate=None):
    decay = torch.as_tensor(decay, dtype=dtype)
    write_rate = torch.as_tensor(write_rate, dtype=dtype)
    if gate is not None:
        gate = torch.sigmoid(torch.as_tensor(gate, dtype=dtype)).expand(heads) if torch.as_tensor(gate).dim() == 0 \
            else torch.sigmoid(torch.as_tensor(gate, dtype=dtype))
    return MemoryParams(
        window=int(window), decay=decay, write_rate=write_rate, gate=gate, normalize_keys=normalize_keys,
        normalize_read=normalize_read, lag=lag, read_eps=read_eps, key_eps=key_eps, query_map=query_map,
        write_gate=write_gate,
    )


def _batched(x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """[..., T, H, d] -> [B, H, T, d] and the leading shape to restore."""
    lead = x.shape[:-3]
    return x.reshape(-1, *x.shape[-3:]).transpose(1, 2), lead


def _unbatched(x: torch.Tensor, lead: tuple) -> torch.Tensor:
    """[B, H, T, d] -> [..., T, H, d]."""
    return x.transpose(1, 2).reshape(*lead, x.shape[2], x.shape[1], x.shape[3])


def tensor_cache_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, decay, write_rate, gate,
    normalize_keys: bool = True, normalize_read: bool = False, *, scale: float | None = None, lag: int = 0,
    read_eps: float = READ_EPS, key_eps: float = KEY_EPS, score_bias: torch.Tensor | None = None,
    return_parts: bool = False, query_map: torch.Tensor | None = None, write_gate: torch.Tensor | None = None,
):
    """Fused Tensor Cache attention for a whole sequence, per head, before the output projection.

    q [..., T, H, d_k] (post-RoPE, not pre-scaled); k [..., T, H_kv, d_k]; v [..., T, H_kv, d_v].
    ``decay`` λ and ``write_rate`` η: values in (0, 1) per KV head [H_kv] (tensors keep gradients);
    ``gate``: gate logits g, per query head [H] or one scalar, γ = sigmoid(g); None closes the gate
    exactly (γ = 0: the output is the sliding-window attention). ``window`` W counts the current
    token. ``scale`` defaults to d_k^-1/2; ``score_bias`` (broadcastable to [B, H, T, T]) is added to
    the local scores (T5 relative positions); ``query_map`` [H, d_k, d_k] reads the memory with M_h q;
    ``write_gate`` [H_kv, d_k + 1] scales each written key (MemoryParams.write_gate).
    Returns out [..., T, H, d_v], or with ``return_parts`` (out, local, memory read).
    """
    heads = q.shape[-2]
    dtype = q.dtype
    params = _params(window, decay, write_rate, gate, normalize_keys, normalize_read, lag, read_eps, key_eps, dtype, heads,
                     query_map, write_gate)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (qb, lead), (kb, _), (vb, _) = _batched(q), _batched(k), _batched(v)  # [B, H, T, d]
    positions = torch.arange(q.shape[-3], device=q.device)  # [T]
    local = local_attention(qb, kb, vb, band_mask(positions, positions, params.window), scale, score_bias)
    if params.gate is None:
        read = torch.zeros_like(local)
        out = local
    else:
        read = memory_read(memory_queries(qb, params), kb, vb, positions, positions, None, None, -1, params)  # [B, H, T, d_v]
        out = local + params.gate[None, :, None, None] * read
    if return_parts:
        return _unbatched(out, lead), _unbatched(local, lead), _unbatched(read, lead)
    return _unbatched(out, lead)


def tensor_cache_attention_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, decay, write_rate, gate,
    normalize_keys: bool = True, normalize_read: bool = False, *, chunk: int = 64, scale: float | None = None,
    lag: int = 0, read_eps: float = READ_EPS, key_eps: float = KEY_EPS, return_state: bool = False,
    query_map: torch.Tensor | None = None, write_gate: torch.Tensor | None = None,
    score_bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, return_parts: bool = False,
):
    """The same result as ``tensor_cache_attention``, in time and memory linear in T.

    Runs the exact streaming extend over chunks of ``chunk`` tokens: each chunk reads the carried
    state A decayed to each of its queries plus its own newly evicted tokens (SPEC §4, chunkwise
    scan). Differentiable. ``score_bias(query_positions, key_positions)`` adds e.g. T5's relative
    position bias to the local scores. Returns out, or with ``return_parts`` (out, local, memory
    read); with ``return_state`` the final MemoryState (A, z, ring) comes last.
    """
    heads = q.shape[-2]
    params = _params(window, decay, write_rate, gate, normalize_keys, normalize_read, lag, read_eps, key_eps, q.dtype, heads,
                     query_map, write_gate)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    (qb, lead), (kb, _), (vb, _) = _batched(q), _batched(k), _batched(v)  # [B, H, T, d]
    state = MemoryState.empty(qb.shape[0], kb.shape[1], kb.shape[-1], vb.shape[-1], params, q.dtype, q.device)
    locals_, reads = [], []
    for start in range(0, qb.shape[2], chunk):
        block = slice(start, start + chunk)
        local, read, state = extend_parts(state, qb[:, :, block], kb[:, :, block], vb[:, :, block], params, scale,
                                          score_bias)  # [B, H, n, d_v] each
        locals_.append(local)
        reads.append(read)
    local = torch.cat(locals_, dim=2)  # [B, H, T, d_v]
    read = torch.zeros_like(local) if params.gate is None else torch.cat(reads, dim=2)
    out = fuse(local, None if params.gate is None else read, params)
    result = (_unbatched(out, lead), _unbatched(local, lead), _unbatched(read, lead)) if return_parts \
        else (_unbatched(out, lead),)
    return (*result, state) if return_state else (result if return_parts else result[0])
