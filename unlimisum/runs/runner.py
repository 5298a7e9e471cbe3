"""Running the jobs of one `summarize` invocation: read, summarize, write, report.

``BatchRunner`` holds the steps both engines use: read every input before the model loads and
report those that cannot be, load the model once, summarize one job into a ``JobResult`` (reading
it, writing its file atomically), and report or print the outcome. The local engine is
``BatchRunner.run``; the Ray engine (``unlimisum.runs.ray``) runs ``summarize_job`` on its workers.
What happens is said through a ``unlimisum.runs.report.Reporter``; stdout goes to ``write_stdout``.
"""

from __future__ import annotations

import os
import stat
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from unlimisum.runs.jobs import Job, OutputConflictError
from unlimisum.runs.output import (
    atomic_write_text,
    error_record,
    is_unlimisum_output,
    render_markdown,
    summary_record,
    to_json_file,
    to_json_line,
)
from unlimisum.config import (
    DEFAULT_MAX_NEW_TOKENS, DecoderOnlyConfig, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, PromptConfig, RetrievalConfig,
)
from unlimisum.runs import manifest as run_manifest
from unlimisum.runs.manifest import DONE, FAILED, SKIPPED, DocumentOutcome
from unlimisum.errors import UnlimisumError
from unlimisum.runs.report import Reporter

# Text of the inputs read before the model loads that is kept for their turn (about 64 million characters:
# a few hundred books); past it an input is read again when summarized, so a large batch costs no memory.
READ_AHEAD_CHARS = 64 * 2**20


@dataclass(frozen=True)
class SummarizeSettings:
    """Everything `summarize` needs besides the inputs: the library configs and output choices."""

    model: ModelConfig
    encoding: EncodingConfig
    index: IndexConfig
    retrieval: RetrievalConfig
    generation: GenerationOptions
    per_chapter: bool = False
    as_json: bool = False
    as_html: bool = False  # --format html: with -o, a self-contained page per input (unlimisum.runs.html)
    output_dir: Path | None = None
    skip_existing: bool = False
    password: str | None = None
    keep_all: bool = False  # EPUB: keep front/back matter and notes (read_document's keep_all)
    tensor_cache: object | None = None  # unlimisum.tensor_cache.TensorCacheSettings, or None for the ordinary cache
    coverage: bool = False  # a coverage table in the Markdown output
    evidence: bool = False  # footnotes quoting each sentence's passages in the Markdown output (--evidence)
    stdout_width: int | None = None  # stdout is a terminal this many columns wide: footnotes are wrapped to it
    cache_dir: Path | None = None  # the cache of encoded books, None: off
    cache_max_bytes: int | None = None  # its size cap, None: none
    prompt: PromptConfig = PromptConfig()  # decoder-only models: what they are asked
    decoder: DecoderOnlyConfig = DecoderOnlyConfig()  # decoder-only models: sinks, blocks


@dataclass
class BatchResult:
    """How a batch went: counts, and (source, one-line problem) per failed input."""

    total: int
    done: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    pipe_closed: bool = False  # the reader of stdout left; the run stopped there
    outcomes: list[DocumentOutcome] = field(default_factory=list)  # per input, in the order they ended
    model: dict | None = None  # the model that summarized (unlimisum.runs.manifest.model_record), once loaded


@dataclass(frozen=True)
class JobResult:
    """One summarized (or failed) input: its outcome, the Summary, and what goes to stdout for it."""

    outcome: DocumentOutcome
    summary: object | None = None  # the Summary of a document that was summarized
    stdout: str = ""  # the Markdown or JSON line to print (without the blank line between documents)
    model: dict | None = None  # the model record of the worker that made it (Ray)


def tensor_cache_note(settings, max_new_tokens: int) -> str:
    """The one line that says what --tensor-cache does here, or that it changes nothing (W >= --max-new-tokens)."""
    from unlimisum.tensor_cache.session import describe, effective_window

    window = effective_window(settings)
    if window >= max_new_tokens:
        return (f"unlimisum: note: --tensor-cache changes nothing here: its window of {window} tokens holds all "
                f"--max-new-tokens {max_new_tokens} tokens of the summary; lower --tc-window to bound memory")
    return f"unlimisum: {describe(settings, window)}"


