"""Which far tokens a query retrieves: the top-k per key-value head, by tokens or by blocks.

The rule (grouped-query attention): the g query heads that share a key-value head make one
selection for it, scoring each far key by the largest of their g dot products; all g heads then
attend to the same k tokens. With one query head per key-value head it is every head's own top-k.

- ``token_ids``: every query its own top-k (brute force over the far tokens; prefill in token
  mode, the exact reference).
- ``decode_ids``: the same rule for one step's queries (every beam), scored by unlimisum's
  measured exact kernel (search/kernels.py) in one streaming pass per key-value head; on a
  CPU, where measured faster on this machine (``grouped_scan_wins``, kept in the user's cache
  folder: unlimisum/measurements.py), by the compiled grouped scan instead
  (search/compiled.py ``select_grouped``: scores, the max over the group and a running
  top-k in one pass over each key-value head's keys, widened in registers, exact fp32 scores).
- ``BlockIndex``: prefill in block mode. Far tokens are grouped into blocks when they leave the
  local window, each represented by the few keys that drew the most attention while they were
  local (InfLLM's representative tokens); one chunk of queries selects whole blocks per key-value
  head, by the mean over its queries of the best representative score, so a chunk costs
  O(blocks) instead of O(far tokens) per query.
"""

from __future__ import annotations

import functools
import math

import torch

from unlimisum import measurements
from unlimisum.search import compiled, kernels

SCORE_BYTES = 64 * 2**20  # float32 block or token scores of one slice
# the compiled grouped scan serves stores from this many far keys: below, the first compile (tens of seconds per
# dtype, once per machine) and the measurement would cost more than a short store saves (kernels.py alike)
GROUPED_SCAN_MIN_KEYS = kernels.COMPILED_MIN_STATES
# ... and at most this many query rows per key-value head (B * g: a step's beams and query heads); more (the
# evidence pass's hundreds of queries) make scoring a matmul, which the torch kernels keep
GROUPED_SCAN_MAX_ROWS = 64
GROUPED_MEASURE_KEYS = 65_536  # keys per key-value head of the measurement's synthetic store
# what the measurement is called in the user's cache folder: a new version measures again
# 2: the compiled scan asks for the rows ahead of it (llvm.PREFETCH_BYTES); 3: a head's keys in parts on threads of
# their own where the key-value heads are fewer than the threads (search/grouped_loops.py)
GROUPED_MEASUREMENT_VERSION = 3


def token_ids(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., G, g, C, n] -> ids [..., G, C, k]: per query and KV head, the top-k by the max over its group."""
    return scores.amax(dim=-3).topk(min(k, scores.shape[-1]), dim=-1).indices


def decode_ids(keys: torch.Tensor, queries: torch.Tensor, k: int, choice: kernels.KernelChoice) -> torch.Tensor:
    """keys [G, n, D] (storage dtype), queries [B, G, g, D] float32 -> ids [B, G, k] of the top-k per row and
    KV head (sorted by score), one pass over the keys per KV head: compiled where ``grouped_scan_serves``, else
    ``choice``'s kernel in slices of bounded scores."""
    if grouped_scan_serves(keys, queries, k):
        return _compiled_decode_ids(keys, queries, k)
    return _torch_decode_ids(keys, queries, k, choice)


def grouped_scan_serves(keys: torch.Tensor, queries: torch.Tensor, k: int) -> bool:
    """Whether ``decode_ids`` selects with the compiled grouped scan: keys [G, n, D] on the CPU that it reads
    (``compiled.usable``), from GROUPED_SCAN_MIN_KEYS of them and for up to GROUPED_SCAN_MAX_ROWS queries [B, G,
    g, D] per KV head, no score kernel forced (UNLIMISUM_SCORE_KERNEL), and measured faster here."""
    rows, heads, group, head_dim = queries.shape
    return (keys.device.type == "cpu" and keys.shape[1] >= GROUPED_SCAN_MIN_KEYS and k > 0
            and 0 < rows * group <= GROUPED_SCAN_MAX_ROWS and kernels.forced_kernel() is None
            and compiled.usable(keys, "select_grouped")
            and grouped_scan_wins(keys.dtype, heads, rows, group, head_dim, k))


