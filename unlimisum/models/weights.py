"""Loading a 32-bit safetensors checkpoint into 16-bit weights one tensor at a time.

transformers memory-maps a safetensors checkpoint and converts each tensor to the dtype asked for, and
every page of the file it has read stays in the process's resident set until the whole model is loaded:
for a float32 checkpoint loaded in bfloat16 (``--dtype auto`` on a CPU with bf16 units), the whole file,
twice the weights' final bytes, beside the converted weights. Random bart-base: 1,145 MiB at the peak of
loading against 614 MiB held once it is loaded, the peak of a whole 16k-token run.

``load_converted`` gives transformers the same tensors read by safetensors' ``pread`` backend instead: each
float32 tensor is read into a temporary of its own, converted, and freed, so the peak is the converted
weights plus the few tensors in flight (872 MiB for the same model). The model is the one
``from_pretrained`` makes from the folder (the same class, config, tensors, tied weights and generation
config); checkpoints it does not cover (pickled weights, remote code, a stored dtype no wider than the one
asked for, a safetensors too old for ``pread``) load as before.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
ASYNC_SETTING = "HF_DEACTIVATE_ASYNC_LOAD"
WIDE_DTYPES = ("F32", "F64")  # safetensors' names of the float dtypes wider than 16 bits


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files holding ``folder``'s weights (one file, or the shards of its index); [] if none."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    index = folder / SHARD_INDEX
    if not index.is_file():
        return []
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return []  # transformers says what is wrong with it
    files = [folder / shard for shard in shards]
    return files if files and all(file.is_file() for file in files) else []


def model_class(kind: str, model_config):
    """transformers' class for ``model_config`` ("seq2seq" or "decoder-only"); None when it has none built in."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING

    mapping = MODEL_FOR_CAUSAL_LM_MAPPING if kind == "decoder-only" else MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING
    try:
        return mapping[type(model_config)]
    except KeyError:
        return None


def load_converted(kind: str, folder: Path, model_config, dtype: torch.dtype):
    """The model of ``folder`` in 16-bit ``dtype``, read tensor by tensor (see the module's docstring), when its
    weights are safetensors stored wider than ``dtype``; None when it is not such a checkpoint (load it as usual)."""
    if dtype.itemsize != 2:
        return None
    files = safetensors_files(folder)
    cls = model_class(kind, model_config)
    if not files or cls is None:
        return None
    from safetensors import safe_open

    with ExitStack() as stack:
        tensors = {}
        for file in files:
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu", backend="pread"))
            except TypeError:  # a safetensors release without the pread backend
                return None
            tensors.update({name: handle.get_slice(name) for name in handle.keys()})
        if not any(part.get_dtype() in WIDE_DTYPES for part in tensors.values()):
            return None  # nothing to convert: the memory map costs nothing beyond the weights themselves
        with _sequential_reads():  # no device_map: it needs accelerate, which `pip install unlimisum` does not bring
            model = cls.from_pretrained(None, config=model_config, state_dict=tensors, dtype=dtype)
    _use_generation_config(model, folder)
    return model


@contextmanager
def _sequential_reads():
    """transformers' reader threads off (its HF_DEACTIVATE_ASYNC_LOAD) while loading: they run ahead of the
    thread that puts tensors in place, and on a busy machine held up to the file's size of tensors read ahead
    (measured: 1.1x to 1.9x the file in all, from run to run); read in turn, one tensor is in flight."""
    previous = os.environ.get(ASYNC_SETTING)
    os.environ[ASYNC_SETTING] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ASYNC_SETTING, None)
        else:
            os.environ[ASYNC_SETTING] = previous


def _use_generation_config(model, folder: Path) -> None:
    """The folder's generation_config.json, as ``from_pretrained(folder)`` reads it (loading from tensors makes
    one from the model config instead)."""
    from transformers import GenerationConfig

    if not (folder / "generation_config.json").is_file():
        return
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):
        pass  # from_pretrained(folder) keeps the model config's too when the file cannot be read
