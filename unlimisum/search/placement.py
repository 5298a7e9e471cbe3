"""Where the datastore lives and which index it uses: ``plan_index`` -> ``IndexPlan``.

The policy in one paragraph (the numbers come from bench/index_choice.py):

- On a GPU the store is always exact: a brute-force matmul over N 16-bit states reads
  N*d*2 bytes per search, which a GPU does in well under a millisecond even at 500k
  tokens, so an approximate index would only lose attention mass. The GPU is used when
  CUDA is present and the store takes at most ``gpu_memory_fraction`` of free memory.
- On the CPU the store is exact up to ``exact_max_tokens`` and approximate above
  (``approximate_kind``, IVF by measurement: HNSW with inner product recalls far less
  attention mass and is slower to build and to search).

Where an exact search scores: ``plan_key_store`` -> ``KeyStorePlan``. The shared store serves every
decoder layer (the paper's memory saving); a key store per layer (unlimisum/search/keys.py) takes
L times the store's bytes and lets each head score its own d_head-dim query, H times fewer multiply-adds
for the same bytes read. ``key_store="auto"`` uses it when all of these hold:

- the index is exact (an approximate index searches the states; the keys are searched exactly);
- the input has at least ``KEY_STORE_MIN_TOKENS`` tokens: below that a step's retrieval is a small share
  of the model's own step either way, not worth L times the memory and the projections;
- the store and the keys together fit ``KEY_STORE_MEMORY_FRACTION`` of the memory left beside this
  process (which holds the model by then), or on a GPU ``gpu_memory_fraction`` of its free memory: the
  other half stays for the decoder, the evidence pass and everything else on the machine;
- the key store's scores and top-k are measured at least ``KEY_STORE_MIN_SPEEDUP`` times faster than the
  shared store's on this machine (unlimisum/search/head_kernels.py, ``kernel_for``): for the generation's
  queries per head, or, where the summary's support is read (the default), for the generation and the
  support readings together (``with_support``: a reading of ``READING_QUERIES_PER_HEAD`` queries per head,
  where the key store gains most, about twice the generation's retrieval on the shared store).

``key_store="per-layer"`` uses it whenever the index is exact (``kind="auto"`` then plans exact);
``"shared"`` never. Where every head attends to every token (``retrieval_k >= n_tokens``: a dense step, bound
by arithmetic, H x N x d multiply-adds a layer over the shared states) the key store keeps each layer's values
too (``KeyStorePlan.values``), H times fewer multiply-adds for another L x the store's bytes, when the store,
the keys and the values together fit the same budget; else the keys alone. At top-k steps the values let each
head sum its k chosen tokens' d_head values instead of their d-wide states (H times fewer bytes gathered, at
every step and support reading), but projecting them costs as much as the keys, once per token: they are kept
for inputs of KEY_STORE_MIN_TOKENS or more where they fit that budget and the saving over the summary's steps
(``summary_tokens``, the most it may write, and its support readings) is measured to exceed their projection
(``head_kernels.value_sums_for``): an input of tens of thousands of tokens summarized at length, not a whole
book's few hundred thousand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from unlimisum.config import IndexConfig
from unlimisum.errors import ConfigError

if TYPE_CHECKING:
    from unlimisum.search.head_kernels import ValueSums

KINDS = ("exact", "ivf", "hnsw")
KEY_STORES = ("auto", "shared", "per-layer")
# auto's key store: inputs from this many tokens (a 4k-token bart-base step retrieves in ~1 ms per layer either way)
KEY_STORE_MIN_TOKENS = 4_096
# auto's key store: the store and the keys may take this share of the memory left beside the process
KEY_STORE_MEMORY_FRACTION = 0.5
# auto's key store: measured at least this many times faster than the shared store (it costs L x the memory)
KEY_STORE_MIN_SPEEDUP = 1.2
# a support reading's queries per head: 2 rows (nothing hidden, passages hidden) x a sentence of about 16 tokens
READING_QUERIES_PER_HEAD = 32
# a support reading's positions per sentence (its two rows read a sentence of about this many tokens at once)
READING_TOKENS = READING_QUERIES_PER_HEAD // 2
# the support pass's retrieval against the generation's, on the shared store: a reading of 32 queries for each
# 16 tokens generated one query at a time costs about twice the steps' (measured: 181 s against 69 s on all of
# Moby-Dick, bart-base, float32, a CPU without 16-bit units; the scores and top-k scale with the queries)
SUPPORT_TO_GENERATION = 2.0
APPROXIMATE_KINDS = ("ivf", "hnsw")
STORAGE_DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class IndexPlan:
    """Which index holds the encoded input and where: the answer of ``plan_index``."""

    kind: str  # "exact" | "ivf" | "hnsw"
    device: str  # "cpu" or "cuda:N"
    reason: str  # one line for `unlimisum info` and the logs


def storage_dtype(config: IndexConfig) -> torch.dtype:
    """The dtype the states are stored in.

    "auto" is bfloat16 whatever the model: 2 bytes per number like float16, but the float32
    range (encoder states beyond +-65504 are stored, not turned into inf), and the dtype the
    fast 16-bit matmul units of CPUs (AVX512-BF16, AMX) and GPUs read. Its 8-bit mantissa is
    the documented precision of scores (unlimisum/search/kernels.py). The choice never depends on the
    machine, so neither do results beyond that precision.
    """
    if config.storage_dtype == "auto":
        return torch.bfloat16
    if config.storage_dtype not in STORAGE_DTYPES:
        choices = ", ".join(["auto", *STORAGE_DTYPES])
        raise ConfigError(f"index storage_dtype must be one of {choices}, not {config.storage_dtype!r}")
    return STORAGE_DTYPES[config.storage_dtype]


def validate_index_config(config: IndexConfig) -> None:
    """Raise ConfigError for any option of ``config`` that has no meaning."""
    if config.kind not in ("auto", *KINDS):
        raise ConfigError(f"index kind must be one of auto, exact, ivf, hnsw, not {config.kind!r}")
    if config.device not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"index device must be one of auto, cpu, gpu, not {config.device!r}")
    if config.approximate_kind not in APPROXIMATE_KINDS:
        raise ConfigError(f"index approximate_kind must be ivf or hnsw, not {config.approximate_kind!r}")
    if not 0.0 < config.gpu_memory_fraction <= 1.0:
        raise ConfigError(f"index gpu_memory_fraction must be in (0, 1], not {config.gpu_memory_fraction}")
    if config.exact_max_tokens < 0:
        raise ConfigError(f"index exact_max_tokens must be >= 0, not {config.exact_max_tokens}")
    if config.ivf_scan_factor <= 0:
        raise ConfigError(f"index ivf_scan_factor must be > 0, not {config.ivf_scan_factor}")
    if config.key_store not in KEY_STORES:
        raise ConfigError(f"index key_store must be one of auto, shared, per-layer, not {config.key_store!r}")
    if config.key_store == "per-layer" and config.kind in APPROXIMATE_KINDS:
        raise ConfigError(f"the per-layer key store is searched exactly; it cannot serve index kind "
                          f"{config.kind!r} (use index kind exact or auto, or key store shared)")
    storage_dtype(config)


def plan_index(n_tokens: int, dim: int, config: IndexConfig, *, retrieval_k: int | None = None,
               queries_per_step: int | None = None, cuda_free_bytes: int | None = None,
               model_device: torch.device | str | None = None) -> IndexPlan:
    """Choose kind and device for a store of ``n_tokens`` states of size ``dim``.

    ``retrieval_k`` and ``queries_per_step`` (heads x beams of one document): an exact
    step reads the store once for all those queries, while IVF scans about ``ivf_scan_factor * k``
    states for each query on its own; auto never picks IVF when that is more than N.

    ``model_device``: where the model runs; automatic placement uses the GPU only for a model on
    CUDA, and that model's GPU (None: any CUDA device counts, as for ``unlimisum info``).
    ``cuda_free_bytes`` overrides the free GPU memory (tests); None asks CUDA when it is available.
    """
    validate_index_config(config)
    if n_tokens <= 0 or dim <= 0:
        raise ConfigError(f"a datastore needs at least one token and one dimension, got {n_tokens} x {dim}")
    element_bytes = torch.empty((), dtype=storage_dtype(config)).element_size()
    store_bytes = n_tokens * dim * element_bytes
    size = f"{n_tokens:,} tokens x {dim} ({store_bytes / 2**20:,.0f} MiB)"
    cuda = torch.cuda.is_available()
    model_device = torch.device(model_device) if model_device is not None else None
    gpu = _cuda_device(model_device)

    if config.device == "gpu":
        if not cuda:
            raise ConfigError("index device 'gpu' was requested but CUDA is not available; use device 'cpu' or 'auto'")
        if config.kind in APPROXIMATE_KINDS:
            raise ConfigError(f"index kind {config.kind!r} runs on the CPU only; on the GPU use kind 'exact' or 'auto'")
        return IndexPlan("exact", gpu, f"exact on GPU as requested, {size}")

    model_on_gpu = model_device is None or model_device.type == "cuda"
    if config.device == "auto" and cuda and model_on_gpu and config.kind in ("auto", "exact"):
        free = torch.cuda.mem_get_info(gpu)[0] if cuda_free_bytes is None else cuda_free_bytes
        budget = config.gpu_memory_fraction * free
        if store_bytes <= budget:
            return IndexPlan("exact", gpu, f"exact on GPU: {size} fits in {budget / 2**20:,.0f} MiB")
        too_big = f"{size} exceeds {budget / 2**20:,.0f} MiB of GPU memory"
    else:
        too_big = None

    if config.kind == "auto" and config.key_store == "per-layer":
        why = "the per-layer key store was requested, which is searched exactly"
        return IndexPlan("exact", "cpu", f"exact on CPU: {why}, {size}{'' if too_big is None else f'; {too_big}'}")
    if config.kind != "auto":
        why = "as requested" if too_big is None else f"as requested; {too_big}"
        return IndexPlan(config.kind, "cpu", f"{config.kind} on CPU {why}, {size}")
    ivf_scan = (queries_per_step or 0) * config.ivf_scan_factor * (retrieval_k or 0)
    if n_tokens <= config.exact_max_tokens:
        kind, why = "exact", f"{n_tokens:,} <= exact_max_tokens {config.exact_max_tokens:,}"
    elif config.approximate_kind == "ivf" and ivf_scan >= n_tokens:
        kind, why = "exact", (f"IVF would scan {ivf_scan:,.0f} states per step for k={retrieval_k:,}, more than one "
                              f"exact pass over {n_tokens:,}")
    else:
        kind, why = config.approximate_kind, f"{n_tokens:,} > exact_max_tokens {config.exact_max_tokens:,}"
    where = "" if too_big is None else f"; {too_big}"
    return IndexPlan(kind, "cpu", f"{kind} on CPU: {why}, {size}{where}")


def _cuda_device(model_device: torch.device | None) -> str:
    """The model's GPU when it is on one, else the current CUDA device."""
    if model_device is not None and model_device.type == "cuda" and model_device.index is not None:
        return f"cuda:{model_device.index}"
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cuda:0"


