"""Loading a checkpoint: hub name or local folder, safe weights, device and dtype."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from unlimisum.events import ProgressCallback
from unlimisum.models import checkpoint, weights
from unlimisum.models.hub import Hub, HubUnavailable
from unlimisum.models.architectures import Architecture, architecture_for
from unlimisum.models.decoder_architectures import DecoderOnlyArchitecture
from unlimisum.models.precision import DtypeChoice, check_asked_dtype, choose_auto_dtype
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
    dtype_warning: str | None = None  # a 16-bit dtype asked for that was measured much slower here

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
    if name not in _DTYPES:
        raise ConfigError(f"unknown dtype '{name}'; use auto, float32, float16 or bfloat16")
    return DtypeChoice(_DTYPES[name], f"{name} as asked", warning=check_asked_dtype(_DTYPES[name], device))


def load_model(config: ModelConfig, progress: ProgressCallback | None = None) -> LoadedModel:
    """Load model and tokenizer with ``from_pretrained``; safetensors preferred, pickles only weights_only.

    Everything that can be checked without the weights is checked first (the folder, its config,
    the architecture, the tokenizer), and every expected failure is a one-line ModelError. A hub
    name is fetched into the Hugging Face cache first and read from there (models/hub.py: no
    request with HF_HUB_OFFLINE, a few seconds at most to find the hub unreachable, downloads
    reported to ``progress`` as ``download`` events).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from unlimisum.models.compat import quiet_transformers

    quiet_transformers()
    device = resolve_device(config.device)
    dtype_choice = _choose_dtype(config.dtype, device)
    dtype = dtype_choice.dtype
    remote = config.trust_remote_code
    location = checkpoint.locate(config.name)
    hub = Hub(progress, code=remote)
    if location.is_local:
        checkpoint.diagnose_folder(location.folder)
        files = location
    else:  # config and tokenizer files now, the weights once the architecture is known
        files = checkpoint.Location(config.name, _fetch(hub, config.name, weights=False))
    name = str(files.folder)
    try:
        model_config = AutoConfig.from_pretrained(name, trust_remote_code=remote)
    except (OSError, ValueError) as error:
        if location.is_local:
            raise ModelError(f"model folder '{config.name}': its config cannot be read ({_first_line(error)})") from None
        raise checkpoint.not_available(config.name, hub.unavailable_reason()) from None
    architecture = architecture_for(model_config)  # before any weights are read
    tokenizer, tokenizer_name = _load_tokenizer(config, location, files, hub)
    checkpoint.check_tokenizer(tokenizer, getattr(model_config, "vocab_size", None), tokenizer_name)
    if not location.is_local:
        _fetch(hub, config.name, weights=True)
    try:
        auto = AutoModelForCausalLM if architecture.kind == "decoder-only" else AutoModelForSeq2SeqLM
        # a 32-bit safetensors checkpoint in 16 bits is read one tensor at a time (models/weights.py): a memory
        # map would hold the whole 32-bit file beside the converted weights while loading
        model = None if remote else weights.load_converted(architecture.kind, files.folder, model_config, dtype)
        if model is None:
            model = auto.from_pretrained(name, dtype=dtype, trust_remote_code=remote, weights_only=True)
        model.to(device).eval()
    except OSError as error:
        if location.is_local:
            raise ModelError(f"model folder '{config.name}': its weights cannot be read ({_first_line(error)})") from None
        raise checkpoint.not_available(config.name, hub.unavailable_reason()) from None
    except Exception as error:  # noqa: BLE001  (damaged weights, a missing extra package, out of memory)
        raise ModelError(f"model '{config.name}' could not be loaded: {_first_line(error)}") from None
    fingerprint = checkpoint.fingerprint(location, None if location.is_local else files.folder.name)
    return LoadedModel(model=model, tokenizer=tokenizer, architecture=architecture, name=config.name,
                       tokenizer_name=tokenizer_name, fingerprint=fingerprint, dtype_reason=dtype_choice.reason,
                       dtype_warning=dtype_choice.warning)


def _fetch(hub: Hub, name: str, *, weights: bool) -> Path:
    """The cached snapshot folder of hub model ``name``; ModelNotFoundError naming the downloads when none."""
    try:
        return hub.fetch(name, weights=weights)
    except HubUnavailable as problem:
        raise checkpoint.not_available(name, problem.reason, cache_only=problem.cache_only) from None


def _load_tokenizer(config: ModelConfig, location: checkpoint.Location, files: checkpoint.Location, hub: Hub):
    """(tokenizer, where it came from): --tokenizer, else the model's own files, else its known base model's.

    ``files``: the folder the model's files are in (``location``'s own, or its hub snapshot)."""
    from transformers import AutoTokenizer

    remote = config.trust_remote_code
    if config.tokenizer is not None:
        wanted = checkpoint.locate_tokenizer(config.tokenizer)
        try:
            if not checkpoint.locate(wanted).is_local:
                wanted = str(hub.fetch(wanted, weights=False))
            return AutoTokenizer.from_pretrained(wanted, trust_remote_code=remote), config.tokenizer
        except HubUnavailable as problem:
            raise TokenizerError(f"tokenizer '{config.tokenizer}' (--tokenizer) is not available: {problem.reason}; "
                                 f"fetch it with `{checkpoint.tokenizer_download(config.tokenizer)}`") from None
        except (OSError, ValueError) as error:
            raise TokenizerError(
                f"tokenizer '{config.tokenizer}' (--tokenizer) cannot be loaded: {_first_line(error)}"
            ) from None
    if checkpoint.has_tokenizer_files(files):
        try:
            return AutoTokenizer.from_pretrained(str(files.folder), trust_remote_code=remote), config.name
        except (OSError, ValueError) as error:
            raise TokenizerError(
                f"the tokenizer of model '{config.name}' cannot be loaded ({_first_line(error)}); "
                "pass one with --tokenizer"
            ) from None
    base = checkpoint.base_tokenizer(files)
    what = "model folder" if location.is_local else "model"
    if base is None:
        raise TokenizerError(f"{what} '{config.name}' has no tokenizer files; pass the tokenizer it was "
                             "trained with: --tokenizer NAME_OR_DIR (a hub name or a folder)")
    advice = f"fetch it (`{checkpoint.tokenizer_download(base)}`) or pass a folder with --tokenizer"
    try:
        return AutoTokenizer.from_pretrained(str(hub.fetch(base, weights=False)), trust_remote_code=remote), base
    except HubUnavailable as problem:
        raise TokenizerError(f"{what} '{config.name}' has no tokenizer files and its base model's tokenizer "
                             f"'{base}' is not available ({problem.reason}); {advice}") from None
    except (OSError, ValueError):
        raise TokenizerError(
            f"{what} '{config.name}' has no tokenizer files and its base model's tokenizer '{base}' is not "
            f"available here; {advice}"
        ) from None


def _first_line(error: Exception) -> str:
    return checkpoint.first_line(error)
