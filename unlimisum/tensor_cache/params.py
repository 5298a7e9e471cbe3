"""The fitted Tensor Cache constants (λ, η, g and the memory projection per layer) and their safetensors file.

File layout (``tc fit --out tc.safetensors``), format ``unlimisum-tensor-cache/4``:
    decay_logit        [L, H_kv]            λ = sigmoid(decay_logit)
    write_logit        [L, H_kv]            η = sigmoid(write_logit)
    gate_logit         [L, G]               γ = sigmoid(gate_logit); G = 1 (one gate per layer) or H (per head)
    memory_projection  [L, d_model, H d_v]  optional: each layer's own projection of the memory read,
                                            y = out_proj(local) + γ · memory_projection(r); absent: the
                                            read goes through out_proj (tied), y = out_proj(local + γ r)
    memory_query_map   [L, H, d_k, d_k]     optional: the memory is read with M_h q instead of q
    memory_write_gate  [L, H_kv, d_k + 1]   optional: weights u and bias c of the write gate, each evicted key
                                            written with strength 2 sigmoid(u·k̂ + c); absent: strength 1
metadata (strings): format, window (the W it was fitted with), normalize_keys, normalize_read,
lag, model_type, model_name, projection ("own" or "tied"), and ``report`` (the fit's JSON numbers).
Files of formats ``unlimisum-tensor-cache/1`` (no projection: always tied), ``/2`` (no query map) and ``/3``
(no write gate) still load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unlimisum.errors import ConfigError
from unlimisum.files import atomic_write_bytes
from unlimisum.tensor_cache.streaming import MemoryParams

FORMAT = "unlimisum-tensor-cache/4"
# /1: written before the memory had its own projection; /2: before it had a query map; /3: before the write gate
READABLE_FORMATS = ("unlimisum-tensor-cache/1", "unlimisum-tensor-cache/2", "unlimisum-tensor-cache/3", FORMAT)
INIT_DECAY = 0.995  # λ0 of the paper's code
INIT_WRITE_RATE = 0.05  # η0 of the paper's code
INIT_GATE_LOGIT = -4.0  # g0 for fitting a pretrained model: γ0 ≈ 0.018, close to the sliding window (SPEC §5)


def logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@dataclass(frozen=True)
class TensorCacheParams:
    """Per-layer logits of λ, η and the gate, and the flags they were fitted with."""

    decay_logit: torch.Tensor  # [L, H_kv]
    write_logit: torch.Tensor  # [L, H_kv]
    gate_logit: torch.Tensor  # [L, G], G = 1 or H
    window: int  # the W used when fitting
    normalize_keys: bool = True  # k̂ = k/‖k‖ written to A
    normalize_read: bool = True  # read divided by max(|q·z|, 1): bounds ‖r‖ for pretrained query norms (SPEC §3)
    lag: int = 0  # canonical: the evicted token is readable at once
    model_type: str = ""  # config.model_type it was fitted on
    model_name: str = ""  # the checkpoint it was fitted on (informational)
    report: dict = field(default_factory=dict)  # the fit's numbers, stored in the file's metadata
    # [L, d_model, H d_v]: each layer's own projection of the memory read; None: the layer's output projection (tied)
    memory_projection: torch.Tensor | None = None
    # [L, H, d_k, d_k]: the memory is read with M_h q instead of the layer's query q; None: q itself
    memory_query_map: torch.Tensor | None = None
    # [L, H_kv, d_k + 1]: each layer's write gate (MemoryParams.write_gate); None: every evicted key written alike
    memory_write_gate: torch.Tensor | None = None

    @property
    def num_layers(self) -> int:
        return self.decay_logit.shape[0]

    @property
    def projection(self) -> str:
        """'own' when the memory read has its own projection per layer, 'tied' when it shares out_proj."""
        return "tied" if self.memory_projection is None else "own"

    @classmethod
    def initial(cls, num_layers: int, kv_heads: int, window: int, gate_heads: int = 1, *,
                decay: float = INIT_DECAY, write_rate: float = INIT_WRITE_RATE, gate_logit: float = INIT_GATE_LOGIT,
                **flags) -> "TensorCacheParams":
        """Starting values for fitting."""
        return cls(
            decay_logit=torch.full((num_layers, kv_heads), logit(decay)),
            write_logit=torch.full((num_layers, kv_heads), logit(write_rate)),
            gate_logit=torch.full((num_layers, gate_heads), float(gate_logit)),
            window=window, **flags,
        )

    def layer_params(self, heads: int, window: int | None = None, dtype: torch.dtype = torch.float32,
                     device=None) -> list[MemoryParams]:
        """MemoryParams per layer for a decoder with ``heads`` query heads, at ``window`` (default: fitted W)."""
        window = self.window if window is None else window
        gate = torch.sigmoid(self.gate_logit.to(dtype))  # [L, G]
        if gate.shape[1] not in (1, heads):
            raise ConfigError(f"the Tensor Cache file has {gate.shape[1]} gates per layer; the model has {heads} heads")
        return [
            MemoryParams(
                window=window,
                decay=torch.sigmoid(self.decay_logit[layer].to(dtype)).to(device),
                write_rate=torch.sigmoid(self.write_logit[layer].to(dtype)).to(device),
                gate=gate[layer].expand(heads).contiguous().to(device),
                normalize_keys=self.normalize_keys, normalize_read=self.normalize_read, lag=self.lag,
                projection=None if self.memory_projection is None else self.memory_projection[layer].to(dtype).to(device),
                query_map=None if self.memory_query_map is None else self.memory_query_map[layer].to(dtype).to(device),
                write_gate=None if self.memory_write_gate is None else self.memory_write_gate[layer].to(dtype).to(device),
            )
            for layer in range(self.num_layers)
        ]


def closed_layer_params(num_layers: int, kv_heads: int, window: int, dtype: torch.dtype = torch.float32,
                        device=None) -> list[MemoryParams]:
    """MemoryParams with the gate closed exactly (sliding-window attention, no memory kept)."""
    return [
        MemoryParams(
            window=window, decay=torch.full((kv_heads,), INIT_DECAY, dtype=dtype, device=device),
            write_rate=torch.full((kv_heads,), INIT_WRITE_RATE, dtype=dtype, device=device), gate=None,
        )
        for _ in range(num_layers)
    ]


def save_params(params: TensorCacheParams, path: str | Path) -> Path:
    """Write ``params`` to a safetensors file, atomically (an interrupted fit leaves no truncated file)."""
    from safetensors.torch import save

    tensors = {
        "decay_logit": params.decay_logit.detach().float().contiguous().cpu(),
        "write_logit": params.write_logit.detach().float().contiguous().cpu(),
        "gate_logit": params.gate_logit.detach().float().contiguous().cpu(),
    }
    if params.memory_projection is not None:
        tensors["memory_projection"] = params.memory_projection.detach().float().contiguous().cpu()
    if params.memory_query_map is not None:
        tensors["memory_query_map"] = params.memory_query_map.detach().float().contiguous().cpu()
    if params.memory_write_gate is not None:
        tensors["memory_write_gate"] = params.memory_write_gate.detach().float().contiguous().cpu()
    metadata = {
        "format": FORMAT,
        "window": str(params.window),
        "normalize_keys": str(int(params.normalize_keys)),
        "normalize_read": str(int(params.normalize_read)),
        "lag": str(params.lag),
        "model_type": params.model_type,
        "model_name": params.model_name,
        "projection": params.projection,
        "report": json.dumps(params.report),
    }
    return atomic_write_bytes(path, save(tensors, metadata=metadata))


def load_params(path: str | Path) -> TensorCacheParams:
    """Read a file written by ``save_params``; ConfigError names the file and the problem."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ConfigError("Tensor Cache parameter file not found", source=path)
    try:
        with safe_open(str(path), framework="pt") as file:
            metadata = file.metadata() or {}
            tensors = {name: file.get_tensor(name) for name in file.keys()}
    except Exception as error:  # safetensors raises its own types for bad headers
        raise ConfigError(f"not a Tensor Cache parameter file ({type(error).__name__}: {error})", source=path) from None
    if metadata.get("format") not in READABLE_FORMATS:
        if str(metadata.get("format", "")).startswith("unlimisum-tensor-cache/"):
            raise ConfigError(f"Tensor Cache parameter file of a newer format ({metadata['format']}); "
                              f"this unlimisum reads {', '.join(READABLE_FORMATS)}: upgrade unlimisum", source=path)
        raise ConfigError(f"not a Tensor Cache parameter file (format {metadata.get('format')!r}, expected {FORMAT!r})", source=path)
    missing = {"decay_logit", "write_logit", "gate_logit"} - set(tensors)
    if missing:
        raise ConfigError(f"Tensor Cache parameter file lacks {', '.join(sorted(missing))}", source=path)
    shapes = {name: tuple(tensors[name].shape) for name in ("decay_logit", "write_logit", "gate_logit")}
    if len({shape[0] for shape in shapes.values()}) != 1 or any(len(shape) != 2 for shape in shapes.values()) \
            or shapes["decay_logit"] != shapes["write_logit"]:
        raise ConfigError(f"inconsistent tensor shapes in Tensor Cache parameter file: {shapes}", source=path)
    layers = shapes["decay_logit"][0]
    projection = tensors.get("memory_projection") if metadata["format"] != READABLE_FORMATS[0] else None
    if projection is not None and (projection.dim() != 3 or projection.shape[0] != layers):
        raise ConfigError(f"memory_projection of shape {tuple(projection.shape)} does not fit "
                          f"{layers} layers in Tensor Cache parameter file", source=path)
    query_map = tensors.get("memory_query_map") if metadata["format"] in READABLE_FORMATS[2:] else None
    if query_map is not None and (query_map.dim() != 4 or query_map.shape[0] != layers
                                  or query_map.shape[2] != query_map.shape[3]):
        raise ConfigError(f"memory_query_map of shape {tuple(query_map.shape)} does not fit "
                          f"{layers} layers of square maps in Tensor Cache parameter file", source=path)
    write_gate = tensors.get("memory_write_gate") if metadata["format"] == FORMAT else None
    if write_gate is not None and (write_gate.dim() != 3 or write_gate.shape[:2] != (layers, shapes["decay_logit"][1])):
        raise ConfigError(f"memory_write_gate of shape {tuple(write_gate.shape)} does not fit "
                          f"{layers} layers x {shapes['decay_logit'][1]} heads in Tensor Cache parameter file", source=path)
    try:
        return TensorCacheParams(
            decay_logit=tensors["decay_logit"], write_logit=tensors["write_logit"], gate_logit=tensors["gate_logit"],
            memory_projection=projection, memory_query_map=query_map, memory_write_gate=write_gate,
            window=int(metadata.get("window", 0)), normalize_keys=metadata.get("normalize_keys", "1") == "1",
            normalize_read=metadata.get("normalize_read", "1") == "1", lag=int(metadata.get("lag", "0")),
            model_type=metadata.get("model_type", ""), model_name=metadata.get("model_name", ""),
            report=json.loads(metadata.get("report", "{}") or "{}"),
        )
    except ValueError as error:  # int() of a bad window or lag, or a report that is not JSON
        raise ConfigError(f"bad metadata in Tensor Cache parameter file: {error}", source=path) from None
