"""`unlimisum evaluate DATA.jsonl`: unlimisum's summaries of a data set scored, beside its baselines.

Thin: read and check the data (every line, every file it names) before the model loads, load the model, run
``unlimisum.evaluation`` with progress on stderr, print the table (stderr, a terminal) or the JSON (stdout,
``--json``), and with ``-o DIR`` write the JSON, a Markdown report and a plot. Every result is kept as it is
scored (in DIR, or the cache home): the same command again resumes where an interrupted one stopped.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import List, Literal, Optional

import typer

from unlimisum.cli.app import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, app, fail
from unlimisum.cli.progress import ProgressDisplay, format_seconds, make_stderr_console
from unlimisum.config import (DEFAULT_MODEL, EncodingConfig, GenerationOptions, IndexConfig, ModelConfig,
                              RetrievalConfig)
from unlimisum.errors import ConfigError, UnlimisumError
from unlimisum.visible import json_text, visible

RESULTS_NAME = "results.jsonl"  # in -o DIR: every (system, document) result, as it is scored
REPORT_NAMES = ("evaluation.json", "report.md", "scores.png")


@app.command()
def evaluate(
    data: Path = typer.Argument(..., metavar="DATA.jsonl", dir_okay=False,
                                help="One document a line: {\"id\", \"text\" or \"path\", \"reference\"} (a string, or "
                                "a list of references: each metric takes the best)."),
    model: str = typer.Option(DEFAULT_MODEL, "-m", "--model", envvar="UNLIMISUM_MODEL", show_envvar=True,
                              help="Hub name or local folder of the model."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer hub name or folder."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = typer.Option("auto", "--dtype",
                                                                             help="The weights' dtype."),
    baseline: List[str] = typer.Option(
        [], "--baseline", metavar="NAME", help="Score beside unlimisum: truncated (the model reading its first "
        "window) or chunked (each window summarized alone, joined); repeat for both."),
    entities: bool = typer.Option(False, "--entities", help="EntMent too: the share of the references' named "
                                  "entities a summary mentions (spaCy and en_core_web_sm)."),
    bertscore: Optional[str] = typer.Option(None, "--bertscore", metavar="MODEL",
                                            help="BERTScore F1 too, with this model (bert-score)."),
    retrieval_k: Optional[int] = typer.Option(None, "--retrieval-k", min=1, metavar="K",
                                              help="Input tokens each head retrieves per step."),
    overlap: float = typer.Option(0.5, "--overlap", help="Share of a window its neighbours overlap (0-0.99)."),
    window: Optional[int] = typer.Option(None, "--window", min=2, help="Tokens per encoder window."),
    encode_int8: bool = typer.Option(False, "--encode-int8", help="Encode with int8 linear layers (CPU)."),
    index: Literal["auto", "exact", "ivf", "hnsw"] = typer.Option("auto", "--index", help="Index kind."),
    key_store: Literal["auto", "shared", "per-layer"] = typer.Option("auto", "--key-store", help="Key store."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Summary length, at most."),
    min_new_tokens: Optional[int] = typer.Option(None, "--min-new-tokens", min=0, help="Summary length, at least."),
    num_beams: Optional[int] = typer.Option(None, "--num-beams", min=1, help="Beams of beam search."),
    support: bool = typer.Option(True, "--support/--no-support",
                                 help="Measure each sentence's support (the share marked check first)."),
    support_by: Literal["hiding", "removal"] = typer.Option("hiding", "--support-by",
                                                            help="How support takes the passages away."),
    as_json: bool = typer.Option(False, "--json", help="Print the evaluation as one JSON object on stdout."),
    output_dir: Optional[Path] = typer.Option(None, "-o", "--output-dir", file_okay=False, metavar="DIR",
                                              help="Write the results, evaluation.json, report.md and scores.png "
                                              "here (the results kept as they come: run again to resume)."),
    fresh: bool = typer.Option(False, "--fresh", help="Start again: forget the results kept so far."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Only errors on stderr."),
) -> None:
    """Score unlimisum's summaries of a data set against references (ROUGE, and EntMent or BERTScore when
    asked), beside baselines, with 95 % bootstrap intervals and paired differences."""
    from unlimisum.evaluation.data import EvaluationDataError, read_items
    from unlimisum.evaluation.metrics import MetricUnavailableError
    from unlimisum.ingest import read_document

    try:
        items = read_items(data)
    except EvaluationDataError as error:
        raise fail(error, EXIT_FAILURE)
    missing = [item for item in items if item.path is not None and not item.path.is_file()]
    if missing:
        raise fail(f"{data}: line {missing[0].line}: no file {missing[0].path}"
                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""), EXIT_FAILURE)
    console = make_stderr_console()
    display = ProgressDisplay(console, show=not quiet)
    generation = GenerationOptions(max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, num_beams=num_beams)
    retrieval = RetrievalConfig(retrieval_k=retrieval_k, support=support, support_by=support_by)
    settings = _settings(data, model, tokenizer, dtype, baseline, entities, bertscore, retrieval, overlap, window,
                         encode_int8, index, key_store, generation)
    results_path = output_dir / RESULTS_NAME if output_dir is not None else _kept_results(settings)
    try:
        with display:
            evaluation, results = _prepare(display, settings, model, tokenizer, device, dtype, generation, retrieval,
                                           overlap, window, encode_int8, index, key_store, baseline, entities,
                                           bertscore, results_path, fresh, read_document)
            on_start, on_result = _progress(display, len(items), len(evaluation.systems))
            outcome = evaluation.run(items, results, on_start=on_start, on_result=on_result)
    except KeyboardInterrupt:
        typer.echo(visible(f"unlimisum: interrupted; the results so far are kept in {results_path}: run the same "
                           "command again to go on"), err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    except (ConfigError, MetricUnavailableError) as error:
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:
        raise fail(error, EXIT_FAILURE)
    from unlimisum.evaluation.run import report

    result = report(outcome)
    if output_dir is not None:
        _write_reports(result, output_dir, data)
    if as_json:
        typer.echo(json_text(json.dumps(result, ensure_ascii=False)))
    elif not quiet:
        console.print(_table(result))
    if not quiet:
        typer.echo(visible(f"unlimisum: results of {len(items)} documents kept in {results_path}"
                           + (f"; report in {output_dir}" if output_dir is not None else "")), err=True)


def _prepare(display, settings, model, tokenizer, device, dtype, generation, retrieval, overlap, window, encode_int8,
             index, key_store, baseline, entities, bertscore, results_path, fresh, read_document):
    """The loaded model's Summarizer, its Evaluation and the results file (checked: other settings refused)."""
    from unlimisum.evaluation.baselines import check_baselines
    from unlimisum.evaluation.run import Evaluation, EvaluationConfig, ResultsFile, Scorers
    from unlimisum.models import load_model
    from unlimisum.summarizer import Summarizer

    config = EvaluationConfig(baselines=tuple(dict.fromkeys(baseline)), entities=entities, bertscore_model=bertscore)
    check_baselines(config.baselines)
    results = ResultsFile(results_path, settings)
    if not fresh:
        results.done()  # refuses another evaluation's file before the model loads
    scorers = Scorers(config)  # a missing metric package is said before the model loads
    display.loading_model(model)
    loaded = load_model(ModelConfig(name=model, tokenizer=tokenizer, device=device, dtype=dtype), progress=display)
    summarizer = Summarizer(loaded, encoding=EncodingConfig(overlap=overlap, window=window, int8=encode_int8),
                            index=IndexConfig(kind=index, key_store=key_store), retrieval=retrieval,
                            generation=generation, progress=display)
    evaluation = Evaluation(summarizer, config, read_document, scorers=scorers)
    results.start(fresh=fresh)
    kept = len(results.done())
    if kept:
        display.note(f"unlimisum: resuming: {kept} results of an earlier run of this evaluation are kept "
                     f"({results_path})")
    return evaluation, results