@dataclass(frozen=True)
class KeyStorePlan:
    """Where an exact search scores: the answer of ``plan_key_store``."""

    kind: str  # "shared" | "per-layer"
    nbytes: int  # the per-layer keys' bytes, and the values' when kept (0 for the shared store)
    reason: str  # one line for `unlimisum info` and the logs
    values: bool = False  # each layer's values kept beside its keys (dense steps, k >= N, or where they pay)


def plan_key_store(n_tokens: int, dim: int, layers: int, heads: int, head_dim: int, config: IndexConfig,
                   index: IndexPlan, *, queries_per_head: int = 1, retrieval_k: int = 1024,
                   free_bytes: int | None = None, speedup: Callable[[], float] | None = None,
                   support: bool = False, summary_tokens: int = 0,
                   value_sums: Callable[[], "ValueSums"] | None = None) -> KeyStorePlan:
    """The shared store or a key store per decoder layer (``layers`` x ``heads`` x ``head_dim`` numbers per token)
    for ``n_tokens`` states of width ``dim`` in the index ``index`` (the policy: this module's docstring).

    ``free_bytes``: the memory left for the store and the keys (None: measured now, beside this process or on the
    index's GPU); ``speedup()``: the key store's measured speed over the shared store's (None: measured through
    head_kernels.kernel_for with ``queries_per_head``, the beams, and ``retrieval_k``; with ``support``, the
    summary's support readings too, ``with_support``), asked only when everything else allows the key store.
    ``summary_tokens``: the most tokens the summary may write (0: values are kept for dense steps only);
    ``value_sums()``: what values cost and save here (None: measured, ``head_kernels.value_sums_for``), asked
    only for top-k steps where the values fit."""
    validate_index_config(config)
    dtype = storage_dtype(config)
    store_bytes = n_tokens * dim * dtype.itemsize
    key_bytes = n_tokens * layers * heads * head_dim * dtype.itemsize
    size = f"{layers} layers x {heads} heads x {head_dim} x {n_tokens:,} tokens ({key_bytes / 2**20:,.0f} MiB)"
    if config.key_store == "shared":
        return KeyStorePlan("shared", 0, "shared store as requested")
    if index.kind != "exact":
        return KeyStorePlan("shared", 0, f"shared store: the {index.kind} index searches the states")
    on_gpu = torch.device(index.device).type == "cuda"
    fraction = config.gpu_memory_fraction if on_gpu else KEY_STORE_MEMORY_FRACTION

    def budget_bytes() -> float:
        nonlocal free_bytes
        if free_bytes is None:
            free_bytes = free_memory(index.device)
        return fraction * free_bytes

    def per_layer(reason: str) -> KeyStorePlan:  # the keys, and the values where they fit (dense) or pay (top-k)
        if retrieval_k < n_tokens:
            values = top_k_values()
            if values is None:
                return KeyStorePlan("per-layer", key_bytes, f"per-layer keys{reason}")
            return KeyStorePlan("per-layer", 2 * key_bytes, f"per-layer keys and values ({values}, "
                                                            f"{2 * key_bytes / 2**20:,.0f} MiB){reason}", values=True)
        if store_bytes + 2 * key_bytes > budget_bytes():
            return KeyStorePlan("per-layer", key_bytes, f"per-layer keys{reason}; not the values (dense steps): "
                                                        f"they, the keys and the store, {(store_bytes + 2 * key_bytes) / 2**20:,.0f} MiB, "
                                                        f"exceed {budget_bytes() / 2**20:,.0f} MiB")
        return KeyStorePlan("per-layer", 2 * key_bytes, f"per-layer keys and values (dense steps: k >= N, "
                                                        f"{2 * key_bytes / 2**20:,.0f} MiB){reason}", values=True)

    def top_k_values() -> str | None:  # why top-k steps sum each head's values, or None: they sum the states
        if (summary_tokens <= 0 or n_tokens < KEY_STORE_MIN_TOKENS  # below: a small share of a step either way
                or store_bytes + 2 * key_bytes > budget_bytes()):
            return None
        nonlocal value_sums
        if value_sums is None:
            from unlimisum.search import head_kernels, kernels

            def value_sums() -> "ValueSums":
                return head_kernels.value_sums_for(index.device, dtype, dim, heads, head_dim,
                                                   queries_per_head=queries_per_head,
                                                   reading_queries=READING_QUERIES_PER_HEAD, k=retrieval_k,
                                                   compiled_kernels=kernels.uses_compiled(n_tokens, index.device))
        sums = value_sums()
        readings = summary_tokens / READING_TOKENS if support else 0.0
        cost = n_tokens * layers * sums.projection_seconds
        saved = layers * (summary_tokens * sums.step_seconds + readings * sums.reading_seconds)
        if saved <= cost:
            return None
        return (f"top-k steps sum each head's values: {saved:.1f} s saved over {summary_tokens:,} steps"
                f"{' and their support' if support else ''} for {cost:.1f} s of projection, measured")

    if config.key_store == "per-layer":
        return per_layer(f" as requested, {size}")
    if n_tokens < KEY_STORE_MIN_TOKENS:
        return KeyStorePlan("shared", 0, f"shared store: {n_tokens:,} tokens < {KEY_STORE_MIN_TOKENS:,}")
    budget = budget_bytes()
    if store_bytes + key_bytes > budget:
        return KeyStorePlan("shared", 0, f"shared store: per-layer keys, {size}, and the store "
                                         f"({store_bytes / 2**20:,.0f} MiB) exceed {budget / 2**20:,.0f} MiB "
                                         f"({fraction:.0%} of the memory left)")
    if speedup is None:
        from unlimisum.search import head_kernels

        def speedup() -> float:
            def measured(queries: int) -> float:
                return head_kernels.kernel_for(index.device, dtype, dim, heads, head_dim, queries_per_head=queries,
                                               k=retrieval_k).speedup

            generation = measured(queries_per_head)
            return with_support(generation, measured(READING_QUERIES_PER_HEAD)) if support else generation
    measured = speedup()
    what = " with the support readings" if support else ""
    if measured < KEY_STORE_MIN_SPEEDUP:
        return KeyStorePlan("shared", 0, f"shared store: per-layer keys measured {measured:.2f}x its speed here"
                                         f"{what}, under the {KEY_STORE_MIN_SPEEDUP}x their memory needs")
    return per_layer(f", {size}: measured {measured:.2f}x the shared store's speed{what}, and with the store "
                     f"within {budget / 2**20:,.0f} MiB")


def with_support(generation: float, reading: float) -> float:
    """The key store's speedup over the shared store for a generation and its support readings together, from the
    speedup measured for the generation's queries per head and for a reading's (``READING_QUERIES_PER_HEAD``): the
    shared store's time split as 1 : ``SUPPORT_TO_GENERATION``, each part divided by its own speedup."""
    return (1 + SUPPORT_TO_GENERATION) / (1 / generation + SUPPORT_TO_GENERATION / reading)


def free_memory(device: str) -> int:
    """Memory left for a store on ``device``: a GPU's free memory, else the usable memory beside this process."""
    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    from unlimisum.search import packed

    usable = packed.usable_memory()
    return 0 if usable is None else max(0, usable - packed.resident_memory())
