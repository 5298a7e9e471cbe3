"""`unlimisum summarize PATH... | -`: summarize files, folders or standard input.

Thin on purpose: parse the options into the library's configs, load the model once, then
for each input read -> summarize -> write, reporting progress on stderr. A bad input is
reported and skipped; Ctrl-C stops at once and leaves no partial output file.
"""

from __future__ import annotations

import io
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

from unlimisum.cli.app import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, app, fail
from unlimisum.cli.jobs import JSON_EXTENSION, MARKDOWN_EXTENSION, Job, plan_jobs
from unlimisum.cli.output import (
    atomic_write_text,
    error_record,
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
    tensor_cache: object | None = None  # unlimisum.tensor_cache.TensorCacheSettings, or None for the ordinary cache


@dataclass
class BatchResult:
    """How a batch went: counts, and (source, one-line problem) per failed input."""

    total: int
    done: int = 0
    skipped: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)


def _check_overlap(value: float) -> float:
    if not 0.0 <= value < 1.0:
        raise typer.BadParameter(f"{value} is not in [0, 1)")
    return value


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
        DEFAULT_MODEL, "-m", "--model", envvar="UNLIMISUM_MODEL", show_envvar=True,
        help="Hub name or local folder of an encoder-decoder summarization model.", rich_help_panel=MODEL_PANEL,
    ),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="Tokenizer hub name or folder (default: the model's own).", rich_help_panel=MODEL_PANEL
    ),
    device: str = typer.Option(
        "auto", "--device", callback=_check_device, help="auto, cpu, cuda, cuda:N or mps (auto: CUDA when available).",
        rich_help_panel=MODEL_PANEL,
    ),
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = typer.Option(
        "auto", "--dtype", help="Model weights dtype (auto: float32 on CPU, bfloat16/float16 on GPU).",
        rich_help_panel=MODEL_PANEL,
    ),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Allow models whose code comes from the hub (runs that code).",
        rich_help_panel=MODEL_PANEL,
    ),
    # -- reading, index and retrieval
    password: Optional[str] = typer.Option(
        None, "--password", help="Password for encrypted PDFs.", rich_help_panel=INDEX_PANEL
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
        None, "--retrieval-k", "--topk", min=1, metavar="K",
        help="Input tokens each cross-attention head retrieves per step (default: the model's window).",
        rich_help_panel=INDEX_PANEL,
    ),
    overlap: float = typer.Option(
        EncodingConfig().overlap, "--overlap", callback=_check_overlap, metavar="F",
        help="Fraction of each encoder window shared with its neighbours.", rich_help_panel=INDEX_PANEL,
    ),
    encode_batch: Optional[int] = typer.Option(
        None, "--encode-batch", min=1, metavar="N", help="Windows per encoder pass (default: chosen by device).",
        rich_help_panel=INDEX_PANEL,
    ),
    # -- generation
    max_new_tokens: int = typer.Option(
        _DEFAULT_GENERATION.max_new_tokens, "--max-new-tokens", min=1, help="Longest summary, in tokens.",
        rich_help_panel=GENERATION_PANEL,
    ),
    min_new_tokens: Optional[int] = typer.Option(
        None, "--min-new-tokens", min=0, help="Shortest summary, in tokens.", rich_help_panel=GENERATION_PANEL
    ),
    num_beams: Optional[int] = typer.Option(
        None, "--num-beams", min=1, help="Beam search width (default: the model's).", rich_help_panel=GENERATION_PANEL
    ),
    no_repeat_ngram_size: Optional[int] = typer.Option(
        None, "--no-repeat-ngram-size", min=0, help="Never repeat an n-gram of this size.",
        rich_help_panel=GENERATION_PANEL,
    ),
    length_penalty: Optional[float] = typer.Option(
        None, "--length-penalty", help="Beam search: >1 favours longer summaries, <1 shorter.",
        rich_help_panel=GENERATION_PANEL,
    ),
    repetition_penalty: Optional[float] = typer.Option(
        None, "--repetition-penalty", help="Penalty for tokens already generated (1 = none).",
        rich_help_panel=GENERATION_PANEL,
    ),
    sample: bool = typer.Option(
        False, "--sample", help="Sample instead of greedy/beam search.", rich_help_panel=GENERATION_PANEL
    ),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", help="Sampling temperature (turns on --sample).",
        rich_help_panel=GENERATION_PANEL,
    ),
    top_p: Optional[float] = typer.Option(
        None, "--top-p", max=1.0, help="Nucleus sampling probability mass (turns on --sample).",
        rich_help_panel=GENERATION_PANEL,
    ),
    seed: Optional[int] = typer.Option(
        None, "--seed", help="Random seed: the same seed gives the same summary.", rich_help_panel=GENERATION_PANEL
    ),
    # -- tensor cache
    tensor_cache: Optional[str] = typer.Option(
        None, "--tensor-cache", metavar="[FILE]",
        help="Bound the decoder's self-attention memory: the last --tc-window tokens exactly, older ones in a "
        "fitted memory (FILE: a .safetensors from `unlimisum tc fit`; without FILE: a plain sliding window).",
        rich_help_panel=TENSOR_CACHE_PANEL,
    ),
    tc_window: Optional[int] = typer.Option(
        None, "--tc-window", min=1, metavar="W",
        help="Tokens the decoder attends to exactly with --tensor-cache (default: the FILE's, else 256).",
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
        help="Write <name>.summary.md (or .summary.json) per input here, mirroring subfolders, instead of stdout.",
        rich_help_panel=OUTPUT_PANEL,
    ),
    skip_existing: bool = typer.Option(
        False, "--skip-existing", help="With -o: skip inputs whose summary file exists (resume a batch).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    # -- display
    quiet: bool = typer.Option(
        False, "-q", "--quiet", help="No progress or per-document lines on stderr; errors only.",
        rich_help_panel=DISPLAY_PANEL,
    ),
    verbose: int = typer.Option(
        0, "-v", "--verbose", count=True, help="Log each stage on stderr (-vv: tracebacks of unexpected errors).",
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
    if tc_window is not None and tensor_cache is None:
        raise fail("--tc-window needs --tensor-cache", EXIT_USAGE)
    try:
        memory = tensor_cache_settings(tensor_cache, tc_window)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    do_sample = sample or temperature is not None or top_p is not None
    settings = SummarizeSettings(
        model=ModelConfig(name=model, tokenizer=tokenizer, device=device, dtype=dtype, trust_remote_code=trust_remote_code),
        encoding=EncodingConfig(overlap=overlap, batch_size=encode_batch),
        index=IndexConfig(kind=index, device=index_device, storage_dtype=storage_dtype),
        retrieval=RetrievalConfig(retrieval_k=retrieval_k),
        generation=GenerationOptions(
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams,
            no_repeat_ngram_size=no_repeat_ngram_size, length_penalty=length_penalty,
            repetition_penalty=repetition_penalty, do_sample=True if do_sample else None, temperature=temperature,
            top_p=top_p, seed=seed,
        ),
        per_chapter=per_chapter, as_json=as_json, output_dir=output_dir, skip_existing=skip_existing,
        password=password, tensor_cache=memory,
    )
    display = ProgressDisplay(make_stderr_console(), show=not quiet, verbose=verbose)
    try:
        check_index_settings(settings.index)
        jobs = plan_jobs(paths, output_dir, JSON_EXTENSION if as_json else MARKDOWN_EXTENSION)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    runner = BatchRunner(settings, display)
    try:
        with display, warnings.catch_warnings():
            if quiet:  # library warnings would break the promise of an empty stderr
                warnings.simplefilter("ignore")
            result = runner.run(jobs)
    except BrokenPipeError:  # `unlimisum summarize ... | head`: the reader left; stop quietly
        _silence_stdout()
        raise typer.Exit(EXIT_FAILURE)
    except KeyboardInterrupt:
        resume = "; rerun with --skip-existing to resume" if output_dir is not None else ""
        typer.echo(f"unlimisum: interrupted after {runner.result.done} of {len(jobs)} inputs{resume}", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:  # the model could not be loaded: nothing can be summarized
        raise fail(error, EXIT_FAILURE)
    if result.failures:
        if result.total > 1:
            display.failure_report(result.failures, result.total)
        raise typer.Exit(EXIT_FAILURE)


def tensor_cache_settings(file: str | None, window: int | None):
    """TensorCacheSettings for `--tensor-cache [FILE]` (None without the option); a bad FILE is a ConfigError."""
    if file is None:
        return None
    from unlimisum.tensor_cache import TensorCacheSettings

    settings = TensorCacheSettings(window=window, params=file or None)
    settings.loaded_params  # read now (once): a missing or invalid file is a usage error, before the model loads
    return settings


def check_index_settings(index: IndexConfig) -> None:
    """Raise ConfigError now, before the model loads, for index options this machine cannot honour."""
    from unlimisum.datastore import plan_index

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
        self._printed = 0

    def run(self, jobs: list[Job]) -> BatchResult:
        """Summarize every job; failures are collected in the result, Ctrl-C propagates."""
        self.result = BatchResult(total=len(jobs))
        skipped = [self._skip(job) for job in jobs]
        if any(job.problem is None and not skip for job, skip in zip(jobs, skipped)):
            self._load_model()
        for number, (job, skip) in enumerate(zip(jobs, skipped), start=1):
            if skip:
                self.result.skipped += 1
                self.display.document_skipped(job.source, job.output)
                continue
            self.display.begin_document(number, len(jobs), job.source)
            self._run_one(job)
        return self.result

    # -- steps -------------------------------------------------------------------------------

    def _skip(self, job: Job) -> bool:
        return self.settings.skip_existing and job.output is not None and job.problem is None and job.output.exists()

    def _load_model(self) -> None:
        from unlimisum.models import load_model
        from unlimisum.summarizer import Summarizer

        settings = self.settings
        self.display.loading_model(settings.model.name)
        started = self.clock()
        loaded = load_model(settings.model)
        self.display.model_loaded(loaded.name, str(loaded.device), str(loaded.dtype).replace("torch.", ""),
                                  self.clock() - started)
        if loaded.device.type == "cuda":
            self.display.set_memory_probe(MemoryProbe(cuda_device=loaded.device))
        elif self.display.memory is None:
            self.display.set_memory_probe(MemoryProbe())
        self.summarizer = Summarizer(
            loaded, encoding=settings.encoding, index=settings.index, retrieval=settings.retrieval,
            generation=settings.generation, tensor_cache=settings.tensor_cache, progress=self.display,
        )
        if settings.tensor_cache is not None:
            from unlimisum.tensor_cache.session import describe, effective_window

            self.display.note(f"unlimisum: {describe(settings.tensor_cache, effective_window(settings.tensor_cache))}")

    def _run_one(self, job: Job) -> None:
        from unlimisum.ingest import read_document

        started = self.clock()
        try:
            if job.problem is not None:
                raise job.problem
            document = read_document(job.source, password=self.settings.password)
            read_seconds = self.clock() - started
            for warning in document.metadata.get("warnings", []):
                self.display.note(f"unlimisum: warning: {job.source}: {warning}")
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
                atomic_write_text(job.output, to_json_file(record))
            else:
                self._print(to_json_line(record) + "\n")
            return
        if job.output is not None:
            atomic_write_text(job.output, render_markdown(summary, document, heading=True))
            return
        several = self.result.total > 1
        text = render_markdown(summary, document, heading=several)
        self._print(("\n" if self._printed else "") + text)
        self._printed += 1

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


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
