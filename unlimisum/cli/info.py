"""`unlimisum info`: versions, devices, Faiss build, model cache, and the index plan for N tokens
(gathered by ``unlimisum.diagnostics``, printed here).

Everything a bug report needs, and the answer to "what would unlimisum do with a book of N
tokens on this machine" (``--tokens N``): for an encoder-decoder model the index over its encoder
states, for a decoder-only model (when its config is local or cached) the window, sinks, k,
position regime, store size and placement. Plain text by default, one JSON object with --json.
"""

from __future__ import annotations

import json
from typing import Literal, Optional

import typer

from unlimisum.cli.app import EXIT_USAGE, app, fail
from unlimisum.config import IndexConfig
from unlimisum.errors import UnlimisumError


@app.command()
def info(
    tokens: Optional[int] = typer.Option(
        None, "--tokens", min=1, metavar="N", help="Show the index and placement unlimisum would choose for N input tokens."
    ),
    model: Optional[str] = typer.Option(
        None, "-m", "--model", envvar="UNLIMISUM_MODEL", show_envvar=True,
        help="Model whose config sizes the plan (read from a local folder or the cache; else a hidden size of "
        "768): an encoder-decoder's index, or a decoder-only model's window, store and placement.",
    ),
    index: Literal["auto", "exact", "ivf", "hnsw"] = typer.Option("auto", "--index", help="Index kind to plan for."),
    index_device: Literal["auto", "cpu", "gpu"] = typer.Option("auto", "--index-device", help="Index device to plan for."),
    key_store: Literal["auto", "shared", "per-layer"] = typer.Option("auto", "--key-store",
                                                                    help="Key store to plan for."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    remeasure: bool = typer.Option(
        False, "--remeasure", help="Forget what was measured on this machine to choose speed settings (the CPU "
        "dtype, the retrieval kernels), under any thread count, and its compiled kernels; measure again now (the "
        "kernel for --tokens N; the rest, and the compiling, when next needed).",
    ),
) -> None:
    """Show versions, devices, the Faiss build, where models are cached, what was measured on this machine,
    and the index plan for N tokens."""
    from unlimisum.diagnostics import collect_report, forget_measurements

    if remeasure:
        forget_measurements()
        from unlimisum.models import precision

        precision._cpu_speedup.cache_clear()
    try:
        report = collect_report(tokens, model, IndexConfig(kind=index, device=index_device, key_store=key_store))
    except UnlimisumError as error:  # ConfigError among them
        raise fail(error, EXIT_USAGE)
    if as_json:
        typer.echo(json.dumps(report, ensure_ascii=False))
    else:
        typer.echo(render_report(report))


# -- rendering ---------------------------------------------------------------------------------


def render_report(report: dict) -> str:
    """The report as aligned plain text (stable for pipes and bug reports)."""
    from unlimisum.cli.progress import format_bytes

    versions, devices, faiss_info, models, plan = (
        report["versions"], report["devices"], report["faiss"], report["models"], report["plan"]
    )
    cuda_build = f" (CUDA {versions['torch_cuda']})" if versions["torch_cuda"] else " (CPU build)"
    lines = [
        "versions",
        *_rows([
            ("unlimisum", versions["unlimisum"]),
            ("python", f"{versions['python']} ({versions['python_executable']})"),
            ("torch", versions["torch"] + cuda_build),
            ("transformers", versions["transformers"]),
            ("tokenizers", versions["tokenizers"]),
            ("faiss", versions["faiss"] or "not installed"),
            ("numba", versions["numba"] or "not installed (the torch kernels serve)"),
        ]),
        "devices",
        *_rows([
            ("cpu", f"{devices['cpu_count']} cores, torch uses {devices['torch_threads']} threads"),
            ("cpu --dtype", devices["cpu_dtype_auto"]),
            ("cuda", "available" if devices["cuda_available"] else "not available"),
            *[(gpu["device"], f"{gpu['name']}, {format_bytes(gpu['free_bytes'])} free of "
               f"{format_bytes(gpu['total_bytes'])}") for gpu in devices["gpus"]],
            ("mps", "available" if devices["mps_available"] else "not available"),
        ]),
        "faiss",
        *_rows([
            ("build", ("GPU" if faiss_info["gpu_build"] else "CPU") if faiss_info["installed"] else "not installed"),
            ("gpus", str(faiss_info["gpus"])),
            ("options", faiss_info["compile_options"] or "-"),
        ]),
        "models",
        *_rows([
            ("default model", models["default_model"]),
            ("model families", ", ".join(models["supported_model_types"])),
            *([("model", models["model"])] if models["model_source"] != "default" else []),
            *([("tokenizer", models["tokenizer_from"])] if models["tokenizer_from"] else []),
            ("available offline", _offline_summary(models)),
            *[("fetch with" if index == 0 else "", command) for index, command in enumerate(models["fetch_commands"])],
            ("HF_HOME", models["hf_home"]),
            ("hub cache", models["hub_cache"]),
            ("HF_HUB_OFFLINE", "on" if models["hf_hub_offline"] else "off"),
        ]),
    ]
    if plan is not None and plan["model_kind"] == "decoder-only":
        lines += _decoder_plan_lines(plan, format_bytes)
    elif plan is not None:
        lines += [
            f"index plan for {plan['tokens']:,} tokens",
            *_rows([
                ("model", f"{plan['model']} (d_model {plan['d_model']}, {plan['d_model_source']})"),
                ("asked", f"--index {plan['index']} --index-device {plan['index_device']}"),
                ("index", f"{plan['kind']} on {plan['device']}"),
                ("reason", plan["reason"]),
                *([("retrieval kernel", plan["retrieval_kernel"])] if plan.get("retrieval_kernel") else []),
                *([("key store", f"{plan['key_store']} ({format_bytes(plan['key_store_bytes'])}): "
                                 f"{plan['key_store_reason']}")] if plan.get("key_store") else []),
                *([("key kernel", plan["key_kernel"])] if plan.get("key_kernel") else []),
            ]),
        ]
    lines += _measurement_lines(report["measurements"])
    return "\n".join(lines)


def _measurement_lines(found: dict) -> list[str]:
    """``measured on this machine``: per speed choice measured, its name, when and what measuring took, then what
    was timed and what won."""
    lines = ["measured on this machine"]
    for entry in found["entries"]:
        when = entry["measured_at"].replace("T", " ")[:16]
        lines += [f"  {entry['name']} ({when} UTC, took {entry['seconds']:.2f} s)", f"      {entry['reason']}"]
    if not found["entries"]:
        lines.append("  nothing yet (measured on first use, about a second)")
    kernels = found.get("kernels") or {}
    compiled = (f"{kernels['files']} files, {_size(kernels['bytes'])} in {kernels['folder']}" if kernels.get("files")
                else f"none yet (compiled by the first book of {_compiled_from():,} tokens or more)")
    return lines + _rows([("kept in", found["file"]), ("measure again", found["remeasure"]),
                          ("compiled kernels", compiled)])


def _size(count: int) -> str:
    from unlimisum.cli.progress import format_bytes

    return format_bytes(count)


def _compiled_from() -> int:
    from unlimisum.search.kernels import COMPILED_MIN_STATES

    return COMPILED_MIN_STATES


def _decoder_plan_lines(plan: dict, format_bytes) -> list[str]:
    window, k = plan["window"], plan["retrieval_k"]
    store = (f"{plan['store_bytes_per_token']:,} bytes per prompt token (2 x {plan['full_layers']} full-attention "
             f"layers x {plan['kv_heads']} KV heads x head dim {plan['head_dim']} x {plan['element_bytes']} bytes, "
             f"{plan['storage_dtype']}), "
             f"{format_bytes(plan['store_bytes'])} in all")
    devices = plan["keys_device"] if plan["keys_device"] == plan["values_device"] else \
        f"keys on {plan['keys_device']}, values on {plan['values_device']}"
    return [
        f"decoder-only plan for a prompt of {plan['tokens']:,} tokens",
        *_rows([
            ("model", f"{plan['model']} ({plan['family']}, {plan['max_positions']:,} positions)"),
            ("window", f"the whole prompt attended exactly, as the model itself does, read in chunks of "
                       f"{plan['chunk']:,} (it fits the model's positions; --window retrieves instead)"
             if plan["exact"] else f"{window:,} tokens attended exactly, read in chunks of {plan['chunk']:,} "
                                   "(--window)"),
            ("sinks", plan["sinks"]),
            ("retrieval k", "none: no token is far" if plan["exact"]
             else f"{k:,} far tokens per key-value head and query (--retrieval-k)"),
            ("positions", f"{plan['positions']} (with --max-new-tokens {plan['max_new_tokens']})"),
            ("layers", f"{plan['full_layers']} full attention (they store the prompt), "
                       f"{plan['sliding_layers']} sliding window (they keep their window)"),
            ("store", store),
            ("placement", f"{devices}: {plan['placement']}"),
        ]),
    ]


def _rows(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"  {key + ':' if key else '':<19}{value}" for key, value in pairs]


def _offline_summary(models: dict) -> str:
    """``yes``, or what is missing and what that means: downloaded on first use, or (HF_HUB_OFFLINE) a failure."""
    missing = models["missing_offline"]
    if not missing:
        return "yes"
    names = ", ".join(missing)
    if models["hf_hub_offline"]:
        return f"no: summarize will fail (HF_HUB_OFFLINE is on and the hub cache lacks {names})"
    return f"no: downloaded on first use ({names})"
