"""Decoder-only retrieval: seconds per generated token against the prompt length N, next to the bandwidth floor;
and prefill tokens per second against the plain model's own forward.

    nice -n 10 python -m bench.decoder_only [--quick] [--tokens 4096,16384,65536,262144] [--new-tokens 8]
                                            [--table decode|prefill|both] [--prefill-tokens 8192,32768,131072]
                                            [--prefill-layers 24] [--before REV]

A Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 query heads on 2 key-value heads of 64,
vocabulary 151,936, 32,768 positions) with random weights (weights do not change cost), float32,
on the CPU, one torch thread unless --threads. For each N the store of every layer is filled with
random 16-bit keys and values as a prefill would leave it (a prefill of the real prompt on this CPU
would take hours at these N and changes nothing of a generation step's cost), then the model's own
generate() makes --new-tokens greedy tokens through unlimisum's attention. In the same run:

- the floor: the bytes a step must read (the weights, and every layer's stored keys, which the exact
  top-k search scores) over this machine's read bandwidth, measured as a float32 matrix-vector
  product over 512 MiB (what a weight read is);
- plain: the model's own generate() with an ordinary KV cache of N tokens in the model's dtype
  (every query attends to every token), for N up to 65,536;
- memory per token: the store's bytes per prompt token (2 x layers x KV heads x head dim x 2), and
  the plain cache's.

The prefill table reads a random prompt of N tokens the way a summary does (reading.prefill: chunks
of --prefill-window, blocks, k = --k) with the same model in bfloat16 (its --prefill-layers first
layers: a layer's cost does not depend on how many there are), next to the plain model's single
forward over the N tokens (its own SDPA attention, the last position's logits only) where N fits
its positions and PLAIN_PREFILL_MAX_TOKENS. With --before REV, unlimisum/decoder_only/cache.py of
git revision REV is loaded beside this tree's and the first N is read with each in turns
(plain, before, now; twice), so that a busy moment of a shared machine falls on all alike.

Prints the tables and writes bench/results/decoder_only.json (``--name NAME``: NAME.json there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from bench.common import RESULTS, print_table, write_result
from unlimisum.config import DecoderOnlyConfig
from unlimisum.decoder_only import reading
from unlimisum.decoder_only.cache import RetrievalLayer
from unlimisum.decoder_only.plan import plan_retrieval
from unlimisum.models import compat

QWEN_05B = dict(vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32_768, tie_word_embeddings=True,
                rope_theta=1_000_000.0)
TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True)
PLAIN_MAX_TOKENS = 65_536
PLAIN_PREFILL_MAX_TOKENS = 32_768  # the plain forward's attention is quadratic: 128k would take hours here
CACHE_PATH = "unlimisum/decoder_only/cache.py"


def random_model(size: dict, model_type: str = "qwen2"):
    from transformers import AutoConfig, AutoModelForCausalLM

    compat.quiet_transformers()
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **size)
    return AutoModelForCausalLM.from_config(config).eval()


def read_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second a float32 matrix-vector product streams its matrix at (best of 5)."""
    rows = megabytes * 2**20 // (4 * 4096)
    matrix, vector = torch.randn(rows, 4096), torch.randn(4096)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        matrix @ vector
        best = min(best, time.perf_counter() - started)
    return matrix.numel() * 4 / best


def filled_store_seconds(model, n_tokens: int, new_tokens: int, k: int, window: int) -> dict:
    """Greedy generate() after a store of ``n_tokens`` random keys and values: seconds per new token."""
    from unlimisum.models.architectures import architecture_for

    architecture = architecture_for(model.config)
    weight = next(model.parameters())  # the store and the probe go where the model is (CPU or GPU)
    plan = plan_retrieval(prompt_tokens=n_tokens, text_start=0, max_new_tokens=new_tokens,
                          max_positions=model.config.max_position_embeddings, window=window, retrieval_k=k,
                          config=DecoderOnlyConfig(), storage_dtype=torch.bfloat16, keys_device=weight.device,
                          values_device=weight.device)
    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    ids = torch.randint(4, config.vocab_size, (n_tokens + 1,), generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode(), reading.session(model, architecture, plan) as cache:
        probe = torch.zeros(1, kv_heads, 0, head_dim, dtype=weight.dtype, device=weight.device)
        for layer in cache.layers:
            if isinstance(layer, RetrievalLayer):
                layer.lazy_initialization(probe, probe)
                for start in range(0, n_tokens, 65_536):  # as a prefill leaves it: every slot written
                    rows = min(65_536, n_tokens - start)
                    layer.store.append(torch.randn(kv_heads, rows, head_dim, generator=generator),
                                       torch.randn(kv_heads, rows, head_dim, generator=generator))
        cache.finish_prefill()
        kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
        started = time.perf_counter()
        reading.generate(model, cache, ids, **kwargs)
        seconds = time.perf_counter() - started
    return {"seconds_per_token": seconds / new_tokens, "search_share": cache.search_seconds / seconds,
            "store_bytes": cache.store_bytes, "positions": "true" if plan.true_positions else "fixed distance"}


def plain_seconds(model, n_tokens: int, new_tokens: int) -> float:
    """The model's own generate() after an ordinary KV cache of ``n_tokens`` random keys and values."""
    from transformers import DynamicCache

    config = model.config
    kv_heads, head_dim = config.num_key_value_heads, config.hidden_size // config.num_attention_heads
    weight = next(model.parameters())  # the cache in the model's dtype, where the model is
    cache = DynamicCache(config=config)
    generator = torch.Generator().manual_seed(2)
    for layer in range(config.num_hidden_layers):
        cache.update(torch.randn(1, kv_heads, n_tokens, head_dim, generator=generator).to(weight.device, weight.dtype),
                     torch.randn(1, kv_heads, n_tokens, head_dim, generator=generator).to(weight.device, weight.dtype),
                     layer)
    ids = torch.randint(4, config.vocab_size, (1, n_tokens + 1), generator=torch.Generator().manual_seed(1))
    ids = ids.to(weight.device)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
    with torch.inference_mode():
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **{compat.cache_argument(model): cache}, **kwargs)
    return (time.perf_counter() - started) / new_tokens


