"""What a model name points at, and what is wrong with it when it cannot be loaded.

``locate`` tells a local folder from a hub name before anything is read, so that a missing
folder is reported as a missing folder; ``check_tokenizer`` refuses a tokenizer that cannot
encode text sensibly (transformers builds a five-token stand-in when a folder has no
tokenizer files, which would turn a book into two tokens and an empty summary).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from unlimisum.errors import ModelError, ModelNotFoundError, TokenizerError

# Files any tokenizer that transformers can load is made of (one of them suffices).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "spiece.model",
    "sentencepiece.bpe.model", "source.spm", "tokenizer.model",
)
# A tokenizer whose vocabulary is below this share of the model's embedding rows is not the
# model's own (checkpoints round their embeddings up by a few rows, never by half).
MIN_VOCABULARY_SHARE = 0.5
# Checkpoints published without tokenizer files, and the tokenizer they were trained with.
KNOWN_BASE_TOKENIZERS = (
    (re.compile(r"^abertsch/(unlimiformer-)?bart-"), "facebook/bart-base"),
)
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class Location:
    """Where a model name points: a local folder, or a name on the hub (or in its cache)."""

    name: str  # as the user gave it
    folder: Path | None  # the local folder, when the name is one

    @property
    def is_local(self) -> bool:
        return self.folder is not None


def locate(name: str) -> Location:
    """A local folder when ``name`` is one (or is written as a path); else a hub name.

    Raises ModelNotFoundError for a path that does not exist, or exists but is not a folder.
    """
    path = Path(name).expanduser()
    if path.is_dir():
        return Location(name, path)
    written_as_path = name.startswith(("/", "./", "../", "~", ".\\")) or name.endswith(("/", "\\")) \
        or name.count("/") > 1 or not _HUB_NAME.match(name)
    if path.exists():
        raise ModelNotFoundError(f"model '{name}' is a file, not a model folder")
    if written_as_path:
        raise ModelNotFoundError(f"model folder '{name}' does not exist")
    return Location(name, None)


def locate_tokenizer(name: str) -> str:
    """The name to load a --tokenizer from; a path that does not exist is a TokenizerError."""
    try:
        location = locate(name)
    except ModelNotFoundError:
        raise TokenizerError(f"tokenizer '{name}' (--tokenizer) does not exist: give a hub name or a folder "
                             "with tokenizer files") from None
    if location.is_local and not has_tokenizer_files(location):
        raise TokenizerError(f"tokenizer folder '{name}' (--tokenizer) has no tokenizer files")
    return str(location.folder) if location.is_local else name


def diagnose_folder(folder: Path) -> None:
    """Raise ModelError when a local folder cannot hold a model: no config.json, or an invalid one."""
    config = folder / "config.json"
    if not config.is_file():
        raise ModelNotFoundError(f"model folder '{folder}' has no config.json, so it holds no saved model")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ModelError(f"model folder '{folder}': config.json is not valid JSON ({first_line(error)})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelError(f"model folder '{folder}': config.json has no model_type, so it is not a model config")


def not_available(name: str, reason: str | None = None, *, cache_only: bool = True) -> ModelNotFoundError:
    """The error for a hub name that is neither cached nor downloadable: ``reason`` says why the hub did
    not serve it; ``cache_only`` (offline, the hub unreachable) adds every download a connected machine
    has to make, the tokenizer of a checkpoint published without one included."""
    if reason is None:
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in {"1", "true", "yes"}
        reason = ("HF_HUB_OFFLINE is set, so only the local cache is searched" if offline
                  else "it is not a local folder and could not be fetched from the Hugging Face hub")
    if not cache_only:
        return ModelNotFoundError(f"model '{name}' is not available: {reason}; check the name, or pass a local "
                                  "folder with --model")
    downloads = f"fetch it with `hf download {name}`"
    base = known_base_tokenizer(name)
    if base is not None:
        downloads += f" and its tokenizer with `{tokenizer_download(base)}`"
    return ModelNotFoundError(
        f"model '{name}' is not available: {reason}, and it is not in the local cache; on a connected machine, "
        f"{downloads} (the cache is in HF_HOME), or pass a local folder with --model"
    )


def tokenizer_download(name: str) -> str:
    """The command that fetches a hub model's tokenizer files only (not its weights, in several formats)."""
    return f'hf download {name} --include "*.json" --include "*.txt" --include "*.model"'


