"""Loading a checkpoint: hub name or local folder, safe weights, device and dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unlimisum.models import checkpoint
from unlimisum.models.architectures import Architecture, architecture_for
from unlimisum.models.decoder_architectures import DecoderOnlyArchitecture
from unlimisum.models.precision import DtypeChoice, choose_auto_dtype
from unlimisum.config import ModelConfig
from unlimisum.errors import ConfigError, ModelError, TokenizerError

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A model ready for summarizing: weights, tokenizer, its architecture row and its name."""

    model: torch.nn.Module
    tokenizer: object
    architecture: Architecture | DecoderOnlyArchitecture  # ``architecture.kind``: "seq2seq" or "decoder-only"
    name: str
    tokenizer_name: str | None = None  # where the tokenizer came from, when not the model's own name
    fingerprint: str | None = None  # the revision: hub commit, or sizes and times of a local folder's files
    tokenizer_fingerprint: str | None = None  # a hash of the tokenizer's vocabulary, computed when first needed
    dtype_reason: str = ""  # why the weights are in their dtype ("auto: bfloat16, measured 2.4x faster...")

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return next(self.model.parameters()).dtype

    @property
    def is_decoder_only(self) -> bool:
        """A causal language model (Llama, Qwen...) rather than an encoder-decoder."""
        return self.architecture.kind == "decoder-only"

    @property
    def max_source_length(self) -> int:
        """The encoder's window in tokens: the length of one encoded window (decoder-only: its positions)."""
        if self.is_decoder_only:
            return self.architecture.max_positions(self.model.config)
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
    """``auto``: bf16 (else fp16) on GPUs; on CPU bf16 where measured faster, else float32 (see precision.py)."""
    return _choose_dtype(name, device).dtype


def _choose_dtype(name: str, device: torch.device) -> DtypeChoice:
    if name == "auto":
        return choose_auto_dtype(device)
    try:
        return DtypeChoice(_DTYPES[name], f"{name} as asked")
    except KeyError:
        raise ConfigError(f"unknown dtype '{name}'; use auto, float32, float16 or bfloat16") from None


def load_model(config: ModelConfig) -> LoadedModel:
    """Load model and tokenizer with ``from_pretrained``; safetensors preferred, pickles only weights_only.

    Everything that can be checked without the weights is checked first (the folder, its config,
    the architecture, the tokenizer), and every expected failure is a one-line ModelError.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from unlimisum.models.compat import quiet_transformers

    quiet_transformers()
    device = resolve_device(config.device)
    dtype_choice = _choose_dtype(config.dtype, device)
    dtype = dtype_choice.dtype
    remote = config.trust_remote_code
    location = checkpoint.locate(config.name)
    if location.is_local:
        checkpoint.diagnose_folder(location.folder)
    name = str(location.folder) if location.is_local else config.name
    try:
        model_config = AutoConfig.from_pretrained(name, trust_remote_code=remote)
    except (OSError, ValueError) as error:
        if location.is_local:
            raise ModelError(f"model folder '{config.name}': its config cannot be read ({_first_line(error)})") from None
        raise checkpoint.not_available(config.name) from None
    architecture = architecture_for(model_config)  # before any weights are read
    tokenizer, tokenizer_name = _load_tokenizer(config, location, remote)
    checkpoint.check_tokenizer(tokenizer, getattr(model_config, "vocab_size", None), tokenizer_name)
    try:
        auto = AutoModelForCausalLM if architecture.kind == "decoder-only" else AutoModelForSeq2SeqLM
        model = auto.from_pretrained(name, dtype=dtype, trust_remote_code=remote, weights_only=True)
        model.to(device).eval()
    except OSError as error:
        if location.is_local:
            raise ModelError(f"model folder '{config.name}': its weights cannot be read ({_first_line(error)})") from None
        raise checkpoint.not_available(config.name) from None
    except Exception as error:  # noqa: BLE001  (damaged weights, a missing extra package, out of memory)
        raise ModelError(f"model '{config.name}' could not be loaded: {_first_line(error)}") from None
    fingerprint = checkpoint.fingerprint(location, getattr(model_config, "_commit_hash", None))
    return LoadedModel(model=model, tokenizer=tokenizer, architecture=architecture, name=config.name,
                       tokenizer_name=tokenizer_name, fingerprint=fingerprint, dtype_reason=dtype_choice.reason)


def _load_tokenizer(config: ModelConfig, location: checkpoint.Location, remote: bool):
    """(tokenizer, where it came from): --tokenizer, else the model's own files, else its known base model's."""
    from transformers import AutoTokenizer

    if config.tokenizer is not None:
        wanted = checkpoint.locate_tokenizer(config.tokenizer)
        try:
            return AutoTokenizer.from_pretrained(wanted, trust_remote_code=remote), config.tokenizer
        except (OSError, ValueError) as error:
            raise TokenizerError(
                f"tokenizer '{config.tokenizer}' (--tokenizer) cannot be loaded: {_first_line(error)}"
            ) from None
    name = str(location.folder) if location.is_local else config.name
    if checkpoint.has_tokenizer_files(location):
        try:
            return AutoTokenizer.from_pretrained(name, trust_remote_code=remote), config.name
        except (OSError, ValueError) as error:
            raise TokenizerError(
                f"the tokenizer of model '{config.name}' cannot be loaded ({_first_line(error)}); "
                "pass one with --tokenizer"
            ) from None
    base = checkpoint.base_tokenizer(location)
    if base is None:
        raise TokenizerError(f"model folder '{config.name}' has no tokenizer files; pass the tokenizer it was "
                             "trained with: --tokenizer NAME_OR_DIR (a hub name or a folder)")
    try:
        return AutoTokenizer.from_pretrained(base, trust_remote_code=remote), base
    except (OSError, ValueError):
        raise TokenizerError(
            f"model '{config.name}' has no tokenizer files and its base model's tokenizer '{base}' is not "
            f"available here; fetch it (`hf download {base}`) or pass a folder with --tokenizer"
        ) from None


def _first_line(error: Exception) -> str:
    return checkpoint.first_line(error)
