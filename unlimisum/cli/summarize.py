"""`unlimisum summarize PATH... | -`: summarize files, folders or standard input.

Thin on purpose: parse the options into the library's configs, check every input (and read
standard input) before the model loads, load the model once, then for each input read ->
summarize -> write, reporting progress on stderr. A bad input is reported (before the model
loads when it can be told from the file) and skipped; Ctrl-C stops at once and leaves no
partial output file; a reader that closes stdout (`| head`) ends the run quietly.
"""

from __future__ import annotations

import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Literal, Optional

import typer

from unlimisum.cli.app import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, app, fail, silence_stdout
from unlimisum.cli.jobs import JSON_EXTENSION, MARKDOWN_EXTENSION, Job, OutputConflictError, plan_jobs
from unlimisum.cli.output import (
    atomic_write_text,
    error_record,
    is_unlimisum_output,
    render_markdown,
    summary_record,
    to_json_file,
    to_json_line,
)
from unlimisum.cli.progress import MemoryProbe, ProgressDisplay, make_stderr_console
from unlimisum.config import DEFAULT_MODEL, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.errors import ConfigError, UnlimisumError

_DEFAULT_GENERATION = GenerationOptions()
_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

MODEL_PANEL = "Model"
INDEX_PANEL = "Reading, index and retrieval"
GENERATION_PANEL = "Generation"
TENSOR_CACHE_PANEL = "Tensor Cache (bounded decoder memory)"
OUTPUT_PANEL = "Output"
CACHE_PANEL = "Cache of encoded books"
DISPLAY_PANEL = "Display"


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
    output_dir: Path | None = None
    skip_existing: bool = False
    password: str | None = None
    keep_all: bool = False  # EPUB: keep front/back matter and notes (read_document's keep_all)
    tensor_cache: object | None = None  # unlimisum.tensor_cache.TensorCacheSettings, or None for the ordinary cache
    coverage: bool = False  # a coverage table in the Markdown output
    cache_dir: Path | None = None  # the cache of encoded books, None: off
    cache_max_bytes: int | None = None  # its size cap, None: none


@dataclass
class BatchResult:
    """How a batch went: counts, and (source, one-line problem) per failed input."""

    total: int
    done: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    pipe_closed: bool = False  # the reader of stdout left; the run stopped there


