"""The paper's training methods compared on the needle task, from the same starting point and budget.

    python -m bench.train_methods [--quick] [--steps 300] [--batch-size 4] [--train-windows 8]
                                  [--lengths 1,50,200] [--trials 10] [--retrieval-k 16] [--seeds 0,1]

Every method fine-tunes the same start with ``unlimisum.train`` on the same synthetic examples:
filler words with one span ``<needle> d d d d </needle>`` anywhere in ``--train-windows``
windows, target the digits. Each trained model (and the untrained start) then reads inputs of
``--lengths`` windows through unlimisum's retrieval (exact index, k = ``--retrieval-k``) and
must copy the digits exactly; greedy decoding. The claim it tests: training through retrieval
beats training truncated on inputs far longer than the window.

The start: the tiny BART of tests/fixtures/needle trained by the same recipe (bench/train_needle.py)
without its multi-window phase, so its decoder has only ever read one 64-token window, and with
labels that begin with ``<s>``, as ``unlimisum train`` writes targets (the usual BART format; the
fixture itself was trained without it, so fine-tuning the fixture would first have to relearn its
output format). Trained once and kept in bench/.cache/ (about 9 minutes on one thread; a 50-step
start with ``--quick``).

Writes bench/results/train_methods.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, save_model, write_result
from bench.needle_eval import POSITIONS
from bench import train_needle
from bench.train_needle import document
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer
from unlimisum.training import METHODS, train

GENERATION = GenerationOptions(max_new_tokens=12, num_beams=1, do_sample=False)  # <s> span </s>: at most 11
WINDOW = 64  # the fixture's
CACHE = Path(__file__).resolve().parent / ".cache"


def single_window_start(steps: int = 3500, seed: int = 0) -> Path:
    """The needle model trained on single windows only (no multi-window phase), labels <s> span </s>,
    cached in bench/.cache/."""
    folder = CACHE / f"needle-single-window-bos-{steps}-{seed}"
    if not (folder / "model.safetensors").exists():
        print(f"training the single-window start ({steps} steps) into {folder}", flush=True)
        model, tokenizer, accuracy, seconds = train_needle.train(steps, 64, 1e-3, seed, other_windows=0,
                                                                 log_every=500, label_bos=True)
        print(f"  {seconds:.0f}s; exact match on held-out single windows {accuracy:.3f}", flush=True)
        partial = folder.with_name(folder.name + ".partial")
        save_model(model, tokenizer, partial)
        partial.rename(folder)
    return folder


def write_data(path: Path, examples: int, windows: int, seed: int) -> Path:
    """``examples`` needle documents of ``windows`` windows as JSON Lines (text, summary). The summary is
    the marked span, markers included, as the start was trained to write it (the markers are special
    tokens, so the decoded summary is the content alone)."""
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for _ in range(examples):
            text, content = document(windows * WINDOW - 2, rng.random(), rng)
            summary = f"{train_needle.OPEN} {content} {train_needle.CLOSE}"
            handle.write(json.dumps({"text": text, "summary": summary}) + "\n")
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


def run(start_steps: int, steps: int, examples: int, train_windows: int, lengths: list[int], trials: int,
        top_k: int, learning_rate: float, batch_size: int, seed: int, methods: list[str]) -> dict:
    start_dir = single_window_start(start_steps)  # one start for every seed: the seed varies data and training
    torch.manual_seed(seed)
    start_scores = exact_match(start_dir, lengths, trials, top_k, seed)
    rows = [["start (single windows only)", "-", "-", *(f"{v:.0%}" for v in start_scores.values())]]
    result = {"start": "single-window", "start_steps": start_steps, "steps": steps, "examples": examples,
              "train_windows": train_windows, "lengths": lengths, "trials_per_position": trials, "positions": list(POSITIONS), "retrieval_k": top_k,
              "learning_rate": learning_rate, "batch_size": batch_size, "start_exact_match": start_scores,
              "methods": {}}
    with tempfile.TemporaryDirectory() as folder:
        data = write_data(Path(folder) / "train.jsonl", examples, train_windows, seed)
        for method in methods:
            started = time.perf_counter()
            trained = train(data, model=str(start_dir), output_dir=Path(folder) / method, method=method,
                            max_steps=steps, learning_rate=learning_rate, retrieval_k=top_k, seed=seed,
                            gradient_accumulation_steps=batch_size, save_steps=steps,
                            logging_steps=max(1, steps // 10), device="cpu")
            seconds = time.perf_counter() - started
            scores = exact_match(Path(folder) / method, lengths, trials, top_k, seed)
            result["methods"][method] = {"train_seconds": seconds, "train_loss": trained.report["train_loss"],
                                         "exact_match": scores}
            rows.append([method, f"{seconds:.0f}s", f"{trained.report['train_loss']:.3f}",
                         *(f"{v:.0%}" for v in scores.values())])
    print(f"seed {seed}:")
    print_table(["method", "training", "train loss", *(f"{n} windows" for n in lengths)], rows)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few steps and trials: checks that it runs")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--train-windows", type=int, default=8)
    parser.add_argument("--lengths", default="1,50,200", help="input lengths in windows to test at")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--retrieval-k", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=1, help="examples per optimizer step (accumulated)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--seeds", default="0", help="comma-separated: each seed draws its own data, training "
                                                     "order and test inputs (one start for all)")
    args = parser.parse_args(argv)
    start_steps = 3500
    if args.quick:
        args.steps, args.examples, args.train_windows, args.lengths, args.trials = 2, 4, 3, "3", 1
        start_steps = 50
    seeds = [int(seed) for seed in args.seeds.split(",")]
    runs = {seed: run(start_steps, args.steps, args.examples, args.train_windows,
                      [int(n) for n in args.lengths.split(",")], args.trials, args.retrieval_k, args.learning_rate,
                      args.batch_size, seed, args.methods.split(",")) for seed in seeds}
    if not args.quick:
        print(f"wrote {write_result('train_methods', {'seeds': runs})}")


if __name__ == "__main__":
    main()
