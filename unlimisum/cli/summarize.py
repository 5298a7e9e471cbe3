"""`unlimisum summarize PATH... | -`: summarize files, folders or standard input.

Thin on purpose: parse the options into the library's configs, check every input (and read
standard input) before the model loads, load the model once, then for each input read ->
summarize -> write, reporting progress on stderr. A bad input is reported (before the model
loads when it can be told from the file) and skipped; Ctrl-C stops at once and leaves no
partial output file; a reader that closes stdout (`| head`) ends the run quietly.
"""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import List, Literal, Optional

import typer

from unlimisum.cli.app import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, _click, app, fail, silence_stdout
from unlimisum.runs.runner import BatchResult, BatchRunner, SummarizeSettings
from unlimisum.runs.jobs import (HTML_EXTENSION, JSON_EXTENSION, MARKDOWN_EXTENSION, Job, assign_page,
    check_output_dir, plan_jobs)
from unlimisum.cli.option_sources import CONFIG, describe, describe_all, from_command_line, option_source, rank
from unlimisum.cli.progress import ProgressDisplay, make_stderr_console
from unlimisum.config import (
    DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL, DEFAULT_PROMPT, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig,
    PromptConfig, RetrievalConfig,
)
from unlimisum.runs import manifest as run_manifest
from unlimisum.runs.manifest import DocumentOutcome
from unlimisum.errors import ConfigError, UnlimisumError

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")

MODEL_PANEL = "Model"
INDEX_PANEL = "Reading, index and retrieval"
DECODER_PANEL = "Decoder-only models"
GENERATION_PANEL = "Generation"
TENSOR_CACHE_PANEL = "Tensor Cache (bounded decoder memory)"
OUTPUT_PANEL = "Output"
CACHE_PANEL = "Cache of encoded books"
DISPLAY_PANEL = "Display"
RUN_PANEL = "Run: settings file and engine"


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
    if not math.isfinite(size) or size <= 0:
        raise typer.BadParameter(f"'{value}' is not a positive size")
    return int(size)


