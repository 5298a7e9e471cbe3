"""The run manifest: ``OUT/unlimisum-run.json``, what one `summarize -o OUT` run did and with what.

Written atomically at the end of every run with ``-o`` — also when inputs failed or the run
was interrupted — so that a batch can be reproduced and audited::

    {
      "schema_version": 1,
      "written_by": "unlimisum",
      "status": "completed" | "failed" | "interrupted",   # failed: some input failed
      "engine": "local" | "ray",
      "versions": {"unlimisum": ..., "python": ..., "torch": ..., "transformers": ..., "faiss": ..., "ray": ...},
      "model": {"name": ..., "tokenizer": ..., "fingerprint": ..., "device": ..., "dtype": ...},  # null: not loaded
      "options": {"max_new_tokens": 256, ...},            # every option as it took effect (a password: "***")
      "option_sources": {"max_new_tokens": "commandline" | "config" | "environment" | "default", ...},
      "config_file": "run.toml" | null,
      "inputs": ["books/"],
      "started": "2025-01-01T12:00:00+00:00", "ended": ..., "seconds": 12.5,
      "counts": {"total": 3, "done": 2, "failed": 1, "skipped": 0, "not_run": 0},
      "documents": [
        {"path": "books/a.txt", "output": "out/a.txt.summary.md", "status": "done" | "failed" | "skipped" | "not run",
         "problem": null, "error_type": null, "seconds": 3.2, "attempts": 1,
         "input_tokens": 5000, "generated_tokens": 200, "timings": {"read": 0.1, "encode": ...}}
      ]
    }

An option that another one given at a higher level set aside (``verbose = 1`` in the config file under
``--quiet`` on the command line, ``temperature`` in the file under ``--no-sample``) shows the value the
run used, with the source of the option that decided it.

The manifest is marked like the summaries (``"written_by": "unlimisum"``): a file of that name
that unlimisum did not write is never overwritten.
"""

from __future__ import annotations

import datetime as _datetime
import json
import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

from unlimisum.runs.output import atomic_write_text, is_unlimisum_output
from unlimisum.version import __version__

MANIFEST_NAME = "unlimisum-run.json"
MANIFEST_SCHEMA_VERSION = 1  # bump when a field changes meaning or disappears
DONE, FAILED, SKIPPED, NOT_RUN = "done", "failed", "skipped", "not run"
SECRET_OPTIONS = ("password",)  # options whose value never goes into the manifest
WRITTEN_BY = "unlimisum"  # the mark of unlimisum's own files (unlimisum.runs.output.WRITTEN_BY)


@dataclass(frozen=True)
class DocumentOutcome:
    """What happened to one input in a run."""

    path: str  # the input as given ("-" for standard input)
    status: str  # DONE, FAILED, SKIPPED or NOT_RUN
    output: str | None = None  # the summary file (None: printed on stdout, or none)
    problem: str | None = None  # the one-line problem of a failed input
    error_type: str | None = None  # the error's class name, for a failed input
    seconds: float | None = None  # wall time of reading + summarizing + writing
    attempts: int = 1  # Ray: how many workers it took (a worker that died makes it retried)
    input_tokens: int | None = None  # tokens of the whole document
    generated_tokens: int | None = None  # summary tokens
    timings: dict = field(default_factory=dict)  # seconds per stage, as in the JSON stats


def done_outcome(path: str, output, summary, read_seconds: float, seconds: float, attempts: int = 1) -> DocumentOutcome:
    """The outcome of a summarized document, from its ``Summary``."""
    stats = summary.stats
    return DocumentOutcome(
        path=path, status=DONE, output=str(output) if output is not None else None, seconds=seconds,
        attempts=attempts, input_tokens=stats.input_tokens, generated_tokens=stats.generated_tokens,
        timings={"read": read_seconds, **stats.timings},
    )


def now() -> _datetime.datetime:
    """The current time, timezone-aware (UTC)."""
    return _datetime.datetime.now(_datetime.timezone.utc)


def versions(engine: str) -> dict[str, str | None]:
    """Versions of unlimisum, Python and the libraries a summary depends on (None: not installed)."""
    found = {"unlimisum": __version__, "python": platform.python_version()}
    for name, distributions in (("torch", ("torch",)), ("transformers", ("transformers",)),
                                ("faiss", ("faiss-cpu", "faiss-gpu", "faiss")), ("ray", ("ray",))):
        if name == "ray" and engine != "ray":
            continue
        found[name] = _distribution_version(distributions)
    return found


def model_record(loaded) -> dict:
    """``{"name", "tokenizer", "fingerprint", "device", "dtype"}`` of a ``LoadedModel``."""
    return {
        "name": loaded.name,
        "tokenizer": loaded.tokenizer_name or loaded.name,
        "fingerprint": loaded.fingerprint,
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).replace("torch.", ""),
    }


def build_manifest(
    *, engine: str, inputs: list[str], options: dict, option_sources: dict, config_file: str | None,
    model: dict | None, started: _datetime.datetime, ended: _datetime.datetime,
    outcomes: list[DocumentOutcome], interrupted: bool,
) -> dict:
    """The manifest as a dict (see the module docstring)."""
    counts = {"total": len(outcomes)}
    for status in (DONE, FAILED, SKIPPED, NOT_RUN):
        counts[status.replace(" ", "_")] = sum(1 for outcome in outcomes if outcome.status == status)
    status = "interrupted" if interrupted else "failed" if counts[FAILED] else "completed"
    shown = {name: ("***" if name in SECRET_OPTIONS and value is not None else _plain(value))
             for name, value in options.items()}
    return {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "written_by": WRITTEN_BY,
        "status": status,
        "engine": engine,
        "versions": versions(engine),
        "model": model,
        "options": shown,
        "option_sources": dict(option_sources),
        "config_file": config_file,
        "inputs": list(inputs),
        "started": started.isoformat(timespec="seconds"),
        "ended": ended.isoformat(timespec="seconds"),
        "seconds": round((ended - started).total_seconds(), 3),
        "counts": counts,
        "documents": [asdict(outcome) for outcome in outcomes],
    }


def write_manifest(output_dir: Path, manifest: dict) -> Path | None:
    """Write ``output_dir/unlimisum-run.json`` atomically; None (nothing written) when a file of that
    name exists that unlimisum did not write."""
    path = Path(output_dir) / MANIFEST_NAME
    if path.exists() and not is_unlimisum_output(path):
        return None
    atomic_write_text(path, json.dumps(manifest, ensure_ascii=False, indent=2) + "\n")
    return path


def _plain(value: object) -> object:
    """An option's value as JSON: paths as strings, tuples as lists."""
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value


def _distribution_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
