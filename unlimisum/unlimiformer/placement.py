"""Where the datastore lives and which index it uses: ``plan_index`` -> ``IndexPlan``.

The policy in one paragraph (the numbers come from bench/index_choice.py):

- On a GPU the store is always exact: a brute-force matmul over N 16-bit states reads
  N*d*2 bytes per search, which a GPU does in well under a millisecond even at 500k
  tokens, so an approximate index would only lose attention mass. The GPU is used when
  CUDA is present and the store takes at most ``gpu_memory_fraction`` of free memory.
- On the CPU the store is exact up to ``exact_max_tokens`` and approximate above
  (``approximate_kind``, IVF by measurement: HNSW with inner product recalls far less
  attention mass and is slower to build and to search).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unlimisum.config import IndexConfig
from unlimisum.errors import ConfigError

KINDS = ("exact", "ivf", "hnsw")
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
    the documented precision of scores (unlimisum/unlimiformer/kernels.py). The choice never depends on the
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
