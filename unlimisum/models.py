"""Loading a checkpoint: hub name or local folder, safe weights, device and dtype."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from unlimisum.architectures import Architecture, architecture_for
from unlimisum.config import ModelConfig
from unlimisum.errors import ConfigError, ModelError, ModelNotFoundError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for summarizing: weights, tokenizer, its architecture row and its name."""

    model: torch.nn.Module
    tokenizer: object
    architecture: Architecture
    name: str

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return next(self.model.parameters()).dtype

    @property
    def max_source_length(self) -> int:
        """The encoder's window in tokens: the length of one encoded window."""
        return self.architecture.max_source_length(self.model.config, self.tokenizer)

    @property
    def max_target_length(self) -> int | None:
        """Positions the decoder has learned embeddings for; None for relative positions (T5: no limit)."""
        config = self.model.config
        for name in ("max_decoder_position_embeddings", "max_position_embeddings", "n_positions"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else CPU; anything else must name an available device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"unknown device '{name}'; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{name}' asked for, but CUDA is not available on this machine")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps' asked for, but MPS is not available on this machine")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on CPU (16-bit matmuls are slow there) and bf16, else fp16, on GPUs."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float16 if device.type == "mps" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype '{name}'; use auto, float32, float16 or bfloat16") from None


def _not_found(name: str, error: Exception) -> ModelNotFoundError:
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}
    how = (
        "HF_HUB_OFFLINE is set, so only the local cache is searched"
        if offline
        else "it is not a local folder and could not be fetched from the Hugging Face hub"
    )
    return ModelNotFoundError(
        f"model '{name}' is not available: {how}; fetch it on a connected machine with "
        f"`huggingface-cli download {name}` (cache: HF_HOME) or pass a local folder with --model "
        f"({type(error).__name__})"
    )


def load_model(config: ModelConfig) -> LoadedModel:
    """Load model and tokenizer with ``from_pretrained``; safetensors preferred, pickles only weights_only."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    from unlimisum.compat import quiet_transformers

    quiet_transformers()
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    remote = config.trust_remote_code
    local = Path(config.name).expanduser()
    name = str(local) if local.is_dir() else config.name
    try:
        model_config = AutoConfig.from_pretrained(name, trust_remote_code=remote)
    except (OSError, ValueError) as error:
        raise _not_found(config.name, error) from None
    architecture = architecture_for(model_config)  # before any weights are read
    try:
        model = AutoModelForSeq2SeqLM.from_pretrained(name, dtype=dtype, trust_remote_code=remote, weights_only=True)
        tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or name, trust_remote_code=remote)
        model.to(device).eval()
    except OSError as error:
        raise _not_found(config.tokenizer or config.name, error) from None
    except (ImportError, ValueError, RuntimeError) as error:  # a missing extra package, bad files, out of memory
        raise ModelError(f"model '{config.name}' could not be loaded: {error}") from None
    return LoadedModel(model=model, tokenizer=tokenizer, architecture=architecture, name=config.name)