def _check_overlap(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise typer.BadParameter(f"{value} is not in [0, 1)")
    return value


def _check_size(value: str | None) -> str | None:
    if value is not None:
        parse_size(value)
    return value


def parse_size(value: str) -> int:
    """``20G`` -> bytes (K, M, G, T: powers of 1024; a plain number is bytes); BadParameter otherwise."""
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    factor = units.get(text[-1:], 1) if text else 1
    number = text[:-1] if text[-1:] in units else text
    try:
        size = float(number) * factor
    except ValueError:
        raise typer.BadParameter(f"'{value}' is not a size; use e.g. 500M or 20G") from None
    if size <= 0:
        raise typer.BadParameter(f"'{value}' is not a positive size")
    return int(size)


def _check_device(value: str) -> str:
    if not _DEVICE_PATTERN.match(value):
        raise typer.BadParameter(f"'{value}' is not a device; use auto, cpu, cuda, cuda:N or mps")
    return value


@app.command()
def summarize(
    paths: List[str] = typer.Argument(
        ..., metavar="PATH",
        help="Files (text, EPUB, PDF), folders (searched recursively) or '-' for standard input. "
        "Put '--' before names that start with '-'.",
    ),
    # -- model
    model: str = typer.Option(
        DEFAULT_MODEL, "-m", "--model", envvar="UNLIMISUM_MODEL", show_envvar=True, metavar="NAME_OR_DIR",
        help="Hub name or local folder of an encoder-decoder summarization model.", rich_help_panel=MODEL_PANEL,
    ),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", metavar="NAME_OR_DIR", help="Tokenizer hub name or folder (default: the model's own).",
        rich_help_panel=MODEL_PANEL,
    ),
    device: str = typer.Option(
        "auto", "--device", callback=_check_device, metavar="DEVICE",
        help="auto, cpu, cuda, cuda:N or mps (auto: CUDA when available).", rich_help_panel=MODEL_PANEL,
    ),
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = typer.Option(
        "auto", "--dtype", help="Model weights dtype (auto: bfloat16 on GPUs, and on CPUs where it is measured "
        "1.5x faster than float32, e.g. with AVX512-BF16/AMX; else float32).",
        rich_help_panel=MODEL_PANEL,
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Allow models whose code comes from the hub (runs that code).",
        rich_help_panel=MODEL_PANEL,
    ),
    # -- reading, index and retrieval
    password: Optional[str] = typer.Option(
        None, "--password", metavar="TEXT", help="Password for encrypted PDFs.", rich_help_panel=INDEX_PANEL
    ),
    keep_all: bool = typer.Option(
        False, "--keep-all", help="EPUB: keep the front and back matter, notes and covers a book marks as such.",
        rich_help_panel=INDEX_PANEL,
    ),
    index: Literal["auto", "exact", "ivf", "hnsw"] = typer.Option(
        "auto", "--index", help="Nearest-neighbour index (auto: exact for short inputs, approximate for long ones on CPU).",
        rich_help_panel=INDEX_PANEL,
    ),
    index_device: Literal["auto", "cpu", "gpu"] = typer.Option(
        "auto", "--index-device", help="Where the index lives (auto: GPU when CUDA is present and it fits).",
        rich_help_panel=INDEX_PANEL,
    ),
    storage_dtype: Literal["auto", "float16", "bfloat16", "float32"] = typer.Option(
        "auto", "--storage-dtype",
        help="How the encoded input is stored (auto: bfloat16 for bfloat16 models, else float16; float32 doubles memory).",
        rich_help_panel=INDEX_PANEL,
    ),
    retrieval_k: Optional[int] = typer.Option(
        None, "--retrieval-k", min=1, metavar="K",
        help="Input tokens each cross-attention head retrieves per step (default: the model's window, at most 1,024); "
        "not sampling's --top-k.",
        rich_help_panel=INDEX_PANEL,
    ),
    retrieval_k_alias: Optional[int] = typer.Option(
        None, "--topk", min=1, metavar="K", hidden=True, help="Old name of --retrieval-k.", rich_help_panel=INDEX_PANEL,
    ),
    overlap: float = typer.Option(
        EncodingConfig().overlap, "--overlap", callback=_check_overlap, metavar="F",
        help="Fraction of each encoder window shared with its neighbours (0 <= F < 1).", rich_help_panel=INDEX_PANEL,
    ),
    encode_batch: Optional[int] = typer.Option(
        None, "--encode-batch", min=1, metavar="N", help="Windows per encoder pass (default: chosen by device).",
        rich_help_panel=INDEX_PANEL,
    ),
    # -- generation
    max_new_tokens: int = typer.Option(
        _DEFAULT_GENERATION.max_new_tokens, "--max-new-tokens", min=1, metavar="N", help="Longest summary, in tokens.",
        rich_help_panel=GENERATION_PANEL,
    ),
    min_new_tokens: Optional[int] = typer.Option(
        None, "--min-new-tokens", min=0, metavar="N", help="Shortest summary, in tokens.",
        rich_help_panel=GENERATION_PANEL,
    ),
    num_beams: Optional[int] = typer.Option(
        None, "--num-beams", min=1, metavar="N", help="Beam search width (default: the model's).",
        rich_help_panel=GENERATION_PANEL,
    ),
    no_repeat_ngram_size: Optional[int] = typer.Option(
        None, "--no-repeat-ngram-size", min=0, metavar="N", help="Never repeat an n-gram of this size.",
        rich_help_panel=GENERATION_PANEL,
    ),
    length_penalty: Optional[float] = typer.Option(
        None, "--length-penalty", metavar="F", help="Beam search: >1 favours longer summaries, <1 shorter.",
        rich_help_panel=GENERATION_PANEL,
    ),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", metavar="F", help="Penalty for tokens already generated (1 = none).",
        rich_help_panel=GENERATION_PANEL,
    ),
    sample: bool = typer.Option(
        False, "--sample", help="Sample instead of greedy/beam search.", rich_help_panel=GENERATION_PANEL
    ),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", metavar="F", help="Sampling temperature (turns on --sample).",
        rich_help_panel=GENERATION_PANEL,
    ),
    top_k: Optional[int] = typer.Option(
        None, "--top-k", min=1, metavar="K",
        help="Sampling: draw each token from the K most likely ones (turns on --sample); not the retrieval k.",
        rich_help_panel=GENERATION_PANEL,
    ),
    top_p: Optional[float] = typer.Option(
        None, "--top-p", max=1.0, metavar="P", help="Nucleus sampling probability mass (turns on --sample).",
        rich_help_panel=GENERATION_PANEL,
    ),
    seed: Optional[int] = typer.Option(
        None, "--seed", metavar="N", help="Random seed: the same seed gives the same summary.",
        rich_help_panel=GENERATION_PANEL,
    ),
    # -- tensor cache
    tensor_cache: bool = typer.Option(
        False, "--tensor-cache",
        help="Bound the decoder's self-attention memory: the last --tc-window tokens exactly, older ones in the "
        "fitted memory of --tc-params (without it: a plain sliding window).",
        rich_help_panel=TENSOR_CACHE_PANEL,
    ),
    tc_params: Optional[Path] = typer.Option(
        None, "--tc-params", metavar="FILE",
        help="Fitted Tensor Cache parameters, a file written by `unlimisum tc fit` (implies --tensor-cache).",
        rich_help_panel=TENSOR_CACHE_PANEL,
    ),
    tc_window: Optional[int] = typer.Option(
        None, "--tc-window", min=1, metavar="W",
        help="Tokens the decoder attends to exactly with --tensor-cache (default: the one --tc-params was fitted "
        "with, else 256).",
        rich_help_panel=TENSOR_CACHE_PANEL,
    ),
    # -- output
    per_chapter: bool = typer.Option(
        False, "--per-chapter", help="Also summarize each chapter on its own (after the whole-book summary).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    as_json: bool = typer.Option(
        False, "--json", help="One JSON object per document (JSON Lines on stdout; .summary.json files with -o).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    output_dir: Optional[Path] = typer.Option(
        None, "-o", "--output-dir", metavar="DIR", file_okay=False,
        help="Write <input name>.summary.md (or .summary.json) per input here, e.g. story.txt.summary.md, "
        "mirroring subfolders, instead of printing on stdout.",
        rich_help_panel=OUTPUT_PANEL,
    ),
    skip_existing: bool = typer.Option(
        False, "--skip-existing",
        help="With -o: skip inputs whose summary file unlimisum already wrote (resume a batch).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    coverage: bool = typer.Option(
        False, "--coverage", help="Add a table of where each summary looked (its share of attention per chapter).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    # -- cache of encoded books
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", envvar="UNLIMISUM_CACHE_DIR", show_envvar=True, metavar="DIR", file_okay=False,
        help="Keep encoded books here: summarizing the same book again (other options) skips reading and encoding.",
        rich_help_panel=CACHE_PANEL,
    ),
    cache_max_bytes: Optional[str] = typer.Option(
        None, "--cache-max-bytes", metavar="SIZE", callback=_check_size,
        help="With --cache-dir: cap its size (e.g. 20G); the least recently used books go first.",
        rich_help_panel=CACHE_PANEL,
    ),
    # -- display
    quiet: bool = typer.Option(
        False, "-q", "--quiet", help="No progress or per-document lines on stderr; errors only.",
        rich_help_panel=DISPLAY_PANEL,
    ),
    verbose: int = typer.Option(
        0, "-v", "--verbose", count=True,
        help="Log each stage on stderr; -vv also prints tracebacks of unexpected errors.",
        rich_help_panel=DISPLAY_PANEL,
    ),
) -> None:
    """Summarize books and long files whole: no truncation, every token reachable by retrieval."""
    if skip_existing and output_dir is None:
        raise fail("--skip-existing needs --output-dir", EXIT_USAGE)
    if quiet and verbose:
        raise fail("--quiet and --verbose contradict each other", EXIT_USAGE)
    if min_new_tokens is not None and min_new_tokens > max_new_tokens:
        raise fail(f"--min-new-tokens {min_new_tokens} exceeds --max-new-tokens {max_new_tokens}", EXIT_USAGE)
    for option, value in (("--temperature", temperature), ("--repetition-penalty", repetition_penalty),
                          ("--top-p", top_p)):
        if value is not None and value <= 0:
            raise fail(f"{option} must be greater than 0, got {value}", EXIT_USAGE)
    if retrieval_k is not None and retrieval_k_alias is not None and retrieval_k != retrieval_k_alias:
        raise fail(f"--retrieval-k {retrieval_k} and --topk {retrieval_k_alias} disagree (--topk is its old name)",
                   EXIT_USAGE)
    if cache_max_bytes is not None and cache_dir is None:
        raise fail("--cache-max-bytes needs --cache-dir (or UNLIMISUM_CACHE_DIR)", EXIT_USAGE)
    if tc_window is not None and not (tensor_cache or tc_params is not None):
        raise fail("--tc-window needs --tensor-cache or --tc-params", EXIT_USAGE)
    try:
        memory = tensor_cache_settings(tensor_cache or tc_params is not None, tc_params, tc_window)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    do_sample = sample or temperature is not None or top_p is not None or top_k is not None
    settings = SummarizeSettings(
        model=ModelConfig(name=model, tokenizer=tokenizer, device=device, dtype=dtype, trust_remote_code=trust_remote_code),
        encoding=EncodingConfig(overlap=overlap, batch_size=encode_batch),
        index=IndexConfig(kind=index, device=index_device, storage_dtype=storage_dtype),
        retrieval=RetrievalConfig(retrieval_k=retrieval_k if retrieval_k is not None else retrieval_k_alias),
        generation=GenerationOptions(
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams,
            no_repeat_ngram_size=no_repeat_ngram_size, length_penalty=length_penalty,
            repetition_penalty=repetition_penalty, do_sample=True if do_sample else None, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed,
        ),
        per_chapter=per_chapter, as_json=as_json, output_dir=output_dir, skip_existing=skip_existing,
        password=password, keep_all=keep_all, tensor_cache=memory, coverage=coverage, cache_dir=cache_dir,
        cache_max_bytes=parse_size(cache_max_bytes) if cache_max_bytes else None,
    )
    display = ProgressDisplay(make_stderr_console(), show=not quiet, verbose=verbose)
    try:
        check_index_settings(settings.index)
        plan = plan_jobs(paths, output_dir, JSON_EXTENSION if as_json else MARKDOWN_EXTENSION,
                         skip_existing=skip_existing)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    display.own_outputs_skipped(plan.own_outputs)
    runner = BatchRunner(settings, display)
    jobs = plan.jobs
    try:
        runner.read_stdin_ahead(jobs)  # before the live display: the terminal may be where it is typed
        with display, warnings.catch_warnings():
            if quiet:  # library warnings would break the promise of an empty stderr
                warnings.simplefilter("ignore")
            result = runner.run(jobs)
    except KeyboardInterrupt:
        resume = "; rerun with --skip-existing to resume" if output_dir is not None else ""
        typer.echo(f"unlimisum: interrupted after {runner.result.done} of {len(jobs)} inputs{resume}", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:  # the model could not be loaded: nothing can be summarized
        raise fail(error, EXIT_FAILURE)
    if result.pipe_closed:  # `unlimisum summarize ... | head`: the reader took what it wanted
        silence_stdout()
    if result.failures:
        if result.total > 1 and not result.pipe_closed:
            display.failure_report(result.failures, result.total)
        raise typer.Exit(EXIT_FAILURE)


def tensor_cache_settings(enabled: bool, params_file: Path | None, window: int | None):
    """TensorCacheSettings for --tensor-cache/--tc-params (None when off); a bad file is a ConfigError."""
    if not enabled:
        return None
    from unlimisum.tensor_cache import TensorCacheSettings

    settings = TensorCacheSettings(window=window, params=str(params_file) if params_file is not None else None)
    settings.loaded_params  # read now (once): a missing or invalid file is a usage error, before the model loads
    return settings


def tensor_cache_note(settings, max_new_tokens: int) -> str:
    """The one line that says what --tensor-cache does here, or that it changes nothing (W >= --max-new-tokens)."""
    from unlimisum.tensor_cache.session import describe, effective_window

    window = effective_window(settings)
    if window >= max_new_tokens:
        return (f"unlimisum: note: --tensor-cache changes nothing here: its window of {window} tokens holds all "
                f"--max-new-tokens {max_new_tokens} tokens of the summary; lower --tc-window to bound memory")
    return f"unlimisum: {describe(settings, window)}"


def check_index_settings(index: IndexConfig) -> None:
    """Raise ConfigError now, before the model loads, for index options this machine cannot honour."""
    from unlimisum.unlimiformer.datastore import plan_index

    plan_index(1, 1, index)  # validates kind/device and CUDA presence for --index-device gpu


class BatchRunner:
    """Runs the jobs of one `summarize` invocation with one model: read, summarize, write, report."""

    def __init__(
        self,
        settings: SummarizeSettings,
        display: ProgressDisplay,
        *,
        write_stdout: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.settings = settings
        self.display = display
        self.write_stdout = write_stdout or _echo
        self.clock = clock
        self.summarizer = None
        self.result = BatchResult(total=0)
        self.read_seconds: dict[str, float] = {}  # inputs read ahead (standard input): seconds it took
        self._printed = 0

    def read_stdin_ahead(self, jobs: list[Job]) -> None:
        """Read standard input now, before the model loads; at a terminal, first say how to end it."""
        from unlimisum.ingest import read_document

        for job in jobs:
            if not job.is_stdin or job.problem is not None or job.skip:
                continue
            if _stdin_is_terminal():
                self.display.reading_stdin_hint()
            started = self.clock()
            try:
                job.document = read_document(job.source, password=self.settings.password,
                                             keep_all=self.settings.keep_all)
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
            for job in jobs:
                if job.problem is not None:
                    self._failed(job, job.problem.problem, type(job.problem).__name__)
                elif job.skip:
                    self.result.skipped += 1
                    self.display.document_skipped(job.source, job.output)
            todo = [job for job in jobs if job.problem is None and not job.skip]
            if todo:
                self._load_model()
            for number, job in enumerate(todo, start=1):
                self.display.begin_document(number, len(todo), job.source)
                self._run_one(job)
        except BrokenPipeError:
            self.result.pipe_closed = True
        return self.result

    # -- steps -------------------------------------------------------------------------------

    def _load_model(self) -> None:
        from unlimisum.models import load_model
        from unlimisum.summarizer import Summarizer

        settings = self.settings
        self.display.loading_model(settings.model.name)
        started = self.clock()
        loaded = load_model(settings.model)
        dtype = str(loaded.dtype).replace("torch.", "")
        self.display.model_loaded(loaded.name, str(loaded.device),
                                  f"{dtype}; {loaded.dtype_reason}" if loaded.dtype_reason else dtype,
                                  self.clock() - started)
        if loaded.device.type == "cuda":
            self.display.set_memory_probe(MemoryProbe(cuda_device=loaded.device))
        elif self.display.memory is None:
            self.display.set_memory_probe(MemoryProbe())
        cache = None
        if settings.cache_dir is not None:
            from unlimisum.unlimiformer.cache import EncodedCache

            cache = EncodedCache(settings.cache_dir, max_bytes=settings.cache_max_bytes,
                                 warn=lambda message: self.display.note(f"unlimisum: warning: {message}"))
        self.summarizer = Summarizer(
            loaded, encoding=settings.encoding, index=settings.index, retrieval=settings.retrieval,
            generation=settings.generation, tensor_cache=settings.tensor_cache, cache=cache, progress=self.display,
        )
        if settings.tensor_cache is not None:
            self.display.note(tensor_cache_note(settings.tensor_cache, settings.generation.max_new_tokens))

    def _run_one(self, job: Job) -> None:
        from unlimisum.ingest import read_document

        started = self.clock()
        try:
            if job.document is not None:
                document, read_seconds = job.document, self.read_seconds.get(job.source, 0.0)
            else:
                document = read_document(job.source, password=self.settings.password,
                                         keep_all=self.settings.keep_all)
                read_seconds = self.clock() - started
            for warning in document.metadata.get("warnings", []):
                self.display.note(f"unlimisum: warning: {job.source}: {warning}")
            if document.left_out:
                self.display.log(f"left out of {job.source}: {'; '.join(document.left_out)} (--keep-all keeps them)")
            summary = self.summarizer.summarize(document, per_chapter=self.settings.per_chapter)
            self._emit(job, document, summary, read_seconds)
        except UnlimisumError as error:
            self._failed(job, error.problem, type(error).__name__)
            return
        except BrokenPipeError:
            raise
        except OSError as error:  # writing the output: disk full, permission denied
            self._failed(job, f"cannot write the summary ({error.strerror or error})", type(error).__name__)
            return
        except Exception as error:  # noqa: BLE001  (one broken input must not end a batch of hundreds)
            self._failed(job, _unexpected(error), type(error).__name__)
            if self.display.verbose > 1:
                self.display.console.print(traceback.format_exc(), markup=False, soft_wrap=True)
            return
        self.result.done += 1
        self.display.document_done(summary, job.source, self.clock() - started, job.output)

    def _emit(self, job: Job, document, summary, read_seconds: float) -> None:
        settings = self.settings
        if settings.as_json:
            record = summary_record(summary, document, read_seconds)
            if job.output is not None:
                self._write(job, to_json_file(record))
            else:
                self._print(to_json_line(record) + "\n")
            return
        if job.output is not None:
            self._write(job, render_markdown(summary, document, heading=True, marker=True,
                                             coverage=settings.coverage))
            return
        several = self.result.total > 1
        text = render_markdown(summary, document, heading=several, coverage=settings.coverage)
        self._print(("\n" if self._printed else "") + text)
        self._printed += 1

    def _write(self, job: Job, text: str) -> None:
        """Write the summary file, unless another program put a file there while this one was summarized."""
        if os.path.lexists(job.output) and not is_unlimisum_output(job.output):
            raise OutputConflictError(
                f"refusing to overwrite {job.output}: unlimisum did not write it (move it, or choose another "
                "--output-dir)", source=job.source,
            )
        atomic_write_text(job.output, text)

    def _print(self, text: str) -> None:
        """Write to stdout with the live display off the screen (they may share a terminal)."""
        with self.display.paused():
            self.write_stdout(text)

    def _failed(self, job: Job, problem: str, error_type: str) -> None:
        self.result.failures.append((job.source, problem))
        self.display.document_failed(job.source, problem)
        if self.settings.as_json and job.output is None:
            self._print(to_json_line(error_record(job.source, problem, error_type)) + "\n")


def _unexpected(error: Exception) -> str:
    name = type(error).__name__
    if name == "OutOfMemoryError":
        return "out of GPU memory; try --index-device cpu, a smaller --encode-batch or --num-beams"
    message = " ".join(str(error).split())
    return f"unexpected {name}: {message} (-vv shows the traceback)" if message else f"unexpected {name}"


def _echo(text: str) -> None:
    typer.echo(text, nl=False)
    sys.stdout.flush()  # one document at a time: a pipe sees each summary when it is done


def _stdin_is_terminal() -> bool:
    try:
        return sys.stdin is not None and sys.stdin.isatty()
    except (AttributeError, ValueError):
        return False