def _progress(display: ProgressDisplay, documents: int, systems: int):
    """The callbacks of Evaluation.run: which document and system is next (its stages shown as summarize shows
    them), and above it how many summaries are done, with the time left at the rate of those made here."""
    state = {"started": display.clock(), "scored": 0, "done": 0}
    total = documents * systems

    def on_start(system: str, item) -> None:
        display.begin_document(state["done"] + 1, total, f"{item.id} ({system})", read=True)
        show()

    def on_result(done: int, total: int, result) -> None:
        state["done"] = done
        if result is not None:
            state["scored"] += 1
            display.log(f"{result.id} ({result.system}): ROUGE-1 {100 * result.scores['rouge1']:.1f}, ROUGE-L "
                        f"{100 * result.scores['rougeL']:.1f}, {result.words} words in {format_seconds(result.seconds)}")
        show()

    def show() -> None:
        elapsed = display.clock() - state["started"]
        done, left = state["done"], ""
        if state["scored"] and done < total:
            left = f" · about {format_seconds(elapsed / state['scored'] * (total - done))} left"
        display.overall(f"evaluating: {documents:,} documents x {systems} systems{left}", done, total)

    return on_start, on_result


def _settings(data, model, tokenizer, dtype, baseline, entities, bertscore, retrieval, overlap, window, encode_int8,
              index, key_store, generation) -> dict:
    """What the results depend on: the data (its bytes), the model and every option that changes a summary or a
    score. A results file made with other settings is another evaluation."""
    return {
        "data_sha256": hashlib.sha256(data.read_bytes()).hexdigest(), "model": model, "tokenizer": tokenizer,
        "dtype": dtype, "baselines": sorted(set(baseline)), "entities": entities, "bertscore": bertscore,
        "retrieval": [retrieval.retrieval_k, retrieval.support, retrieval.support_by], "overlap": overlap,
        "window": window, "encode_int8": encode_int8, "index": index, "key_store": key_store,
        "generation": generation.to_generate_kwargs(),
    }