def _load_config(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """--config FILE (eager): check the file and make it the command's defaults, below flags and env vars."""
    if value is None or ctx.resilient_parsing:
        return value
    from unlimisum.runs.run_config import config_defaults, read_config_file

    try:
        defaults = config_defaults(ctx.command, ctx, value, read_config_file(value))
    except ConfigError as error:
        raise _click.exceptions.UsageError(str(error), ctx=ctx) from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def _check_device(value: str) -> str:
    if not _DEVICE_PATTERN.match(value):
        raise typer.BadParameter(f"'{value}' is not a device; use auto, cpu, cuda, cuda:N or mps")
    return value


@app.command()
def summarize(
    ctx: typer.Context,
    paths: List[str] = typer.Argument(
        ..., metavar="PATH",
        help="Files (text, EPUB, PDF), folders (searched recursively) or '-' for standard input. "
        "Put '--' before names that start with '-'.",
    ),
    # -- model
    model: str = typer.Option(
        DEFAULT_MODEL, "-m", "--model", envvar="UNLIMISUM_MODEL", show_envvar=True, metavar="NAME_OR_DIR",
        help="Hub name or local folder: an encoder-decoder summarization model, or a decoder-only (instruct) model.",
        rich_help_panel=MODEL_PANEL,
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
        help="How the encoded input is stored (auto: bfloat16, which never overflows; float16 has 3 more "
        "mantissa bits but overflows beyond 65504; float32 doubles memory).",
        rich_help_panel=INDEX_PANEL,
    ),
    key_store: Literal["auto", "shared", "per-layer"] = typer.Option(
        "auto", "--key-store",
        help="Where an exact search scores: per-layer keys (L x the store's memory, H times fewer multiply-adds) or "
        "the shared store of states (auto: per-layer from 4,096 tokens when they fit half the free memory and "
        "are measured faster here).",
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
    encode_int8: bool = typer.Option(
        False, "--encode-int8", help="Encode with the encoder's linear layers in dynamic int8 (CPU, float32 "
        "weights): encoding ~1.2x faster without 16-bit units, encoder states within ~3% of float32's.",
        rich_help_panel=INDEX_PANEL,
    ),
    # -- decoder-only models
    prompt: str = typer.Option(
        DEFAULT_PROMPT, "--prompt", metavar="TEMPLATE",
        help="What a decoder-only model is asked: {text} stands for the document (in the user message of the "
        "model's chat template; without one, the whole prompt).",
        rich_help_panel=DECODER_PANEL,
    ),
    system: Optional[str] = typer.Option(
        None, "--system", metavar="TEXT", help="A system message for the chat template (default: the template's).",
        rich_help_panel=DECODER_PANEL,
    ),
    window: Optional[int] = typer.Option(
        None, "--window", min=1, metavar="N",
        help="Tokens attended exactly: a decoder-only model's local window (the end of the text, the request, "
        "the summary; default: the whole prompt where it fits the model's positions, else 4,096, at most a quarter "
        "of them), an encoder-decoder's encoder window (default: the model's).",
        rich_help_panel=DECODER_PANEL,
    ),
    # -- generation
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", min=1, metavar="N",
        help=f"Longest summary, in tokens (default: {DEFAULT_MAX_NEW_TOKENS}, at most the positions of the "
        "model's decoder).",
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
    sample: Optional[bool] = typer.Option(
        None, "--sample/--no-sample",
        help="Sample, or search (greedy or beams) even where the checkpoint samples by default, as instruct "
        "models often do (default: the model's generation config).",
        rich_help_panel=GENERATION_PANEL,
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
    output_format: Literal["markdown", "md", "json", "html"] = typer.Option(
        "markdown", "--format",
        help="markdown (or md); json (as --json); html: with -o, a page per input to read each sentence beside the "
        "passages of the book it drew on (.summary.html, one file that opens in a browser).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    html_page: Optional[Path] = typer.Option(
        None, "--html", metavar="FILE", dir_okay=False,
        help="Also write that page for the one input to FILE (the summary still goes to stdout or -o).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    output_dir: Optional[Path] = typer.Option(
        None, "-o", "--output-dir", metavar="DIR", file_okay=False,
        help="Write <input name>.summary.md (.summary.json, .summary.html) per input here, e.g. "
        "story.txt.summary.md, mirroring subfolders, instead of printing on stdout.",
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
    evidence: Optional[bool] = typer.Option(
        None, "--evidence/--no-evidence",
        help="--evidence: after each sentence a footnote quoting the passages of the book it drew on (JSON has "
        "them always). --no-evidence: skip the pass that finds them (coverage then counts every generation step).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    evidence_passages: int = typer.Option(
        3, "--evidence-passages", metavar="N", min=1, help="Passages of the book kept per summary sentence.",
        rich_help_panel=OUTPUT_PANEL,
    ),
    support: bool = typer.Option(
        True, "--support/--no-support",
        help="Read each sentence again with its passages hidden, to say how much it depends on them (its "
        "support); --no-support saves that pass (two readings of each sentence).",
        rich_help_panel=OUTPUT_PANEL,
    ),
    support_by: Literal["hiding", "removal"] = typer.Option(
        "hiding", "--support-by",
        help="How a sentence's passages are taken away for its support: hidden from retrieval, or removed from "
        "the input with the windows that held them encoded again (the states around them no longer carry them; "
        "an encoder pass per such window and sentence).", rich_help_panel=OUTPUT_PANEL,
    ),
    # -- cache of encoded books
    cache_dir: Optional[Path] = typer.Option(
        None, "--cache-dir", envvar="UNLIMISUM_CACHE_DIR", show_envvar=True, metavar="DIR", file_okay=False,
        help="Keep encoded books here: summarizing the same book again (other options) skips tokenizing and encoding.",
        rich_help_panel=CACHE_PANEL,
    ),
    cache_max_bytes: Optional[str] = typer.Option(
        None, "--cache-max-bytes", metavar="SIZE", callback=_check_size,
        help="With --cache-dir: cap its size (e.g. 20G); the least recently used books go first.",
        rich_help_panel=CACHE_PANEL,
    ),
    # -- run: settings file and engine
    config: Optional[Path] = typer.Option(
        None, "--config", metavar="FILE", is_eager=True, callback=_load_config, dir_okay=False,
        help="TOML file of options (keys: long option names without the dashes, e.g. max_new_tokens = 300); "
        "command-line flags and environment variables win over it.",
        rich_help_panel=RUN_PANEL,
    ),
    engine: Literal["local", "ray"] = typer.Option(
        "local", "--engine", help="Where the batch runs: this process, or a Ray cluster (pip install "
        "\"unlimisum[ray]\"; inputs and -o on storage every node sees). One input: its windows are encoded "
        "across the workers and the summary made here.",
        rich_help_panel=RUN_PANEL,
    ),
    ray_address: Optional[str] = typer.Option(
        None, "--ray-address", envvar="RAY_ADDRESS", show_envvar=True, metavar="ADDR",
        help="--engine ray: the cluster to use (default: a local Ray instance started for the run).",
        rich_help_panel=RUN_PANEL,
    ),
    workers: Optional[int] = typer.Option(
        None, "--workers", min=1, metavar="N",
        help="--engine ray: workers, each with its own loaded model (default: as many as the cluster's free "
        "CPUs, or GPUs, allow, at most one per input unless there is one; fewer when the cluster has no room "
        "for N).",
        rich_help_panel=RUN_PANEL,
    ),
    gpus_per_worker: Optional[float] = typer.Option(
        None, "--gpus-per-worker", min=0.0, metavar="G",
        help="--engine ray: GPUs each worker reserves (default: 1 when the cluster has GPUs and --device "
        "allows them, else 0).",
        rich_help_panel=RUN_PANEL,
    ),
    cpus_per_worker: Optional[int] = typer.Option(
        None, "--cpus-per-worker", min=1, metavar="C",
        help="--engine ray: CPUs each worker reserves, and its torch threads (default: the free CPUs of the "
        "cluster divided by the workers).",
        rich_help_panel=RUN_PANEL,
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
        raise fail(f"{describe(ctx, 'skip_existing')} needs --output-dir", EXIT_USAGE)
    as_json, as_html = _output_format(ctx, as_json, output_format, output_dir)
    decided: dict[str, tuple] = {}  # option -> (the value used, the source of the option that set it aside)
    quiet, verbose = _display_level(ctx, quiet, verbose, decided)
    _check_generation(ctx, min_new_tokens, max_new_tokens, temperature, repetition_penalty, top_p)
    _check_prompt(ctx, prompt, system)
    retrieval_k = _retrieval_k(ctx, retrieval_k, retrieval_k_alias, decided)
    if cache_max_bytes is not None and cache_dir is None:
        raise fail(f"{describe(ctx, 'cache_max_bytes')} needs --cache-dir (or UNLIMISUM_CACHE_DIR)", EXIT_USAGE)
    if tc_window is not None and not (tensor_cache or tc_params is not None):
        raise fail(f"{describe(ctx, 'tc_window')} needs --tensor-cache or --tc-params", EXIT_USAGE)
    try:
        memory = tensor_cache_settings(tensor_cache or tc_params is not None, tc_params, tc_window)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    _check_engine(ctx, engine, workers, gpus_per_worker, cpus_per_worker)
    do_sample, temperature, top_k, top_p = _sampling(ctx, sample, temperature, top_k, top_p, decided)
    if encode_int8:  # int8 copies are made of float32 weights: auto loads those, a 16-bit dtype contradicts it
        if dtype in ("float16", "bfloat16"):
            raise fail(f"{describe(ctx, 'encode_int8')} quantizes float32 weights and "
                       f"{describe(ctx, 'dtype', value=True)} loads 16-bit ones", EXIT_USAGE)
        dtype = "float32"
    settings = SummarizeSettings(
        model=ModelConfig(name=model, tokenizer=tokenizer, device=device, dtype=dtype, trust_remote_code=trust_remote_code),
        encoding=EncodingConfig(overlap=overlap, batch_size=encode_batch, window=window, int8=encode_int8),
        index=IndexConfig(kind=index, device=index_device, storage_dtype=storage_dtype, key_store=key_store),
        retrieval=RetrievalConfig(retrieval_k=retrieval_k, evidence=evidence is not False,
                                  evidence_passages=evidence_passages, support=support, support_by=support_by),
        generation=GenerationOptions(
            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams,
            no_repeat_ngram_size=no_repeat_ngram_size, length_penalty=length_penalty,
            repetition_penalty=repetition_penalty, do_sample=do_sample, temperature=temperature,
            top_k=top_k, top_p=top_p, seed=seed,
        ),
        per_chapter=per_chapter, as_json=as_json, as_html=as_html, output_dir=output_dir, skip_existing=skip_existing,
        password=password, keep_all=keep_all, tensor_cache=memory, coverage=coverage,
        evidence=bool(evidence), stdout_width=_terminal_columns(), cache_dir=cache_dir,
        cache_max_bytes=parse_size(cache_max_bytes) if cache_max_bytes else None,
        prompt=PromptConfig(template=prompt, system=system),
    )
    display = ProgressDisplay(make_stderr_console(), show=not quiet, verbose=verbose, evidence=bool(evidence))
    try:
        check_index_settings(settings.index)
        extension = HTML_EXTENSION if as_html else JSON_EXTENSION if as_json else MARKDOWN_EXTENSION
        plan = plan_jobs(paths, output_dir, extension, skip_existing=skip_existing)
        if output_dir is not None and any(job.problem is None and not job.skip for job in plan.jobs):
            check_output_dir(output_dir)
        if html_page is not None:
            assign_page(plan, html_page)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    display.own_outputs_skipped(plan.own_outputs)
    runner = BatchRunner(settings, display)
    jobs = plan.jobs
    started = run_manifest.now()
    interrupted = False
    try:
        runner.read_stdin_ahead(jobs)  # before the live display: the terminal may be where it is typed
        with warnings.catch_warnings():
            if quiet:  # library warnings would break the promise of an empty stderr
                warnings.simplefilter("ignore")
            result = _run_engine(engine, runner, jobs, ray_address, workers, gpus_per_worker, cpus_per_worker)
    except KeyboardInterrupt:
        interrupted = True
        resume = "; rerun with --skip-existing to resume" if output_dir is not None else ""
        typer.echo(f"unlimisum: interrupted after {runner.result.done} of {len(jobs)} inputs{resume}", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:  # the model could not be loaded: nothing can be summarized
        raise fail(error, EXIT_FAILURE)
    finally:
        if output_dir is not None:
            _save_manifest(ctx, output_dir, runner, jobs, paths, engine, started, interrupted, decided)
    if result.pipe_closed:  # `unlimisum summarize ... | head`: the reader took what it wanted
        silence_stdout()
    if result.failures:
        if result.total > 1 and not result.pipe_closed:
            display.failure_report(result.failures, result.total)
        raise typer.Exit(EXIT_FAILURE)


# -- the options checked, and reconciled where two of them disagree (the higher level wins: the command line
# over a --config file); ``decided`` notes each value set aside, for the run manifest


def _display_level(ctx, quiet: bool, verbose: int, decided: dict) -> tuple[bool, int]:
    """(quiet, verbose) once --quiet and --verbose are reconciled: the one given on the higher level wins; a usage
    error where both are given on the same level."""
    if quiet and verbose:
        if rank(ctx, "quiet") == rank(ctx, "verbose"):
            raise fail(" and ".join(describe_all(ctx, "quiet", "verbose")) + " contradict each other", EXIT_USAGE)
        if rank(ctx, "quiet") > rank(ctx, "verbose"):
            verbose, decided["verbose"] = 0, (0, option_source(ctx, "quiet"))
        else:
            quiet, decided["quiet"] = False, (False, option_source(ctx, "verbose"))
    return quiet, verbose


def _check_generation(ctx, min_new_tokens: int | None, max_new_tokens: int | None, temperature: float | None,
                      repetition_penalty: float | None, top_p: float | None) -> None:
    """A usage error for a minimum length above the maximum, or a sampling setting that is not positive."""
    if min_new_tokens is not None and min_new_tokens > (max_new_tokens or DEFAULT_MAX_NEW_TOKENS):
        if max_new_tokens is None:
            shown = [describe(ctx, "min_new_tokens", value=True),
                     f"--max-new-tokens {DEFAULT_MAX_NEW_TOKENS} (the default)"]
        else:
            shown = describe_all(ctx, "min_new_tokens", "max_new_tokens", value=True)
        raise fail(" exceeds ".join(shown), EXIT_USAGE)
    for name, value in (("temperature", temperature), ("repetition_penalty", repetition_penalty), ("top_p", top_p)):
        if value is not None and value <= 0:
            got = f", got {value}" if from_command_line(ctx, name) else ""
            raise fail(f"{describe(ctx, name)} must be greater than 0{got}", EXIT_USAGE)


def _check_prompt(ctx, prompt: str, system: str | None) -> None:
    """A usage error unless --prompt holds {text} once and --system not at all."""
    if prompt.count("{text}") != 1:
        shown = f": {prompt!r}" if from_command_line(ctx, "prompt") else ""
        raise fail(f"{describe(ctx, 'prompt')} must contain {{text}} exactly once, where the document goes{shown}",
                   EXIT_USAGE)
    if system is not None and "{text}" in system:
        shown = f": {system!r}" if from_command_line(ctx, "system") else ""
        raise fail(f"{describe(ctx, 'system')} must not contain {{text}}: the document goes where --prompt puts "
                   f"it{shown}", EXIT_USAGE)


def _retrieval_k(ctx, retrieval_k: int | None, alias: int | None, decided: dict) -> int | None:
    """--retrieval-k, or --topk (its old name) where only it is given or it is given on the higher level."""
    if retrieval_k is not None and alias is not None and retrieval_k != alias:
        if rank(ctx, "retrieval_k") == rank(ctx, "retrieval_k_alias"):
            raise fail(" and ".join(describe_all(ctx, "retrieval_k", "retrieval_k_alias", value=True))
                       + " disagree (--topk is the old name of --retrieval-k)", EXIT_USAGE)
        if rank(ctx, "retrieval_k_alias") > rank(ctx, "retrieval_k"):
            retrieval_k = alias
            decided["retrieval_k"] = (retrieval_k, option_source(ctx, "retrieval_k_alias"))
    return retrieval_k if retrieval_k is not None else alias


def _check_engine(ctx, engine: str, workers: int | None, gpus_per_worker: float | None,
                  cpus_per_worker: int | None) -> None:
    """A usage error for a Ray option without --engine ray, or --engine ray without Ray installed."""
    if engine == "local":
        for name, value in (("workers", workers), ("gpus_per_worker", gpus_per_worker),
                            ("cpus_per_worker", cpus_per_worker)):
            if value is not None:
                local = f" ({describe(ctx, 'engine')})" if option_source(ctx, "engine") == CONFIG else ""
                raise fail(f"{describe(ctx, name)} needs --engine ray{local}", EXIT_USAGE)
        return
    from unlimisum.runs import require_ray

    try:
        require_ray()
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)


def _sampling(ctx, sample: bool | None, temperature: float | None, top_k: int | None, top_p: float | None,
              decided: dict) -> tuple[bool | None, float | None, int | None, float | None]:
    """(do_sample, temperature, top_k, top_p): a sampling option given samples; --no-sample against one of them
    is settled as --quiet against --verbose (the higher level wins). do_sample None: the model's own setting."""
    sampling_options = [name for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p))
                        if value is not None]
    if sample is False and sampling_options:
        highest = max(rank(ctx, name) for name in sampling_options)
        if highest == rank(ctx, "sample"):
            named = describe_all(ctx, "sample", *[name for name in sampling_options if rank(ctx, name) == highest])
            which = "which samples" if len(named) == 2 else "which sample"
            raise fail(f"{named[0]} contradicts {', '.join(named[1:])}, {which}", EXIT_USAGE)
        if highest > rank(ctx, "sample"):
            sample = None
        else:
            for name in sampling_options:
                decided[name] = (None, option_source(ctx, "sample"))
            temperature = top_k = top_p = None
            sampling_options = []
    do_sample = True if sample or sampling_options else sample
    if do_sample != ctx.params.get("sample"):  # a sampling option given (it samples) set --sample's value
        decided["sample"] = (do_sample, option_source(ctx, max(sampling_options, key=lambda name: rank(ctx, name))))
    return do_sample, temperature, top_k, top_p


def _output_format(ctx, as_json: bool, output_format: str, output_dir: Path | None) -> tuple[bool, bool]:
    """(JSON, HTML pages) from --json and --format; a usage error where they contradict each other, or for
    --format html without the -o folder its pages go to."""
    if as_json and output_format != "json" and option_source(ctx, "output_format") != "default":
        if rank(ctx, "output_format") == rank(ctx, "as_json"):
            raise fail(" and ".join(describe_all(ctx, "as_json", "output_format", value=True))
                       + " contradict each other", EXIT_USAGE)
        if rank(ctx, "output_format") > rank(ctx, "as_json"):
            as_json = False
    as_json = as_json or output_format == "json"
    as_html = output_format == "html" and not as_json
    if as_html and output_dir is None:
        raise fail(f"{describe(ctx, 'output_format', value=True)} writes one page per input into a folder: give "
                   "-o DIR (or --html FILE for one input, beside the summary on stdout)", EXIT_USAGE)
    return as_json, as_html


def _terminal_columns() -> int | None:
    """The width of the terminal stdout is, or None when it is a pipe or a file."""
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    except (AttributeError, OSError, ValueError):  # no real file behind stdout (a test's capture)
        return None


def _run_engine(engine: str, runner: "BatchRunner", jobs: list[Job], address: str | None, workers: int | None,
                gpus_per_worker: float | None, cpus_per_worker: int | None = None) -> BatchResult:
    """Run the jobs in this process (the BatchRunner) or on Ray (unlimisum.runs.ray)."""
    if engine == "ray":
        from unlimisum.runs.ray import RayEngine, RaySettings

        return RayEngine(runner, RaySettings(address=address, workers=workers, gpus_per_worker=gpus_per_worker,
                                             cpus_per_worker=cpus_per_worker)).run(jobs)
    with runner.reporter:
        return runner.run(jobs)


def _save_manifest(ctx, output_dir: Path, runner: "BatchRunner", jobs: list[Job], inputs: list[str], engine: str,
                   started, interrupted: bool, decided: dict) -> None:
    """Write OUT/unlimisum-run.json (see unlimisum.runs.manifest); a problem writing it is a warning."""
    options, sources = effective_options(ctx, decided)
    outcomes = list(runner.result.outcomes)
    finished = {outcome.path for outcome in outcomes}
    outcomes += [DocumentOutcome(job.source, run_manifest.NOT_RUN, output=str(job.output) if job.output else None)
                 for job in jobs if job.source not in finished]
    config = ctx.params.get("config")
    manifest = run_manifest.build_manifest(
        engine=engine, inputs=inputs, options=options, option_sources=sources,
        config_file=str(config) if config is not None else None, model=runner.result.model, started=started,
        ended=run_manifest.now(), outcomes=outcomes, interrupted=interrupted,
    )
    try:
        if run_manifest.write_manifest(output_dir, manifest) is None:
            runner.reporter.note(f"unlimisum: warning: not writing {Path(output_dir) / run_manifest.MANIFEST_NAME}: "
                                "unlimisum did not write the file that is there")
    except OSError as error:
        runner.reporter.note(f"unlimisum: warning: cannot write the run manifest ({error.strerror or error})")


def effective_options(ctx, decided: dict | None = None) -> tuple[dict, dict]:
    """Every option of this `summarize` (PATH and --config aside) with the value that took effect and where it
    came from (commandline, environment, config or default). ``decided``: the options another one given at a
    higher level set aside (``verbose = 1`` in the file under ``--quiet``), with the value used and that
    option's source."""
    options, sources = {}, {}
    for name, value in ctx.params.items():
        if name not in ("paths", "config", "retrieval_k_alias"):
            options[name], sources[name] = value, option_source(ctx, name)
    alias = ctx.params.get("retrieval_k_alias")
    if options.get("retrieval_k") is None and alias is not None:  # --topk, the old name
        options["retrieval_k"], sources["retrieval_k"] = alias, option_source(ctx, "retrieval_k_alias")
    for name, (value, source) in (decided or {}).items():
        options[name], sources[name] = value, source
    return options, sources


def tensor_cache_settings(enabled: bool, params_file: Path | None, window: int | None):
    """TensorCacheSettings for --tensor-cache/--tc-params (None when off); a bad file is a ConfigError."""
    if not enabled:
        return None
    from unlimisum.tensor_cache import TensorCacheSettings

    settings = TensorCacheSettings(window=window, params=str(params_file) if params_file is not None else None)
    settings.loaded_params  # read now (once): a missing or invalid file is a usage error, before the model loads
    return settings


def check_index_settings(index: IndexConfig) -> None:
    """Raise ConfigError now, before the model loads, for index options this machine cannot honour."""
    from unlimisum.search.datastore import plan_index

    plan_index(1, 1, index)  # validates kind/device and CUDA presence for --index-device gpu
