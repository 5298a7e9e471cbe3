"""The paper's training methods compared on the needle task, from the same starting point and budget.

    python -m bench.train_methods [--quick] [--steps 300] [--train-windows 8] [--lengths 50,200] [--trials 10]

Every method fine-tunes the tiny BART of tests/fixtures/needle (a 64-token window) with
``unlimisum.train`` on the same synthetic examples: filler words with one span
``<needle> d d d d </needle>`` anywhere in ``--train-windows`` windows, target the digits. Each
trained model (and the untrained start) then reads inputs of ``--lengths`` windows through
unlimisum's retrieval (exact index, k = ``--retrieval-k``) and must copy the digits exactly;
greedy decoding. The claim it tests: training through retrieval beats training truncated on
inputs far longer than the window.

Not run on the machine this was written on (2 shared CPU cores): only ``--quick``, which checks
that it runs, not what it finds. Writes bench/results/train_methods.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, write_result
from bench.needle_eval import POSITIONS
from bench.train_needle import FIXTURE, document
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer
from unlimisum.training import METHODS, train

GENERATION = GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False)
WINDOW = 64  # the fixture's


def write_data(path: Path, examples: int, windows: int, seed: int) -> Path:
    """``examples`` needle documents of ``windows`` windows as JSON Lines (text, summary)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(examples):
            text, content = document(windows * WINDOW - 2, rng.random(), rng)
            handle.write(json.dumps({"text": text, "summary": content}) + "\n")
    return path


def exact_match(model_dir: Path, lengths: list[int], trials: int, top_k: int, seed: int) -> dict:
    """Per length (windows): the fraction of trials whose output equals the needle's digits."""
    loaded = load_model(ModelConfig(name=str(model_dir), device="cpu", dtype="float32"))
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=top_k),
                            index=IndexConfig(kind="exact", device="cpu"))
    scores = {}
    for length in lengths:
        rng = random.Random(seed * 1009 + length)
        hits = total = 0
        for position in POSITIONS:
            for _ in range(trials):
                text, content = document(length * WINDOW - 2, position, rng)
                hits += summarizer.summarize(text).text.strip() == content
                total += 1
        scores[length] = hits / total
    return scores


def run(steps: int, examples: int, train_windows: int, lengths: list[int], trials: int, top_k: int,
        learning_rate: float, seed: int, methods: list[str]) -> dict:
    torch.manual_seed(seed)
    start = exact_match(FIXTURE, lengths, trials, top_k, seed)
    rows = [["start (untrained)", "-", *(f"{v:.0%}" for v in start.values())]]
    result = {"steps": steps, "examples": examples, "train_windows": train_windows, "lengths": lengths,
              "trials_per_position": trials, "positions": list(POSITIONS), "retrieval_k": top_k,
              "learning_rate": learning_rate, "start": start,
              "methods": {}}
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder) / "train.jsonl", examples, train_windows, seed)
        for method in methods:
            started = time.perf_counter()
            trained = train(data, model=str(FIXTURE), output_dir=Path(folder) / method, method=method,
                            max_steps=steps, learning_rate=learning_rate, retrieval_k=top_k, seed=seed,
                            save_steps=steps, logging_steps=max(1, steps // 10), device="cpu")
            seconds = time.perf_counter() - started
            scores = exact_match(Path(folder) / method, lengths, trials, top_k, seed)
            result["methods"][method] = {"train_seconds": seconds, "train_loss": trained.report["train_loss"],
                                         "exact_match": scores}
            rows.append([method, f"{seconds:.0f}s", *(f"{v:.0%}" for v in scores.values())])
    print_table(["method", "training", *(f"{n} windows" for n in lengths)], rows)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps and trials: checks that it runs")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--train-windows", type=int, default=8)
    parser.add_argument("--lengths", default="50,200")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--retrieval-k", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.examples, args.train_windows, args.lengths, args.trials = 2, 4, 3, "3", 1
    result = run(args.steps, args.examples, args.train_windows, [int(n) for n in args.lengths.split(",")],
                 args.trials, args.retrieval_k, args.learning_rate, args.seed, args.methods.split(","))
    if not args.quick:
        print(f"wrote {write_result('train_methods', result)}")


if __name__ == "__main__":
    main()