def cache_at(revision: str):
    """unlimisum/decoder_only/cache.py as it was at ``revision``, imported under its own name."""
    root = Path(__file__).resolve().parent.parent
    source = subprocess.run(["git", "show", f"{revision}:{CACHE_PATH}"], cwd=root, capture_output=True,
                            text=True, check=True).stdout
    module = types.ModuleType("cache_before")
    sys.modules["cache_before"] = module
    exec(compile(source, f"{revision}:{CACHE_PATH}", "exec"), module.__dict__)
    return module


def prefill_seconds(model, ids: torch.Tensor, window: int, k: int, cache_class=None) -> float:
    """Seconds to read ``ids`` through unlimisum's chunked prefill (with ``cache_class`` in place of this tree's)."""
    from unlimisum.models.architectures import architecture_for

    plan = plan_retrieval(prompt_tokens=ids.shape[0], text_start=0, max_new_tokens=256,
                          max_positions=model.config.max_position_embeddings, window=window, retrieval_k=k,
                          config=DecoderOnlyConfig(), storage_dtype=torch.bfloat16)
    current = reading.RetrievalCache
    reading.RetrievalCache = cache_class or current
    try:
        with torch.inference_mode(), reading.session(model, architecture_for(model.config), plan) as cache:
            started = time.perf_counter()
            reading.prefill(model, cache, ids)
            return time.perf_counter() - started
    finally:
        reading.RetrievalCache = current


def plain_prefill_seconds(model, ids: torch.Tensor) -> float:
    """Seconds of the plain model's one forward over ``ids`` (its own attention, the last logits only)."""
    with torch.inference_mode():
        started = time.perf_counter()
        model(ids.unsqueeze(0), logits_to_keep=1)
        return time.perf_counter() - started


