"""Decoding: seconds per generated token vs input length N, for each index kind, with recall.

    python -m bench.decoding [--quick] [--tokens 10000,100000,500000] [--kinds exact,ivf,hnsw]

A bart-base-sized model with random weights generates from a datastore of N states. The
states are synthetic (bench/index_choice.py: topic clusters, offset, outlier dimensions),
because encoding 500k tokens on two cores would take longer than the decoding we measure;
decode cost depends on N and d, not on what the states say. The queries are the model's
own: every query the exact run sends to the index is recorded, and each approximate index
is scored by the share of the exact top-k attention mass it retrieves for them.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import print_table, random_model, write_result
from bench.index_choice import synthetic_states
from unlimisum.config import GenerationOptions, IndexConfig
from unlimisum.search.datastore import DatastoreBuilder, IndexPlan, attention_mass_recall
from unlimisum.summarizer import Summarizer


class RecordingStore:
    """A datastore that remembers the queries it is asked (a sample of them)."""

    def __init__(self, store, keep_every: int = 1):
        self.store, self.keep_every, self.queries, self._calls = store, keep_every, [], 0

    def attend(self, queries, k):
        if self._calls % self.keep_every == 0:
            self.queries.append(queries.detach().clone())
        self._calls += 1
        return self.store.attend(queries, k)

    def __getattr__(self, name):
        return getattr(self.store, name)


def build_store(states: torch.Tensor, kind: str):
    n, d = states.shape
    started = time.perf_counter()
    builder = DatastoreBuilder(n, d, IndexPlan(kind, "cpu", "benchmark"), IndexConfig())
    for chunk in states.split(8192):
        builder.add(chunk)
    store = builder.finish()
    return store, time.perf_counter() - started


# HNSW takes minutes to build beyond this on two cores and recalls the least attention mass
# (bench/index_choice.py), so the full run leaves it out there.
HNSW_MAX_TOKENS = 200_000


def run(n_values: list[int], kinds: list[str], new_tokens: int, size: str = "bart-base") -> dict:
    loaded = random_model(size)
    d = loaded.model.config.d_model
    k = loaded.max_source_length
    generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    summarizer = Summarizer(loaded, generation=generation)
    rows = []
    for n in n_values:
        states = synthetic_states(n, d)
        exact = None
        queries = None
        for kind in kinds:
            if kind == "hnsw" and n > HNSW_MAX_TOKENS:
                continue
            store, build_seconds = build_store(states, kind)
            target = RecordingStore(store, keep_every=3) if kind == "exact" else store
            run = summarizer.generate([target])
            seconds, search_seconds = run.seconds, run.search_seconds
            row = dict(n_tokens=n, kind=kind, device=store.device, build_seconds=build_seconds,
                       seconds_per_token=seconds / new_tokens, search_share=search_seconds / seconds,
                       bytes_per_token=store.nbytes / n, recall=None)
            if kind == "exact":
                exact, queries = store, torch.cat(target.queries)
                row["recall"] = 1.0
            elif exact is not None:
                row["recall"] = attention_mass_recall(exact, store, queries, k)  # queries carry the scaling
            rows.append(row)
            print(f"  N={n:,} {kind}: {row['seconds_per_token']:.3f} s/token", flush=True)
            del store, target
        del states, exact
    return dict(size=size, top_k=k, new_tokens=new_tokens, runs=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 10k and 100k, 4 tokens")
    parser.add_argument("--tokens", default=None, help="comma-separated input lengths")
    parser.add_argument("--kinds", default="exact,ivf,hnsw")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--size", default="bart-base")
    args = parser.parse_args(argv)
    n_values = [int(n) for n in args.tokens.split(",")] if args.tokens else (
        [10_000, 100_000] if args.quick else [10_000, 100_000, 500_000])
    new_tokens = args.new_tokens or (4 if args.quick else 8)
    result = run(n_values, args.kinds.split(","), new_tokens, args.size)
    print(f"decoding {result['size']}, k={result['top_k']}, {new_tokens} new tokens, greedy")
    print_table(
        ["N", "index", "device", "build s", "s/token", "search share", "bytes/token", "attention-mass recall"],
        [[f"{r['n_tokens']:,}", r["kind"], r["device"], f"{r['build_seconds']:.1f}", f"{r['seconds_per_token']:.3f}",
          f"{r['search_share']:.0%}", f"{r['bytes_per_token']:.0f}", f"{r['recall']:.3f}" if r["recall"] is not None else "-"]
         for r in result["runs"]],
    )
    print("wrote", write_result("decoding", result))
    return result


if __name__ == "__main__":
    main()
