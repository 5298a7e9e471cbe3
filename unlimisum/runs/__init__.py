"""Batch runs as a library: the jobs of a `summarize` invocation, run here or on a Ray cluster.

``jobs`` plans them (inputs found and checked, output names), ``runner`` runs them in this process
(``BatchRunner``: read, summarize, write atomically, report), ``ray`` on Ray workers with the same
steps, so both engines produce the same files, stdout, failure lines and exit codes. ``output``
renders summaries (Markdown, JSON) and writes them, ``manifest`` records a run, ``run_config`` reads
``--config`` files, ``report`` is the protocol the runner reports through. Nothing here imports the
CLI: it hands in a reporter and a writer of stdout.
"""

from __future__ import annotations

from unlimisum.errors import ConfigError, install_hint

ENGINES = ("local", "ray")
RAY_EXTRA_HINT = install_hint("ray")


class EngineUnavailableError(ConfigError):
    """The engine asked for needs a package that is not installed."""


def require_ray():
    """The ``ray`` module; EngineUnavailableError naming the extra when Ray is not installed."""
    try:
        import ray
    except ImportError:
        raise EngineUnavailableError(f"--engine ray needs Ray, which is not installed: {RAY_EXTRA_HINT}") from None
    return ray
