"""Where a batch of `summarize` runs: ``local`` (this process) or ``ray`` (a Ray cluster).

Both engines take the same jobs (planned and checked on the driver by ``unlimisum.cli.jobs``)
and the same settings, and produce the same files, stdout, failure lines and exit codes; see
``local`` and ``ray`` (whose workers ``ray_plan`` sizes from what the cluster has free).
``manifest`` records a run, ``run_config`` reads ``--config`` files.
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
