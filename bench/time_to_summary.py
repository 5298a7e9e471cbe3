"""Time to a summary: whole-process wall time of `unlimisum summarize` on the default path, stage by stage.

    python -m bench.time_to_summary [--sizes bart-base,bart-large] [--inputs story,16k,100k,300k]
                                    [--new-tokens 64] [--before REV] [--quick] [--python VENV/bin/python]

The number a reader feels: `unlimisum summarize BOOK --json` run as a fresh process with no environment
overrides (only HF_HUB_OFFLINE=1 and a cache folder of the benchmark's own), for models of bart-base and
bart-large shapes with random weights (they cost what trained ones do) and a byte-level BPE tokenizer of
BART's size trained here on the corpus, so that English text tokenizes as it would. The time is split into
start-up (the interpreter, imports, writing the output: what no stage claims), load (the model, including the
dtype measurement of `--dtype auto`), read, tokenize, encode, index, prepare (kernels measured, store packed),
generate, evidence and support, beside:

- the plain model truncated to 1,024 tokens: a fresh process that loads the same folder with transformers,
  tokenizes the same text with truncation and generates as many tokens (what a reader would run instead);
- the encoder's floor: the windows unlimisum encoded times one window's forward (in batches of the size
  unlimisum uses, the weights in the dtype the run chose), measured in this process;
- the book's floor: the plain process plus every other token of the input encoded once (ceil(N / 1,024)
  windows, its first already in the plain process; a window at the faster of the encoder's forward and
  unlimisum's own encoding), the ratio a whole book is judged by.

Each input is summarized twice: "first run" with an empty cache folder (this machine's speed choices measured,
unlimisum/measurements.py, and the retrieval kernels compiled into it: numba's cache lives there too) and "later
runs" with the folder the first run filled (``--variants later`` alone fills it by an unreported first run of the
same input and options: a later run of a long input is not one after a short text, which compiles no scan kernel).
``--python``: run the unlimisum installed in that interpreter's environment (``pip install .`` in a fresh venv, as
a user has it) rather than this tree's source.
With ``--before REV`` the same commands run the code of git revision REV (a worktree under bench/.cache), in turns
with this tree's, so the before/after comes from one run. Summaries are forced to ``--new-tokens`` (min = max),
greedy (the random model's generation config). Inputs: samples/story.epub, the first 10k, 16k, 20k and 100k tokens of
Moby-Dick, and the whole of it (../shared/corpus; skipped when absent). Writes bench/results/time_to_summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import SIZES, VOCAB, print_table, worktree, write_result

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "time_to_summary"
CORPUS = ROOT.parent / "shared" / "corpus"
MOBY = CORPUS / "txt_moby-dick_pg2701_utf8-bom.txt"
TRAINING_TEXTS = [MOBY, CORPUS / "txt_pride-and-prejudice_pg1342_utf8.txt", ROOT / "samples" / "story.txt"]
WINDOW = 1024
# 10k: between kernels.COMPILED_TOP_K_MIN_STATES and COMPILED_MIN_STATES, where a first run compiles the top-k
# alone; 20k: past COMPILED_MIN_STATES, where it compiles the kernels its store runs (the 16k cut is 16,114 tokens)
CUTS = {"10k": 10_000, "16k": 16_384, "20k": 20_000, "100k": 100_000}

PLAIN = r'''
import sys, time
started = time.perf_counter()
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
folder, text_file, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
loaded = time.perf_counter()
text = open(text_file, encoding="utf-8").read()
inputs = tokenizer(text, truncation=True, max_length=1024, return_tensors="pt")
with torch.inference_mode():
    out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1, do_sample=False)
summary = tokenizer.decode(out[0], skip_special_tokens=True)
print(f"plain load {loaded - started:.3f} generate {time.perf_counter() - loaded:.3f} tokens {inputs['input_ids'].shape[1]}")
'''


def english_tokenizer(folder: Path):
    """A byte-level BPE of BART's vocabulary size trained on the corpus (cached in ``folder``)."""
    from transformers import PreTrainedTokenizerFast

    if (folder / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    from tokenizers import ByteLevelBPETokenizer, processors

    texts = [path for path in TRAINING_TEXTS if path.exists()]
    bpe = ByteLevelBPETokenizer()
    bpe.train([str(path) for path in texts], vocab_size=VOCAB, min_frequency=1,
              special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", mask_token="<mask>", model_max_length=WINDOW)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    return tokenizer


def model_folder(size: str) -> Path:
    """A saved BART of ``size``'s shape with random weights and the corpus tokenizer (made once)."""
    folder = CACHE / "models" / size
    if (folder / "model.safetensors").exists():
        return folder
    from transformers import BartConfig, BartForConditionalGeneration

    tokenizer = english_tokenizer(CACHE / "tokenizer")
    torch.manual_seed(0)
    config = BartConfig(vocab_size=len(tokenizer), max_position_embeddings=WINDOW, **SIZES[size])
    model = BartForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def inputs(names: list[str]) -> dict[str, Path]:
    """Input files by name: the sample EPUB, cuts of Moby-Dick by tokens of the corpus tokenizer, the whole."""
    found = {}
    tokenizer = english_tokenizer(CACHE / "tokenizer")
    for name in names:
        if name == "story":
            found[name] = ROOT / "samples" / "story.epub"
            continue
        if not MOBY.exists():
            print(f"  skipping {name}: {MOBY} is not here", flush=True)
            continue
        if name == "300k":
            found[name] = MOBY
            continue
        path = CACHE / "inputs" / f"moby-{name}.txt"
        if not path.exists():
            text = MOBY.read_text(encoding="utf-8-sig")
            ends = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text[: ends[min(CUTS[name], len(ends)) - 1][1]], encoding="utf-8")
        found[name] = path
    return found


def plain_text(path: Path) -> Path:
    """The document's text as unlimisum reads it, for the plain model (which reads no EPUB)."""
    from unlimisum.ingest import read_document

    target = CACHE / "inputs" / f"{path.stem}.plain.txt"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(read_document(str(path)).text, encoding="utf-8")
    return target


def clean_environment(cache_home: Path, code: Path | None, installed: bool = False) -> dict:
    """The reader's environment: no unlimisum, numba or thread overrides; this run's cache folder; ``code``: the
    tree to import unlimisum from (None: this one; ``installed``: none, the interpreter's own install)."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("UNLIMISUM_") and key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONPATH",
                                                                "NUMBA_CACHE_DIR")}
    env.update(HF_HUB_OFFLINE="1", UNLIMISUM_CACHE_HOME=str(cache_home), XDG_CACHE_HOME=str(cache_home))
    if not installed:
        env["PYTHONPATH"] = str(code or ROOT)
    return env


PYTHON = sys.executable  # the interpreter that runs unlimisum (--python: a venv where it is installed)


def run_unlimisum(folder: Path, document: Path, new_tokens: int, cache_home: Path, code: Path | None,
                  extra: list[str] = ()) -> dict:
    """One `unlimisum summarize --json -v` process: its wall time, and its stages from the JSON and the log."""
    command = [PYTHON, "-m", "unlimisum", "summarize", "-m", str(folder), str(document), "--json", "-v",
               "--max-new-tokens", str(new_tokens), "--min-new-tokens", str(new_tokens), *extra]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True,
                          env=clean_environment(cache_home, code, installed=PYTHON != sys.executable),
                          cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"unlimisum failed ({done.returncode}): {done.stderr[-2000:]}")
    record = json.loads(done.stdout.splitlines()[0])
    stats = record["stats"]
    loaded = re.search(r"loaded in ([0-9.]+) ?(ms|s)", done.stderr)
    load = float(loaded[1]) / (1000 if loaded[2] == "ms" else 1) if loaded else 0.0
    stages = {name: float(seconds) for name, seconds in stats["timings"].items() if name != "search"}
    stages["load"] = load
    stages["startup"] = max(0.0, wall - sum(stages.values()))
    return dict(wall=wall, stages=stages, tokens=stats["input_tokens"], windows=stats["windows"],
                generated=stats["generated_tokens"], dtype=stats.get("model_dtype"))


def run_plain(folder: Path, text: Path, new_tokens: int) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PLAIN, str(folder), str(text), str(new_tokens)], capture_output=True,
                          text=True, env=clean_environment(CACHE / "plain-home", None), cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the plain model failed: {done.stderr[-2000:]}")
    figures = dict(zip(*[iter(done.stdout.split()[1:])] * 2))
    return dict(wall=wall, load=float(figures["load"]), generate=float(figures["generate"]))


def encoder_floor(folder: Path, windows: int, dtype: str | None = None) -> float:
    """Seconds for ``windows`` windows through the encoder in the batches unlimisum uses (one batch, timed), its
    weights in ``dtype`` (the run's: what `--dtype auto` chose; None: float32)."""
    from transformers import AutoModelForSeq2SeqLM

    from unlimisum.unlimiformer.encoding import auto_batch_size

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=getattr(torch, dtype or "float32")).eval()
    batch = auto_batch_size(WINDOW, windows, torch.device("cpu"))
    ids = torch.randint(4, 1000, (batch, WINDOW))
    encoder = model.get_encoder()
    with torch.inference_mode():
        encoder(input_ids=ids)
        seconds = float("inf")
        for _ in range(3):  # the best of three: a busy moment is not the floor
            started = time.perf_counter()
            encoder(input_ids=ids)
            seconds = min(seconds, time.perf_counter() - started)
    return seconds * windows / batch


def book_floor(run: dict) -> float:
    """What a whole book cannot cost less than: every token encoded once (ceil(N / window) windows) and the plain
    model's process (start-up, loading, its first window encoded, its steps to the same summary length), that
    first window counted once. A window's cost is the faster of the encoder's own forward (``encoder_floor``)
    and unlimisum's encoding in the run (its architecture's path may be faster than transformers' default)."""
    once = math.ceil(run["tokens"] / WINDOW)
    window = min(run["encoder_floor"], run["stages"].get("encode", math.inf)) / run["windows"]
    return run["plain"]["wall"] + window * (once - 1)


STAGES = ("startup", "load", "read", "tokenize", "encode", "index", "prepare", "generate", "evidence", "support")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="bart-base,bart-large")
    parser.add_argument("--inputs", default="story,16k,100k,300k")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree, in turns")
    parser.add_argument("--quick", action="store_true", help="bart-base, the story only")
    parser.add_argument("--variants", default="first,later",
                        help="first: an empty cache folder (speed choices measured); later: the folder a first "
                             "run of the same input filled")
    parser.add_argument("--extra", default="", help="more summarize options for every run, e.g. --encode-int8")
    parser.add_argument("--name", default="time_to_summary", help="the result file's name (bench/results/NAME.json)")
    parser.add_argument("--python", default=None,
                        help="run the unlimisum installed for this interpreter (a venv's bin/python), not this tree")
    args = parser.parse_args(argv)
    global PYTHON
    if args.python:
        PYTHON = args.python
    sizes = ["bart-base"] if args.quick else args.sizes.split(",")
    names = ["story"] if args.quick else args.inputs.split(",")
    trees = {"this tree": None}
    if args.before:
        trees[f"before ({args.before})"] = worktree(args.before, CACHE)
    documents = inputs(names)
    rows = []
    started = time.perf_counter()
    for size in sizes:
        folder = model_folder(size)
        for name, document in documents.items():
            plain = run_plain(folder, plain_text(document), args.new_tokens)
            for tree, code in trees.items():
                home = Path(tempfile.mkdtemp(prefix="unlimisum-bench-home-"))
                try:
                    wanted = args.variants.split(",")
                    extra = args.extra.split()
                    if "first" not in wanted:  # what a reader's earlier run of this job left: the same input and
                        # options, unreported (a short text would leave the long input's kernels uncompiled)
                        run_unlimisum(folder, document, args.new_tokens, home, code, extra)
                    for variant in [v for v in ("first run", "later runs") if v.split()[0] in wanted]:
                        run = run_unlimisum(folder, document, args.new_tokens, home, code, extra)
                        run.update(size=size, input=name, tree=tree + (f" {args.extra}" if args.extra else ""),
                                   variant=variant, plain=plain)
                        run["encoder_floor"] = encoder_floor(folder, run["windows"], run["dtype"])
                        run["ratio"] = run["wall"] / plain["wall"]
                        run["book_floor"] = book_floor(run)
                        run["floor_ratio"] = run["wall"] / run["book_floor"]
                        outside = run["wall"] - run["stages"].get("encode", 0.0) - run["stages"].get("generate", 0.0)
                        run["outside_encode_generate_ratio"] = outside / plain["wall"]
                        rows.append(run)
                        stages = ", ".join(f"{stage} {run['stages'][stage]:.1f}" for stage in STAGES
                                           if stage in run["stages"])
                        print(f"  {size} {name} {tree}, {variant}: {run['wall']:.1f} s ({run['ratio']:.2f}x the plain "
                              f"{plain['wall']:.1f} s, {run['floor_ratio']:.2f}x the floor {run['book_floor']:.1f} s); "
                              + stages, flush=True)
                finally:
                    shutil.rmtree(home, ignore_errors=True)
    report(rows, args.new_tokens)
    first_runs(rows)
    path = write_result(args.name, dict(rows=rows, new_tokens=args.new_tokens, seconds=time.perf_counter() - started,
                                        threads=torch.get_num_threads(), python=PYTHON))
    print(f"wrote {path}")


