"""Shared pieces of the benchmarks: real-size random models, a word-per-token tokenizer, JSON output.

Weights do not change cost, so every benchmark uses random weights of real sizes.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from unlimisum.measurements import INSTRUCTION_SETTINGS

RESULTS = Path(__file__).resolve().parent / "results"

# Real sizes of the two checkpoints the README recommends (vocabulary of the BART tokenizer).
SIZES = {
    "bart-base": dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                      decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072),
    "bart-large": dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                       decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096),
    # a small size for smoke runs of the benchmark scripts themselves
    "bart-tiny": dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128),
}
VOCAB = 50265


def word_tokenizer(vocab_size: int = VOCAB, max_length: int = 1024):
    """A tokenizer with one token per word ``w<id>``: inputs of exactly N tokens, no training needed."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        model_max_length=max_length,
    )


def random_text(n_tokens: int, seed: int = 0, vocab_size: int = VOCAB) -> str:
    """``n_tokens - 2`` random words (the tokenizer adds <s> and </s>)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab_size, (max(0, n_tokens - 2),), generator=generator)
    return " ".join(f"w{i}" for i in ids.tolist())


def random_model(size: str = "bart-base", window: int = 1024):
    """A LoadedModel of BART with ``size``'s real dimensions and random weights."""
    from transformers import BartConfig, BartForConditionalGeneration

    from unlimisum.models.architectures import architecture_for
    from unlimisum.models.compat import quiet_transformers
    from unlimisum.models import LoadedModel

    quiet_transformers()
    torch.manual_seed(0)
    config = BartConfig(vocab_size=VOCAB, max_position_embeddings=window, **SIZES[size])
    model = BartForConditionalGeneration(config).eval()
    return LoadedModel(model=model, tokenizer=word_tokenizer(max_length=window),
                       architecture=architecture_for(config), name=f"random {size}")


def matmul_gflops(n: int = 2048, repeats: int = 5, trials: int = 3) -> float:
    """This machine's float32 matmul throughput with torch, in GFLOP/s (the roofline): best of ``trials``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(trials):
        started = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        best = max(best, 2 * n**3 * repeats / (time.perf_counter() - started) / 1e9)
    return best


def microarchitecture() -> str:
    """The CPU's microarchitecture as LLVM names it (``znver4``, ``znver5``, ``sapphirerapids``): a model name
    such as "AMD EPYC" covers several, whose vector units differ."""
    import llvmlite.binding

    return llvmlite.binding.get_host_cpu_name()


def cpu_kind() -> str:
    """The CPU as a figure is named by: its model name, the 16-bit and vector units it has, its
    microarchitecture, and "as AVX2" under the settings that make it behave like a CPU without those units
    (unlimisum.measurements.INSTRUCTION_SETTINGS)."""
    from unlimisum.measurements import _cpu_description

    name, flags = _cpu_description()
    units = [unit for unit in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if unit in flags.split()]
    emulated = " as AVX2" if any(name in os.environ for name in INSTRUCTION_SETTINGS) else ""
    return f"{name} ({', '.join(units[:2]) or 'no AVX2'}; {microarchitecture()}){emulated}"


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_kind": cpu_kind(),
        "microarchitecture": microarchitecture(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        # what torch's kernels run here, and the settings that change it (an emulated CPU without 16-bit units)
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "instruction_settings": {name: os.environ[name] for name in INSTRUCTION_SETTINGS if name in os.environ},
    }


def save_model(model, tokenizer, folder: Path) -> int:
    """Save a trained model and its tokenizer to ``folder`` (config.json, generation_config.json,
    model.safetensors, tokenizer files); return the folder's size in bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def worktree(revision: str, folder: Path) -> Path:
    """A checkout of ``revision`` in ``folder``/rev-<revision> (made once), for a script's --before."""
    import subprocess

    path = folder / f"rev-{revision}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), revision], cwd=RESULTS.parent.parent,
                       check=True, capture_output=True)
    return path


def write_result(name: str, data: dict) -> Path:
    """Write ``bench/results/<name>.json`` with the machine's facts added; return the path."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(dict(data, machine=machine()), indent=2))
    return path


def print_table(headers: list[str], rows: list[list]) -> None:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(str(h).rjust(w) for h, w in zip(headers, widths)))
    for row in rows:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))


def print_position_table(result: dict, cell_text) -> None:
    """The needle benchmarks' table: needle position (rows) x input length in windows (columns), one cell of
    ``result["cells"]`` each, written by ``cell_text(cell)``."""
    lengths = sorted({cell["length"] for cell in result["cells"]})
    rows = []
    for position in result["positions"]:
        row = [f"{position:.2f}"]
        for length in lengths:
            cell = next(c for c in result["cells"] if c["length"] == length and c["position"] == position)
            row.append(cell_text(cell))
        rows.append(row)
    print_table(["position"] + [f"{n}x ({n * result['window']} tok)" for n in lengths], rows)
