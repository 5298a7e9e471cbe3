"""The shared store against a key store per decoder layer: seconds per token and per layer against N, beside the
memory-bandwidth floor measured in the same run.

    python -m bench.key_store [--quick] [--tokens 16384,100000,300000,1000000] [--size bart-base] [--beams 1,4]

A model of ``--size``'s shape with random weights (weights do not change cost) generates from synthetic encoder
states of N tokens (bench/index_choice.py), exact index, k=1,024 and k=N, once with the shared store (the
paper's one store of states: each head's query projected to d_model numbers) and once with per-layer keys
(unlimisum/search/keys.py: each head scores its own d_head numbers), on the same states in the same run.
The keys are the model's own projections of the states up to ``--synthetic-keys-from`` tokens and random numbers
of the same shape beyond (their cost to score is the same; projecting a million states would take minutes).

In the same process:

- the streaming bandwidth: the best of 3 float32 sums over ``--bandwidth-mib`` (1 GiB by default), measured
  just before and just after each row's generation; a row's floor uses the better of its two (a shared machine's
  bandwidth moves by half from minute to minute), ``vs_best_floor`` the best of the whole run;
- the truncated baseline: the model's own generate() over the first 1,024 states (its own step, after the first:
  bench/decode_speed.py ``steady``: the median step), the best of 3 (once for the run: one slow moment would skew
  every row's floor), as transformers runs it (the "vs truncated rate" a reader compares with) and with the
  decoder's linear layers in the form unlimisum measured faster (unlimisum/search/projections.py: as unlimisum's
  own steps run them; the floor's model step);
- the floor of an exact step: L layers x the bytes one layer reads (the store, or that layer's keys: the same
  count of 16-bit numbers when H x d_head = d; a dense step's keys and values where the policy keeps the values,
  k = N) over the bandwidth, plus the model's own step with those linear layers;
- unlimisum's step, measured as the floor's model step is: the median step after the first of a generate() of
  ``--new-tokens`` tokens, each step from the start of one decoder forward to the next; the first step with what
  a generate() call sets up (wrapping the model, the session) apart, in ``first_step_seconds``;
- one layer's retrieval alone (scores, top-k and the weighted sum), both stores in turns on the same queries;
- memory: the store's and the keys' bytes, and the process's peak resident set after each N.

Per-layer rows are skipped (and say so) when the keys and the store do not fit the policy's memory budget
(unlimisum/search/placement.py); k = N rows run up to ``--dense-max-tokens``. Prints a table and writes
bench/results/key_store.json (``--json PATH``
elsewhere). ``--quick``: N = 16,384, 4 tokens, a 256 MiB bandwidth sum, greedy only: a smoke test in under a minute.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from bench.common import RESULTS, machine, print_table, random_model
from bench.decode_speed import steady_step, step_clock, truncated_seconds_per_token
from bench.index_choice import synthetic_store
from unlimisum.config import GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.results import peak_rss_bytes
from unlimisum.summarizer import Summarizer
from unlimisum.search import head_kernels
from unlimisum.search.keys import KeyStore, build_key_store, key_store_bytes, key_weights, value_weights
from unlimisum.search.placement import KEY_STORE_MEMORY_FRACTION, IndexPlan, free_memory, plan_key_store

TURNS = 3  # one layer's retrieval: the best of this many turns of each store
BASELINE_TURNS = 3  # the truncated model's step: the best of this many generations' median steps


def streaming_bandwidth(mebibytes: int = 1024) -> float:
    """Bytes per second of the best of 3 float32 sums over ``mebibytes`` MiB (the machine's streaming read)."""
    data = torch.ones(mebibytes * 2**20 // 4)
    data.sum()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best


def synthetic_keys(layers: int, heads: int, n: int, head_dim: int, dtype: torch.dtype, chunk: int = 65_536) -> KeyStore:
    """Random keys [L, H, N, dh] in ``dtype``, filled ``chunk`` tokens at a time (no float32 copy of all of them)."""
    keys = torch.empty(layers, heads, n, head_dim, dtype=dtype)
    generator = torch.Generator().manual_seed(7)
    for start in range(0, n, chunk):
        part = keys[:, :, start:start + chunk]
        part.copy_(torch.randn(part.shape, generator=generator))
    return KeyStore(keys)


def seconds_per_token(loaded, store, k: int, new_tokens: int, beams: int) -> tuple[float, float, float]:
    """(the median seconds of a step after the first, the share of the run in retrieval, the seconds of the first
    step with what a generate() call sets up before it) of generate() with retrieval over ``store``: each step
    timed from the start of one decoder forward to the next (``step_clock``), as the floor's model step is."""
    def generate(tokens: int):
        generation = GenerationOptions(max_new_tokens=tokens, min_new_tokens=tokens, num_beams=beams, do_sample=False)
        return Summarizer(loaded, generation=generation, retrieval=RetrievalConfig(retrieval_k=k)).generate([store])

    generate(2)  # warm up (and calibrate)
    with step_clock(loaded.model) as starts:
        started = time.perf_counter()
        run = generate(new_tokens)
    return steady_step(starts), run.search_seconds / run.seconds, starts[1] - started


def one_layer_seconds(loaded, store, keys: KeyStore, k: int, beams: int) -> dict[str, float]:
    """One decoder layer's retrieval alone, the stores in turns on the same random decoder states: best seconds
    (with the keys' values at a top-k step too, where the key store holds them)."""
    layer = loaded.architecture.decoder_layers(loaded.model)[0]
    attention = getattr(*loaded.architecture.cross_attention.locate(layer))
    weights = key_weights(loaded.model, loaded.architecture)[0]  # [H, dh, d]
    heads, head_dim, dim = weights.shape
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(beams, heads, head_dim, generator=generator) * attention.scaling  # [beams, H, dh]
    shared_queries = torch.einsum("bhe,hed->bhd", q, weights.float()).reshape(-1, dim)  # [beams * H, d]
    head_queries = q.permute(1, 0, 2).contiguous()  # [H, beams, dh]
    choice = keys.choice(dim, queries_per_head=beams, k=k)
    runs = {"shared": lambda: store.attend(shared_queries, k),
            "per-layer": lambda: head_kernels.head_attend(keys.layer(0), store.states(), head_queries,
                                                          min(k, store.n_tokens), choice, store.kernel(),
                                                          values=keys.layer_values(0) if k >= store.n_tokens
                                                          else None)}
    if keys.values is not None and k < store.n_tokens:
        runs["per-layer+values"] = lambda: head_kernels.head_attend(keys.layer(0), store.states(), head_queries, k,
                                                                    choice, store.kernel(), values=keys.layer_values(0))
    best = {name: float("inf") for name in runs}
    for _ in range(TURNS + 1):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _floors(row: dict, bandwidth: float, layers: int) -> dict:
    """A row's floor at ``bandwidth`` bytes/s: L layers' reads plus the model's own step."""
    return dict(bandwidth_bytes_per_second=bandwidth, floor_layer_seconds=row["read_bytes"] / bandwidth,
                floor_seconds=layers * row["read_bytes"] / bandwidth + row["model_step_seconds"])


def run(n_values: list[int], size: str, new_tokens: int, beams_values: list[int], bandwidth_mib: int,
        synthetic_from: int, dense_max_tokens: int = 300_000) -> dict:
    bandwidths = [streaming_bandwidth(bandwidth_mib)]  # every measure of the run, in order
    print(f"streaming bandwidth {bandwidths[0] / 1e9:.1f} GB/s (float32 sum over {bandwidth_mib:,} MiB)", flush=True)
    loaded = random_model(size)
    config = loaded.model.config
    layers, dim = config.decoder_layers, config.d_model
    weights = key_weights(loaded.model, loaded.architecture)
    heads, head_dim, _ = weights[0].shape
    index = IndexConfig(kind="exact", device="cpu")
    rows, baseline, model_step = [], {}, {}
    for n in n_values:
        store = synthetic_store(n, dim, index)
        store.kernel()  # calibrated before anything is timed
        key_bytes = key_store_bytes(n, layers, heads, head_dim, store.storage_dtype)
        budget = KEY_STORE_MEMORY_FRACTION * (free_memory("cpu") + store.nbytes)  # the store is already resident
        keys = values = build_seconds = values_seconds = None
        if store.nbytes + key_bytes <= budget:
            started = time.perf_counter()
            keys = (build_key_store(store.states(), weights) if n <= synthetic_from
                    else synthetic_keys(layers, heads, n, head_dim, store.storage_dtype))
            build_seconds = time.perf_counter() - started if n <= synthetic_from else None
        # a dense step's key store keeps the values too where the policy says (the store and both fit its budget);
        # a top-k step is timed with them as a row of its own ("per-layer+values"), where the plan may keep them
        dense_plan = plan_key_store(n, dim, layers, heads, head_dim, IndexConfig(kind="exact", key_store="per-layer"),
                                    IndexPlan("exact", "cpu", ""), retrieval_k=n,
                                    free_bytes=free_memory("cpu") + store.nbytes)
        if keys is not None and dense_plan.values:
            started = time.perf_counter()
            values = (build_key_store(store.states(), weights, value_weights=value_weights(loaded.model,
                                                                                           loaded.architecture),
                                      keys=keys.keys).values if n <= synthetic_from
                      else synthetic_keys(layers, heads, n, head_dim, store.storage_dtype).keys)
            values_seconds = time.perf_counter() - started if n <= synthetic_from else None
        for beams in beams_values:
            if beams not in baseline:
                window = store.states()[:1024].float()
                baseline[beams] = min(truncated_seconds_per_token(loaded, window, new_tokens, beams=beams,
                                                                  steady=True) for _ in range(BASELINE_TURNS))
                model_step[beams] = min(truncated_seconds_per_token(loaded, window, new_tokens, beams=beams,
                                                                    measured_projections=True, steady=True)
                                        for _ in range(BASELINE_TURNS))
            layer_bytes = n * max(dim, heads * head_dim) * store.storage_dtype.itemsize
            for k in sorted({min(1024, n), n if n <= dense_max_tokens else 1024}):
                with_values = k >= n and values is not None  # the dense step's per-layer store reads them too
                layer_keys = KeyStore(keys.keys, values if with_values else None) if keys is not None else None
                kinds = ("shared", "per-layer") + (("per-layer+values",) if values is not None and k < n else ())
                for kind in kinds:
                    # one layer's step: the keys (the shared states), and at k >= N the values too; a top-k step
                    # reads k chosen values a head, a small share beside the keys, which the floor leaves out
                    read = layer_bytes * (2 if kind == "per-layer" and with_values else 1)
                    row_keys = KeyStore(keys.keys, values) if kind == "per-layer+values" else layer_keys
                    row = dict(n_tokens=n, k=k, beams=beams, store=kind.removesuffix("+values"),
                               store_bytes=store.nbytes,
                               key_store_bytes=(row_keys.nbytes if row_keys is not None else key_bytes)
                               if kind != "shared" else 0,
                               values=kind == "per-layer+values" or kind == "per-layer" and with_values,
                               read_bytes=read,
                               baseline_seconds_per_token=baseline[beams], model_step_seconds=model_step[beams])
                    if kind == "per-layer" and keys is None:
                        rows.append(dict(row, skipped=f"store + keys {(store.nbytes + key_bytes) / 2**30:.1f} GiB "
                                                      f"exceed the budget {budget / 2**30:.1f} GiB"))
                        continue
                    store.keys = row_keys if kind != "shared" else None
                    before = streaming_bandwidth(bandwidth_mib)
                    seconds, share, first = seconds_per_token(loaded, store, k, new_tokens, beams)
                    bandwidths += [before, streaming_bandwidth(bandwidth_mib)]
                    row.update(_floors(row, max(bandwidths[-2:]), layers))
                    floor = row["floor_seconds"]
                    row.update(seconds_per_token=seconds, first_step_seconds=first, retrieval_share=share,
                               vs_floor=seconds / floor,
                               vs_baseline_rate=baseline[beams] / seconds, key_build_seconds=build_seconds,
                               value_build_seconds=values_seconds if row["values"] else None)
                    rows.append(row)
                    print(f"  N={n:,} k={k:,} beams={beams} {kind}{' (keys and values)' if row['values'] else ''}: "
                          f"{seconds:.4f} s/token (the first {first:.3f} s), floor {floor:.4f} "
                          f"({seconds / floor:.2f}x), "
                          f"{baseline[beams] / seconds:.2f}x the truncated rate", flush=True)
                store.keys = None
                if keys is not None:
                    layer = one_layer_seconds(loaded, store, KeyStore(keys.keys, values) if len(kinds) > 2
                                              else layer_keys, k, beams)
                    for row in rows[-len(kinds):]:
                        row["layer_seconds"] = layer[row["store"] + ("+values" if row["values"] and k < n else "")]
        for row in rows:
            if row["n_tokens"] == n:
                row["peak_rss_bytes"] = peak_rss_bytes()
        del store, keys, values, layer_keys
    best = max(bandwidths)
    for row in rows:
        if "skipped" in row:
            row.update(_floors(row, best, layers))
        else:
            row["vs_best_floor"] = row["seconds_per_token"] / _floors(row, best, layers)["floor_seconds"]
    choice = head_kernels._MEASURED and next(iter(head_kernels._MEASURED.values()))
    return dict(size=size, new_tokens=new_tokens, bandwidth_bytes_per_second=best,
                bandwidths_measured=bandwidths, layers=layers, heads=heads,
                head_dim=head_dim, d_model=dim, head_kernel=choice.reason if choice else None, runs=rows)


def print_result(result: dict) -> None:
    table = []
    for row in result["runs"]:
        if "skipped" in row:
            table.append([f"{row['n_tokens']:,}", f"{row['k']:,}", row["beams"], row["store"], "skipped", "", "", "",
                          "", "", "", "", row["skipped"], ""])
            continue
        layer = row.get("layer_seconds")
        table.append([f"{row['n_tokens']:,}", f"{row['k']:,}", row["beams"],
                      row["store"] + (" + values" if row.get("values") else ""),
                      f"{row['seconds_per_token']:.4f}", f"{row['first_step_seconds']:.3f}",
                      f"{row['bandwidth_bytes_per_second'] / 1e9:.1f}",
                      f"{row['floor_seconds']:.4f}", f"{row['vs_floor']:.2f}x", f"{row['vs_best_floor']:.2f}x",
                      f"{layer * 1e3:.1f}" if layer is not None else "-", f"{row['floor_layer_seconds'] * 1e3:.1f}",
                      f"{(row['store_bytes'] + row['key_store_bytes']) / 2**20:,.0f} MiB",
                      f"{row['vs_baseline_rate']:.2f}x"])
    print_table(["N", "k", "beams", "store", "s/token", "first s", "GB/s", "floor", "vs floor", "vs best floor",
                 "layer ms", "floor layer ms", "memory", "vs truncated rate"], table)
    measured = result["bandwidths_measured"]
    print(f"each row's floor at the better of the bandwidths measured just before and after it (GB/s); the run's "
          f"measures {min(measured) / 1e9:.1f}-{max(measured) / 1e9:.1f} GB/s, the best for 'vs best floor'")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 16,384, 4 tokens, greedy: a smoke test")
    parser.add_argument("--tokens", help="comma-separated N (default 16384,100000,300000,1000000)")
    parser.add_argument("--size", default="bart-base", help="bench/common.py SIZES (default bart-base)")
    parser.add_argument("--beams", help="comma-separated beam counts (default 1,4; --quick 1)")
    parser.add_argument("--new-tokens", type=int,
                        help="tokens generated per run: a step is their median after the first (default 16; --quick 4)")
    parser.add_argument("--bandwidth-mib", type=int, help="MiB summed to measure the bandwidth (default 1024)")
    parser.add_argument("--synthetic-keys-from", type=int, default=300_000,
                        help="above this N the keys are random numbers of their shape (default 300,000)")
    parser.add_argument("--dense-max-tokens", type=int, default=300_000,
                        help="k = N rows (dense steps) up to this N only (default 300,000)")
    parser.add_argument("--json", type=Path, help="where to write the result (default bench/results/key_store.json)")
    args = parser.parse_args(argv)
    n_values = [int(n) for n in args.tokens.split(",")] if args.tokens else (
        [16_384] if args.quick else [16_384, 100_000, 300_000, 1_000_000])
    beams = [int(b) for b in args.beams.split(",")] if args.beams else ([1] if args.quick else [1, 4])
    result = run(n_values, args.size, args.new_tokens or (4 if args.quick else 16), beams,
                 args.bandwidth_mib or (256 if args.quick else 1024), args.synthetic_keys_from,
                 args.dense_max_tokens)
    result["quick"] = args.quick
    print_result(result)
    path = args.json or RESULTS / "key_store.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(result, machine=machine()), indent=2))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
