"""What this machine and installation offer unlimisum: versions, devices, the Faiss build, the model cache,
and the plan for an input of N tokens (the index over an encoder-decoder's states, or a decoder-only
model's window, store and placement). ``collect_report`` gathers it all; ``unlimisum info`` prints it.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

from unlimisum.config import DEFAULT_MAX_NEW_TOKENS, DEFAULT_MODEL, IndexConfig
from unlimisum.errors import ConfigError, UnlimisumError
from unlimisum.version import __version__

ASSUMED_D_MODEL = 768  # hidden size of the base models (BART-base, LED-base, T5-base) when no config is at hand
ASSUMED_DECODER_LAYERS = 6  # BART-base's decoder, likewise
ASSUMED_HEADS = 12  # BART-base's cross-attention heads, likewise


def collect_report(tokens: int | None = None, model: str | None = None, index: IndexConfig = IndexConfig()) -> dict:
    """Versions, devices, the Faiss build, the models (``model`` and the default) and, with ``tokens``, the plan
    for an input of that many tokens. Raises ConfigError for index options this machine cannot honour."""
    return {
        "versions": collect_versions(),
        "devices": collect_devices(),
        "faiss": collect_faiss(),
        "models": collect_models(model),
        "plan": collect_plan(tokens, model or DEFAULT_MODEL, index) if tokens is not None else None,
        "measurements": collect_measurements(),  # last: what the sections above measured is listed too
    }


def collect_measurements() -> dict:
    """What unlimisum measured on this machine to choose its speed settings, when, and where it is kept."""
    from unlimisum import measurements

    store = measurements.default_store()
    files, size = compiled_kernels_in(measurements.kernel_cache_folder())
    return {
        "file": str(store.path),
        "machine_key": store.key,
        "entries": [{"name": m.name, "measured_at": m.measured_at, "seconds": round(m.seconds, 3), "reason": m.reason}
                    for m in store.all()],
        "remeasure": "unlimisum info --remeasure",
        "kernels": {"folder": str(measurements.kernel_cache_folder()), "files": files, "bytes": size},
    }


def forget_measurements() -> int:
    """Forget every measurement of this machine (each is made again when next needed) and its compiled kernels
    (compiled again when next needed); how many measurements there were."""
    from unlimisum import measurements

    clear_compiled_kernels()
    return measurements.default_store().forget()


def compiled_kernels_in(folder: Path) -> tuple[int, int]:
    """(files, bytes) of unlimisum's compiled kernels numba keeps under ``folder`` (``_kernel_files``)."""
    files = _kernel_files(folder)
    return len(files), files_bytes(files)


def files_bytes(paths: list[Path]) -> int:
    """The bytes of ``paths``; one removed meanwhile counts 0."""
    total = 0
    for path in paths:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def clear_compiled_kernels() -> tuple[int, int]:
    """Remove the compiled kernels (each is compiled again when a run next needs it): (files, bytes) removed. Only
    unlimisum's are removed: a $NUMBA_CACHE_DIR shared with other programs keeps theirs."""
    from unlimisum.measurements import kernel_cache_folder

    return _remove(_kernel_files(kernel_cache_folder()))


def stale_compiled_kernels() -> list[Path]:
    """unlimisum's compiled kernel files that this code never loads: those of other versions of the kernels' code
    (another release, an older checkout), each version in a folder of its own, and those kept before there were
    such folders. Only unlimisum's: a $NUMBA_CACHE_DIR shared with other programs keeps theirs."""
    from unlimisum.measurements import kernel_cache_folder, kernel_code_folder

    current = kernel_code_folder()
    return [path for path in _kernel_files(kernel_cache_folder()) if current not in path.parents]


def clear_stale_compiled_kernels() -> tuple[int, int]:
    """Remove ``stale_compiled_kernels`` and the folders they leave empty: (files, bytes) removed."""
    from unlimisum.measurements import kernel_cache_folder

    stale = stale_compiled_kernels()
    removed = _remove(stale)
    top = kernel_cache_folder()
    for folder in sorted({parent for path in stale for parent in path.parents if top in parent.parents},
                         key=lambda folder: len(folder.parts), reverse=True):  # the deepest first
        try:
            folder.rmdir()  # only where empty: another program's files keep their folder
        except OSError:
            pass
    return removed


def _remove(paths: list[Path]) -> tuple[int, int]:
    """Unlink ``paths``: (files, bytes) removed; one that cannot be is left."""
    removed = freed = 0
    for path in paths:
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        removed, freed = removed + 1, freed + size
    return removed, freed


