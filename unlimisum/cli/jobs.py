"""From command-line paths to jobs: which input to read and where its summary goes.

Rules (the README repeats them):

- A file argument's summary goes to ``DIR/<stem><extension>``; a directory argument's files
  mirror their subfolders under DIR, relative to that directory argument; standard input
  (``-``) becomes ``DIR/stdin<extension>``.
- When two inputs would get the same name (``book.txt`` and ``book.epub``), both keep their
  suffix instead: ``book.txt.summary.md`` and ``book.epub.summary.md``.
- Directory expansion skips unlimisum's own outputs (``*.summary.md``), so a folder can hold
  books and their summaries side by side.
- The same file given twice is summarized once; ``-`` may be given once.
- A job whose output would land on an input file is refused (it fails, the batch goes on).
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from unlimisum.errors import ConfigError, UnlimisumError
from unlimisum.ingest import STDIN, expand_paths

MARKDOWN_EXTENSION = ".summary.md"
JSON_EXTENSION = ".summary.json"


class OutputConflictError(UnlimisumError):
    """The output path of an input is unusable: it is an input, or another input's output."""


@dataclass
class Job:
    """One input to summarize: ``source`` as the user will see it, and where its summary goes."""

    source: str  # the path as given or found ("-" for standard input)
    output: Path | None = None  # None: print on stdout
    problem: UnlimisumError | None = None  # known before reading: the job fails without being read
    # where the output goes relative to the output folder, and the input file name (before collisions)
    relative_folder: Path = Path()
    name: str = ""

    @property
    def is_stdin(self) -> bool:
        return self.source == STDIN


def plan_jobs(arguments: list[str], output_dir: Path | None, extension: str = MARKDOWN_EXTENSION) -> list[Job]:
    """The jobs for ``arguments`` (files, directories, ``-``), with output paths under ``output_dir``.

    Raises ConfigError when ``-`` is given more than once (a usage error).
    """
    if sum(1 for argument in arguments if argument == STDIN) > 1:
        raise ConfigError("standard input '-' can be given only once")
    jobs: list[Job] = []
    seen: set[str] = set()
    for argument in arguments:
        for job in _jobs_for_argument(argument):
            key = job.source if job.is_stdin else os.path.realpath(job.source)
            if key in seen:
                continue
            seen.add(key)
            jobs.append(job)
    if output_dir is not None:
        _assign_outputs(jobs, Path(output_dir), extension)
    return jobs


def _jobs_for_argument(argument: str) -> list[Job]:
    if argument == STDIN:
        return [Job(STDIN, name="stdin")]
    path = Path(argument)
    if not path.is_dir():
        return [Job(argument, name=path.name)]
    found = [item for item in expand_paths([path]) if not _is_own_output(Path(item))]
    if not found or found == [path]:
        return [Job(argument, name=path.name or "input")]  # reading it reports "holds no supported files"
    jobs = []
    for item in found:
        relative = Path(item).relative_to(path)
        jobs.append(Job(str(item), relative_folder=relative.parent, name=relative.name))
    return jobs


def _is_own_output(path: Path) -> bool:
    return path.name.lower().endswith(MARKDOWN_EXTENSION)


def _assign_outputs(jobs: list[Job], output_dir: Path, extension: str) -> None:
    by_target: dict[Path, list[Job]] = defaultdict(list)
    for job in jobs:
        stem = Path(job.name).stem if not job.is_stdin else job.name
        by_target[output_dir / job.relative_folder / f"{stem}{extension}"].append(job)
    claimed: dict[Path, Job] = {}
    for target, group in by_target.items():
        for job in group:
            output = target if len(group) == 1 else output_dir / job.relative_folder / f"{job.name}{extension}"
            if output in claimed:
                job.problem = OutputConflictError(
                    f"its output {output} is also the output of {claimed[output].source}; summarize them in separate runs",
                    source=job.source,
                )
                continue
            claimed[output] = job
            job.output = output
    _refuse_overwriting_inputs(jobs)


def _refuse_overwriting_inputs(jobs: list[Job]) -> None:
    inputs = [job for job in jobs if not job.is_stdin]
    real_inputs = {os.path.realpath(job.source) for job in inputs}
    identities = set()
    for job in inputs:
        try:
            info = os.stat(job.source)
            identities.add((info.st_dev, info.st_ino))
        except OSError:
            continue
    for job in jobs:
        if job.output is None or job.problem is not None:
            continue
        clash = os.path.realpath(job.output) in real_inputs
        if not clash:
            try:
                info = os.stat(job.output)
                clash = (info.st_dev, info.st_ino) in identities  # a hard link to an input
            except OSError:
                pass
        if clash:
            job.problem = OutputConflictError(
                f"refusing to write the summary to {job.output}: that is an input file", source=job.source
            )