def first_runs(rows: list[dict]) -> None:
    """What a machine's first run costs over its later ones (kernels compiled, speed choices measured), per input."""
    later = {(row["size"], row["input"], row["tree"]): row for row in rows if row["variant"] == "later runs"}
    pairs = [(row, later[key]) for row in rows if row["variant"] == "first run"
             and (key := (row["size"], row["input"], row["tree"])) in later]
    if pairs:
        print("\nthe first run of a machine (every cache empty) against the next one:")
        print_table(["model", "input", "code", "first", "later", "first - later"],
                    [[first["size"], first["input"], first["tree"], f"{first['wall']:.1f}", f"{second['wall']:.1f}",
                      f"{first['wall'] - second['wall']:+.1f}"] for first, second in pairs])


def report(rows: list[dict], new_tokens: int) -> None:
    print(f"\nwhole-process seconds to a {new_tokens}-token summary, `unlimisum summarize --json` on the default path:")
    print_table(["model", "input", "tokens", "code", "run", "wall", "x plain", "x floor", "start-up", "load",
                 "encode (floor)", "prepare", "generate", "evidence+support", "rest x plain"],
                [[row["size"], row["input"], f"{row['tokens']:,}", row["tree"], row["variant"], f"{row['wall']:.1f}",
                  f"{row['ratio']:.2f}", f"{row['floor_ratio']:.2f}", f"{row['stages']['startup']:.1f}",
                  f"{row['stages']['load']:.1f}",
                  f"{row['stages'].get('encode', 0):.1f} ({row['encoder_floor']:.1f})",
                  f"{row['stages'].get('prepare', 0):.1f}", f"{row['stages'].get('generate', 0):.1f}",
                  f"{row['stages'].get('evidence', 0) + row['stages'].get('support', 0):.1f}",
                  f"{row['outside_encode_generate_ratio']:.2f}"] for row in rows])
    print("plain: the same model truncated to 1,024 tokens in a fresh process (same summary length); floor: the "
          "plain process plus every other token encoded once (bench.time_to_summary.book_floor); rest: the wall "
          "time outside encode and generate, against the plain process's")


if __name__ == "__main__":
    main()