# the modules of unlimisum/search whose functions numba compiles and caches (jit.py's decorations): compiled_loops.py,
# score_loops.py, top_k_loops.py, linear_loops.py and grouped_loops.py today; compiled.py held them before the search
# became one unit, and a cache home may still keep those
KERNEL_MODULES = ("compiled", "compiled_loops", "score_loops", "top_k_loops", "linear_loops", "grouped_loops")


def _kernel_files(folder: Path) -> list[Path]:
    """numba's cache files of unlimisum's kernels under ``folder``: an index (.nbi) and machine code (.nbc) per
    function, named after their module: ``compiled_loops.<function>-<line>.py311...``."""
    if not folder.is_dir():
        return []
    return [path for path in folder.rglob("*") if path.suffix in (".nbi", ".nbc")
            and path.name.split(".", 1)[0] in KERNEL_MODULES and path.is_file()]


def collect_versions() -> dict:
    """Versions of unlimisum, Python and the libraries that do the work."""
    import torch

    return {
        "unlimisum": __version__,
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,  # None on CPU-only builds
        "transformers": _package_version("transformers"),
        "tokenizers": _package_version("tokenizers"),
        "huggingface_hub": _package_version("huggingface_hub"),
        "faiss": _faiss_version(),
        "numba": _package_version("numba"),  # compiles the CPU retrieval kernels (search/compiled.py)
        "typer": _package_version("typer"),
        "rich": _package_version("rich"),
    }


def collect_devices() -> dict:
    """CPU threads, CUDA GPUs with their free memory, and MPS."""
    import torch

    gpus = []
    cuda = torch.cuda.is_available()
    if cuda:
        for number in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(number)
            gpus.append({
                "device": f"cuda:{number}", "name": torch.cuda.get_device_name(number),
                "free_bytes": free, "total_bytes": total,
            })
    from unlimisum.models.precision import choose_auto_dtype

    mps = getattr(torch.backends, "mps", None)
    return {
        "cpu_count": os.cpu_count(),
        "cpu_dtype_auto": choose_auto_dtype(torch.device("cpu")).reason,  # what --dtype auto loads on the CPU
        "torch_threads": torch.get_num_threads(),
        "cuda_available": cuda,
        "gpus": gpus,
        "mps_available": bool(mps and mps.is_available()),
    }


def collect_faiss() -> dict:
    """The Faiss build: version, GPU support (``get_num_gpus`` exists only in GPU builds) and CPU options."""
    try:
        import faiss
    except ImportError:
        return {"installed": False, "version": None, "gpu_build": False, "gpus": 0, "compile_options": None}
    get_num_gpus = getattr(faiss, "get_num_gpus", None)
    gpus = int(get_num_gpus()) if get_num_gpus else 0
    options = faiss.get_compile_options().strip() if hasattr(faiss, "get_compile_options") else None
    return {
        "installed": True,
        "version": getattr(faiss, "__version__", None),
        "gpu_build": hasattr(faiss, "StandardGpuResources"),
        "gpus": gpus,
        "compile_options": options,
    }


def collect_models(model: str | None) -> dict:
    """The default model, the model asked for, whether each is available offline, and the cache folders."""
    from huggingface_hub import constants

    from unlimisum.models.architectures import supported_model_types

    if model:  # a folder that does not exist is an error here too, not a hub name to download
        from unlimisum.models.checkpoint import locate

        locate(model)
    chosen = model or DEFAULT_MODEL
    tokenizer = _needed_tokenizer(chosen)
    missing = [name for name, available in ((chosen, _available_offline(chosen)),
                                           (tokenizer, tokenizer is None or _tokenizer_available_offline(tokenizer)))
               if not available]
    return {
        "default_model": DEFAULT_MODEL,
        "supported_model_types": supported_model_types(),
        "model": chosen,
        "model_source": "--model/UNLIMISUM_MODEL" if model else "default",
        "model_available_offline": _available_offline(chosen),
        "tokenizer_from": tokenizer,  # the hub tokenizer the model needs besides its own files, if any
        "missing_offline": missing,  # what a run would download first (or, offline, fail without)
        "fetch_commands": [_fetch_command(name, tokenizer_only=name != chosen) for name in missing],
        "hf_home": str(constants.HF_HOME),
        "hub_cache": str(constants.HF_HUB_CACHE),
        "hf_hub_offline": bool(constants.HF_HUB_OFFLINE),
    }


