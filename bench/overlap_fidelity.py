"""What a smaller window overlap costs in fidelity, and what it saves in encoding: before any default changes.

    python -m bench.overlap_fidelity [--quick] [--overlaps 0.5,0.375,0.25,0.125,0] [--trials 10] [--lengths 50,200]

For each overlap (0.5 is the paper's and today's default):

- encoding: the encoder forwards per kept token, ``windows x window / N``, for all of Moby-Dick
  (283,271 tokens) at bart's window of 1,024 (1.0: every token encoded once); arithmetic of the plan;
- the trained needle model (tests/fixtures/needle, a 64-token window; bench/train_needle.py): exact
  match of the hidden span, 7 x ``--trials`` needles at random positions per input length (in windows),
  greedy, with the default top-k (the window) and with k = 16, through the library; and as many needles at the
  longest length each centred where one window's kept tokens give way to the next's (the worst place);
- the same documents at the longest length scored by ``unlimisum evaluate --overlap X --no-support
  --json`` (the command, in a process of its own): ROUGE-1 and ROUGE-L with their 95 % intervals.

The states themselves are not compared: with another overlap a token sits elsewhere in its window, so its
state moves with its position as well as with its context, and the difference says nothing of fidelity.

Prints tables and writes bench/results/overlap_fidelity.json (overlap_fidelity_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, print_table, write_result
from bench.needle_eval import GENERATION, POSITIONS
from bench.train_needle import FILLER, FIXTURE, document, needle_text
from unlimisum.config import EncodingConfig, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer
from unlimisum.unlimiformer.encoding import plan_windows

MOBY_DICK_TOKENS = 283_271  # all of Moby-Dick with bart's tokenizer (BENCHMARKS.md, A whole book)
BART_WINDOW = 1024


def encoding_cost(overlap: float, n_tokens: int = MOBY_DICK_TOKENS, window: int = BART_WINDOW) -> float:
    """Encoder forwards per kept token: 1.0 is every token encoded once."""
    return plan_windows(n_tokens, window, overlap).n_windows * window / n_tokens


def needle_cases(length: int, window: int, trials: int, seed: int = 0):
    """(position, text, content) of ``len(POSITIONS) * trials`` needles at uniformly random positions (``length``
    in windows). Not bench.needle_eval's 7 fixed positions: a needle lands where the windows' edges fall, which
    each overlap moves, so fixed positions would measure a few alignments many times over."""
    n_words = length * window - 2
    rng = random.Random(seed * 1_000_003 + length * 1009)
    for _ in range(len(POSITIONS) * trials):
        position = rng.random()
        text, content = document(n_words, position, rng)
        yield position, text, content


def edge_cases(length: int, window: int, overlap: float, trials: int, seed: int = 0):
    """(None, text, content) of ``len(POSITIONS) * trials`` needles each centred on the point where one window's
    kept tokens end and the next one's begin (``WindowPlan.kept``): the worst place for a small overlap, where the
    span's tokens are kept from two windows and the nearer edge of each is ``overlap / 2`` of a window away."""
    n_words = length * window - 2
    plan = plan_windows(n_words + 2, window, overlap)
    rng = random.Random(seed * 1_000_003 + length * 1009 + 1)
    for _ in range(len(POSITIONS) * trials):
        span, content = needle_text(rng)
        boundary = plan.keep_bounds[rng.randrange(1, plan.n_windows)]  # a token position; word = position - 1
        at = min(max(0, boundary - 1 - len(span) // 2), n_words - len(span))
        words = [rng.choice(FILLER) for _ in range(n_words - len(span))]
        words[at:at] = span
        yield None, " ".join(words), " ".join(content)


def needle_accuracy(loaded, overlap: float, lengths: list[int], trials: int) -> dict:
    window = loaded.max_source_length
    index = IndexConfig(kind="exact", device="cpu")
    found = {}
    for top_k in (None, 16):
        summarizer = Summarizer(loaded, encoding=EncodingConfig(overlap=overlap), generation=GENERATION,
                                retrieval=RetrievalConfig(retrieval_k=top_k), index=index)
        kinds = [(f"{length}x", needle_cases(length, window, trials)) for length in lengths]
        kinds.append((f"{max(lengths)}x at an edge", edge_cases(max(lengths), window, overlap, trials)))
        for where, cases in kinds:
            hits = total = 0
            for _, text, content in cases:
                hits += summarizer.summarize(text).text == content
                total += 1
            found[f"k={top_k or window}, {where}"] = dict(hits=hits, trials=total, accuracy=hits / total)
    return found


def evaluate_command(model: Path, overlap: float, length: int, trials: int, window: int, folder: Path) -> dict:
    """ROUGE-1 and ROUGE-L (mean, 95 % interval) of ``unlimisum evaluate --overlap`` on the needle documents."""
    data = folder / f"needle-{length}x.jsonl"
    with data.open("w", encoding="utf-8") as file:
        for number, (_, text, content) in enumerate(needle_cases(length, window, trials)):
            file.write(json.dumps({"id": number, "text": text, "reference": content}) + "\n")
    environment = dict(os.environ, HF_HUB_OFFLINE="1", UNLIMISUM_CACHE_HOME=str(folder / "cache"))
    command = [sys.executable, "-m", "unlimisum", "evaluate", str(data), "-m", str(model), "--overlap", str(overlap),
               "--no-support", "--json", "--max-new-tokens", str(GENERATION.max_new_tokens)]
    run = subprocess.run(command, capture_output=True, text=True, env=environment, check=False)
    if run.returncode != 0:
        raise SystemExit(f"unlimisum evaluate failed: {run.stderr.strip()[-2000:]}")
    (system,) = [system for system in json.loads(run.stdout)["systems"] if system["name"] == "unlimisum"]
    return {metric: system["metrics"][metric] for metric in ("rouge1", "rougeL")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 trials per position, lengths 50 and 200")
    parser.add_argument("--overlaps", default="0.5,0.375,0.25,0.125,0")
    parser.add_argument("--trials", type=int, default=None, help="needles per length, in sevens (default 10: 70; quick 3)")
    parser.add_argument("--lengths", default="50,200", help="input lengths in windows of 64 tokens")
    parser.add_argument("--model", type=Path, default=FIXTURE)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    overlaps = [float(value) for value in args.overlaps.split(",")]
    lengths = [int(value) for value in args.lengths.split(",")]
    trials = args.trials or (3 if args.quick else 10)
    loaded = load_model(ModelConfig(name=str(args.model), device="cpu"))
    window = loaded.max_source_length
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="unlimisum-bench-overlap-") as folder:
        for overlap in overlaps:
            row = dict(overlap=overlap, encoding_cost=encoding_cost(overlap),
                       needle=needle_accuracy(loaded, overlap, lengths, trials),
                       evaluate=evaluate_command(args.model, overlap, max(lengths), trials, window, Path(folder)))
            rows.append(row)
            print(f"  overlap {overlap}: done ({time.perf_counter() - started:.0f} s)", flush=True)
    result = dict(machine=machine(), model=str(args.model), window=window, trials_per_position=trials,
                  positions=list(POSITIONS), lengths=lengths, rows=rows,
                  seconds=time.perf_counter() - started, quick=args.quick)
    report(result)
    write_result("overlap_fidelity_quick" if args.quick else "overlap_fidelity", result)


def report(result: dict) -> None:
    names = list(result["rows"][0]["needle"])
    headers = ["overlap", "encode / once"] + [f"needle {name}" for name in names] + ["evaluate R-1", "R-L"]
    table = []
    for row in result["rows"]:
        needle = [f"{cell['accuracy']:.2f} ({cell['hits']}/{cell['trials']})" for cell in row["needle"].values()]
        rouge = [f"{row['evaluate'][m]['mean'] * 100:.1f} ({row['evaluate'][m]['low'] * 100:.1f}-"
                 f"{row['evaluate'][m]['high'] * 100:.1f})" for m in ("rouge1", "rougeL")]
        table.append([row["overlap"], f"{row['encoding_cost']:.2f}x", *needle, *rouge])
    print_table(headers, table)
    print(f"\n{result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
