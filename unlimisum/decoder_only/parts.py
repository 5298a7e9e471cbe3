"""One softmax over the parts a query attends to: sinks, retrieved far tokens, the exact local window.

Queries are laid out per key-value head, ``[B, G, g, C, D]`` (batch, KV heads, the g query heads
sharing each KV head, queries, head dim). A part's keys and values come in one of three layouts:

- ``shared`` ``[G, n, D]``: the same for every row and query (sinks, the prompt's local window);
- ``batched`` ``[B, G, n, D]``: per row (the generated tokens, far tokens each beam retrieved);
- ``per_query`` ``[B, G, C, n, D]``: per query (far tokens each prompt query retrieved, token mode).

Each part may bring its own version of the queries (rotated to another position, see positions.py)
and a boolean mask broadcast to ``[B, G, g, C, n]`` (True: attend). Scores are scaled, soft-capped
when the model does (Gemma 2) and normalised by one softmax over all parts together, so attending
to every past token through the parts is the model's own attention. Everything runs in float32
(float64 for a float64 model), in blocks of queries that keep the scores under ``SCORE_BYTES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORE_BYTES = 64 * 2**20  # float32 scores of one block of queries

_SCORES = {"shared": "bghcd,gnd->bghcn", "batched": "bghcd,bgnd->bghcn", "per_query": "bghcd,bgcnd->bghcn"}
_VALUES = {"shared": "bghcn,gnd->bghcd", "batched": "bghcn,bgnd->bghcd", "per_query": "bghcn,bgcnd->bghcd"}


@dataclass
class Part:
    """Keys and values one query attends to, in one layout (see the module docstring)."""

    keys: torch.Tensor
    values: torch.Tensor
    layout: str  # "shared" | "batched" | "per_query"
    mask: torch.Tensor | None = None  # bool, broadcast to [B, G, g, C, n]; None: every key
    queries: torch.Tensor | None = None  # [B, G, g, C, D]: this part's own queries; None: the common ones
    # the last ``causal_tail`` keys are the queries' own (key j of them seen by queries i >= j), every key before
    # them seen by all: a prefill chunk's window, said without a mask (the flash kernel's causal mode reads it)
    causal_tail: int = 0

    @property
    def size(self) -> int:
        return self.keys.shape[-2]

    def visible(self, n_queries: int) -> torch.Tensor | None:
        """The part's mask (bool, broadcast to [B, G, g, C, n]), built from ``causal_tail`` where that says it."""
        if not self.causal_tail:
            return self.mask
        first = self.size - self.causal_tail
        return causal(first, n_queries, 0, self.size, self.keys.device)


def attend(queries: torch.Tensor, parts: list[Part], scaling: float, softcap: float | None = None,
           mass_out: list | None = None, per_query_mass: bool = False) -> torch.Tensor:
    """queries [B, G, g, C, D] -> [B, G, g, C, D] (float32 or wider): softmax over all parts' keys, times their values.

    ``mass_out``: when a list, it receives per part (in order, empty parts included) the attention each key
    drew, summed over the g query heads and the C queries: [B, G, n] ([B, G, C, n] for a per_query part,
    whose keys differ per query, and for every part with ``per_query_mass``), float32 or wider, for coverage,
    evidence and choosing block representatives. Summed block by block: the weights of a whole chunk
    ([B, G, g, C, n]) are never held at once.
    """
    b, heads, group, n_queries, _ = queries.shape
    dtype = torch.promote_types(queries.dtype, torch.float32)
    total = sum(part.size for part in parts)
    block = max(1, SCORE_BYTES // max(1, b * heads * group * total * 4))
    out = queries.new_empty(queries.shape, dtype=dtype)
    masses = [None] * len(parts)
    visible = [part.visible(n_queries) for part in parts]
    for start in range(0, n_queries, block):
        rows = slice(start, start + block)
        logits = []
        for part, part_mask in zip(parts, visible):
            q = (part.queries if part.queries is not None else queries)[:, :, :, rows].to(dtype)
            keys = part.keys[:, :, rows] if part.layout == "per_query" else part.keys
            scores = torch.einsum(_SCORES[part.layout], q, keys.to(dtype)) * scaling
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if part_mask is not None:
                mask = part_mask[..., rows, :] if part_mask.dim() >= 2 and part_mask.shape[-2] == n_queries \
                    else part_mask
                scores = scores.masked_fill(~mask, float("-inf"))
            logits.append(scores)
        weights = torch.softmax(torch.cat(logits, dim=-1), dim=-1)  # [B, G, g, c, total]
        result = 0
        for index, (part, part_weights) in enumerate(zip(parts, weights.split([p.size for p in parts], dim=-1))):
            values = part.values[:, :, rows] if part.layout == "per_query" else part.values
            result = result + torch.einsum(_VALUES[part.layout], part_weights, values.to(dtype))
            if mass_out is not None:
                masses[index] = _add_mass(masses[index], part_weights, per_query_mass or part.layout == "per_query")
        out[:, :, :, rows] = result
    if mass_out is not None:
        mass_out.extend(masses)
    return out


def _add_mass(mass: torch.Tensor | None, weights: torch.Tensor, per_query: bool) -> torch.Tensor:
    """Add one block's weights [B, G, g, c, n] to a part's mass: [B, G, n], or [B, G, C, n] per query."""
    if not per_query:
        block = weights.sum(dim=(2, 3))
        return block if mass is None else mass + block
    block = weights.sum(dim=2)  # [B, G, c, n]
    return block if mass is None else torch.cat([mass, block], dim=2)


def grouped(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, C, D] -> [B, G, g, C, D]: query head h shares KV head h // g (transformers' repeat_kv order)."""
    b, heads, c, d = query.shape
    return query.view(b, kv_heads, heads // kv_heads, c, d)


def ungrouped(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B, G, g, C, D] -> [B, C, H, D] in the query's dtype: what an attention function returns."""
    b, g, group, c, d = out.shape
    return out.reshape(b, g * group, c, d).transpose(1, 2).to(like.dtype)


def causal(first_query: int, n_queries: int, first_key: int, n_keys: int, device) -> torch.Tensor:
    """[C, n] bool: key at position first_key + j is visible to the query at first_query + i when not after it."""
    queries = torch.arange(first_query, first_query + n_queries, device=device)
    keys = torch.arange(first_key, first_key + n_keys, device=device)
    return keys.unsqueeze(0) <= queries.unsqueeze(1)
