"""The command-line interface: a thin layer over the library.

Each command lives in its own module and registers itself on ``app``.
"""

from unlimisum.cli.app import app, main
from unlimisum.cli import ingest as _ingest  # noqa: F401  (registers `ingest`)

__all__ = ["app", "main"]