def prefill_table(args, tokens: list[int]) -> dict:
    """The prefill table: tokens/s of unlimisum's chunked prefill and of the plain forward, per N."""
    model = random_model(dict(QWEN_05B, num_hidden_layers=args.prefill_layers)).to(torch.bfloat16)
    positions = model.config.max_position_embeddings
    ids_of = {n: torch.randint(4, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
              for n in tokens}
    prefill_seconds(model, ids_of[tokens[0]][:2048], args.prefill_window, args.k)  # warm-up
    plain_prefill_seconds(model, ids_of[tokens[0]][:2048])
    before = None
    if args.before:
        old = cache_at(args.before).RetrievalCache
        turns = {"plain": [], "before": [], "now": []}
        ids = ids_of[tokens[0]]
        for _ in range(args.turns):
            turns["plain"].append(plain_prefill_seconds(model, ids))
            turns["before"].append(prefill_seconds(model, ids, args.prefill_window, args.k, old))
            turns["now"].append(prefill_seconds(model, ids, args.prefill_window, args.k))
        median = {name: statistics.median(values) for name, values in turns.items()}
        before = dict(revision=args.before, tokens=tokens[0], seconds=turns,
                      rate_vs_plain={name: median["plain"] / median[name] for name in ("before", "now")})
        print_table(["N", "turn", "plain s", "before s", "now s", "before x plain rate", "now x plain rate"],
                    [[f"{tokens[0]:,}", i + 1, f"{p:.1f}", f"{b:.1f}", f"{n:.1f}", f"{p / b:.2f}", f"{p / n:.2f}"]
                     for i, (p, b, n) in enumerate(zip(turns["plain"], turns["before"], turns["now"]))])
        print(flush=True)
    rows, results = [], []
    for n in tokens:
        ids = ids_of[n]
        if before is not None and n == before["tokens"]:
            ours, plain = statistics.median(before["seconds"]["now"]), statistics.median(before["seconds"]["plain"])
        else:
            ours = prefill_seconds(model, ids, args.prefill_window, args.k)
            plain = plain_prefill_seconds(model, ids) if n <= min(positions, PLAIN_PREFILL_MAX_TOKENS) else None
        positions_kind = "true" if n + 257 <= positions else "fixed distance"
        results.append(dict(tokens=n, seconds=ours, tokens_per_second=n / ours, plain_seconds=plain,
                            plain_tokens_per_second=n / plain if plain else None, positions=positions_kind,
                            rate_vs_plain=plain / ours if plain else None))
        rows.append([f"{n:,}", positions_kind, f"{ours:.1f}", f"{n / ours:.0f}",
                     f"{plain:.1f}" if plain else "-", f"{n / plain:.0f}" if plain else "-",
                     f"{plain / ours:.2f}" if plain else "-",
                     f"{n / ours / (tokens[0] / results[0]['seconds']):.2f}"])
        print_table(["N", "positions", "s", "tokens/s", "plain s", "plain tokens/s", "x plain rate",
                     "rate vs first N"], rows)
        print(flush=True)
    return dict(layers=args.prefill_layers, window=args.prefill_window, k=args.k, dtype="bfloat16",
                results=results, before=before)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N up to 65,536")
    parser.add_argument("--tokens", default=None, help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--size", choices=["qwen2.5-0.5b", "tiny"], default="qwen2.5-0.5b")
    parser.add_argument("--table", choices=["decode", "prefill", "both"], default="both")
    parser.add_argument("--prefill-tokens", default=None, help="comma-separated prompt lengths to prefill")
    parser.add_argument("--prefill-layers", type=int, default=None, help="layers of the prefill model (24; --quick 4)")
    parser.add_argument("--prefill-window", type=int, default=1024)
    parser.add_argument("--before", default=None, help="git revision whose decoder_only/cache.py is the baseline")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--name", default="decoder_only",
                        help="write bench/results/NAME.json (--table prefill keeps the decode table there)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.prefill_layers is None:
        args.prefill_layers = 4 if args.quick else QWEN_05B["num_hidden_layers"]
    prefill = None
    if args.table in ("prefill", "both"):
        prefill = prefill_table(args, [int(n) for n in (args.prefill_tokens or "8192,32768,131072").split(",")])
        if args.table == "prefill":  # the decode table of an earlier run stays beside it
            earlier = RESULTS / f"{args.name}.json"
            kept = json.loads(earlier.read_text()) if earlier.exists() else {}
            kept.pop("machine", None)
            path = write_result(args.name, dict(kept, prefill=prefill))
            print(f"wrote {path}")
            return
    default = "4096,16384,65536" if args.quick else "4096,16384,65536,262144"
    tokens = [int(n) for n in (args.tokens or default).split(",")]
    model = random_model(QWEN_05B if args.size == "qwen2.5-0.5b" else TINY)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    key_bytes_per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2  # bf16 keys
    bandwidth = read_bandwidth()
    window = min(args.window, config.max_position_embeddings // 4)
    reading_step = filled_store_seconds(model, 1024, 2, args.k, window)  # warm-up: kernel calibration, allocation
    del reading_step
    rows, results = [], []
    for n in tokens:
        ours = filled_store_seconds(model, n, args.new_tokens, args.k, window)
        floor = (weight_bytes + n * key_bytes_per_token) / bandwidth
        plain = plain_seconds(model, n, args.new_tokens) if n <= PLAIN_MAX_TOKENS else None
        plain_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
        results.append(dict(tokens=n, k=args.k, window=window, floor_seconds=floor, plain_seconds_per_token=plain,
                            store_bytes_per_token=ours["store_bytes"] / n, plain_cache_bytes_per_token=plain_bytes,
                            **ours))
        rows.append([f"{n:,}", ours["positions"], f"{ours['seconds_per_token'] * 1e3:.0f}", f"{floor * 1e3:.0f}",
                     f"{ours['seconds_per_token'] / floor:.2f}", f"{ours['search_share']:.0%}",
                     f"{plain * 1e3:.0f}" if plain is not None else "-", f"{ours['store_bytes'] / n:,.0f}",
                     f"{plain_bytes:,}"])
        print_table(["N", "positions", "ms/token", "floor ms", "x floor", "search", "plain ms", "store B/token",
                     "plain B/token"], rows)
        print(flush=True)
    path = write_result(args.name, dict(
        model=args.size, weights_bytes=weight_bytes, read_bandwidth_bytes_per_second=bandwidth,
        new_tokens=args.new_tokens, threads=args.threads, results=results, prefill=prefill))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
