"""Encoding throughput: batched windows vs one window per pass, as a fraction of the matmul roofline.

    python -m bench.encoding [--quick] [--size bart-base|bart-large] [--tokens N]

Kept input tokens per second (what a user waits for) and encoded tokens per second (the
overlap makes the encoder read each token about 1/(1-overlap) times), and the achieved
GFLOP/s against torch's float32 matmul GFLOP/s measured in the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import SIZES, matmul_gflops, print_table, random_model, write_result
from unlimisum.config import IndexConfig
from unlimisum.search.datastore import DatastoreBuilder, plan_index
from unlimisum.unlimiformer.encoding import auto_batch_size, encode_windows, plan_windows


def encoder_flops_per_token(size: str, window: int) -> float:
    """Multiply-adds x 2 per encoded token: projections, feed-forward, and attention over the window."""
    d, layers, ffn = SIZES[size]["d_model"], SIZES[size]["encoder_layers"], SIZES[size]["encoder_ffn_dim"]
    per_layer = 2 * (4 * d * d + 2 * d * ffn) + 2 * 2 * window * d  # q,k,v,o + fc1,fc2 + QK^T and AV
    return layers * per_layer


def run(size: str, n_tokens: int, batch_sizes: list[int], overlap: float = 0.5) -> dict:
    loaded = random_model(size)
    window = loaded.max_source_length
    d = loaded.model.config.d_model
    input_ids = torch.randint(4, 50_000, (n_tokens,))
    plan = plan_windows(n_tokens, window, overlap)
    encoded_tokens = sum(plan.length(i) for i in range(plan.n_windows))
    flops = encoded_tokens * encoder_flops_per_token(size, window)
    roofline = matmul_gflops()
    rows = []
    for batch_size in batch_sizes:
        config = IndexConfig(kind="exact", device="cpu")
        builder = DatastoreBuilder(n_tokens, d, plan_index(n_tokens, d, config), config)
        encode_windows(loaded.model.get_encoder(), input_ids[: window * 2], plan_windows(window * 2, window, overlap),
                       lambda states: None, batch_size=min(batch_size, 2))  # warm-up
        started = time.perf_counter()
        encode_windows(loaded.model.get_encoder(), input_ids, plan, builder.add, batch_size=batch_size)
        seconds = time.perf_counter() - started
        builder.finish()
        gflops = flops / seconds / 1e9
        rows.append(dict(batch_size=batch_size, seconds=seconds, input_tokens_per_s=n_tokens / seconds,
                         encoded_tokens_per_s=encoded_tokens / seconds, gflops=gflops,
                         roofline_fraction=gflops / roofline))
    return dict(size=size, n_tokens=n_tokens, window=window, overlap=overlap, windows=plan.n_windows,
                overlap_factor=encoded_tokens / n_tokens, matmul_gflops=roofline,
                auto_batch_size=auto_batch_size(window, plan.n_windows, torch.device("cpu")), runs=rows)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bart-base, 8k tokens")
    parser.add_argument("--size", default=None, choices=sorted(SIZES))
    parser.add_argument("--tokens", type=int, default=None)
    args = parser.parse_args(argv)
    size = args.size or "bart-base"
    n_tokens = args.tokens or (8_192 if args.quick else 32_768)
    batch_sizes = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16]
    result = run(size, n_tokens, batch_sizes)
    print(f"encoding {size}: {n_tokens} tokens, {result['windows']} windows of {result['window']}, "
          f"overlap factor {result['overlap_factor']:.2f}, matmul roofline {result['matmul_gflops']:.0f} GFLOP/s, "
          f"auto batch {result['auto_batch_size']}")
    base = result["runs"][0]["input_tokens_per_s"]
    print_table(
        ["windows/pass", "s", "input tok/s", "encoded tok/s", "GFLOP/s", "of roofline", "vs 1/pass"],
        [[r["batch_size"], f"{r['seconds']:.2f}", f"{r['input_tokens_per_s']:.0f}", f"{r['encoded_tokens_per_s']:.0f}",
          f"{r['gflops']:.0f}", f"{r['roofline_fraction']:.0%}", f"{r['input_tokens_per_s'] / base:.2f}x"]
         for r in result["runs"]],
    )
    print("wrote", write_result("encoding", result))
    return result


if __name__ == "__main__":
    main()