def collect_plan(tokens: int, model: str, index: IndexConfig) -> dict:
    """The index kind and device ``plan_index`` chooses for ``tokens`` states of the model's hidden size, or the
    decoder-only plan (``collect_decoder_plan``) when the model's config says it is one."""
    from unlimisum.models.decoder_architectures import BY_MODEL_TYPE
    from unlimisum.search.datastore import plan_index
    from unlimisum.search.placement import plan_key_store

    config = model_config(model)
    if config is not None and getattr(config, "model_type", None) in BY_MODEL_TYPE:
        return collect_decoder_plan(tokens, model, config, index)
    d_model, d_model_source = model_hidden_size(model)
    plan = plan_index(tokens, d_model, index)
    layers, heads, head_dim, _ = model_decoder_shape(model, d_model)
    kernel = None
    if plan.kind == "exact":  # what an exact step runs here, measured now (~0.3 s)
        import torch

        from unlimisum.search import packed
        from unlimisum.search.kernels import kernel_for, uses_compiled
        from unlimisum.search.placement import storage_dtype

        choice = kernel_for(torch.device(plan.device), storage_dtype(index), d_model,
                            compiled_sums=uses_compiled(tokens, plan.device))
        kernel = choice.reason
        if choice.scores == "packed" and not packed.memory_allows(tokens, d_model):
            kernel = (f"{choice.fallback} for {tokens:,} tokens: the packed copies "
                      f"({packed.packed_bytes(tokens, d_model) / 2**30:.1f} GiB) would exceed "
                      f"{packed.PACKED_MEMORY_FRACTION:.1%} of the memory left beside this process; "
                      f"for smaller inputs {kernel}")
    keys = plan_key_store(tokens, d_model, layers, heads, head_dim, index, plan, support=True,  # summarize's defaults
                          summary_tokens=DEFAULT_MAX_NEW_TOKENS)
    key_kernel = None
    if keys.kind == "per-layer":  # what its heads run here (measured with the choice under auto)
        import torch

        from unlimisum.search import head_kernels, kernels
        from unlimisum.search.placement import storage_dtype

        key_kernel = head_kernels.kernel_for(torch.device(plan.device), storage_dtype(index), d_model, heads,
                                             head_dim, compiled_kernels=kernels.uses_compiled(tokens, plan.device)
                                             ).reason
    return {
        "model_kind": "seq2seq",
        "tokens": tokens,
        "model": model,
        "d_model": d_model,
        "d_model_source": d_model_source,
        "index": index.kind,
        "index_device": index.device,
        "kind": plan.kind,
        "device": plan.device,
        "reason": plan.reason,
        "retrieval_kernel": kernel,
        "decoder_layers": layers,
        "heads": heads,
        "head_dim": head_dim,
        "key_store": keys.kind,
        "key_store_bytes": keys.nbytes,
        "key_store_reason": keys.reason,
        "key_kernel": key_kernel,
    }


def collect_decoder_plan(tokens: int, model: str, config, index: IndexConfig) -> dict:
    """What a decoder-only model would do with a prompt of ``tokens`` tokens and the default options: the window,
    sinks, k, position regime (or why it is refused), the store's bytes by its formula, and where it goes."""
    import torch

    from unlimisum.config import DecoderOnlyConfig
    from unlimisum.decoder_only.plan import (
        MIN_SINKS, default_retrieval_k, default_window, kv_shape, plan_retrieval, store_bytes_per_token, store_devices,
    )
    from unlimisum.models.architectures import architecture_for
    from unlimisum.search.placement import storage_dtype

    architecture = architecture_for(config)  # UnsupportedModelError when no layer is full attention
    max_positions = architecture.max_positions(config)
    windows = architecture.layer_windows(config)
    retrieval_k = default_retrieval_k(default_window(max_positions))
    dtype = storage_dtype(index)
    per_token = store_bytes_per_token(config, windows, dtype)
    store = (tokens - 1) * per_token  # generate() reads the prompt's last token itself
    model_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # where --device auto loads it
    keys_device, values_device, placement = store_devices(store // 2, store // 2, index, model_device)
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    window = chunk = default_window(max_positions)
    try:
        plan = plan_retrieval(prompt_tokens=tokens - 1, text_start=0, max_new_tokens=max_new_tokens,
                              max_positions=max_positions, window=None, retrieval_k=retrieval_k,
                              config=DecoderOnlyConfig(), storage_dtype=dtype)
        positions = "true" if plan.true_positions else f"fixed distance {plan.fixed_distance}"
        window, chunk = plan.window, plan.chunk
    except ConfigError as error:
        positions = f"refused: {error}"
    kv_heads, head_dim = kv_shape(config)
    full_layers = sum(w is None for w in windows)
    return {
        "model_kind": "decoder-only",
        "tokens": tokens,
        "model": model,
        "family": architecture.name,
        "max_positions": max_positions,
        "window": window,
        "chunk": chunk,
        "exact": window >= tokens - 1,
        "sinks": f"the prompt up to the text, at least {MIN_SINKS} tokens",
        "retrieval_k": retrieval_k,
        "max_new_tokens": max_new_tokens,
        "positions": positions,
        "full_layers": full_layers,
        "sliding_layers": len(windows) - full_layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "storage_dtype": str(dtype).removeprefix("torch."),
        "element_bytes": torch.finfo(dtype).bits // 8,
        "store_bytes_per_token": per_token,
        "store_bytes": store,
        "keys_device": keys_device.type,
        "values_device": values_device.type,
        "placement": placement,
    }


def model_config(model: str):
    """The model's transformers config when it is a local folder or cached, else None."""
    local = Path(model).expanduser()
    if not (local.is_dir() or _available_offline(model)):
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(local) if local.is_dir() else model, local_files_only=True)
    except (OSError, ValueError):
        return None


