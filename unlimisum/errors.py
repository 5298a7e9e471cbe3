"""Errors for people: every failure unlimisum expects is an UnlimisumError.

The message is one line that names the input (when there is one) and the problem.
The CLI prints ``str(error)`` on stderr and exits non-zero; library users can catch
the subclasses they care about.
"""

from __future__ import annotations

from pathlib import Path


class UnlimisumError(Exception):
    """Base class: ``str(err)`` is ``"<source>: <problem>"`` or just ``"<problem>"``."""

    def __init__(self, problem: str, source: str | Path | None = None):
        self.problem = " ".join(str(problem).split())  # always one line
        self.source = str(source) if source is not None else None
        super().__init__(self.problem)

    def __str__(self) -> str:
        return f"{self.source}: {self.problem}" if self.source else self.problem


class UnlimisumWarning(UserWarning):
    """Base class of unlimisum's warnings: the message is one line for the reader, starting ``unlimisum:`` (the CLI
    prints it as it is, without the file and line a warning otherwise carries)."""


def install_hint(extra: str) -> str:
    """How to install the optional ``extra``: from the package index, and in a clone of the repository."""
    return f'pip install "unlimisum[{extra}]" (in a clone of unlimisum: pip install -e ".[{extra}]")'


# --- reading inputs -------------------------------------------------------------------


class InputError(UnlimisumError):
    """An input cannot be read as a document."""


class InputNotFoundError(InputError):
    """The path does not exist or is not a regular file or directory."""


class UnsupportedFormatError(InputError):
    """The file is not text, EPUB or PDF (judged by content, not by extension)."""


class EmptyDocumentError(InputError):
    """The file is empty, or holds only whitespace."""


class NoTextError(InputError):
    """The file opens but holds no extractable text (image-only PDF, fixed-layout EPUB)."""


class CorruptFileError(InputError):
    """The file is truncated, malformed or not what its structure claims."""


class UnsafeFileError(InputError):
    """The file tries something dangerous: zip bomb, path traversal, external entities."""


class PasswordRequiredError(InputError):
    """The PDF needs a password, or the password given is wrong."""


class InputTooLargeError(InputError):
    """The file is larger than the ingestion limits allow (see IngestLimits)."""


# --- models and configuration -----------------------------------------------------------


class ConfigError(UnlimisumError):
    """An option has an invalid value or options contradict each other."""


class ModelError(UnlimisumError):
    """The model cannot be loaded or used."""


class ModelNotFoundError(ModelError):
    """The model name is neither a local folder nor available from the hub or its cache."""


class TokenizerError(ModelError):
    """The tokenizer is missing, or cannot encode text sensibly (not the model's own)."""


class UnsupportedModelError(ModelError):
    """The model's architecture has no row in unlimisum's architecture table."""
