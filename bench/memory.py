"""Memory: peak RSS and datastore bytes per input token vs N, against the naive key/value store.

    python -m bench.memory [--quick] [--tokens 10000,100000,500000] [--encode-limit 100000]

Each N runs in its own process, so the process's peak RSS is that run's. Up to
``--encode-limit`` tokens the whole pipeline runs (tokenize, encode every window with a
bart-base-sized model, index, generate 4 tokens); above it the datastore is filled with
synthetic states of the same shape instead of encoding (the encoder's memory does not grow
with N: it holds one batch of windows at a time), and generation runs the same way.

The naive store is what keeping every layer's cross-attention keys and values for the whole
input costs: 2 * L * N * d numbers (L decoder layers), in float32 as the research code keeps them.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import psutil

from bench.common import SIZES, print_table, write_result


def child(n_tokens: int, encode: bool, size: str) -> dict:
    """Run one N in this process and return its figures."""
    import torch

    from bench.common import random_model, random_text
    from bench.index_choice import synthetic_store
    from unlimisum.config import GenerationOptions, IndexConfig
    from unlimisum.summarizer import Summarizer

    loaded = random_model(size)
    d = loaded.model.config.d_model
    after_load = psutil.Process().memory_info().rss
    summarizer = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=4, min_new_tokens=4))
    started = time.perf_counter()
    if encode:
        summary = summarizer.summarize(random_text(n_tokens))
        store_bytes, kind = summary.stats.datastore_bytes, summary.stats.index_kind
    else:
        store = synthetic_store(n_tokens, d, IndexConfig())
        summarizer.generate([store])
        store_bytes, kind = store.nbytes, store.kind
    layers = loaded.model.config.decoder_layers
    return dict(
        n_tokens=n_tokens, encoded=encode, index_kind=kind, seconds=time.perf_counter() - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, model_rss_bytes=after_load,
        datastore_bytes=store_bytes, naive_bytes=2 * layers * n_tokens * d * 4,
        torch_threads=torch.get_num_threads(),
    )


def run(n_values: list[int], encode_limit: int, size: str) -> dict:
    rows = []
    for n in n_values:
        command = [sys.executable, "-m", "bench.memory", "--child", str(n), "--size", size]
        if n <= encode_limit:
            command.append("--encode")
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
        print(f"  N={n:,}: peak RSS {rows[-1]['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
    return dict(size=size, d_model=SIZES[size]["d_model"], runs=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k and 100k, encoding only 10k")
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--encode-limit", type=int, default=None)
    parser.add_argument("--size", default="bart-base")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--encode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.encode, args.size)))
        return {}
    n_values = [int(n) for n in args.tokens.split(",")] if args.tokens else (
        [10_000, 100_000] if args.quick else [10_000, 100_000, 500_000])
    encode_limit = args.encode_limit if args.encode_limit is not None else (10_000 if args.quick else 100_000)
    result = run(n_values, encode_limit, args.size)
    print(f"memory, {args.size} (random weights), generating 4 tokens")
    mib = 2**20
    print_table(
        ["N", "states", "index", "peak RSS MiB", "model MiB", "store MiB", "store B/token", "B per number",
         "naive 2LNd fp32 MiB", "naive / store"],
        [[f"{r['n_tokens']:,}", "encoded" if r["encoded"] else "synthetic", r["index_kind"],
          f"{r['peak_rss_bytes'] / mib:,.0f}", f"{r['model_rss_bytes'] / mib:,.0f}", f"{r['datastore_bytes'] / mib:,.0f}",
          f"{r['datastore_bytes'] / r['n_tokens']:,.0f}", f"{r['datastore_bytes'] / r['n_tokens'] / result['d_model']:.2f}",
          f"{r['naive_bytes'] / mib:,.0f}", f"{r['naive_bytes'] / r['datastore_bytes']:.0f}x"]
         for r in result["runs"]],
    )
    print("wrote", write_result("memory", result))
    return result


if __name__ == "__main__":
    main()