class BatchRunner:
    """Runs the jobs of one `summarize` invocation with one model: read, summarize, write, report."""

    def __init__(
        self,
        settings: SummarizeSettings,
        reporter: Reporter,
        *,
        write_stdout: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        summarizer=None,
    ):
        """``write_stdout``: where summaries without -o go (default: sys.stdout, flushed per document);
        ``summarizer``: a Summarizer (or anything with its ``summarize``) to use instead of loading
        ``settings.model`` when the first input is ready."""
        self.settings = settings
        self.reporter = reporter  # what the run says goes here (the CLI: its Rich display on stderr)
        self.write_stdout = write_stdout or _echo
        self.clock = clock
        self.summarizer = summarizer
        self.result = BatchResult(total=0)
        self.read_seconds: dict[str, float] = {}  # inputs read ahead (standard input): seconds it took
        self._printed = 0

    def read_stdin_ahead(self, jobs: list[Job]) -> None:
        """Read standard input now, before the model loads; at a terminal, first say how to end it."""
        for job in jobs:
            if not job.is_stdin or job.problem is not None or job.skip:
                continue
            if _stdin_is_terminal():
                self.reporter.reading_stdin_hint()
            started = self.clock()
            try:
                job.document = self._read(job.source)
            except UnlimisumError as error:
                job.problem = error
            self.read_seconds[job.source] = self.clock() - started

    def run(self, jobs: list[Job]) -> BatchResult:
        """Report unusable inputs, then summarize the rest; failures are collected, Ctrl-C propagates.

        The model is loaded only when some input is left to summarize. A reader that closes
        stdout ends the run (``result.pipe_closed``).
        """
        self.result = BatchResult(total=len(jobs))
        try:
            todo = self.read_ahead(self.report_unusable(jobs))
            if todo:
                self.load_model()
            for number, job in enumerate(todo, start=1):
                self.reporter.begin_document(number, len(todo), job.source, read=job.document is not None)
                self.finish(job, self.summarize_job(job, several=len(jobs) > 1))
        except BrokenPipeError:
            self.result.pipe_closed = True
        return self.result

    def read_ahead(self, jobs: list[Job]) -> list[Job]:
        """Read every input now, before the model loads; report those that cannot be read at once and return
        the others. Their documents are kept for their turn up to READ_AHEAD_CHARS of text in all (pipes and
        devices always: they cannot be read twice); past that a file is read again when its turn comes."""
        readable, kept = [], 0
        for number, job in enumerate(jobs, start=1):
            if job.document is None:
                self.reporter.reading_input(number, len(jobs), job.source)
                started = self.clock()
                try:
                    document = self._read(job.source)
                except UnlimisumError as error:
                    self.finish(job, self.failed_result(job, error.problem, type(error).__name__,
                                                         self.clock() - started))
                    continue
                size = len(document.text)
                if kept + size <= READ_AHEAD_CHARS or not _is_regular_file(job.source):
                    job.document, kept = document, kept + size
                    self.read_seconds[job.source] = self.clock() - started
            readable.append(job)
        return readable

    def report_unusable(self, jobs: list[Job]) -> list[Job]:
        """Report the inputs that failed before reading and those skipped; return the ones to summarize."""
        todo = []
        for job in jobs:
            if job.problem is not None:
                self.finish(job, self.failed_result(job, job.problem.problem, type(job.problem).__name__))
            elif job.skip:
                self.result.skipped += 1
                self.result.outcomes.append(DocumentOutcome(job.source, SKIPPED, output=str(job.output)))
                self.reporter.document_skipped(job.source, job.output)
            else:
                todo.append(job)
        return todo

    # -- steps -------------------------------------------------------------------------------

    def load_model(self) -> None:
        """Load the model (once) and make the Summarizer; UnlimisumError when it cannot be loaded."""
        from unlimisum.decoder_only.prompting import UnprotectedPromptWarning, unprotected_turn_end
        from unlimisum.models import load_model
        from unlimisum.models.compat import quiet_hub
        from unlimisum.summarizer import Summarizer

        if self.summarizer is not None:
            return
        settings = self.settings
        self.reporter.loading_model(settings.model.name)
        started = self.clock()
        quiet_hub(verbose=self.reporter.verbose > 1)  # its retry warnings would scroll under the display
        loaded = load_model(settings.model, progress=self.reporter)
        self.result.model = run_manifest.model_record(loaded)
        dtype = str(loaded.dtype).replace("torch.", "")
        self.reporter.model_loaded(loaded.name, str(loaded.device),
                                  f"{dtype}; {loaded.dtype_reason}" if loaded.dtype_reason else dtype,
                                  self.clock() - started)
        if loaded.dtype_warning:
            self.reporter.note(f"unlimisum: warning: {loaded.dtype_warning}")
        cache = None
        if settings.cache_dir is not None and loaded.is_decoder_only:
            self.reporter.note("unlimisum: note: --cache-dir keeps encoder states; a decoder-only model reads the "
                              "prompt each time")
        elif settings.cache_dir is not None:
            from unlimisum.unlimiformer.cache import EncodedCache

            cache = EncodedCache(settings.cache_dir, max_bytes=settings.cache_max_bytes,
                                 warn=lambda message: self.reporter.note(f"unlimisum: warning: {message}"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnprotectedPromptWarning)  # said below, in one line
            self.summarizer = Summarizer(
                loaded, encoding=settings.encoding, index=settings.index, retrieval=settings.retrieval,
                generation=settings.generation, tensor_cache=settings.tensor_cache, cache=cache,
                progress=self.reporter, prompt=settings.prompt, decoder=settings.decoder,
            )
        unprotected = unprotected_turn_end(loaded.tokenizer) if loaded.is_decoder_only else None
        if unprotected is not None:
            self.reporter.note(f"unlimisum: warning: {unprotected}")
        limit = self.summarizer.generation.max_new_tokens
        if settings.generation.max_new_tokens is None and limit < DEFAULT_MAX_NEW_TOKENS:
            self.reporter.log(f"--max-new-tokens: {limit}, not the default {DEFAULT_MAX_NEW_TOKENS}: the decoder of "
                             f"{settings.model.name} has {limit} positions")
        if settings.tensor_cache is not None:
            self.reporter.note(tensor_cache_note(settings.tensor_cache, limit))

    def summarize_job(self, job: Job, *, several: bool) -> JobResult:
        """Read, summarize and (with -o) write one input; a failure of this input is a failed JobResult.

        Nothing is printed on stdout here: ``emit`` does that (the Ray engine calls this on its
        workers and prints on the driver). ``several``: the run has more than one input (the
        Markdown on stdout then starts with a heading).
        """
        started = self.clock()
        try:
            if job.document is not None:
                document, read_seconds = job.document, self.read_seconds.get(job.source, 0.0)
            else:
                document = self._read(job.source)
                read_seconds = self.clock() - started
            shown = "standard input" if job.is_stdin else job.source  # as the done and error lines name it
            for warning in document.metadata.get("warnings", []):
                self.reporter.note(f"unlimisum: warning: {shown}: {warning}")
            if document.left_out:
                self.reporter.log(f"left out of {shown}: {'; '.join(document.left_out)} (--keep-all keeps them)")
            summary = self.summarizer.summarize(document, per_chapter=self.settings.per_chapter)
            for part, warning in _summary_warnings(summary):
                self.reporter.note(f"unlimisum: warning: {shown}{part}: {warning}")
            stdout = self._render(job, document, summary, read_seconds, several)
            if job.page is not None:
                page_failed = self._write_page(job, document, summary, started)
                if page_failed is not None:  # the summary itself is kept: on stdout, or in its file
                    return replace(page_failed, summary=summary, stdout=stdout)
        except UnlimisumError as error:
            return self.failed_result(job, error.problem, type(error).__name__, self.clock() - started)
        except BrokenPipeError:
            raise
        except OSError as error:  # writing the output: disk full, permission denied
            return self.failed_result(job, f"cannot write the summary ({error.strerror or error})",
                                      type(error).__name__, self.clock() - started)
        except Exception as error:  # noqa: BLE001  (one broken input must not end a batch of hundreds)
            self.reporter.traceback(traceback.format_exc())
            return self.failed_result(job, _unexpected(error), type(error).__name__, self.clock() - started)
        outcome = run_manifest.done_outcome(job.source, job.output, summary, read_seconds, self.clock() - started)
        return JobResult(outcome, summary=summary, stdout=stdout, model=self.result.model)

    def _write_page(self, job: Job, document, summary, started: float) -> JobResult | None:
        """``--html FILE``: write the page; the failed JobResult when it cannot be written, else None."""
        from unlimisum.runs.html import render_html

        try:
            self._write(job, render_html(summary, document), job.page)
        except OutputConflictError as error:
            return self.failed_result(job, error.problem, type(error).__name__, self.clock() - started)
        except OSError as error:
            return self.failed_result(job, f"cannot write the page {job.page} ({error.strerror or error})",
                                      type(error).__name__, self.clock() - started)
        return None

    def _read(self, source: str):
        """The Document of ``source``, read with the run's password and --keep-all; UnlimisumError if it cannot be."""
        from unlimisum.ingest import read_document

        return read_document(source, password=self.settings.password, keep_all=self.settings.keep_all)

    def failed_result(self, job: Job, problem: str, error_type: str, seconds: float | None = None) -> JobResult:
        """The JobResult of an input that failed: with --json and no -o, its error record goes to stdout."""
        outcome = DocumentOutcome(job.source, FAILED, output=str(job.output) if job.output is not None else None,
                                  problem=problem, error_type=error_type, seconds=seconds)
        stdout = ""
        if self.settings.as_json and self.settings.output_dir is None:  # with -o every record is a file's
            stdout = to_json_line(error_record(job.source, problem, error_type)) + "\n"
        return JobResult(outcome, stdout=stdout)

    def report(self, job: Job, result: JobResult) -> None:
        """Count the result and give its line on stderr (done, or the failure)."""
        outcome = result.outcome
        self.result.outcomes.append(outcome)
        if outcome.status == DONE:
            self.result.done += 1
            self.reporter.document_done(result.summary, job.source, outcome.seconds,
                                        job.output if job.output is not None else job.page)
        else:
            self.result.failures.append((job.source, outcome.problem))
            self.reporter.document_failed(job.source, outcome.problem)

    def emit(self, result: JobResult) -> None:
        """Print what the result puts on stdout; Markdown summaries are separated by a blank line."""
        if not result.stdout:
            return
        markdown = result.outcome.status == DONE and not self.settings.as_json
        self._print(("\n" if markdown and self._printed else "") + result.stdout)
        if markdown:
            self._printed += 1

    def finish(self, job: Job, result: JobResult) -> None:
        """Report and print a result: a summary before its done line (which, with its coverage bar, then
        stays in view), a failure line before the failure's JSON record."""
        if result.outcome.status == DONE:
            self.emit(result)
            self.report(job, result)
        else:
            self.report(job, result)
            self.emit(result)

    def _render(self, job: Job, document, summary, read_seconds: float, several: bool) -> str:
        """Write the summary file (with -o) and return ""; without -o return the text for stdout."""
        settings = self.settings
        if settings.as_html and job.output is not None:
            from unlimisum.runs.html import render_html

            self._write(job, render_html(summary, document))
            return ""
        if settings.as_json:
            record = summary_record(summary, document, read_seconds)
            if job.output is not None:
                self._write(job, to_json_file(record))
                return ""
            return to_json_line(record) + "\n"
        if job.output is not None:
            self._write(job, render_markdown(summary, document, heading=True, marker=True,
                                             coverage=settings.coverage, evidence=settings.evidence))
            return ""
        return render_markdown(summary, document, heading=several, coverage=settings.coverage,
                               evidence=settings.evidence, width=settings.stdout_width,
                               escape=settings.stdout_width is None)  # a terminal renders no Markdown

    def _write(self, job: Job, text: str, path: Path | None = None) -> None:
        """Write the summary file (or ``path``: the page of --html), unless another program put a file there
        while this one was summarized."""
        path = job.output if path is None else path
        if os.path.lexists(path) and not is_unlimisum_output(path):
            choose = "--output-dir" if path == job.output else "--html FILE"
            raise OutputConflictError(
                f"refusing to overwrite {path}: unlimisum did not write it (move it, or choose another {choose})",
                source=job.source,
            )
        atomic_write_text(path, text)

    def _print(self, text: str) -> None:
        """Write to stdout with the live display off the screen (they may share a terminal)."""
        with self.reporter.paused():
            self.write_stdout(text)




def _summary_warnings(summary) -> list[tuple[str, str]]:
    """(" (chapter 'Title')" or "", warning) for the summary and each chapter summary."""
    found = [("", warning) for warning in summary.warnings]
    for chapter in summary.chapters:
        found += [(f" (chapter '{chapter.title}')", warning) for warning in chapter.warnings]
    return found


def _is_regular_file(source: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(source).st_mode)
    except OSError:
        return False


def _unexpected(error: Exception) -> str:
    name = type(error).__name__
    if name == "OutOfMemoryError":
        return "out of GPU memory; try --index-device cpu, a smaller --encode-batch or --num-beams"
    message = " ".join(str(error).split())
    return f"unexpected {name}: {message} (-vv shows the traceback)" if message else f"unexpected {name}"


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # one document at a time: a pipe sees each summary when it is done


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False
