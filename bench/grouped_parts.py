"""The decoder-only grouped scan with fewer key-value heads than threads: a thread a head against a part a thread.

    python -m bench.grouped_parts [--tokens 32768,100000,300000] [--shapes gemma3-1b,qwen2.5-0.5b] [--turns 7]

``compiled.select_grouped`` (a generation step's far-token selection, k = 1,024, one row: a greedy step) of random
keys in the model's shape, bfloat16 and float32, each head's keys whole (a thread a head, as before
grouped_loops.py took parts) and in the parts it now takes (``grouped_loops.parts_of`` for this machine's
threads), in turns, the best of ``--turns`` each; beside them the keys' read at the streaming bandwidth measured
just before and after the row (bench.key_store.streaming_bandwidth, the better of the two). Where the heads
already occupy every thread both ways are the same call (the ratio 1). Writes bench/results/grouped_parts.json
(``--name NAME``: NAME.json).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, print_table, write_result
from bench.key_store import streaming_bandwidth
from unlimisum.search import compiled, grouped_loops

K = 1024  # the retrieval's default k
# (key-value heads, query heads per key-value head, head width) of decoder-only models
SHAPES = {"gemma3-1b": (1, 4, 256), "qwen2.5-0.5b": (2, 7, 64), "llama3.2-1b": (8, 4, 64)}


def rows_of(n_values: list[int], shapes: list[str], turns: int, bandwidth_mib: int) -> list[dict]:
    """One row per (shape, dtype, N): the whole-head and parted scans' best seconds beside the keys' read."""
    rows = []
    threads = torch.get_num_threads()
    generator = torch.Generator().manual_seed(5)
    for name in shapes:
        heads, group, head_dim = SHAPES[name]
        for dtype in (torch.bfloat16, torch.float32):
            compiled.ready("select_grouped", dtype)  # compiled and checked before anything is timed
            for n in n_values:
                keys = torch.randn(heads, n, head_dim, generator=generator).to(dtype)
                queries = torch.randn(heads, group, head_dim, generator=generator) * head_dim ** -0.5  # [G, g, D]
                parts = grouped_loops.parts_of(heads, n, threads)
                k = min(K, n)
                scores = torch.empty(heads, 1, k)
                ids = torch.empty(heads, 1, k, dtype=torch.long)
                ways = {"whole": 1, "parts": parts}

                def scan(way: str) -> None:
                    compiled._select_grouped_in(keys, queries, group, k, scores, ids, ways[way])

                for way in ways:  # each size's first call before any timing
                    scan(way)
                before = streaming_bandwidth(bandwidth_mib)
                best = dict.fromkeys(ways, float("inf"))
                for _ in range(turns):
                    for way in ways:
                        started = time.perf_counter()
                        scan(way)
                        best[way] = min(best[way], time.perf_counter() - started)
                bandwidth = max(before, streaming_bandwidth(bandwidth_mib))
                read = keys.numel() * keys.element_size()
                rows.append(dict(shape=name, kv_heads=heads, group=group, head_dim=head_dim,
                                 dtype=str(dtype).removeprefix("torch."), n_tokens=n, parts=parts,
                                 whole_seconds=best["whole"], parts_seconds=best["parts"],
                                 speedup=best["whole"] / best["parts"], key_bytes=read,
                                 read_seconds=read / bandwidth, bandwidth_bytes_per_second=bandwidth,
                                 bandwidths=[before, bandwidth]))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="32768,100000,300000", help="comma-separated N (far tokens)")
    parser.add_argument("--shapes", default="gemma3-1b,qwen2.5-0.5b", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--turns", type=int, default=7, help="timings of each way, in turns (best kept)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="MiB summed to measure the bandwidth")
    parser.add_argument("--name", default="grouped_parts", help="the result file's name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    rows = rows_of([int(n) for n in args.tokens.split(",")], args.shapes.split(","), args.turns, args.bandwidth_mib)
    print_table(["shape", "dtype", "N", "parts", "a thread a head", "a part a thread", "speed-up", "keys' read"],
                [[f"{row['shape']} ({row['kv_heads']} x {row['head_dim']})", row["dtype"], f"{row['n_tokens']:,}",
                  row["parts"], f"{row['whole_seconds'] * 1e3:.2f} ms", f"{row['parts_seconds'] * 1e3:.2f} ms",
                  f"{row['speedup']:.2f}x", f"{row['read_seconds'] * 1e3:.2f} ms"] for row in rows])
    result = dict(rows=rows, k=K, threads=torch.get_num_threads(), machine=machine())
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()
