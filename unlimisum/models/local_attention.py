"""LED's encoder self-attention (Longformer's sliding window plus global tokens), computed in blocks.

transformers' implementation builds chunked, overlapping copies of the queries and keys and a
[B, S, H, 2w+1] score tensor (w = half the attention window): on a CPU that is three quarters of
LED's encoding time and most of its memory (bench/led_encoding.py). Here each block of queries
is scored against the keys around it (and the global keys) in one matmul, masked to the band
|i - j| <= w, under one softmax: the same numbers (tests/test_local_attention.py).

``BlockedLocalSelfAttention`` wraps the original module (its projections are the original's) and
gives it back where its own output is asked for: attention weights, or training (dropout).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


class BlockedLocalSelfAttention(nn.Module):
    """An ``LEDEncoderSelfAttention`` computed block by block; the original is the child ``original``."""

    def __init__(self, original: nn.Module, query_block: int | None = None):
        super().__init__()
        self.original = original
        # queries scored at a time; None: a quarter of the one-sided window w. A block of b queries reads
        # b + 2w keys, b / 2w of them outside every query's band; smaller blocks waste less but pay more steps.
        self.query_block = query_block

    def forward(self, hidden_states, attention_mask=None, is_index_masked=None, is_index_global_attn=None,
                is_global_attn=None, output_attentions=False):
        """The original's signature and return tuple: (attention output [B, S, d],)."""
        if output_attentions or self.original.training or attention_mask is None:
            return self.original(hidden_states, attention_mask=attention_mask, is_index_masked=is_index_masked,
                                 is_index_global_attn=is_index_global_attn, is_global_attn=is_global_attn,
                                 output_attentions=output_attentions)
        original = self.original
        batch, length, d_model = hidden_states.shape
        heads, head_dim = original.num_heads, original.head_dim
        half = original.one_sided_attn_window_size  # w: a token attends to w tokens on each side

        def split(x):  # [B, S, d] -> [B, H, S, dh], contiguous
            return x.view(batch, -1, heads, head_dim).transpose(1, 2).contiguous()

        q = split(original.query(hidden_states) / math.sqrt(head_dim))
        k, v = split(original.key(hidden_states)), split(original.value(hidden_states))
        windowed = attention_mask == 0  # [B, S]: keys of the sliding window (not padding, not global)
        if is_global_attn:  # every query also attends to the global tokens, through the local projections
            positions, global_valid = _global_positions(is_index_global_attn)  # [B, G] each
            gather = positions[:, None, :, None].expand(-1, heads, -1, head_dim)
            global_keys, global_values = k.gather(2, gather), v.gather(2, gather)  # [B, H, G, dh]
        else:
            positions = global_valid = None
            global_keys = global_values = q.new_empty(batch, heads, 0, head_dim)
            global_valid = windowed.new_empty(batch, 0)
        lowest = torch.finfo(q.dtype).min
        block = self.query_block or max(1, half // 4)
        out = torch.empty_like(q)  # [B, H, S, dh]
        for start in range(0, length, block):
            end = min(length, start + block)
            first, last = max(0, start - half), min(length, end + half)
            keys = torch.cat([global_keys, k[:, :, first:last]], dim=2)  # [B, H, G + kk, dh]
            values = torch.cat([global_values, v[:, :, first:last]], dim=2)
            distance = (torch.arange(first, last, device=q.device)[None, :]
                        - torch.arange(start, end, device=q.device)[:, None]).abs()  # [b, kk]
            allowed = torch.cat([global_valid[:, None, :].expand(-1, end - start, -1),
                                 (distance <= half)[None] & windowed[:, None, first:last]], dim=2)  # [B, b, G + kk]
            scores = (q[:, :, start:end] @ keys.transpose(-1, -2)).masked_fill_(~allowed[:, None], lowest)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)  # [B, H, b, G + kk]
            masked = is_index_masked[:, start:end]
            if masked.any():  # padding queries: zero, as in transformers
                probs.masked_fill_(masked[:, None, :, None], 0.0)
            torch.matmul(probs.type_as(values), values, out=out[:, :, start:end])
        if is_global_attn:
            _global_outputs(original, hidden_states, out, positions, global_valid, is_index_masked)
        return (out.transpose(1, 2).reshape(batch, length, d_model),)


def _global_positions(is_index_global_attn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, G] positions of each row's global tokens, in order, padded with 0; [B, G] bool real)."""
    counts = is_index_global_attn.sum(dim=1)  # [B]
    slots = int(counts.max())
    order = torch.argsort((~is_index_global_attn).to(torch.int8), dim=1, stable=True)[:, :slots]  # globals first
    valid = torch.arange(slots, device=counts.device)[None, :] < counts[:, None]
    return order.masked_fill(~valid, 0), valid


def _global_outputs(original, hidden_states, out, positions, valid, is_index_masked) -> None:
    """Overwrite the output of every global token with its attention over the whole sequence, through the
    global projections (Longformer), in ``out`` [B, H, S, dh]."""
    batch, length, d_model = hidden_states.shape
    heads, head_dim = original.num_heads, original.head_dim
    picked = hidden_states.gather(1, positions[:, :, None].expand(-1, -1, d_model))  # [B, G, d]
    q = original.query_global(picked) / math.sqrt(head_dim)
    q = q.view(batch, -1, heads, head_dim).transpose(1, 2)  # [B, H, G, dh]
    k = original.key_global(hidden_states).view(batch, length, heads, head_dim).transpose(1, 2)  # [B, H, S, dh]
    v = original.value_global(hidden_states).view(batch, length, heads, head_dim).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)).masked_fill(is_index_masked[:, None, None, :], torch.finfo(q.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(scores)  # [B, H, G, S]
    result = probs @ v  # [B, H, G, dh]
    rows, slots = valid.nonzero(as_tuple=True)
    out[rows, :, positions[rows, slots]] = result[rows, :, slots]


def _unwrapped_sites(encoder: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every LED encoder self-attention not wrapped yet."""
    return [(parent, name) for parent in encoder.modules() if not isinstance(parent, BlockedLocalSelfAttention)
            for name, child in parent.named_children() if type(child).__name__ == "LEDEncoderSelfAttention"]


@contextmanager
def blocked_local_attention(encoder: nn.Module) -> Iterator[list[BlockedLocalSelfAttention]]:
    """Within the block every LED encoder self-attention of ``encoder`` is computed in blocks; the original
    modules are back afterwards. Already wrapped modules are left as they are (never stacked)."""
    installed = []
    for parent, name in _unwrapped_sites(encoder):
        wrapper = BlockedLocalSelfAttention(getattr(parent, name))
        setattr(parent, name, wrapper)
        installed.append((parent, name, wrapper))
    try:
        yield [wrapper for _, _, wrapper in installed]
    finally:
        for parent, name, wrapper in installed:
            setattr(parent, name, wrapper.original)
