"""`unlimisum tc fit`: learn the Tensor Cache constants of a pretrained model.

    unlimisum tc fit --model M --text book.txt --text other.epub --window 256 --out tc.safetensors

The model stays frozen; per layer only λ, η, the gate, the memory read's own projection
(initialised from the layer's output projection), a query map per head (initialised to the
identity) and a write gate per head (initialised to write every evicted token alike) are learned;
--tie-projection --no-query-map --no-write-gate keeps the read on the output projection and the
layer's queries and learns only 2 H_kv + 1 numbers per layer. The file is then used with
`unlimisum summarize -m M --tc-params tc.safetensors BOOK`; `tc fit` prints that command, ready
to run, for the model and the first text it was fitted on. Progress and the held-out comparison
go to stderr; with --json one JSON object with the numbers goes to stdout.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import List, Literal, Optional

import typer

from unlimisum.cli.app import EXIT_USAGE, UnlimisumGroup, UnlimisumTyper, app, fail
from unlimisum.config import DEFAULT_MODEL, ModelConfig
from unlimisum.errors import ConfigError, UnlimisumError

tc_app = UnlimisumTyper(
    name="tc", cls=UnlimisumGroup, help="Tensor Cache: bounded decoder memory (fit its constants).",
    no_args_is_help=True,
)
app.add_typer(tc_app, name="tc")


@tc_app.command("fit")
def fit(
    texts: List[Path] = typer.Option(
        ..., "--text", metavar="FILE", help="Text, EPUB or PDF file to fit on (repeat for more)."
    ),
    out: Path = typer.Option(..., "--out", metavar="FILE", help="Where to write the parameter file (.safetensors)."),
    window: int = typer.Option(
        256, "--window", min=1, metavar="W", help="L1 window W in tokens (use the one you summarize with)."
    ),
    model: str = typer.Option(
        DEFAULT_MODEL, "-m", "--model", metavar="NAME_OR_DIR", help="Hub name or local folder of the model."
    ),
    steps: int = typer.Option(200, "--steps", min=1, metavar="N", help="Optimizer steps."),
    context: Optional[int] = typer.Option(
        None, "--context", metavar="N", help="Decoder tokens per block (default: min(4W, the decoder's limit))."
    ),
    batch_size: int = typer.Option(4, "--batch-size", min=1, metavar="N", help="Blocks per step."),
    learning_rate: float = typer.Option(0.05, "--lr", metavar="F", help="Adam learning rate on the logits."),
    gate: Literal["layer", "head"] = typer.Option(
        "layer", "--gate", help="One gate per 'layer' (as published) or per 'head'."
    ),
    tie_projection: bool = typer.Option(
        False, "--tie-projection",
        help="Read the memory through each layer's output projection (a few numbers per layer) instead of "
             "fitting a projection of its own (d_model x d_model per layer, the default).",
    ),
    projection_lr: float = typer.Option(
        1e-3, "--projection-lr", metavar="F", help="Adam learning rate of the memory's own projection."
    ),
    query_map: bool = typer.Option(
        True, "--query-map/--no-query-map",
        help="Fit a d_head x d_head map per head that the memory is read with (started at identity): the "
             "model's queries were shaped for softmax attention, not for the memory's linear read.",
    ),
    query_map_lr: float = typer.Option(
        1e-3, "--query-map-lr", metavar="F", help="Adam learning rate of the query maps."
    ),
    write_gate: bool = typer.Option(
        True, "--write-gate/--no-write-gate",
        help="Fit a write gate per head (d_head + 1 numbers, started at strength 1) that decides how strongly "
             "each evicted token is written to the memory, so that what is never asked for does not crowd it.",
    ),
    write_gate_lr: float = typer.Option(
        1e-2, "--write-gate-lr", metavar="F", help="Adam learning rate of the write gates."
    ),
    chunk: str = typer.Option(
        "auto", "--chunk", metavar="auto|dense|N",
        help="The exact form fitted with: chunks of N decoder tokens (linear in --context), 'dense' (quadratic), "
             "or 'auto': whichever runs a step fastest here (the numbers are the same).",
    ),
    encoder_tokens: int = typer.Option(
        64, "--encoder-tokens", min=1, metavar="N", help="Leading tokens of each text fed to the encoder."
    ),
    held_out: float = typer.Option(
        0.2, "--held-out", min=0.0, max=0.9, metavar="F", help="Fraction of blocks kept for the report."
    ),
    device: str = typer.Option("auto", "--device", metavar="DEVICE", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option(
        "float32", "--dtype", metavar="DTYPE", help="Model dtype while fitting (float32 recommended)."
    ),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Block order."),
    start: Optional[Path] = typer.Option(
        None, "--start", metavar="FILE",
        help="Continue from this parameter file (an earlier tc fit of the same model), e.g. fitted on shorter "
             "outputs first, instead of the usual starting values.",
    ),
    password: Optional[str] = typer.Option(None, "--password", metavar="TEXT", help="Password for encrypted PDFs."),
    as_json: bool = typer.Option(False, "--json", help="Print the numbers as one JSON object on stdout."),
) -> None:
    """Fit λ, η (per head), the gate (per layer), the memory projection, query maps and write gates of a frozen model;
    report held-out NLL."""
    import torch

    from unlimisum.ingest import read_document
    from unlimisum.models import load_model
    from unlimisum.tensor_cache.fit import FitSettings, fit_tensor_cache, nll_summary
    from unlimisum.tensor_cache.params import load_params, save_params

    try:
        settings = FitSettings(
            window=window, context=context, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
            gate=gate, encoder_tokens=encoder_tokens, held_out=held_out, seed=seed,
            tie_projection=tie_projection, projection_learning_rate=projection_lr,
            query_map=query_map, query_map_learning_rate=query_map_lr,
            write_gate=write_gate, write_gate_learning_rate=write_gate_lr, chunk=_chunk_setting(chunk),
        )
        documents = [read_document(path, password=password) for path in texts]
        started = load_params(start) if start is not None else None
        typer.echo(f"unlimisum: loading {model}", err=True)
        loaded = load_model(ModelConfig(name=model, device=device, dtype=dtype))
        if started is not None and started.model_type and started.model_type != loaded.model.config.model_type:
            raise ConfigError(f"{start}: fitted on a {started.model_type} model, not {loaded.model.config.model_type}")
        torch.manual_seed(seed)
        every = max(1, steps // 10)

        def progress(step: int, total: int, loss: float) -> None:
            if step % every == 0 or step == total:
                typer.echo(f"unlimisum: step {step}/{total}  far-position NLL {loss:.4f}", err=True)

        report = fit_tensor_cache(
            loaded.model, loaded.tokenizer, [document.text for document in documents], window,
            architecture=loaded.architecture, settings=settings, model_name=model, progress=progress, start=started,
        )
        save_params(report.params, out)
    except ConfigError as error:  # options that do not fit together or do not fit the model
        raise fail(error, EXIT_USAGE)
    except UnlimisumError as error:
        raise fail(error)
    for line in nll_summary(report):
        typer.echo(line, err=True)
    typer.echo(f"unlimisum: wrote {out}; summarize with it:", err=True)
    typer.echo(f"  {usage_command(model, out, texts[0])}", err=True)
    if as_json:
        typer.echo(json.dumps({"out": str(out), "model": model, **report.summary()}))


def _chunk_setting(text: str) -> int | str | None:
    """--chunk as FitSettings.chunk: "auto", None for "dense", or a number of tokens."""
    if text in ("auto", "dense"):
        return None if text == "dense" else text
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"--chunk must be 'auto', 'dense' or a number of tokens, got {text!r}") from None


def usage_command(model: str, params: Path, book: Path) -> str:
    """The command that summarizes ``book`` with the fitted ``params``, quoted for a POSIX shell, ready to run.

    The window is the file's own, so none is given.
    """
    return shlex.join(["unlimisum", "summarize", "-m", model, "--tc-params", str(params), "--", str(book)])
