"""`unlimisum tc fit`: learn the Tensor Cache constants (λ, η, g) of a pretrained model.

    unlimisum tc fit --model M --text book.txt --text other.epub --window 256 --out tc.safetensors

The model stays frozen; only a few numbers per layer are learned. The file is then used with
`unlimisum summarize --tensor-cache tc.safetensors`. Progress and the held-out comparison go to
stderr; with --json one JSON object with the numbers goes to stdout.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from unlimisum.cli.app import app, fail
from unlimisum.config import DEFAULT_MODEL, ModelConfig
from unlimisum.errors import UnlimisumError

tc_app = typer.Typer(
    name="tc", help="Tensor Cache: bounded decoder memory (fit its constants).", no_args_is_help=True,
)
app.add_typer(tc_app, name="tc")


@tc_app.command("fit")
def fit(
    texts: List[Path] = typer.Option(..., "--text", help="Text, EPUB or PDF file to fit on (repeat for more)."),
    out: Path = typer.Option(..., "--out", help="Where to write the parameter file (.safetensors)."),
    window: int = typer.Option(256, "--window", min=1, help="L1 window W in tokens (use the one you summarize with)."),
    model: str = typer.Option(DEFAULT_MODEL, "--model", help="Hub name or local folder of the model."),
    steps: int = typer.Option(200, "--steps", min=1, help="Optimizer steps."),
    context: Optional[int] = typer.Option(None, "--context", help="Decoder tokens per block (default: min(4W, the decoder's limit))."),
    batch_size: int = typer.Option(4, "--batch-size", min=1, help="Blocks per step."),
    learning_rate: float = typer.Option(0.05, "--lr", help="Adam learning rate on the logits."),
    gate: str = typer.Option("layer", "--gate", help="One gate per 'layer' (as published) or per 'head'."),
    encoder_tokens: int = typer.Option(64, "--encoder-tokens", min=1, help="Leading tokens of each text fed to the encoder."),
    held_out: float = typer.Option(0.2, "--held-out", min=0.0, max=0.9, help="Fraction of blocks kept for the report."),
    device: str = typer.Option("auto", "--device", help="auto, cpu, cuda, cuda:N or mps."),
    dtype: str = typer.Option("float32", "--dtype", help="Model dtype while fitting (float32 recommended)."),
    seed: int = typer.Option(0, "--seed", help="Block order."),
    password: Optional[str] = typer.Option(None, "--password", help="Password for encrypted PDFs."),
    as_json: bool = typer.Option(False, "--json", help="Print the numbers as one JSON object on stdout."),
) -> None:
    """Fit λ, η (per head) and the gate (per layer) of a frozen model; report held-out NLL."""
    import torch

    from unlimisum.ingest import read_document
    from unlimisum.models import load_model
    from unlimisum.tensor_cache.fit import FitSettings, fit_tensor_cache, nll_summary
    from unlimisum.tensor_cache.params import save_params

    try:
        settings = FitSettings(
            window=window, context=context, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
            gate=gate, encoder_tokens=encoder_tokens, held_out=held_out, seed=seed,
        )
        documents = [read_document(path, password=password) for path in texts]
        typer.echo(f"unlimisum: loading {model}", err=True)
        loaded = load_model(ModelConfig(name=model, device=device, dtype=dtype))
        torch.manual_seed(seed)
        every = max(1, steps // 10)

        def progress(step: int, total: int, loss: float) -> None:
            if step % every == 0 or step == total:
                typer.echo(f"unlimisum: step {step}/{total}  far-position NLL {loss:.4f}", err=True)

        report = fit_tensor_cache(
            loaded.model, loaded.tokenizer, [document.text for document in documents], window,
            architecture=loaded.architecture, settings=settings, model_name=model, progress=progress,
        )
        save_params(report.params, out)
    except UnlimisumError as error:
        raise fail(error)
    for line in nll_summary(report):
        typer.echo(line, err=True)
    typer.echo(f"unlimisum: wrote {out} (use: unlimisum summarize --tensor-cache {out} --tc-window {window})", err=True)
    if as_json:
        typer.echo(json.dumps({"out": str(out), "model": model, **report.summary()}))