def known_base_tokenizer(name: str) -> str | None:
    """The tokenizer a known checkpoint published without tokenizer files was trained with (no file read)."""
    for pattern, tokenizer in KNOWN_BASE_TOKENIZERS:
        if pattern.match(name):
            return tokenizer
    return None


def has_tokenizer_files(location: Location) -> bool:
    """True when a local folder holds tokenizer files; hub names are assumed to (their loader says if not)."""
    if not location.is_local:
        return True
    return any((location.folder / name).is_file() for name in TOKENIZER_FILES)


def base_tokenizer(location: Location) -> str | None:
    """The tokenizer a checkpoint without tokenizer files was trained with, when known.

    From the table of known checkpoints, else the hub name its config.json was saved from.
    """
    known = known_base_tokenizer(location.name)
    if known is not None:
        return known
    config = _raw_config(location)
    saved_from = config.get("_name_or_path") if config else None
    if isinstance(saved_from, str) and saved_from != location.name and _HUB_NAME.match(saved_from) \
            and not Path(saved_from).expanduser().exists():
        return saved_from
    return None


def check_tokenizer(tokenizer, vocab_size: int | None, source: str) -> None:
    """Raise TokenizerError when ``tokenizer`` is far smaller than the model's vocabulary."""
    size = len(tokenizer)
    if vocab_size and size < MIN_VOCABULARY_SHARE * vocab_size:
        raise TokenizerError(
            f"the tokenizer of '{source}' has {size:,} tokens but the model has {vocab_size:,}: it is not the "
            f"model's tokenizer; pass the right one with --tokenizer"
        )


def check_encoding(n_tokens: int, n_special: int, n_unknown: int, text: str, source: str | None = None) -> None:
    """Raise TokenizerError when a text came out as (nearly) nothing, or (nearly) all unknown tokens."""
    words = len(text.split())
    content = n_tokens - n_special
    if words >= 20 and content < 0.2 * words:
        raise TokenizerError(
            f"{words:,} words became {content:,} tokens: the tokenizer cannot encode this text "
            "(is it the model's own? see --tokenizer)", source=source
        )
    if content >= 20 and n_unknown > 0.5 * content:
        raise TokenizerError(
            f"{n_unknown:,} of {content:,} tokens are unknown to the tokenizer: it cannot encode this text "
            "(is it the model's own? see --tokenizer)", source=source
        )


def _raw_config(location: Location) -> dict | None:
    try:
        if location.is_local:
            path = location.folder / "config.json"
        else:
            from transformers.utils import cached_file

            path = cached_file(location.name, "config.json", _raise_exceptions_for_missing_entries=False)
            if path is None:
                return None
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001  (only a hint for an error message: no hint is fine)
        return None


def fingerprint(location: Location, commit_hash: str | None) -> str | None:
    """What identifies these weights: the hub commit, or a hash of a local folder's file names, sizes and
    modification times (a re-saved or fine-tuned folder changes it)."""
    if not location.is_local:
        return commit_hash
    import hashlib

    digest = hashlib.sha256()
    for path in sorted(location.folder.iterdir()):
        if path.is_file() and path.suffix in {".json", ".safetensors", ".bin", ".model", ".txt"}:
            info = path.stat()
            digest.update(f"{path.name}:{info.st_size}:{info.st_mtime_ns};".encode())
    return "folder:" + digest.hexdigest()[:16]


def first_line(error: Exception) -> str:
    """The first line of an error's message, without the exception type (one-line errors)."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