def model_hidden_size(model: str) -> tuple[int, str]:
    """``(d_model, where it came from)``: the model's config when it is local or cached, else 768."""
    config = model_config(model)
    if config is not None:
        size = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
        if isinstance(size, int) and size > 0:
            return size, "model config"
    return ASSUMED_D_MODEL, f"assumed ({model} is not available offline)"


def model_decoder_shape(model: str, d_model: int) -> tuple[int, int, int, str]:
    """``(decoder layers, cross-attention heads, head dim, where they came from)``: the model's config when it is
    local or cached, else bart-base's 6 layers of 12 heads (the head dim from ``d_model``)."""
    config = model_config(model)
    if config is not None:
        layers = next((getattr(config, name) for name in ("decoder_layers", "num_decoder_layers", "num_layers")
                       if isinstance(getattr(config, name, None), int)), None)
        heads = next((getattr(config, name) for name in ("decoder_attention_heads", "num_heads", "num_attention_heads")
                      if isinstance(getattr(config, name, None), int)), None)
        head_dim = getattr(config, "d_kv", None) if isinstance(getattr(config, "d_kv", None), int) else None
        if layers and heads:
            return layers, heads, head_dim or d_model // heads, "model config"
    return ASSUMED_DECODER_LAYERS, ASSUMED_HEADS, d_model // ASSUMED_HEADS, f"assumed ({model} is not available offline)"


# -- rendering ------------------------------------------------------------------------------


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _faiss_version() -> str | None:
    for name in ("faiss-cpu", "faiss-gpu", "faiss-gpu-cu12", "faiss-gpu-cu11", "faiss"):
        version = _package_version(name)
        if version:
            return f"{version} ({name})"
    try:
        import faiss

        return getattr(faiss, "__version__", "unknown")
    except ImportError:
        return None


def _needed_tokenizer(model: str) -> str | None:
    """The hub tokenizer ``model`` is loaded with because it ships none (unlimisum.models.checkpoint's table of
    known checkpoints, or a local folder's config); None when it has its own. Never reaches the network."""
    from unlimisum.models import checkpoint

    try:
        location = checkpoint.locate(model)
    except UnlimisumError:
        return None
    if location.is_local:
        return None if checkpoint.has_tokenizer_files(location) else checkpoint.base_tokenizer(location)
    return checkpoint.known_base_tokenizer(model)


def _tokenizer_available_offline(name: str) -> bool:
    """True when ``name`` is a local folder or one of its tokenizer files is in the Hugging Face cache."""
    from unlimisum.models.checkpoint import TOKENIZER_FILES

    if Path(name).expanduser().is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(name, file), str) for file in TOKENIZER_FILES)
    except Exception:  # noqa: BLE001  (an invalid repo id is simply not available)
        return False


def _fetch_command(name: str, tokenizer_only: bool) -> str:
    """The `hf download` that puts ``name`` in the cache (for a tokenizer: its small files, not the weights)."""
    from unlimisum.models.checkpoint import tokenizer_download

    return tokenizer_download(name) if tokenizer_only else f"hf download {name}"


def _available_offline(model: str) -> bool:
    """True when ``model`` is a local folder or its config is in the Hugging Face cache."""
    if Path(model).expanduser().is_dir():
        return True
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001  (an invalid repo id is simply not available)
        return False
    return isinstance(found, str)
