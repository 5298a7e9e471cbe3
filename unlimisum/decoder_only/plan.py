"""How one prompt is read: the window, sinks, k, the position regime and where the store lives.

``plan_retrieval`` decides it all before the first chunk is read, from the prompt length, the
summary length and the model's positions, and checks that what the model will see stays within
the positions it was trained with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unlimisum.config import DEFAULT_RETRIEVAL_K, DecoderOnlyConfig, IndexConfig
from unlimisum.errors import ConfigError

DEFAULT_WINDOW = 4096  # exact local window: a few thousand tokens, at most a quarter of the model's positions
MIN_SINKS = 4  # the first tokens draw attention mass whatever they say (StreamingLLM's attention sinks)
PREFILL_SELECTIONS = ("blocks", "tokens")


@dataclass(frozen=True)
class RetrievalPlan:
    """Everything the cache and the attention function need to read one prompt and generate after it."""

    prompt_tokens: int  # tokens the store holds: the prompt (all but the last token, which generate() reads)
    window: int  # W: exact local window (the whole prompt where it is read exactly)
    sinks: int  # S: the prompt's first tokens, attended exactly by every query
    retrieval_k: int  # far tokens per KV head and query (decode) or per chunk (blocks)
    block_size: int
    block_representatives: int
    prefill_selection: str  # "blocks" | "tokens"
    fixed_distance: int | None  # None: true positions; else far tokens sit this far before every query
    max_new_tokens: int = 0  # the most tokens generate() adds after the prompt
    storage_dtype: torch.dtype = torch.bfloat16
    keys_device: torch.device = torch.device("cpu")
    values_device: torch.device = torch.device("cpu")
    chunk: int | None = None  # tokens read per forward of the prefill; None: the window

    def __post_init__(self):
        if self.chunk is None:
            object.__setattr__(self, "chunk", self.window)

    @property
    def true_positions(self) -> bool:
        return self.fixed_distance is None

    @property
    def exact(self) -> bool:
        """Whether every query attends to the whole prompt (the window holds it): the model's own attention."""
        return self.window >= self.prompt_tokens


def default_window(max_positions: int) -> int:
    """DEFAULT_WINDOW tokens, at most a quarter of the model's positions: the window of a prompt beyond them,
    and the prefill's chunk."""
    return max(1, min(DEFAULT_WINDOW, max_positions // 4))


def default_retrieval_k(window: int) -> int:
    """Far tokens per KV head when none is asked for: the window, at most DEFAULT_RETRIEVAL_K."""
    return min(window, DEFAULT_RETRIEVAL_K)


def kv_shape(model_config) -> tuple[int, int]:
    """(key-value heads, head dim) of a decoder-only config (no num_key_value_heads: one per query head)."""
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return kv_heads, head_dim


def store_bytes_per_token(model_config, layer_windows: list[int | None], dtype: torch.dtype) -> int:
    """Bytes the store holds per prompt token: 2 (keys, values) x full-attention layers x KV heads x head dim x
    the storage dtype's size (sliding-window layers keep their window only)."""
    kv_heads, head_dim = kv_shape(model_config)
    full_layers = sum(window is None for window in layer_windows)
    return 2 * full_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def plan_retrieval(*, prompt_tokens: int, text_start: int, max_new_tokens: int, max_positions: int,
                   window: int | None, retrieval_k: int, config: DecoderOnlyConfig,
                   storage_dtype: torch.dtype = torch.bfloat16, keys_device="cpu", values_device="cpu") -> RetrievalPlan:
    """The plan for a prompt of ``prompt_tokens`` whose text starts at token ``text_start``.

    True positions while prompt + summary fit ``max_positions``; beyond, far tokens at a fixed distance of
    one window, sinks just before them. ConfigError when the model would see distances it was not trained on.
    ``window`` None: where the prompt and summary fit, the whole prompt is the window (read exactly, as the
    model itself would, in chunks of ``default_window``); beyond, ``default_window``.
    """
    fits = prompt_tokens + 1 + max_new_tokens <= max_positions
    chunk = None
    if window is None:
        window = default_window(max_positions)
        if fits:
            window, chunk = max(window, prompt_tokens), window
    if window < 1:
        raise ConfigError(f"the local window must be at least 1 token, got {window}")
    if retrieval_k < 1:
        raise ConfigError(f"retrieval k must be at least 1, got {retrieval_k}")
    if config.prefill_selection not in PREFILL_SELECTIONS:
        raise ConfigError(f"prefill_selection must be blocks or tokens, not {config.prefill_selection!r}")
    if config.block_size < 1 or config.block_representatives < 1:
        raise ConfigError("block_size and block_representatives must be at least 1")
    sinks = config.sinks if config.sinks is not None else max(MIN_SINKS, text_start)
    if sinks < 0:
        raise ConfigError(f"sinks must be at least 0, got {sinks}")
    sinks = min(sinks, prompt_tokens)
    fixed_distance = None
    if not fits:
        # the farthest the model then looks: a chunk's window (2W - 1), the window plus the summary, the sinks
        farthest = window + max(window - 1, max_new_tokens + 1, sinks)
        if farthest > max_positions:
            raise ConfigError(
                f"the prompt ({prompt_tokens + 1:,} tokens) and summary do not fit the model's {max_positions:,} "
                f"positions, and with a window of {window:,} tokens, {sinks:,} sinks and {max_new_tokens:,} new "
                f"tokens it would look {farthest:,} positions back; lower --window or --max-new-tokens")
        fixed_distance = window
    block_size = min(config.block_size, window)
    return RetrievalPlan(
        prompt_tokens=prompt_tokens, window=window, sinks=sinks, retrieval_k=retrieval_k, block_size=block_size,
        block_representatives=config.block_representatives, prefill_selection=config.prefill_selection,
        fixed_distance=fixed_distance, max_new_tokens=max_new_tokens, storage_dtype=storage_dtype,
        keys_device=torch.device(keys_device), values_device=torch.device(values_device), chunk=chunk,
    )


def store_devices(keys_bytes: int, values_bytes: int, index: IndexConfig, model_device: torch.device,
                  cuda_free_bytes: int | None = None) -> tuple[torch.device, torch.device, str]:
    """(keys device, values device, reason) for a store of that many bytes, by ``index.device``.

    auto: with the model on a GPU, keys and values there when both fit in ``gpu_memory_fraction`` of its free
    memory; else only the keys (the search runs there; the k values of each step come from the CPU); else the
    CPU. "cpu" and "gpu" say where both go.
    """
    model_device = torch.device(model_device)
    cpu = torch.device("cpu")
    if index.device == "cpu":
        return cpu, cpu, "on the CPU, as asked"
    if index.device == "gpu":
        if not torch.cuda.is_available():
            raise ConfigError("--index-device gpu asked for, but CUDA is not available on this machine")
        gpu = model_device if model_device.type == "cuda" else torch.device("cuda")
        return gpu, gpu, "on the GPU, as asked"
    if model_device.type != "cuda":
        return cpu, cpu, "on the CPU, with the model"
    free = cuda_free_bytes if cuda_free_bytes is not None else torch.cuda.mem_get_info(model_device)[0]
    budget = index.gpu_memory_fraction * free
    if keys_bytes + values_bytes <= budget:
        return model_device, model_device, "keys and values on the GPU"
    if keys_bytes <= budget:
        return model_device, cpu, "keys on the GPU, values on the CPU (both do not fit)"
    return cpu, cpu, "on the CPU: the keys do not fit in the GPU's free memory"
