"""Needle accuracy by position x input length: unlimisum vs the truncated baseline, with learned weights.

    python -m bench.needle_eval [--quick] [--trials 20] [--lengths 1,50,100,200] [--model tests/fixtures/needle]

The model is the tiny BART of bench/train_needle.py (a 64-token window, trained only on
single windows). Each input is filler words with one span ``<needle> d d d d </needle>``
whose first word sits at a relative position of the text; the input length is given in
windows (1 = fits the model's context; 200 = 12,800 tokens). A trial is a hit when the
decoded output equals the span's digits exactly. Greedy decoding, 10 new tokens at most (the longest span is 8 plus </s>).

- unlimisum k=64: Summarizer with the default retrieval top-k (= the window, 64), exact
  index, default (fp16) storage, default overlap 0.5; unlimisum k=16: the same with top-k 16;
- truncated: the unmodified model on the first 64 tokens (``truncation=True``);
- a top-k ablation at the longest length: how few retrieved tokens per head still work.

Writes bench/results/needle.json.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from bench.common import print_position_table, print_table, write_result
from bench.train_needle import FIXTURE, document
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

POSITIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
GENERATION = GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False)


def truncated(loaded, text: str) -> str:
    """The baseline: the unmodified model reads the first window only."""
    tokens = loaded.tokenizer(text, truncation=True, max_length=loaded.max_source_length, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**tokens, **GENERATION.to_generate_kwargs())
    return loaded.tokenizer.decode(out[0], skip_special_tokens=True).strip()


def cases(length: int, window: int, trials: int, seed: int):
    """(position, text, content) for every position and trial; ``length`` in windows."""
    n_words = length * window - 2  # the tokenizer adds <s> and </s>
    for p, position in enumerate(POSITIONS):
        rng = random.Random(seed * 1_000_003 + length * 1009 + p)
        for _ in range(trials):
            text, content = document(n_words, position, rng)
            yield position, text, content


def run(model: Path, lengths: list[int], trials: int, ablation_k: list[int], extra_k: list[int], seed: int = 0) -> dict:
    loaded = load_model(ModelConfig(name=str(model), device="cpu"))
    window = loaded.max_source_length
    index = IndexConfig(kind="exact", device="cpu")

    def summarizer(top_k=None):
        return Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=top_k), index=index)

    systems = {f"unlimisum k={top_k or window}": summarizer(top_k) for top_k in (None, *extra_k)}
    cells = []
    started = time.perf_counter()
    for length in lengths:
        by_position: dict[float, dict] = {}
        for position, text, content in cases(length, window, trials, seed):
            cell = by_position.setdefault(position, dict(length=length, position=position, trials=0, truncated=0,
                                                         misses=[], **{name: 0 for name in systems}))
            cell["trials"] += 1
            cell["truncated"] += truncated(loaded, text) == content
            for name, system in systems.items():
                summary = system.summarize(text)
                cell[name] += summary.text == content
                cell["tokens"] = summary.stats.input_tokens
                if summary.text != content:
                    cell["misses"].append({"system": name, "expected": content, "got": summary.text})
        cells.extend(by_position.values())
        print(f"  {length}x done ({time.perf_counter() - started:.0f}s)", flush=True)

    ablation = []
    longest = max(lengths)
    for top_k in ablation_k:
        hits = total = 0
        for _, text, content in cases(longest, window, max(1, trials // 2), seed + 1):
            hits += summarizer(top_k).summarize(text).text == content
            total += 1
        ablation.append(dict(top_k=top_k, length=longest, trials=total, accuracy=hits / total))
    return dict(model=str(model), window=window, systems=[*systems, "truncated"], positions=list(POSITIONS), trials=trials, cells=cells,
                top_k_ablation=ablation, seconds=time.perf_counter() - started)


def report(result: dict) -> None:
    for system in result["systems"]:
        print(f"\n{system}: exact match by needle position (rows) x input length in windows of "
              f"{result['window']} tokens (columns), {result['trials']} trials per cell")
        print_position_table(result, lambda cell, system=system: f"{cell[system] / cell['trials']:.2f}")
    if result["top_k_ablation"]:
        print(f"\nunlimisum top-k ablation at {result['top_k_ablation'][0]['length']}x, all positions:")
        print_table(["top_k", "trials", "exact"],
                    [[a["top_k"], a["trials"], f"{a['accuracy']:.2f}"] for a in result["top_k_ablation"]])
    misses = [(c["length"], c["position"], m) for c in result["cells"] for m in c["misses"]]
    for length, position, miss in misses[:10]:
        print(f"{miss['system']} missed at {length}x, position {position}: expected '{miss['expected']}', "
              f"got '{miss['got']}'")
    print(f"\n{result['seconds']:.0f}s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer trials and lengths (under ~2 minutes)")
    parser.add_argument("--trials", type=int, default=None, help="trials per cell (default 20; quick 4)")
    parser.add_argument("--lengths", default=None, help="input lengths in windows (default 1,50,100,200; quick 1,50,200)")
    parser.add_argument("--model", type=Path, default=FIXTURE)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    trials = args.trials or (4 if args.quick else 20)
    lengths = [int(n) for n in (args.lengths or ("1,50,200" if args.quick else "1,50,100,200")).split(",")]
    ablation_k = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    result = run(args.model, lengths, trials, ablation_k, extra_k=[16])
    result["quick"] = args.quick
    report(result)
    print(f"wrote {write_result('needle', result)}")


if __name__ == "__main__":
    main()
