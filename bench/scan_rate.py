"""How fast the compiled scan reads a layer's keys, by queries per head, against how fast memory streams.

    python -m bench.scan_rate [--tokens 16384,100000,300000] [--queries 1,2,4,8,32] [--turns 7] [--name NAME]

A step's retrieval over per-layer keys is one pass of the compiled scan (``compiled.select``, k = 1,024) over
each head's bfloat16 keys ([12, N, 64]: bart-base's heads), every query of a head met by each key while it is in
cache. Its floor (bench/key_store.py) is the keys' bytes over the streaming bandwidth; the scan reaches it only
while its arithmetic keeps up: a greedy step has one query a head, 4 beams have 4, a support reading 16 to 64.
For each N and queries per head this prints the scan's best time of ``--turns``, the keys it consumes per second,
its fp32 multiply-adds per second, and its time over the floor's read at the bandwidth measured just before and
after the row (bench.key_store.streaming_bandwidth, the better of the two), the configurations in turns so that a
slow minute falls on all of them. Writes bench/results/scan_rate.json (``--name NAME``: NAME.json).
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import machine, print_table, write_result
from bench.key_store import streaming_bandwidth
from unlimisum.search import compiled

HEADS, HEAD_DIM, K = 12, 64, 1024  # bart-base's heads; the retrieval's default k


def scan_rates(n_values: list[int], queries_values: list[int], turns: int, bandwidth_mib: int) -> list[dict]:
    """One row per (N, queries per head): the scan's best seconds and its rates, beside the bandwidth."""
    rows = []
    compiled.ready("select", torch.bfloat16)  # as a run has it: checked, and this machine's choices measured
    generator = torch.Generator().manual_seed(5)
    for n in n_values:
        keys = torch.randn(HEADS, n, HEAD_DIM, generator=generator).to(torch.bfloat16)
        queries = {count: torch.randn(HEADS, count, HEAD_DIM, generator=generator) * HEAD_DIM ** -0.5
                   for count in queries_values}
        for count in queries_values:  # compiled, and each size's first call, before any timing
            compiled.select(keys, queries[count], K)
        before = streaming_bandwidth(bandwidth_mib)
        best = dict.fromkeys(queries_values, float("inf"))
        for _ in range(turns):
            for count in queries_values:
                started = time.perf_counter()
                compiled.select(keys, queries[count], K)
                best[count] = min(best[count], time.perf_counter() - started)
        bandwidth = max(before, streaming_bandwidth(bandwidth_mib))
        read = keys.numel() * keys.element_size()
        for count in queries_values:
            seconds = best[count]
            rows.append(dict(n_tokens=n, queries_per_head=count, seconds=seconds, key_bytes=read,
                             keys_bytes_per_second=read / seconds,
                             multiply_adds_per_second=HEADS * n * count * HEAD_DIM / seconds,
                             bandwidth_bytes_per_second=bandwidth, bandwidths=[before, bandwidth],
                             times_read=seconds / (read / bandwidth)))
        del keys
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16384,100000,300000", help="comma-separated N")
    parser.add_argument("--queries", default="1,2,4,8,32", help="comma-separated queries per head")
    parser.add_argument("--turns", type=int, default=7, help="timings of each configuration, in turns (best kept)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024, help="MiB summed to measure the bandwidth")
    parser.add_argument("--name", default="scan_rate", help="the result file's name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    rows = scan_rates([int(n) for n in args.tokens.split(",")], [int(q) for q in args.queries.split(",")],
                      args.turns, args.bandwidth_mib)
    print_table(["N", "queries a head", "scan", "keys read", "multiply-adds", "memory streams", "x its read"],
                [[f"{row['n_tokens']:,}", row["queries_per_head"], f"{row['seconds'] * 1e3:.2f} ms",
                  f"{row['keys_bytes_per_second'] / 1e9:.1f} GB/s", f"{row['multiply_adds_per_second'] / 1e9:.0f} G/s",
                  f"{row['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s", f"{row['times_read']:.2f}x"]
                 for row in rows])
    result = dict(rows=rows, heads=HEADS, head_dim=HEAD_DIM, k=K, threads=torch.get_num_threads(),
                  machine=machine())
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()
