"""Which index for which input length: exact vs IVF vs HNSW on the CPU.

For d=768, nq=48 queries (heads x beams of one layer), k=1024 and several N, measures build
seconds, search seconds per call, bytes per token, and the attention mass the approximate
top-k keeps of the exact top-k. Prints a table, writes bench/results/index_choice.json.

    python -m bench.index_choice            # N = 10k, 50k, 100k, 200k (~2.5 min on 2 cores)
    python -m bench.index_choice --quick    # N = 10k, 50k, 100k (~1 min)

Synthetic data built like real encoder states and cross-attention queries: states are a
shared offset + one of many topic centres (Zipf-frequent) + token noise + a few large
outlier dimensions; each query is a random rank-64 head projection W_k W_q^T of a stored
state (decoder states resemble what they attend to) plus noise, scaled so that softmax
with 1/sqrt(64) puts ~20-40% of the mass on the top token (peaked, as trained heads are).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from unlimisum.config import IndexConfig
from unlimisum.search.datastore import DatastoreBuilder, IndexPlan, attention_mass_recall

HEAD_DIM = 64
SCALING = HEAD_DIM**-0.5
RESULTS = Path(__file__).parent / "results" / "index_choice.json"


def synthetic_states(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, d] float32 states with topic clusters, a common offset and outlier dimensions."""
    g = torch.Generator().manual_seed(seed)
    n_topics = 1024
    centres = torch.randn(n_topics, d, generator=g)  # [T, d]
    zipf = 1.0 / torch.arange(1, n_topics + 1, dtype=torch.float32)
    topic = torch.multinomial(zipf, n, replacement=True, generator=g)  # [n]
    states = 0.5 * torch.randn(d, generator=g) + centres[topic] + 0.7 * torch.randn(n, d, generator=g)
    states[:, :4] *= 8.0  # a few large dimensions, as in trained transformers
    return states


def synthetic_store(n: int, d: int, config, chunk: int = 65_536):
    """An exact-or-planned datastore (``config``: an IndexConfig) of ``synthetic_states``, built ``chunk`` rows at
    a time as the encoder fills it (no [n, d] float32 tensor at once)."""
    from unlimisum.search.datastore import DatastoreBuilder, plan_index

    builder = DatastoreBuilder(n, d, plan_index(n, d, config), config)
    for start in range(0, n, chunk):
        builder.add(synthetic_states(min(chunk, n - start), d, seed=start))
    return builder.finish()


def synthetic_queries(states: torch.Tensor, nq: int, seed: int = 1, strength: float = 2.0) -> torch.Tensor:
    """[nq, d] hidden-space queries: per-head rank-64 projections of stored states plus noise."""
    g = torch.Generator().manual_seed(seed)
    n, d = states.shape
    w_q = torch.randn(nq, d, HEAD_DIM, generator=g) / d**0.5  # [nq, d, hd]
    w_k = torch.randn(nq, d, HEAD_DIM, generator=g) / d**0.5
    anchors = states[torch.randint(0, n, (nq,), generator=g)]  # [nq, d]
    queries = torch.einsum("qd,qde,qfe->qf", anchors, w_q, w_k) * strength  # q_h = (s W_q) W_k^T
    noise = torch.randn(nq, d, generator=g) * queries.norm(dim=1, keepdim=True) * 0.1 / d**0.5
    return queries + noise


def build(states: torch.Tensor, kind: str):
    n, d = states.shape
    start = time.perf_counter()
    builder = DatastoreBuilder(n, d, IndexPlan(kind, "cpu", "bench"), IndexConfig())
    for chunk in states.split(8192):  # the encoder hands over a few windows at a time
        builder.add(chunk)
    store = builder.finish()
    return store, time.perf_counter() - start


def time_search(store, queries: torch.Tensor, k: int, reps: int) -> float:
    """Best of ``reps`` calls: the CPUs are shared, and the minimum is the least disturbed figure."""
    store.search(queries, k)  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        store.search(queries, k)
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 100k, fewer repetitions")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--nq", type=int, default=48)
    parser.add_argument("--k", type=int, default=1024)
    args = parser.parse_args(argv)
    sizes = [10_000, 50_000, 100_000] if args.quick else [10_000, 50_000, 100_000, 200_000]
    reps = 3 if args.quick else 5
    rows = []
    header = f"{'N':>8} {'index':<18} {'build s':>8} {'search s':>9} {'B/token':>8} {'B/number':>9} {'mass recall':>11}"
    print(header)
    print("-" * len(header))
    for n in sizes:
        states = synthetic_states(n, args.dim)
        queries = synthetic_queries(states, args.nq)
        exact, exact_build = build(states, "exact")
        exact_scores = exact.search(queries, args.k)[0]
        top1_mass = float(torch.softmax(exact_scores * SCALING, 1)[:, 0].mean())
        variants = [("exact", exact, exact_build, {})]
        ivf, ivf_build = build(states, "ivf")
        for factor in (16.0, 32.0, 64.0):
            variants.append((f"ivf scan={factor:g}", ivf, ivf_build, {"scan_factor": factor}))
        hnsw, hnsw_build = build(states, "hnsw")
        for ef in (1.0, 2.0):
            variants.append((f"hnsw ef={ef:g}k", hnsw, hnsw_build, {"ef_per_k": ef}))
        for name, store, build_s, knobs in variants:
            for knob, value in knobs.items():
                setattr(store, knob, value)
            search_s = time_search(store, queries, args.k, reps)
            recall = 1.0 if store.kind == "exact" else attention_mass_recall(exact, store, queries, args.k, SCALING)
            row = {
                "n_tokens": n, "index": name, "kind": store.kind, **knobs, "build_s": round(build_s, 3),
                "search_s_per_call": round(search_s, 4), "bytes_per_token": round(store.nbytes / n, 1),
                "bytes_per_number": round(store.nbytes / n / args.dim, 3), "attention_mass_recall": round(recall, 4),
                "nprobe": store.nprobe(args.k) if store.kind == "ivf" else None, "top1_mass": round(top1_mass, 3),
            }
            rows.append(row)
            print(f"{n:>8} {name:<18} {build_s:>8.2f} {search_s:>9.4f} {row['bytes_per_token']:>8.0f} "
                  f"{row['bytes_per_number']:>9.3f} {recall:>11.4f}", flush=True)
        del variants, exact, ivf, hnsw, states
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    meta = {"dim": args.dim, "nq": args.nq, "k": args.k, "quick": args.quick, "torch_threads": torch.get_num_threads(),
            "machine": platform.processor() or platform.machine()}
    RESULTS.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
