"""`unlimisum train DATA... -m M -o DIR --method METHOD`: fine-tune a checkpoint with the paper's methods.

Thin: parse the options into a TrainConfig, call ``unlimisum.train``, print one progress line per
report on stderr, and the summarize command for the result at the end. Bad data is one line
naming file and row (exit 1); options that do not fit together are usage errors (exit 2).
"""

from __future__ import annotations

import shlex
import traceback
from pathlib import Path
from typing import List, Optional

import typer

from unlimisum.cli.app import EXIT_USAGE, app, fail
from unlimisum.errors import ConfigError, UnlimisumError

_METHODS = "truncated, chunked, random-encoded, retrieval or alternating"


@app.command("train")
def train(
    data: List[Path] = typer.Argument(..., metavar="DATA",
                                      help="Training files: JSON Lines, JSON, CSV or Parquet with text and summary columns, or "
                                      "folders of documents each with X.summary.txt (or .md) beside it."),
    model: str = typer.Option(..., "-m", "--model", metavar="NAME_OR_DIR", help="Checkpoint to start from."),
    output_dir: Path = typer.Option(..., "-o", "--output-dir", metavar="DIR",
                                    help="Where the trained checkpoint goes (written at the end, all at once)."),
    method: str = typer.Option(..., "--method", metavar="METHOD", help=f"Training method: {_METHODS}."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", metavar="NAME_OR_DIR",
                                            help="Tokenizer, when it is not the model's own."),
    text_field: str = typer.Option("text", "--text-field", metavar="NAME", help="Column with the input text."),
    summary_field: str = typer.Option("summary", "--summary-field", metavar="NAME", help="Column with the summary."),
    validation: Optional[List[Path]] = typer.Option(None, "--validation", metavar="FILE",
                                                    help="Validation file (repeat for more)."),
    validation_fraction: float = typer.Option(0.0, "--validation-fraction", metavar="F",
                                              help="Hold out this fraction of the training rows for validation."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", metavar="N", help="Optimizer steps (overrides --epochs)."),
    epochs: float = typer.Option(3.0, "--epochs", metavar="N", help="Passes over the data."),
    learning_rate: float = typer.Option(5e-5, "--learning-rate", "--lr", metavar="F", help="AdamW learning rate."),
    batch_size: int = typer.Option(1, "--batch-size", metavar="N", help="Examples per batch."),
    gradient_accumulation_steps: int = typer.Option(1, "--gradient-accumulation-steps", metavar="N",
                                                    help="Batches per optimizer step."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Data order, initial state and random-encoded draws."),
    max_input_tokens: int = typer.Option(16_384, "--max-input-tokens", metavar="N",
                                         help="Cut training inputs to N tokens (the paper: 16k)."),
    retrieval_k: Optional[int] = typer.Option(None, "--retrieval-k", metavar="K",
                                              help="States each head attends to (default: the model's window, at most 1,024)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing",
                                                help="Recompute activations: less memory, more time."),
    precision: str = typer.Option("auto", "--precision", metavar="P",
                                  help="auto, float32, bfloat16 or float16 (mixed precision, GPU only)."),
    device: str = typer.Option("auto", "--device", metavar="DEVICE", help="auto, cpu, cuda or mps."),
    save_steps: int = typer.Option(500, "--save-steps", metavar="N",
                                   help="Steps between checkpoints and validations."),
    metric: str = typer.Option("rougeL", "--metric", metavar="NAME",
                               help="Chooses the checkpoint kept: rougeL, rougeLsum, rouge1, rouge2 or loss."),
    eval_max_new_tokens: int = typer.Option(256, "--eval-max-new-tokens", metavar="N",
                                            help="Longest validation summary."),
    eval_num_beams: int = typer.Option(1, "--eval-num-beams", metavar="N", help="Beams of validation generation."),
    logging_steps: int = typer.Option(10, "--logging-steps", metavar="N", help="Steps between progress lines."),
    resume: bool = typer.Option(False, "--resume", help="Continue the unfinished run into DIR from its last checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace DIR when the new checkpoint is complete."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Errors only."),
    verbose: int = typer.Option(0, "-v", "--verbose", count=True, help="-vv: tracebacks of unexpected errors."),
) -> None:
    """Fine-tune a checkpoint to read through retrieval (Unlimiformer paper, section 3)."""
    from unlimisum.training.errors import require_training_extras

    try:
        require_training_extras()
    except UnlimisumError as error:
        raise fail(error)
    from unlimisum.training import TrainConfig, train as run_train

    try:
        config = TrainConfig(
            method=method, text_field=text_field, summary_field=summary_field,
            validation=tuple(str(path) for path in validation or ()), validation_fraction=validation_fraction,
            max_steps=max_steps, epochs=epochs, learning_rate=learning_rate, batch_size=batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps, seed=seed, max_input_tokens=max_input_tokens,
            retrieval_k=retrieval_k, gradient_checkpointing=gradient_checkpointing, precision=precision,
            device=device, save_steps=save_steps, metric=metric, eval_max_new_tokens=eval_max_new_tokens,
            eval_num_beams=eval_num_beams, logging_steps=logging_steps, resume=resume, overwrite=overwrite,
        )
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)

    def progress(report) -> None:
        if quiet:
            return
        if report.metrics:
            figures = "  ".join(f"{name} {value:.4g}" for name, value in report.metrics.items())
            typer.echo(f"unlimisum: step {report.step}/{report.total}  validation: {figures}", err=True)
        else:
            typer.echo(f"unlimisum: step {report.step}/{report.total}  loss {report.loss:.4f}", err=True)

    if not quiet:
        typer.echo(f"unlimisum: training {model} ({method}) into {output_dir}", err=True)
    try:
        result = run_train([str(path) for path in data], model=model, output_dir=output_dir, config=config,
                           tokenizer=tokenizer, progress=progress)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:
        raise fail(error)
    except KeyboardInterrupt:
        typer.echo("unlimisum: interrupted; rerun with --resume to continue from the last checkpoint", err=True)
        raise typer.Exit(130)
    except Exception as error:  # noqa: BLE001  (out of memory, a library's own error: one line, not a traceback)
        if verbose > 1:
            traceback.print_exc()
        message = " ".join(str(error).split()) or type(error).__name__
        raise fail(f"training stopped: unexpected {type(error).__name__}: {message}"
                   + ("" if verbose > 1 else " (-vv shows the traceback)"))
    if not quiet:
        best = result.report["best"]
        chosen = f"; kept step {best['step']} ({best['metric']} {best['value']:.4g})" if best else ""
        if result.final_validation:
            figures = "  ".join(f"{name} {value:.4g}" for name, value in result.final_validation.items())
            typer.echo(f"unlimisum: validation of the kept model: {figures}", err=True)
        typer.echo(f"unlimisum: wrote {output_dir} after {result.steps} steps{chosen}; summarize with it:", err=True)
        typer.echo(f"  {shlex.join(['unlimisum', 'summarize', '-m', str(output_dir), 'BOOK'])}", err=True)
