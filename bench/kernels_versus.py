"""Decoding speed of this tree's retrieval kernels against an earlier revision's, in one process.

    python -m bench.kernels_versus --before REV [--tokens 16384,100000] [--new-tokens 12] [--turns 3]
                                   [--model bart-base|led-base]

``unlimisum/search/kernels.py`` of git revision REV is loaded beside this tree's (it must
offer the same functions: revisions since the packed kernel). For each N and (k, beams) — k=1,024
and k=N greedy, k=1,024 with 4 beams at the first N — one generate() over the same store runs
with each module in turns (A B A B ...), so that a busy moment of a shared machine falls on both
alike; both use this tree's calibrated kernel choice. Prints seconds per token (median of the
turns) and the median pair-by-pair ratio, and writes bench/results/kernels_versus.json.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import types
from pathlib import Path

import torch

from bench.common import print_table, random_model, write_result
from bench.decode_speed import exact_store, random_led
from bench.index_choice import synthetic_states
from unlimisum.config import GenerationOptions, RetrievalConfig
from unlimisum.summarizer import Summarizer
from unlimisum.search import datastore, kernels

KERNELS_PATH = "unlimisum/search/kernels.py"


def kernels_at(revision: str):
    """The kernels module as it was at ``revision``, imported under its own name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:{KERNELS_PATH}"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType("kernels_before")
    sys.modules["kernels_before"] = module  # dataclasses look their module up while it loads
    exec(compile(source, f"{revision}:{KERNELS_PATH}", "exec"), module.__dict__)
    module._CALIBRATED = kernels._CALIBRATED  # the same measured choice for both
    return module


def seconds_per_token(loaded, store, k: int, beams: int, new_tokens: int, module) -> float:
    """One generate() over ``store`` with ``module`` serving the exact store's retrieval."""
    generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams,
                                   do_sample=False)
    summarizer = Summarizer(loaded, generation=generation, retrieval=RetrievalConfig(retrieval_k=k))
    datastore.kernels = module
    try:
        return summarizer.generate([store]).seconds / new_tokens
    finally:
        datastore.kernels = kernels


def run(before: str, n_values: list[int], new_tokens: int, turns: int, model: str) -> dict:
    earlier = kernels_at(before)
    loaded = random_led() if model == "led-base" else random_model(model)
    d = loaded.model.config.d_model
    rows = []
    for index, n in enumerate(n_values):
        store = exact_store(synthetic_states(n, d))
        store.prepare()
        cases = [(1024, 1), (n, 1)] + ([(1024, 4)] if index == 0 else [])
        for k, beams in cases:
            seconds_per_token(loaded, store, k, beams, 2, kernels)  # warm up
            times = {"before": [], "after": []}
            for _ in range(turns):
                times["before"].append(seconds_per_token(loaded, store, k, beams, new_tokens, earlier))
                times["after"].append(seconds_per_token(loaded, store, k, beams, new_tokens, kernels))
            ratios = [b / a for b, a in zip(times["before"], times["after"])]
            row = dict(n_tokens=n, k=k, beams=beams, before_seconds_per_token=statistics.median(times["before"]),
                       after_seconds_per_token=statistics.median(times["after"]), speedup=statistics.median(ratios),
                       turns=times)
            rows.append(row)
            print(f"  N={n:,} k={k:,} beams={beams}: {row['before_seconds_per_token']:.4f} -> "
                  f"{row['after_seconds_per_token']:.4f} s/token ({row['speedup']:.2f}x)", flush=True)
        del store
    kernel = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, d).reason
    return dict(before=before, model=model, new_tokens=new_tokens, kernel=kernel, runs=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision whose kernels.py is the baseline")
    parser.add_argument("--tokens", default="16384", help="comma-separated input lengths")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--turns", type=int, default=3, help="generate() calls per module, in turns")
    parser.add_argument("--model", choices=("bart-base", "bart-tiny", "led-base"), default="bart-base")
    args = parser.parse_args(argv)
    result = run(args.before, [int(n) for n in args.tokens.split(",")], args.new_tokens, args.turns, args.model)
    print(f"\nkernels.py at {args.before} (before) vs this tree (after); {result['kernel']}")
    print_table(["N", "k", "beams", "before s/token", "after s/token", "speed-up (median pair)"],
                [[f"{r['n_tokens']:,}", f"{r['k']:,}", r["beams"], f"{r['before_seconds_per_token']:.4f}",
                  f"{r['after_seconds_per_token']:.4f}", f"{r['speedup']:.2f}x"] for r in result["runs"]])
    print("wrote", write_result("kernels_versus", result))
    return result


if __name__ == "__main__":
    main()
