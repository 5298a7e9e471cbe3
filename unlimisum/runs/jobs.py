"""From command-line paths to jobs: which inputs to read, which are unusable, where summaries go.

Rules (docs/options.md repeats them, under -o):

- An output name depends on its input path alone, never on the rest of the batch: a file
  argument ``story.txt`` goes to ``DIR/story.txt.summary.md`` (the input's suffix is kept, so
  ``story.pdf`` gets ``story.pdf.summary.md``); a directory argument's files mirror their
  subfolders under DIR, relative to that directory argument; standard input (``-``) becomes
  ``DIR/stdin.summary.md``. ``.summary.json`` replaces ``.summary.md`` with ``--json``, ``.summary.html``
  (a page to read each sentence beside its passages) with ``--format html``.
- ``--html FILE`` writes that page for one input to FILE, beside the usual output; FILE follows the
  rules of outputs below (overwritten only when unlimisum wrote it, never an input).
- Two inputs with the same output (``a/x.txt`` and ``b/x.txt`` as folder contents) are a usage
  error naming both, found before any work starts.
- Every input is checked before the model loads (exists, readable, a kind unlimisum reads);
  an unusable one becomes a job with a ``problem`` and no output.
- Folder scans skip the summaries unlimisum wrote (recognised by their marker, see
  ``unlimisum.runs.output``), and only those; ``Plan.own_outputs`` lists them.
- An existing output is overwritten only when unlimisum wrote it; ``--skip-existing`` skips an
  input whose output unlimisum wrote. An output that is another file, or an input, is refused
  (that input fails, the batch goes on).
- The same file given twice is summarized once; ``-`` may be given once.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from unlimisum.runs.output import is_unlimisum_output
from unlimisum.errors import (
    ConfigError,
    EmptyDocumentError,
    InputError,
    InputNotFoundError,
    UnlimisumError,
    UnsupportedFormatError,
)
from unlimisum.ingest import STDIN, SUPPORTED_SUFFIXES, expand_paths
from unlimisum.ingest.detect import sniff_format
from unlimisum.ingest.limits import DEFAULT_LIMITS

MARKDOWN_EXTENSION = ".summary.md"
JSON_EXTENSION = ".summary.json"
HTML_EXTENSION = ".summary.html"
STDIN_NAME = "stdin"  # the output name of standard input
_MARKDOWN_SUFFIXES = (".md", ".markdown")


class OutputConflictError(UnlimisumError):
    """The output path of an input is unusable: it is an input, or a file unlimisum did not write."""


@dataclass
class Job:
    """One input to summarize: ``source`` as the user will see it, and where its summary goes."""

    source: str  # the path as given or found ("-" for standard input)
    output: Path | None = None  # None: print on stdout
    problem: UnlimisumError | None = None  # known before reading: the job fails without being read
    relative: Path = Path()  # the output's path under the output folder, without the extension
    skip: bool = False  # --skip-existing: unlimisum already wrote its output
    page: Path | None = None  # --html FILE: the HTML page written beside the output
    document: object | None = None  # the Document, when read ahead (standard input)

    @property
    def is_stdin(self) -> bool:
        return self.source == STDIN


@dataclass
class Plan:
    """The jobs of one `summarize` run, and the summaries of unlimisum found in folders and not read."""

    jobs: list[Job]
    own_outputs: list[Path] = field(default_factory=list)


def plan_jobs(
    arguments: list[str], output_dir: Path | None, extension: str = MARKDOWN_EXTENSION, *, skip_existing: bool = False
) -> Plan:
    """The jobs for ``arguments`` (files, directories, ``-``), checked, with outputs under ``output_dir``.

    Raises ConfigError (a usage error) when ``-`` is given more than once or two inputs
    would write the same output.
    """
    if sum(1 for argument in arguments if argument == STDIN) > 1:
        raise ConfigError("standard input '-' can be given only once")
    plan = Plan(jobs=[])
    seen: set[str] = set()
    for argument in arguments:
        for job in _jobs_for_argument(argument, plan.own_outputs):
            key = job.source if job.is_stdin else os.path.realpath(job.source)
            if key in seen:
                continue
            seen.add(key)
            if job.problem is None and not job.is_stdin:
                job.problem = check_input(job.source)
            plan.jobs.append(job)
    if output_dir is not None:
        _assign_outputs(plan.jobs, Path(output_dir), extension, skip_existing)
    return plan


def check_output_dir(output_dir: Path) -> None:
    """ConfigError (a usage error) unless summaries can be written in ``output_dir``, checked before the model
    loads: the folder is made where it is missing (the run's manifest goes there too), then a file is written
    in it and removed. Found only when the first summary is written, every book would be summarized in vain."""
    try:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise ConfigError(f"cannot write summaries to --output-dir {output_dir}: {error.strerror or error}") from None


def assign_page(plan: Plan, page: Path) -> None:
    """``--html FILE``: the one job of ``plan`` also writes its HTML page to ``page``.

    Raises ConfigError when the plan has more than one input. A ``page`` that is an input, or a file
    unlimisum did not write, makes that job fail (OutputConflictError) before any work starts.
    """
    if len(plan.jobs) != 1:
        raise ConfigError(f"--html {page} writes the page of one input, and {len(plan.jobs)} were given; for "
                          "several, --format html -o DIR writes one page per input")
    job = plan.jobs[0]
    if job.problem is not None:
        return
    job.page = Path(page)
    if not job.is_stdin and _same_file(job.page, Path(job.source)):
        job.problem = OutputConflictError(f"refusing to write the page to {page}: that is the input file",
                                          source=job.source)
    elif os.path.lexists(job.page) and (job.page.is_dir() or not is_unlimisum_output(job.page)):
        job.problem = OutputConflictError(
            f"refusing to overwrite {page}: unlimisum did not write it (move it, or choose another --html FILE)",
            source=job.source,
        )


def _same_file(a: Path, b: Path) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def output_name(relative: Path, extension: str) -> Path:
    """``sub/story.txt`` -> ``sub/story.txt.summary.md``: the input's name with its suffix, plus ``extension``."""
    return relative.with_name(relative.name + extension)


def check_input(source: str) -> UnlimisumError | None:
    """Why ``source`` cannot be summarized, judged from its type and first bytes; None when it looks readable.

    Pipes and character devices pass (reading them is the only way to know). The messages
    are the ones reading the file would give.
    """
    path = Path(source)
    try:
        info = path.stat()
    except FileNotFoundError:
        return InputNotFoundError("no such file or directory", source=source)
    except PermissionError:
        return InputError("permission denied", source=source)
    except OSError as error:
        return InputError(f"cannot open ({error.strerror or error})", source=source)
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        suffixes = ", ".join(sorted(SUPPORTED_SUFFIXES))
        return UnsupportedFormatError(f"directory holds no supported files ({suffixes})", source=source)
    if stat.S_ISFIFO(mode) or stat.S_ISCHR(mode):
        return None
    if not stat.S_ISREG(mode):
        kind = "a socket" if stat.S_ISSOCK(mode) else "a block device" if stat.S_ISBLK(mode) else "a special file"
        return UnsupportedFormatError(f"{kind}, not a file or pipe that can be read", source=source)
    try:
        with open(path, "rb") as file:
            head = file.read(DEFAULT_LIMITS.sniff_bytes)
    except PermissionError:
        return InputError("permission denied", source=source)
    except OSError as error:
        return InputError(f"cannot read ({error.strerror or error})", source=source)
    if info.st_size <= len(head) and not head.strip():
        return EmptyDocumentError("empty file" if not head else "file holds only whitespace", source=source)
    if _is_safetensors(head):
        return UnsupportedFormatError(
            "a safetensors file (Tensor Cache parameters go after --tc-params), not text, EPUB or PDF", source=source
        )
    try:
        sniff_format(head)
    except ValueError as description:
        return UnsupportedFormatError(f"{description}, not text, EPUB or PDF", source=source)
    return None


def _is_safetensors(head: bytes) -> bool:
    """A safetensors file: an 8-byte little-endian header length, then the JSON header."""
    size = int.from_bytes(head[:8], "little") if len(head) > 8 else 0
    return 2 <= size < 100 * 2**20 and head[8:9] == b"{"


def _jobs_for_argument(argument: str, own_outputs: list[Path]) -> list[Job]:
    if argument == STDIN:
        return [Job(STDIN, relative=Path(STDIN_NAME))]
    path = Path(argument)
    if not path.is_dir():
        return [Job(argument, relative=Path(path.name))]
    found = []
    for item in expand_paths([path]):
        if item != path and _is_own_markdown(Path(item)):
            own_outputs.append(Path(item))
        elif item != path:
            found.append(Path(item))
    if not found:
        problem = None
        if own_outputs and any(_is_within(item, path) for item in own_outputs):
            problem = UnsupportedFormatError("directory holds only summaries unlimisum wrote", source=argument)
        return [Job(argument, relative=Path(path.name or "input"), problem=problem)]
    return [Job(str(item), relative=item.relative_to(path)) for item in found]


def _is_own_markdown(path: Path) -> bool:
    return path.suffix.lower() in _MARKDOWN_SUFFIXES and is_unlimisum_output(path)


def _is_within(item: Path, folder: Path) -> bool:
    try:
        item.relative_to(folder)
    except ValueError:
        return False
    return True


def _assign_outputs(jobs: list[Job], output_dir: Path, extension: str, skip_existing: bool) -> None:
    claimed: dict[str, Job] = {}
    for job in jobs:
        if job.problem is not None:
            continue
        output = output_dir / output_name(job.relative, extension)
        key = os.path.normcase(os.path.abspath(output))
        if key in claimed:
            raise ConfigError(
                f"{_shown(claimed[key].source)} and {_shown(job.source)} would both be summarized to {output}; "
                "summarize them in separate runs or to separate --output-dir folders"
            )
        claimed[key] = job
        job.output = output
    _refuse_overwriting_inputs(jobs)
    for job in jobs:
        if job.problem is None and job.output is not None and os.path.lexists(job.output):
            _existing_output(job, skip_existing)


def _existing_output(job: Job, skip_existing: bool) -> None:
    """An output that exists: skip (--skip-existing) or overwrite it when unlimisum wrote it, else refuse."""
    if not is_unlimisum_output(job.output):
        job.problem = OutputConflictError(
            f"refusing to overwrite {job.output}: unlimisum did not write it (move it, or choose another --output-dir)",
            source=job.source,
        )
    elif skip_existing:
        job.skip = True


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


def _shown(source: str) -> str:
    return "standard input" if source == STDIN else source
