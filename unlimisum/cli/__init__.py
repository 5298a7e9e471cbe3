"""The command-line interface: a thin layer over the library.

Each command lives in its own module and registers itself on ``app``; it parses options into the
library's configs, calls the library (``unlimisum.runs`` for `summarize` batches,
``unlimisum.diagnostics`` for `info`, ``unlimisum.training``, ...) and renders: ``progress`` and
``batch_progress`` draw on stderr with Rich (``ProgressDisplay`` is the runner's Reporter). Nothing
below this package imports it.
"""

from unlimisum.cli.app import app, main
from unlimisum.cli import summarize as _summarize  # noqa: F401  (registers `summarize`)
from unlimisum.cli import ingest as _ingest  # noqa: F401  (registers `ingest`)
from unlimisum.cli import info as _info  # noqa: F401  (registers `info`)
from unlimisum.cli import tc as _tc  # noqa: F401  (registers `tc fit`)
from unlimisum.cli import cache as _cache  # noqa: F401  (registers `cache list|prune|clear`)
from unlimisum.cli import evaluate as _evaluate  # noqa: F401  (registers `evaluate`)
from unlimisum.cli import train as _train  # noqa: F401  (registers `train`)

__all__ = ["app", "main"]
