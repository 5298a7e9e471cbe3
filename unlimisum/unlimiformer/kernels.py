"""Exact retrieval attention over a 16-bit store: one streaming read of the store per call.

One decoder layer's step is one call for every query of that step (every head, beam and row
of one document): ``attend(states [N, d], queries [nq, d], k)`` returns, per query, the softmax-
weighted sum of its top-k stored states. The store is read once to score all queries at
once; then either the k winners are gathered (k small next to N), or a second dense pass
sums the masked softmax over every state (k a large share of N), or, with k >= N, there is no
top-k at all: plain dense attention.

Two score kernels, the same result within the documented precision:

- ``native``: the query is rounded to the storage dtype (on every machine alike) and the
  matmul runs in that dtype with fp32 accumulation; the scores come out rounded to the
  storage dtype (rounding error up to 2^-8 relative in bf16, 2^-11 in fp16). Fast where the CPU or GPU has 16-bit
  units (AVX512-BF16/AMX, tensor cores).
- ``float32``: blocks of the store are widened to fp32 and multiplied with the fp32 query:
  exact fp32 scores; faster on CPUs without 16-bit units.

Which one runs, the block size, the layout the top-k is selected in ([nq, N] scores, or
[N, nq] from ``states @ queries^T``, the faster matmul orientation on some CPUs), and when a
dense pass beats gathering are measured on the machine that runs (``calibrate``, once per
process, device, dtype and width, ~0.3 s), never assumed.
The attention weights are the softmax of the kernel's scores in every path; the weighted sum
of states runs in the storage dtype with the native kernel, in fp32 with the float32 kernel.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

SCORE_KERNELS = ("native", "float32")
# Calibration store: large enough to leave the caches (as real stores do), small enough to time in ~0.1 s.
CALIBRATION_ROWS = 32_768
CALIBRATION_QUERIES = 12  # one greedy step of a 12-head layer, the common case
CALIBRATION_GATHER_ROWS = 8_192
FLOAT32_BLOCK_CHOICES = (2_048, 8_192)  # rows widened to fp32 at a time (the temporary stays in cache)
# Bound on the fp32 scores buffer [nq, N]; beyond it the store is scored in slices with a running top-k.
MAX_SCORE_BYTES = 256 * 2**20
# top_k: columns per block of the block-maxima pre-selection (rows shorter than 4 k blocks use torch.topk).
TOPK_BLOCK = 16


@dataclass(frozen=True)
class KernelChoice:
    """How exact retrieval runs on one device for one storage dtype and width (see ``calibrate``)."""

    scores: str  # "native" | "float32"
    block_rows: int  # float32 kernel: rows widened per step
    tokens_major: bool  # native top-k selection scores as states @ queries^T ([N, nq]), measured faster
    gather_row_cost: float  # seconds per gathered state (gather + the weighted sum)
    dense_row_cost: float  # seconds per stored state for one dense pass over the store
    reason: str = ""  # what was measured, for `unlimisum info` and the benchmarks

    def dense_is_cheaper(self, n_queries: int, k: int, n_tokens: int) -> bool:
        """Gathering nq*k states costs more than a second dense pass over all N states."""
        return n_queries * k * self.gather_row_cost > n_tokens * self.dense_row_cost


_CALIBRATED: dict[tuple, KernelChoice] = {}


def forced_kernel() -> str | None:
    """UNLIMISUM_SCORE_KERNEL=native|float32 forces a kernel (tests, benchmarks); unset: measured."""
    value = os.environ.get("UNLIMISUM_SCORE_KERNEL", "").strip().lower()
    if value and value not in SCORE_KERNELS:
        raise ValueError(f"UNLIMISUM_SCORE_KERNEL must be native or float32, not {value!r}")
    return value or None


def kernel_for(device: torch.device, dtype: torch.dtype, dim: int) -> KernelChoice:
    """The calibrated choice for this device, dtype and width (measured on first use, then reused)."""
    key = (str(device), dtype, dim, forced_kernel())
    if key not in _CALIBRATED:
        _CALIBRATED[key] = calibrate(device, dtype, dim, force=forced_kernel())
    return _CALIBRATED[key]


def calibrate(device: torch.device, dtype: torch.dtype, dim: int, *, force: str | None = None,
              rows: int = CALIBRATION_ROWS) -> KernelChoice:
    """Time both score kernels, the float32 block sizes, a gather and a dense pass on a synthetic store."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    states = torch.randn(rows, dim, generator=generator).to(device, dtype)  # [rows, d]
    queries = torch.randn(CALIBRATION_QUERIES, dim, generator=generator).to(device)  # [nq, d] fp32
    timings = {}
    if dtype != torch.float32:
        timings["native"] = _best_time(lambda: native_scores(states, queries), device)
    for block in FLOAT32_BLOCK_CHOICES:
        timings[f"float32/{block}"] = _best_time(lambda: float32_scores(states, queries, block), device)
    block = min(FLOAT32_BLOCK_CHOICES, key=lambda b: timings[f"float32/{b}"])
    if force is not None:
        kernel = "native" if force == "native" and dtype != torch.float32 else "float32"
    else:
        kernel = "native" if timings.get("native", float("inf")) < timings[f"float32/{block}"] else "float32"
    tokens_major = False
    if kernel == "native":  # which layout selects the top-k faster: [nq, N] or [N, nq] scores
        k = max(1, rows // (8 * TOPK_BLOCK))
        for layout in (False, True):
            choice = KernelChoice("native", block, layout, 0.0, 0.0)
            timings[f"select/{'tokens' if layout else 'queries'}-major"] = _best_time(
                lambda: select(states, queries, k, choice), device)
        tokens_major = timings["select/tokens-major"] < timings["select/queries-major"]
    ids = torch.randint(0, rows, (CALIBRATION_QUERIES, CALIBRATION_GATHER_ROWS // CALIBRATION_QUERIES),
                        generator=generator).to(device)
    weights = torch.rand(ids.shape, generator=generator).to(device)
    gather_seconds = _best_time(lambda: gathered_attention(states, ids, weights, kernel), device)
    dense_seconds = _best_time(lambda: dense_values(states, weights.new_zeros(CALIBRATION_QUERIES, rows), kernel,
                                                    block), device)
    del weights
    measured = ", ".join(f"{name} {seconds * 1e3:.2f} ms" for name, seconds in timings.items())
    reason = (f"{kernel} scores{' (forced)' if force else ''}; measured on {rows:,} x {dim} {str(dtype)[6:]} "
              f"for {CALIBRATION_QUERIES} queries: {measured}")
    return KernelChoice(
        scores=kernel, block_rows=block, tokens_major=tokens_major,
        gather_row_cost=gather_seconds / ids.numel(), dense_row_cost=dense_seconds / rows,
        reason=reason,
    )


def _best_time(run, device: torch.device, repeats: int = 3) -> float:
    run()  # warm up: first calls allocate and pick kernels
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


# --- the kernels ------------------------------------------------------------------------------


def native_scores(states: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[nq, N] scores in the storage dtype from one matmul in it (query rounded to it; fp32 accumulation)."""
    return queries.to(states.dtype) @ states.T


def native_scores_tokens_major(states: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """[N, nq] scores in the storage dtype: ``states @ queries^T``, the faster orientation on some CPUs."""
    return states @ queries.to(states.dtype).T


def float32_scores(states: torch.Tensor, queries: torch.Tensor, block_rows: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """[nq, N] exact fp32 scores: blocks of the store widened to fp32, each multiplied once."""
    n = states.shape[0]
    if out is None:
        out = queries.new_empty(queries.shape[0], n)  # [nq, N]
    for start in range(0, n, block_rows):
        block = states[start:start + block_rows].float()  # [b, d] fp32, stays in cache
        torch.mm(queries, block.T, out=out[:, start:start + block.shape[0]])
    return out


def scores(states: torch.Tensor, queries: torch.Tensor, choice: KernelChoice) -> torch.Tensor:
    """[nq, N] scores by the chosen kernel: in the storage dtype (native) or fp32 (float32 kernel and stores)."""
    if choice.scores == "native" and states.dtype != torch.float32:
        return native_scores(states, queries)
    return float32_scores(states, queries, choice.block_rows)


def gathered_attention(states: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, kernel: str) -> torch.Tensor:
    """sum_j weights[i, j] * states[ids[i, j]]: ids, weights [nq, k] -> [nq, d] fp32.

    The native kernel sums the gathered 16-bit states in their dtype (fp32 accumulation), the
    float32 kernel widens them first.
    """
    nq, k = ids.shape
    per_query = k * states.shape[1] * (states.element_size() + (4 if kernel != "native" else 0))
    rows_per_step = max(1, MAX_SCORE_BYTES // per_query)  # the gathered states stay bounded
    out = torch.empty(nq, states.shape[1], dtype=torch.float32, device=states.device)
    for first in range(0, nq, rows_per_step):
        part = slice(first, first + rows_per_step)
        rows = states.index_select(0, ids[part].reshape(-1)).view(-1, k, states.shape[1])  # [r, k, d]
        if kernel == "native" and states.dtype != torch.float32:
            out[part] = torch.bmm(weights[part].to(states.dtype).unsqueeze(1), rows).squeeze(1).float()
        else:
            out[part] = torch.bmm(weights[part].float().unsqueeze(1), rows.float()).squeeze(1)
    return out


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits.topk(k, dim=1)`` (sorted), faster for long rows: the top-k elements lie in the k blocks of
    TOPK_BLOCK columns with the highest maxima (any other block has k larger elements above its max)."""
    nq, n = logits.shape
    block = TOPK_BLOCK
    if n < 4 * k * block:
        return logits.topk(k, dim=1)
    usable = n - n % block
    maxima = logits[:, :usable].view(nq, -1, block).amax(dim=2)  # [nq, n / block]
    tail = logits[:, usable:]  # the last, partial block always takes part
    _, blocks = maxima.topk(k, dim=1)  # [nq, k]
    columns = (blocks.unsqueeze(2) * block + torch.arange(block, device=logits.device)).view(nq, -1)  # [nq, k*block]
    candidates = logits.gather(1, columns)
    if tail.shape[1]:
        candidates = torch.cat([candidates, tail], 1)
        columns = torch.cat([columns, torch.arange(usable, n, device=logits.device).expand(nq, -1)], 1)
    values, order = candidates.topk(k, dim=1)
    return values, columns.gather(1, order)


def dense_values(states: torch.Tensor, weights: torch.Tensor, kernel: str, block_rows: int) -> torch.Tensor:
    """weights [nq, N] @ states [N, d] -> [nq, d] fp32: the second dense pass."""
    if kernel == "native" and states.dtype != torch.float32:
        return (weights.to(states.dtype) @ states).float()
    out = weights.new_zeros(weights.shape[0], states.shape[1])  # [nq, d]
    for start in range(0, states.shape[0], block_rows):
        block = states[start:start + block_rows].float()  # [b, d]
        out.addmm_(weights[:, start:start + block.shape[0]], block)
    return out


def top_k_tokens_major(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``top_k`` of ``logits.T`` for scores laid out [N, nq] (as ``states @ queries.T`` gives them, the
    fast matmul orientation on some CPUs), without transposing all of them: [nq, k] values and ids."""
    n, nq = logits.shape
    block = TOPK_BLOCK
    if n < 4 * k * block:
        values, ids = logits.topk(k, dim=0)  # [k, nq]
        return values.T, ids.T
    usable = n - n % block
    maxima = logits[:usable].view(-1, block, nq).amax(dim=1).T.contiguous()  # [nq, n / block]
    _, blocks = maxima.topk(k, dim=1)  # [nq, k]
    rows = (blocks.unsqueeze(2) * block + torch.arange(block, device=logits.device)).view(nq, -1)  # [nq, k*block]
    if usable < n:  # the last, partial block always takes part
        rows = torch.cat([rows, torch.arange(usable, n, device=logits.device).expand(nq, -1)], 1)
    candidates = logits.T.gather(1, rows)
    values, order = candidates.topk(k, dim=1)
    return values, rows.gather(1, order)


def attend(states: torch.Tensor, queries: torch.Tensor, k: int, choice: KernelChoice,
           coverage: torch.Tensor | None = None) -> torch.Tensor:
    """Exact top-k retrieval attention: queries [nq, d] fp32 (scaling folded in) -> [nq, d] fp32.

    Per query: softmax over its k highest scores, times those states. k >= N is dense attention.
    ``coverage`` [N] fp32, when given, gets every query's attention weights added to it.
    """
    n, nq = states.shape[0], queries.shape[0]
    queries = queries.to(states.device, torch.float32)
    fits = nq * n * 4 <= MAX_SCORE_BYTES
    if k >= n and not fits:
        return _dense_in_slices(states, queries, choice, coverage)
    if k >= n:
        weights = torch.softmax(scores(states, queries, choice), dim=1, dtype=torch.float32)  # [nq, N]
    elif fits and choice.dense_is_cheaper(nq, k, n):
        logits = scores(states, queries, choice)  # [nq, N]
        keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        keep.scatter_(1, top_k(logits, k)[1], True)  # exactly the k ids the gather path would take
        weights = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=1, dtype=torch.float32)
    else:
        logits, ids = select(states, queries, min(k, n), choice)
        weights = torch.softmax(logits, dim=1, dtype=torch.float32)  # [nq, k]
        if coverage is not None:
            coverage.index_add_(0, ids.reshape(-1), weights.reshape(-1))
        return gathered_attention(states, ids, weights, choice.scores)
    if coverage is not None:
        coverage += weights.sum(dim=0)
    return dense_values(states, weights, choice.scores, choice.block_rows)


def _dense_in_slices(states, queries, choice, coverage) -> torch.Tensor:
    """Dense attention over a store whose [nq, N] scores do not fit in MAX_SCORE_BYTES: slices of it,
    combined by their softmax maxima and sums (the online softmax); coverage needs a second pass."""
    n, nq = states.shape[0], queries.shape[0]
    step = max(1, MAX_SCORE_BYTES // (nq * 4))
    maxima, sums, parts = [], [], []
    for start in range(0, n, step):
        block = states[start:start + step]
        logits = scores(block, queries, choice).float()  # [nq, <=step]
        peak = logits.amax(dim=1, keepdim=True)  # [nq, 1]
        weights = torch.exp(logits - peak)
        maxima.append(peak)
        sums.append(weights.sum(dim=1, keepdim=True))
        parts.append(dense_values(block, weights, choice.scores, choice.block_rows))  # [nq, d] unnormalised
    peaks = torch.cat(maxima, dim=1)  # [nq, slices]
    scale = torch.exp(peaks - peaks.amax(dim=1, keepdim=True))  # [nq, slices]
    total = (torch.cat(sums, dim=1) * scale).sum(dim=1, keepdim=True)  # [nq, 1]
    out = sum(part * scale[:, i:i + 1] for i, part in enumerate(parts)) / total
    if coverage is not None:
        overall = peaks.amax(dim=1, keepdim=True)
        for start in range(0, n, step):
            logits = scores(states[start:start + step], queries, choice).float()
            coverage[start:start + step] += (torch.exp(logits - overall) / total).sum(dim=0)
    return out


def select(states: torch.Tensor, queries: torch.Tensor, k: int, choice: KernelChoice):
    """(scores, ids) [nq, k] of each query's top-k by the kernel's scores, sorted descending.

    One pass over the store; beyond MAX_SCORE_BYTES of scores it goes in slices with a running top-k.
    """
    n = states.shape[0]
    step = max(k, MAX_SCORE_BYTES // (queries.shape[0] * 4))
    best_scores = best_ids = None
    tokens_major = choice.tokens_major and choice.scores == "native" and states.dtype != torch.float32
    for start in range(0, n, step):
        block = states[start:start + step]
        if tokens_major:
            top, ids = top_k_tokens_major(native_scores_tokens_major(block, queries), min(k, block.shape[0]))
        else:
            part = scores(block, queries, choice)  # [nq, <=step]
            top, ids = top_k(part, min(k, part.shape[1]))
        ids += start
        if best_scores is not None:
            top, ids = torch.cat([best_scores, top], 1), torch.cat([best_ids, ids], 1)
            top, order = top.topk(min(k, top.shape[1]), dim=1)
            ids = ids.gather(1, order)
        best_scores, best_ids = top, ids
    return best_scores, best_ids
