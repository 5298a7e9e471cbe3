"""Streaming Tensor Cache: the per-layer state and the exact multi-token extend.

State of one decoder layer (SPEC §2), per sequence of the batch:
    ring    the last W + lag key/value pairs, oldest first     keys, values [B, H_kv, m, d]
    A       the L2 memory, fed only by pairs evicted from L1   [B, H_kv, d_k, d_v]
    z       its normaliser (only with normalize_read)          [B, H_kv, d_k]
    seen    tokens processed so far (all rows share it)

Step t (lag 0, canonical): evict token t-W from L1 and write it, A <- λA + η s k̂⊗v (s = 1, or a
fitted write gate's strength for that key, see MemoryParams.write_gate); attend with
softmax over tokens t-W+1..t; read r = q A; output local + γ r. ``extend`` processes a block of
n tokens at once with the closed form of SPEC §2.2, so one call of n tokens equals n calls of one
token (to float rounding), and the chunked parallel form in scan.py is ``extend`` over chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

KEY_EPS = 1e-5  # k̂ = k / (‖k‖₂ + KEY_EPS), as in the published code
READ_EPS = 1.0  # normalised read divides by max(|q·z|, READ_EPS)


@dataclass(frozen=True)
class MemoryParams:
    """The Tensor Cache constants of one layer, as tensors ready for the maths.

    ``gate`` None means the gate is closed exactly: no memory is kept or read, and the output is
    bit-for-bit the sliding-window attention.
    """

    window: int  # W: tokens attended by L1, the current one included
    decay: torch.Tensor  # λ per KV head, in (0, 1)            [H_kv]
    write_rate: torch.Tensor  # η per KV head, in (0, 1)       [H_kv]
    gate: torch.Tensor | None  # γ = sigmoid(g) per query head [H]; None = closed (γ = 0 exactly)
    normalize_keys: bool = True  # write k̂ = k/(‖k‖+1e-5) instead of k (published default)
    normalize_read: bool = False  # divide the read by max(|q·z|, read_eps)
    lag: int = 0  # 0: the evicted token is readable at the step it is evicted (canonical); 1: published-code order
    read_eps: float = READ_EPS  # floor of the read normaliser
    key_eps: float = KEY_EPS  # added to ‖k‖ before dividing
    # weight [d_model, H d_v] of the memory read's own output projection; None: the layer's output projection
    # (tied). Not used by the maths here; the self-attention wrapper applies it.
    projection: torch.Tensor | None = None
    # [H, d_k, d_k]: the memory is read with M_h q instead of q (the local attention keeps q); None: q itself.
    # A pretrained head's queries were shaped for softmax attention, not for a linear read.
    query_map: torch.Tensor | None = None
    # [H_kv, d_k + 1]: weights u and bias c (last column) of a write gate per KV head: each evicted key is
    # written with strength s = 2 sigmoid(u·k/‖k‖ + c), A <- λA + η s k̂⊗v (s = 1 at u = c = 0); None: s = 1.
    # It lets a fitted memory keep what is asked for later and skip the rest: less cross-talk in the linear read.
    write_gate: torch.Tensor | None = None

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if self.lag not in (0, 1):
            raise ValueError(f"lag must be 0 or 1, got {self.lag}")

    @property
    def retained(self) -> int:
        """Tokens the ring keeps between calls: the window, plus one when the write lags a step."""
        return self.window + self.lag

    # Per-head constants shaped to broadcast over [B, heads, n, d] (computed once: a decoding step is short).
    @cached_property
    def decay_view(self) -> torch.Tensor:
        return self.decay[None, :, None, None]  # [1, H_kv, 1, 1]

    @cached_property
    def write_rate_view(self) -> torch.Tensor:
        return self.write_rate[None, :, None, None]  # [1, H_kv, 1, 1]

    @cached_property
    def gate_view(self) -> torch.Tensor:
        return self.gate[None, :, None, None]  # [1, H, 1, 1]


@dataclass
class MemoryState:
    """One layer's retained state; see the module docstring for shapes."""

    keys: torch.Tensor  # ring keys, oldest first                 [B, H_kv, m, d_k]
    values: torch.Tensor  # ring values                           [B, H_kv, m, d_v]
    memory: torch.Tensor | None  # A (None when the gate is closed)  [B, H_kv, d_k, d_v]
    normalizer: torch.Tensor | None  # z (None unless normalize_read)  [B, H_kv, d_k]
    seen: int = 0  # tokens processed so far

    @classmethod
    def empty(cls, batch: int, kv_heads: int, key_dim: int, value_dim: int, params: MemoryParams,
              dtype: torch.dtype, device, memory_dtype: torch.dtype | None = None) -> "MemoryState":
        """A state before the first token. The memory is kept in ``memory_dtype`` (float32 for 16-bit models)."""
        memory_dtype = memory_dtype or _memory_dtype(dtype)
        keys = torch.zeros(batch, kv_heads, 0, key_dim, dtype=dtype, device=device)
        values = torch.zeros(batch, kv_heads, 0, value_dim, dtype=dtype, device=device)
        memory = normalizer = None
        if params.gate is not None:
            memory = torch.zeros(batch, kv_heads, key_dim, value_dim, dtype=memory_dtype, device=device)
            if params.normalize_read:
                normalizer = torch.zeros(batch, kv_heads, key_dim, dtype=memory_dtype, device=device)
        return cls(keys, values, memory, normalizer, 0)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the state retains."""
        return [t for t in (self.keys, self.values, self.memory, self.normalizer) if t is not None]

    def nbytes(self) -> int:
        """Bytes of retained state."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep/reorder batch rows (beam search reorder, batch selection)."""
        self.keys = self.keys.index_select(0, index.to(self.keys.device))
        self.values = self.values.index_select(0, index.to(self.values.device))
        if self.memory is not None:
            self.memory = self.memory.index_select(0, index.to(self.memory.device))
        if self.normalizer is not None:
            self.normalizer = self.normalizer.index_select(0, index.to(self.normalizer.device))

    def repeat_rows(self, repeats: int) -> None:
        """Repeat each batch row ``repeats`` times in place (row r -> rows r*repeats ... )."""
        self.keys = self.keys.repeat_interleave(repeats, dim=0)
        self.values = self.values.repeat_interleave(repeats, dim=0)
        if self.memory is not None:
            self.memory = self.memory.repeat_interleave(repeats, dim=0)
        if self.normalizer is not None:
            self.normalizer = self.normalizer.repeat_interleave(repeats, dim=0)