def _kept_results(settings: dict) -> Path:
    """Where an evaluation without -o keeps its results: the cache home, named by its settings."""
    from unlimisum.measurements import cache_home

    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:20]
    return cache_home() / "evaluations" / f"{digest}.jsonl"


def _write_reports(result: dict, output_dir: Path, data: Path) -> None:
    """evaluation.json, report.md and scores.png in ``output_dir``, each written whole."""
    from unlimisum.evaluation.outputs import markdown, plot
    from unlimisum.files import atomic_write_bytes

    output_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output_dir / "evaluation.json",
                       (json_text(json.dumps(result, ensure_ascii=False, indent=1)) + "\n").encode("utf-8"))
    atomic_write_bytes(output_dir / "report.md",
                       markdown(result, f"Evaluation of {data.name}").encode("utf-8"))
    picture = io.BytesIO()
    try:
        plot(result, picture)
    except ImportError:
        from unlimisum.errors import install_hint

        raise fail(f"the plot needs matplotlib: {install_hint('evaluate')} (evaluation.json and report.md are "
                   f"written in {output_dir})", EXIT_FAILURE) from None
    atomic_write_bytes(output_dir / "scores.png", picture.getvalue())


def _table(result: dict):
    """A Rich table: a row per metric, a column per system (mean and 95 % interval), the paired differences of
    ROUGE-1 and ROUGE-L under it; as wide as three systems need at 80 columns."""
    from rich.table import Table

    from unlimisum.evaluation.outputs import SHOWN, interval

    systems = result["systems"]
    table = Table(title="mean over the documents (95 % bootstrap interval), percent", title_justify="left")
    table.add_column("")
    for system in systems:
        table.add_column(system["name"], justify="right")
    for key, name in SHOWN:
        if any(key in system["metrics"] for system in systems):
            table.add_row(name, *[interval(system["metrics"][key]) if key in system["metrics"] else "–"
                                  for system in systems])
    table.add_row("words", *[interval(system["metrics"]["words"], percent=False) if "words" in system["metrics"]
                             else "–" for system in systems])
    table.add_row("check first", *[f"{100 * system['metrics']['check_first']['mean']:.0f} %"
                                   if "check_first" in system["metrics"] else "–" for system in systems])
    table.add_row("documents", *[str(len(system["documents"])) for system in systems])
    lines = [f"unlimisum - {pair['baseline']}, {pair['metric']}: {100 * pair['difference']:+.1f} "
             f"({100 * pair['low']:+.1f} to {100 * pair['high']:+.1f})"
             for pair in result["paired"] if pair["metric"] in ("rouge1", "rougeL")]
    table.caption = "\n".join(lines) or None
    return table
