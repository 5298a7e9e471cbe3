"""Beyond exact at a million tokens: an IVF index over each head's per-layer keys against the exact scan of them,
at the share of the attention mass it keeps.

    python -m bench.approximate_keys [--tokens 1000000] [--ivf-heads 2] [--nlist 4096] [--nprobe 8,32,128,512]

One decoder layer of a bart-base shape (12 heads of 64 over d=768): N synthetic encoder states as
bench/index_choice.py builds them (topic clusters, a shared offset, a few large dimensions: IVF's lists have
something to find, which iid random numbers would not give them), projected by a random key projection per head
into the key store's bf16 keys [H, N, 64] (unlimisum/search/keys.py). Each head's queries are its query
projection of a stored state, scaled so that the softmax over the exact top-k puts a fifth to a half of the mass
on the best token (peaked, as trained heads are), plus noise.

- **exact**: the per-layer store's compiled scan (unlimisum/search/compiled.py ``select``) of every head
  for one query each (a greedy step), best of a few calls; beside it the layer's bandwidth floor, its keys'
  bytes over the streaming bandwidth measured in the same run;
- **IVF**: faiss ``IndexIVFScalarQuantizer`` over each of the first ``--ivf-heads`` heads' keys (bf16 codes: the
  same bytes as the keys, plus 8 bytes of id per key), inner product, ``--nlist`` lists trained on a sample;
  for each nprobe the seconds of one query's search on one thread (a layer: H of them spread over the threads)
  and the attention-mass recall: the share of the exact top-k's softmax mass (scores x 1/sqrt(64)) that IVF's
  top-k also holds, averaged over ``--queries`` queries per head; and the build seconds per head.

Prints a table and writes bench/results/approximate_keys.json (``--json PATH`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import RESULTS, machine, print_table
from bench.index_choice import synthetic_store
from bench.key_store import streaming_bandwidth
from unlimisum.config import IndexConfig
from unlimisum.search import compiled
from unlimisum.search.keys import build_key_store

DIM, HEADS, HEAD_DIM = 768, 12, 64
SCALING = HEAD_DIM**-0.5
RECALL_TARGET = 0.99  # the attention-mass recall an approximate path must keep to replace the exact one
TURNS = 5


def head_queries(states: torch.Tensor, w_q: torch.Tensor, count: int, strength: float, seed: int = 1) -> torch.Tensor:
    """[H, count, dh] fp32 queries: each head's query projection w_q [H, dh, d] of stored states, times
    ``strength``, plus noise of a tenth of their norm."""
    generator = torch.Generator().manual_seed(seed)
    anchors = states[torch.randint(0, states.shape[0], (count,), generator=generator)].float()  # [count, d]
    queries = torch.einsum("cd,hed->hce", anchors, w_q) * strength  # [H, count, dh]
    noise = torch.randn(queries.shape, generator=generator) * queries.norm(dim=2, keepdim=True) * 0.1 / HEAD_DIM**0.5
    return queries + noise


def mass_recall(exact_scores: torch.Tensor, exact_ids: torch.Tensor, found_ids: torch.Tensor) -> torch.Tensor:
    """[nq]: the share of each query's exact top-k softmax mass (scores [nq, k] x SCALING) whose ids are among
    ``found_ids`` [nq, k'] (-1: none)."""
    mass = torch.softmax(exact_scores * SCALING, dim=1)
    hit = (exact_ids.unsqueeze(2) == found_ids.unsqueeze(1)).any(dim=2)  # [nq, k]
    return (mass * hit).sum(dim=1)


def best_seconds(run, turns: int = TURNS) -> float:
    run()  # warm up
    best = float("inf")
    for _ in range(turns):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def ivf_index(keys: torch.Tensor, nlist: int, train_rows: int):
    """(faiss IVF index over one head's keys [N, dh] bf16 as bf16 codes, its build seconds)."""
    import faiss

    started = time.perf_counter()
    quantizer = faiss.IndexFlatIP(HEAD_DIM)
    index = faiss.IndexIVFScalarQuantizer(quantizer, HEAD_DIM, nlist, faiss.ScalarQuantizer.QT_bf16,
                                          faiss.METRIC_INNER_PRODUCT)
    sample = keys[torch.randperm(keys.shape[0], generator=torch.Generator().manual_seed(2))[:train_rows]]
    index.train(sample.float().numpy())
    for start in range(0, keys.shape[0], 262_144):
        index.add(keys[start:start + 262_144].float().numpy())
    return index, time.perf_counter() - started


def run(n: int, k: int, ivf_heads: int, nlist: int, nprobes: list[int], queries_per_head: int,
        strength: float, bandwidth_mib: int = 1024) -> dict:
    import faiss

    bandwidth = streaming_bandwidth(bandwidth_mib)
    print(f"streaming bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    threads = torch.get_num_threads()
    store = synthetic_store(n, DIM, IndexConfig(kind="exact", device="cpu"))  # bf16 states [N, d]
    generator = torch.Generator().manual_seed(0)
    w_k = torch.randn(HEADS, HEAD_DIM, DIM, generator=generator) / DIM**0.5  # [H, dh, d]
    w_q = torch.randn(HEADS, HEAD_DIM, DIM, generator=generator) / DIM**0.5
    started = time.perf_counter()
    keys = build_key_store(store.states(), [w_k]).layer(0)  # [H, N, dh] bf16
    key_seconds = time.perf_counter() - started
    queries = head_queries(store.states(), w_q, queries_per_head, strength)  # [H, nq, dh]
    del store
    exact_scores, exact_ids = compiled.select(keys, queries, k)  # [H, nq, k]
    exact_scores, order = exact_scores.sort(dim=2, descending=True)
    exact_ids = exact_ids.gather(2, order)
    top1 = float(torch.softmax(exact_scores * SCALING, dim=2)[:, :, 0].mean())
    step_queries = queries[:, :1].contiguous()  # a greedy step: one query per head
    exact_layer = best_seconds(lambda: compiled.select(keys, step_queries, k))
    floor_layer = keys.numel() * keys.element_size() / bandwidth
    print(f"N={n:,}: exact scan of a layer {exact_layer * 1e3:.1f} ms (floor {floor_layer * 1e3:.1f} ms), "
          f"top-1 mass {top1:.2f}, keys built in {key_seconds:.1f} s", flush=True)
    rows = [dict(index="exact", nprobe=None, layer_seconds=exact_layer, recall=1.0, recall_min=1.0,
                 build_seconds_per_head=0.0)]
    faiss.omp_set_num_threads(1)  # one head's search on one thread, as the per-layer scans run
    per_head = {nprobe: [] for nprobe in nprobes}
    build = []
    for head in range(ivf_heads):
        index, seconds = ivf_index(keys[head], nlist, min(n, 64 * nlist))
        build.append(seconds)
        one = queries[head, :1].numpy()
        for nprobe in nprobes:
            index.nprobe = nprobe
            _, found = index.search(queries[head].numpy(), k)  # [nq, k]
            recall = mass_recall(exact_scores[head], exact_ids[head], torch.from_numpy(found))
            per_head[nprobe].append((best_seconds(lambda: index.search(one, k)), recall))
        del index
        print(f"  head {head}: IVF built in {seconds:.1f} s", flush=True)
    faiss.omp_set_num_threads(threads)
    for nprobe in nprobes:
        seconds = min(s for s, _ in per_head[nprobe])
        recalls = torch.cat([r for _, r in per_head[nprobe]])
        layer = seconds * -(-HEADS // threads)  # H heads, one query each, spread over the threads
        rows.append(dict(index=f"ivf nlist={nlist}", nprobe=nprobe, layer_seconds=layer,
                         query_seconds=seconds, recall=float(recalls.mean()), recall_min=float(recalls.min()),
                         build_seconds_per_head=sum(build) / len(build)))
        print(f"  nprobe={nprobe}: {layer * 1e3:.2f} ms a layer, mass recall {recalls.mean():.4f} "
              f"(lowest {recalls.min():.4f})", flush=True)
    return dict(n_tokens=n, k=k, heads=HEADS, head_dim=HEAD_DIM, d_model=DIM, threads=threads, nlist=nlist,
                bandwidth_bytes_per_second=bandwidth, floor_layer_seconds=floor_layer, top1_mass=top1,
                queries_per_head=queries_per_head, ivf_heads=ivf_heads, key_build_seconds=key_seconds,
                recall_target=RECALL_TARGET, rows=rows)


def print_result(result: dict) -> None:
    exact = result["rows"][0]["layer_seconds"]
    table = [[row["index"], row["nprobe"] or "-", f"{row['layer_seconds'] * 1e3:.2f}",
              f"{exact / row['layer_seconds']:.1f}x", f"{row['recall']:.4f}", f"{row['recall_min']:.4f}",
              f"{row['build_seconds_per_head']:.1f}"] for row in result["rows"]]
    print(f"N={result['n_tokens']:,}, k={result['k']:,}, floor of a layer {result['floor_layer_seconds'] * 1e3:.1f} ms")
    print_table(["index", "nprobe", "layer ms", "vs exact", "mass recall", "lowest", "build s/head"], table)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--ivf-heads", type=int, default=2, help="heads given an IVF index (default 2)")
    parser.add_argument("--nlist", type=int, default=4096)
    parser.add_argument("--nprobe", default="8,32,128,512", help="comma-separated nprobe values")
    parser.add_argument("--queries", type=int, default=32, help="queries per head for the recall (default 32)")
    parser.add_argument("--strength", type=float, default=2.0, help="query scale: how peaked the attention is")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="MiB summed to measure the bandwidth")
    parser.add_argument("--json", type=Path, help="default bench/results/approximate_keys.json")
    args = parser.parse_args(argv)
    result = run(args.tokens, args.k, args.ivf_heads, args.nlist, [int(p) for p in args.nprobe.split(",")],
                 args.queries, args.strength, args.bandwidth_mib)
    print_result(result)
    path = args.json or RESULTS / "approximate_keys.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result, machine=machine()), indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