def _memory_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def normalize_keys(keys: torch.Tensor, eps: float = KEY_EPS) -> torch.Tensor:
    """k̂ = k / (‖k‖₂ + eps) over the last dimension."""
    return keys / (keys.norm(dim=-1, keepdim=True) + eps)


def written_keys(keys: torch.Tensor, params: MemoryParams) -> torch.Tensor:
    """The keys as A receives them: k̂ (or k without normalize_keys), times the write gate's strength.

    keys [B, H_kv, m, d_k] -> [B, H_kv, m, d_k]
    """
    if params.write_gate is None:
        return normalize_keys(keys, params.key_eps) if params.normalize_keys else keys
    unit = normalize_keys(keys, params.key_eps)
    written = unit if params.normalize_keys else keys
    gate = params.write_gate.to(keys.dtype)  # [H_kv, d_k + 1]
    logits = torch.einsum("bhmd,hd->bhm", unit, gate[:, :-1]) + gate[None, :, -1:]  # [B, H_kv, m]
    return written * (2 * torch.sigmoid(logits))[..., None]


def _expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, H_kv, ...] -> [B, H, ...] for grouped-query attention (query head h reads kv head h // G)."""
    kv_heads = x.shape[1]
    return x if kv_heads == heads else x.repeat_interleave(heads // kv_heads, dim=1)


def _per_head(x: torch.Tensor, heads: int) -> torch.Tensor:
    """A per-KV-head vector [H_kv] -> per query head [H]."""
    return x if x.shape[0] == heads else x.repeat_interleave(heads // x.shape[0])


def write_weights(query_positions: torch.Tensor, key_positions: torch.Tensor, params: MemoryParams,
                  written_upto: int) -> torch.Tensor:
    """D[h, t, i] = η_h λ_h^(e_t − i) for keys written to A by the time of query t and not before the block.

    e_t = t − W − lag is the newest token in A at query t; keys at positions <= ``written_upto``
    were written in earlier calls and are read through the carried state instead.
    query_positions [n], key_positions [m] -> [H_kv, n, m]
    """
    newest = query_positions - params.window - params.lag  # e_t [n]
    steps = newest[:, None] - key_positions[None, :]  # [n, m]
    in_memory = (steps >= 0) & (key_positions[None, :] > written_upto)  # [n, m]
    log_decay = torch.log(params.decay)  # [H_kv]
    weights = params.write_rate[:, None, None] * torch.exp(steps.clamp(min=0).to(log_decay.dtype) * log_decay[:, None, None])
    return torch.where(in_memory, weights, torch.zeros((), dtype=weights.dtype, device=weights.device))


def memory_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor,
                query_positions: torch.Tensor, state_memory: torch.Tensor | None, state_normalizer: torch.Tensor | None,
                written_upto: int, params: MemoryParams) -> torch.Tensor:
    """L2 read r_t for a block of queries: carried state decayed to each query, plus the block's new writes.

    q [B, H, n, d_k]; keys, values [B, H_kv, m, d] (ring then block); state memory [B, H_kv, d_k, d_v]
    -> r [B, H, n, d_v] (normalised when params.normalize_read), in the memory's dtype.
    """
    dtype = params.decay.dtype
    heads = q.shape[1]
    q = q.to(dtype)
    keys_hat = written_keys(keys.to(dtype), params)
    weights = _expand_kv_heads(write_weights(query_positions, key_positions, params, written_upto)[None], heads)  # [1, H, n, m]
    scores = torch.matmul(q, _expand_kv_heads(keys_hat, heads).transpose(-1, -2)) * weights  # [B, H, n, m]
    read = torch.matmul(scores, _expand_kv_heads(values.to(dtype), heads))  # [B, H, n, d_v]
    if params.normalize_read:
        qz = scores.sum(-1)  # [B, H, n]
    if written_upto >= 0 and state_memory is not None:
        newest = query_positions - params.window - params.lag  # [n]
        carried = torch.exp((newest - written_upto).to(dtype)[None, :] * torch.log(_per_head(params.decay, heads))[:, None])  # [H, n]
        read = read + carried[None, :, :, None] * torch.matmul(q, _expand_kv_heads(state_memory, heads))
        if params.normalize_read:
            qz = qz + carried[None] * torch.matmul(q, _expand_kv_heads(state_normalizer, heads)[..., None])[..., 0]
    if params.normalize_read:
        read = read / qz.abs().clamp(min=params.read_eps)[..., None]
    return read


def memory_write(keys: torch.Tensor, values: torch.Tensor, key_positions: torch.Tensor, memory: torch.Tensor,
                 normalizer: torch.Tensor | None, written_upto: int, newest: int,
                 params: MemoryParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A and z after writing every key at positions (written_upto, newest]:
    A' = λ^(newest − written_upto) A + Σ η λ^(newest − i) k̂_i ⊗ v_i.

    keys, values [B, H_kv, m, d]; memory [B, H_kv, d_k, d_v] -> (memory', normalizer')
    """
    if newest <= written_upto:
        return memory, normalizer
    dtype = memory.dtype
    keys_hat = written_keys(keys.to(dtype), params)
    weights = write_weights(torch.tensor([newest + params.window + params.lag], device=key_positions.device),
                            key_positions, params, written_upto)[:, 0, :]  # [H_kv, m]
    weighted_keys = keys_hat * weights[None, :, :, None]  # [B, H_kv, m, d_k]
    memory = memory * _carry(params, newest, written_upto)[None, :, None, None] + torch.matmul(
        weighted_keys.transpose(-1, -2), values.to(dtype))  # [B, H_kv, d_k, d_v]
    if normalizer is not None:
        normalizer = normalizer * _carry(params, newest, written_upto)[None, :, None] + weighted_keys.sum(-2)
    return memory, normalizer


def _carry(params: MemoryParams, newest: int, written_upto: int) -> torch.Tensor:
    """λ^(newest − written_upto) per KV head; the carried state is zero when nothing was written yet."""
    if written_upto < 0:
        return torch.zeros_like(params.decay)
    return torch.exp((newest - written_upto) * torch.log(params.decay))


def band_mask(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int) -> torch.Tensor:
    """True where query t may attend key i: t − W < i <= t.  [n], [m] -> [n, m] bool"""
    offset = query_positions[:, None] - key_positions[None, :]
    return (offset >= 0) & (offset < window)


def local_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                    scale: float, score_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention over the allowed keys. q [B, H, n, d], keys/values [B, H_kv, m, d], allowed [n, m]
    (score_bias broadcastable to [B, H, n, m]) -> [B, H, n, d_v]."""
    heads = q.shape[1]
    scores = torch.matmul(q, _expand_kv_heads(keys, heads).transpose(-1, -2)) * scale  # [B, H, n, m]
    if score_bias is not None:
        scores = scores + score_bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), _expand_kv_heads(values, heads))


LocalAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def extend(state: MemoryState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: MemoryParams,
           scale: float, score_bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
           attend: LocalAttention | None = None) -> tuple[torch.Tensor, MemoryState]:
    """Process n new tokens; returns the fused per-head output local + γ r and the new state.

    q [B, H, n, d_k] (not pre-scaled), k [B, H_kv, n, d_k], v [B, H_kv, n, d_v] -> out [B, H, n, d_v]
    ``score_bias(query_positions, key_positions)`` adds e.g. T5's relative position bias to the
    local scores; ``attend(q, keys, values, query_positions, key_positions)`` replaces the local
    softmax attention (the wrapper uses the model's own attention kernel there). The state passed
    in is not modified.
    """
    local, read, new_state = extend_parts(state, q, k, v, params, scale, score_bias, attend)
    return fuse(local, read, params), new_state


def fuse(local: torch.Tensor, read: torch.Tensor | None, params: MemoryParams) -> torch.Tensor:
    """local + γ r per head (in the read's dtype, returned in local's); read None (closed gate): local itself."""
    if read is None:
        return local  # closed gate: exactly the sliding window
    if local.dtype == read.dtype:
        return local + params.gate_view * read
    return (local.to(read.dtype) + params.gate_view.to(read.dtype) * read).to(local.dtype)


def extend_parts(state: MemoryState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: MemoryParams,
                 scale: float, score_bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 attend: LocalAttention | None = None) -> tuple[torch.Tensor, torch.Tensor | None, MemoryState]:
    """``extend`` before the fusion: (local, read, new state).

    local [B, H, n, d_v] (L1 softmax attention, in q's dtype); read [B, H, n, d_v] the L2 read r
    (not gated, in the memory's dtype), None when the gate is closed. For a memory read through a
    projection of its own: y = out_proj(local) + γ · memory_proj(read).
    """
    n, past = q.shape[2], state.seen
    if n == 0:
        empty = q.new_zeros(*q.shape[:3], v.shape[-1])
        return empty, (None if params.gate is None else empty), state
    keys = torch.cat([state.keys, k.to(state.keys.dtype)], dim=2)  # [B, H_kv, m + n, d_k]
    values = torch.cat([state.values, v.to(state.values.dtype)], dim=2)
    m_old = state.keys.shape[2]
    key_positions = torch.arange(past - m_old, past + n, device=q.device)  # [m + n]
    query_positions = torch.arange(past, past + n, device=q.device)  # [n]

    if attend is not None:
        local = attend(q, keys, values, query_positions, key_positions)
    else:
        bias = score_bias(query_positions, key_positions) if score_bias is not None else None
        local = local_attention(q, keys, values, band_mask(query_positions, key_positions, params.window), scale, bias)

    written_upto = max(past - 1 - params.window - params.lag, -1)  # newest position already in A
    newest = past + n - 1 - params.window - params.lag  # newest position in A after this block
    memory, normalizer, read = state.memory, state.normalizer, None
    if params.gate is not None:
        q = memory_queries(q, params)  # the local attention above used the layer's own queries
        if n == 1:  # a decoding step: write the evicted pair, then read (SPEC §2)
            read, memory, normalizer = _single_step(q, keys, values, newest - (past - m_old), memory, normalizer,
                                                    newest >= 0, params)
        else:
            read = memory_read(q, keys, values, key_positions, query_positions, memory, normalizer, written_upto, params)
            memory, normalizer = memory_write(keys, values, key_positions, memory, normalizer, written_upto, newest, params)

    keep = min(past + n, params.retained)
    new_state = MemoryState(keys[:, :, -keep:], values[:, :, -keep:], memory, normalizer, past + n)
    return local, read, new_state


def memory_queries(q: torch.Tensor, params: MemoryParams) -> torch.Tensor:
    """The queries the memory is read with: q [B, H, n, d_k] -> M_h q [B, H, n, d_k] (q when no map)."""
    if params.query_map is None:
        return q
    return torch.einsum("bhnd,hed->bhne", q, params.query_map.to(q.dtype))


def _single_step(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, evicted: int, memory: torch.Tensor,
                 normalizer: torch.Tensor | None, writes: bool, params: MemoryParams):
    """One token: A <- λA + η k̂_e ⊗ v_e for the pair at index ``evicted`` of keys/values (when ``writes``), then
    r = q A (/ max(|q·z|, eps)). Equal to memory_read + memory_write for n = 1, in a fraction of the operations.

    q [B, H, 1, d_k]; keys, values [B, H_kv, m, d] -> (r [B, H, 1, d_v], A, z)
    """
    dtype, heads = memory.dtype, q.shape[1]
    cast = (lambda x: x) if q.dtype == dtype else (lambda x: x.to(dtype))  # noqa: E731  (a 16-bit model's float32 memory)
    if writes:
        key = cast(keys[:, :, evicted:evicted + 1])  # [B, H_kv, 1, d_k]
        key = written_keys(key, params) * params.write_rate_view  # η s k̂
        value = cast(values[:, :, evicted:evicted + 1])  # [B, H_kv, 1, d_v]
        memory = memory * params.decay_view + key.transpose(-1, -2) * value  # [B, H_kv, d_k, d_v]
        if normalizer is not None:
            normalizer = normalizer * params.decay_view[..., 0] + key[:, :, 0]  # [B, H_kv, d_k]
    q = cast(q)
    read = torch.matmul(q, _expand_kv_heads(memory, heads))  # [B, H, 1, d_v]
    if params.normalize_read:
        qz = torch.matmul(q, _expand_kv_heads(normalizer, heads)[..., None])  # [B, H, 1, 1]
        read = read / qz.abs().clamp(min=params.read_eps)
    return read, memory, normalizer


def settled_memory(state: MemoryState, params: MemoryParams) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(A, z) holding every token that has left L1 (positions <= seen − 1 − W).

    With lag 0 that is the state itself. With lag 1 the newest evicted pair is still pending in
    the ring (it is written at the next step, after that step's read); this applies the pending
    write, which is what the published code holds at the end of a step.
    """
    if params.lag == 0 or state.memory is None:
        return state.memory, state.normalizer
    past = state.seen
    written_upto = max(past - 1 - params.window - params.lag, -1)
    newest = past - 1 - params.window
    positions = torch.arange(past - state.keys.shape[2], past, device=state.keys.device)
    return memory_write(state.keys, state.values, positions, state.memory, state.normalizer, written_upto, newest, params)