@functools.lru_cache(maxsize=None)
def grouped_scan_wins(dtype: torch.dtype, kv_heads: int, rows: int, group: int, head_dim: int, k: int) -> bool:
    """Whether the compiled grouped scan selects faster than the torch kernels (``kernels.kernel_for``'s choice)
    on this machine for this dtype, shape and k: raced once on a synthetic store of GROUPED_MEASURE_KEYS keys per
    KV head, kept in the user's cache folder (unlimisum/measurements.py), memoised per process. ``rows`` (B) is
    measured at the next power of two (at most GROUPED_SCAN_MAX_ROWS // group), k at most a 16th of the keys."""
    rows = max(rows, min(1 << (rows - 1).bit_length(), GROUPED_SCAN_MAX_ROWS // group))
    k = max(1, min(k, GROUPED_MEASURE_KEYS // 16))
    name = (f"decoder-only grouped scan v{GROUPED_MEASUREMENT_VERSION} cpu {str(dtype).removeprefix('torch.')} "
            f"{kv_heads} KV heads x {rows} rows x {group} queries, d={head_dim}, k={k}")

    def measured() -> tuple[dict, str]:
        return _race_grouped_scan(dtype, kv_heads, rows, group, head_dim, k)

    found = measurements.remembered(name, measured)
    try:
        return bool(found.value["compiled_wins"])
    except (TypeError, KeyError):  # an entry another release wrote: measured again, for this process
        return bool(measured()[0]["compiled_wins"])


def _race_grouped_scan(dtype: torch.dtype, kv_heads: int, rows: int, group: int, head_dim: int,
                       k: int) -> tuple[dict, str]:
    """({"compiled_wins", "compiled_seconds", "torch_seconds"}, reason): both ways of ``decode_ids`` raced
    (measurements.race) on a synthetic store."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.empty(kv_heads, GROUPED_MEASURE_KEYS, head_dim, dtype=dtype)  # [G, n, D]
    for head in range(kv_heads):  # one head at a time: no fp32 copy of the whole store
        keys[head] = torch.randn(GROUPED_MEASURE_KEYS, head_dim, generator=generator)
    queries = torch.randn(rows, kv_heads, group, head_dim, generator=generator)  # [B, G, g, D]
    choice = kernels.kernel_for(torch.device("cpu"), dtype, head_dim)
    compiled.measure_before_timing(keys, rows * group, "select_grouped")  # not timed in the compiled one's first call
    seconds = measurements.race({"compiled": lambda: _compiled_decode_ids(keys, queries, k),
                                 "torch": lambda: _torch_decode_ids(keys, queries, k, choice)})
    wins = seconds["compiled"] < seconds["torch"]
    torch_kernel = "native" if choice.scores == "native" and dtype != torch.float32 else "float32"  # kernels.scores
    reason = (f"{'compiled grouped scan' if wins else f'torch {torch_kernel} kernel'} selects far tokens: "
              f"compiled {seconds['compiled'] * 1e3:.2f} ms, torch {torch_kernel} {seconds['torch'] * 1e3:.2f} ms "
              f"on {GROUPED_MEASURE_KEYS:,} keys x {kv_heads} KV heads x {head_dim}, {rows} rows x {group} queries "
              f"each, k={k:,}")
    return {"compiled_wins": wins, "compiled_seconds": seconds["compiled"], "torch_seconds": seconds["torch"]}, reason


def _compiled_decode_ids(keys: torch.Tensor, queries: torch.Tensor, k: int) -> torch.Tensor:
    """``decode_ids`` by the compiled grouped scan: ids [B, G, k] sorted by score."""
    scores, ids = compiled.select_grouped(keys, queries, k)  # [B, G, k], in no order
    return ids.gather(2, scores.argsort(dim=2, descending=True))


def _torch_decode_ids(keys: torch.Tensor, queries: torch.Tensor, k: int, choice: kernels.KernelChoice) -> torch.Tensor:
    """``decode_ids`` by ``choice``'s torch kernel: per KV head, slices of bounded scores and a running top-k."""
    b, heads, group, _ = queries.shape
    n = keys.shape[1]
    k = min(k, n)
    step = max(k, SCORE_BYTES // (b * group * 4))
    result = []
    for head in range(heads):
        rows = queries[:, head].reshape(b * group, -1)  # [B*g, D]
        best_scores = best_ids = None
        for start in range(0, n, step):
            scores = kernels.scores(keys[head, start:start + step], rows, choice).float()  # [B*g, s]
            scores = scores.view(b, group, -1).amax(dim=1)  # [B, s]: the KV-head rule
            top, ids = kernels.top_k(scores, min(k, scores.shape[1]))
            ids = ids + start
            if best_scores is not None:
                top, order = torch.cat([best_scores, top], 1).topk(k, dim=1)
                ids = torch.cat([best_ids, ids], 1).gather(1, order)
            best_scores, best_ids = top, ids
        result.append(best_ids)
    return torch.stack(result, dim=1)  # [B, G, k]


class BlockIndex:
    """The far tokens of one layer's prompt in blocks, each with its representative keys (prefill only)."""

    def __init__(self, block_size: int, representatives: int):
        self.block_size, self.representatives = block_size, representatives
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.rep_keys: torch.Tensor | None = None  # [G, blocks, r, D] (the store's dtype)

    @property
    def n_blocks(self) -> int:
        return len(self.starts)

    @property
    def end(self) -> int:
        """Tokens before this are in blocks."""
        return self.ends[-1] if self.ends else 0

    def add(self, start: int, keys: torch.Tensor, received: torch.Tensor) -> None:
        """Tokens ``[start, start + n)`` leave the local window: keys [G, n, D] (as stored), received [G, n]
        (attention they drew while local, summed over queries and heads) -> blocks of ``block_size``."""
        n = keys.shape[1]
        reps = []
        for offset in range(0, n, self.block_size):
            size = min(self.block_size, n - offset)
            r = min(self.representatives, size)
            top = received[:, offset:offset + size].topk(r, dim=1).indices  # [G, r]
            top = torch.cat([top, top[:, :1].expand(-1, self.representatives - r)], dim=1)  # repeats change no max
            reps.append(keys[:, offset:offset + size].gather(1, top.unsqueeze(-1).expand(-1, -1, keys.shape[2])))
            self.starts.append(start + offset)
            self.ends.append(start + offset + size)
        added = torch.stack(reps, dim=1)  # [G, new blocks, r, D]
        self.rep_keys = added if self.rep_keys is None else torch.cat([self.rep_keys, added], dim=1)

    def select(self, queries: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """queries [1, G, g, C, D] float32 (as they score far keys) -> (ids [G, m], valid [G, m]) of the tokens
        of the ceil(k / block_size) best blocks per KV head; ``valid`` is False on the padding of short blocks."""
        heads, blocks, reps, dim = self.rep_keys.shape
        n_queries = queries.shape[3]
        chosen = min(blocks, math.ceil(k / self.block_size))
        rep_keys = self.rep_keys.reshape(heads, blocks * reps, dim).float()
        step = max(1, SCORE_BYTES // (queries.shape[2] * blocks * reps * 4 * heads))
        totals = queries.new_zeros(heads, blocks, dtype=torch.float32)
        for start in range(0, n_queries, step):
            q = queries[0, :, :, start:start + step].float()  # [G, g, c, D]
            scores = torch.einsum("ghcd,gnd->ghcn", q, rep_keys).view(heads, q.shape[1], q.shape[2], blocks, reps)
            totals += scores.amax(dim=4).amax(dim=1).sum(dim=1)  # best representative, best head; summed over queries
        best = totals.topk(chosen, dim=1).indices  # [G, chosen]
        starts = torch.tensor(self.starts, device=best.device)[best]  # [G, chosen]
        ends = torch.tensor(self.ends, device=best.device)[best]
        ids = starts.unsqueeze(-1) + torch.arange(self.block_size, device=best.device)  # [G, chosen, b]
        valid = ids < ends.unsqueeze(-1)
        ids = torch.where(valid, ids, starts.unsqueeze(-1))
        return ids.view(heads, -1), valid.view(heads, -1)
