"""Decode speed against the truncated baseline and the memory-bandwidth floor, in one run.

    python -m bench.decode_speed [--quick] [--tokens 16384,100000,300000] [--new-tokens 16] [--versus float32]

A bart-base-sized model with random weights (weights do not change cost) generates greedily
from synthetic encoder states of N tokens (bench/index_choice.py), exact index, at k=1,024
and k=N. In the same process and run:

- the truncated baseline: the model's own generate() over the first 1,024 encoded states
  (plain cross-attention, no unlimisum), decode only;
- the floor of an exact step: L decoder layers x one scores pass of the 12 head queries over the
  whole store by the fastest way this machine has (16-bit matmul, fp32-widened blocks, or the packed
  fp16 copy when the store has one), plus the baseline's own step;
- with --versus KERNEL (e.g. float32), every bart-base row again with that kernel forced, on the same
  store in the same run: the speed-up of the kernel calibrated here over it;
- 4 beams at the first N, per-step time against greedy;
- LED-base's shape (d=768, 6+6 layers, 16,384-token window) at 100k tokens with the paper's
  default k (the window) and unlimisum's (1,024), unless --quick.

Prints a table and writes bench/results/decode_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Iterator

import torch

from bench.common import print_table, random_model, write_result
from bench.index_choice import synthetic_states
from unlimisum.models import compat
from unlimisum.search import kernels, projections
from unlimisum.config import GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.search.datastore import DatastoreBuilder, IndexPlan
from unlimisum.summarizer import Summarizer

BASELINE_WINDOW = 1024


def exact_store(states: torch.Tensor, device: str = "cpu"):
    """An exact 16-bit store of ``states`` [N, d] on ``device`` ("cpu" or "cuda:N")."""
    n, d = states.shape
    builder = DatastoreBuilder(n, d, IndexPlan("exact", device, "benchmark"), IndexConfig())
    for chunk in states.split(16_384):
        builder.add(chunk)
    return builder.finish()


@contextlib.contextmanager
def step_clock(model: torch.nn.Module) -> Iterator[list[float]]:
    """The time each forward of ``model``'s decoder starts, within the block: one a step of generate() (all its
    beams at once), so that a step's time is the gap to the next one's start (``steady_step``)."""
    starts: list[float] = []
    hook = model.get_decoder().register_forward_pre_hook(lambda module, args: starts.append(time.perf_counter()))
    try:
        yield starts
    finally:
        hook.remove()


def steady_step(starts: list[float]) -> float:
    """The median seconds of a step after the first, from ``step_clock``'s starts: every step but the first and
    the last (whose end no later start marks). A median, not a mean: a moment the machine was busy elsewhere
    lands on one step, and a total over several steps (or a difference of two totals) would keep it."""
    gaps = [later - earlier for earlier, later in zip(starts[1:], starts[2:])]
    if not gaps:
        raise ValueError(f"{len(starts)} steps timed: a step after the first needs 3")
    return statistics.median(gaps)


def truncated_seconds_per_token(loaded, states: torch.Tensor, new_tokens: int, beams: int = 1,
                                measured_projections: bool = False, steady: bool = False) -> float:
    """generate() with ordinary cross-attention over the first BASELINE_WINDOW states: seconds per token.
    ``measured_projections``: the decoder's linear layers in the form unlimisum measured faster
    (unlimisum/search/projections.py, as its own steps run them), else transformers' own. ``steady``: the median
    step after the first (``steady_step``): the first step also projects the window's keys and values for every
    beam (4 beams x 1,024 states x 6 layers of bart-base: about half a second on 2 cores), a one-time cost that
    would weigh on every step of a short run."""
    model = loaded.model
    window = states[:BASELINE_WINDOW].to(loaded.device, loaded.dtype).unsqueeze(0)  # [1, W, d] as the model reads
    if measured_projections:
        projections.prepare(model, beams)

    def generate(tokens: int) -> float:
        started = time.perf_counter()
        model.generate(encoder_outputs=compat.encoder_outputs(window), max_new_tokens=tokens, min_new_tokens=tokens,
                       num_beams=beams, do_sample=False)
        return time.perf_counter() - started

    faster = projections.faster_projections(model) if measured_projections else contextlib.nullcontext()
    with torch.inference_mode(), faster:
        generate(2)
        if steady:
            with step_clock(model) as starts:
                generate(new_tokens)
            return steady_step(starts)
        return generate(new_tokens) / new_tokens


def unlimisum_seconds_per_token(loaded, store, k: int, new_tokens: int, beams: int = 1) -> tuple[float, float]:
    """(seconds per token, share of it in retrieval) for generate() with retrieval over ``store``."""
    generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams,
                                   do_sample=False)
    summarizer = Summarizer(loaded, generation=generation, retrieval=RetrievalConfig(retrieval_k=k))
    Summarizer(loaded, generation=GenerationOptions(max_new_tokens=2, min_new_tokens=2),
               retrieval=RetrievalConfig(retrieval_k=k)).generate([store])  # warm up (and calibrate)
    run = summarizer.generate([store])
    return run.seconds / new_tokens, run.search_seconds / run.seconds


def scores_matmul_seconds(store, n_queries: int) -> float:
    """Best of 3 runs of the fastest way this machine has to score ``n_queries`` queries against the whole
    store once: a matmul in the storage dtype (queries x states^T or states x queries^T), or blocks widened
    to fp32 (the float32 kernel, at the block size calibrated). The floor of an exact step's read."""
    states = store.states()
    queries = torch.randn(n_queries, store.dim)
    queries16 = queries.to(states.dtype)
    block = store.kernel().block_rows
    best = float("inf")
    ways = [lambda: queries16 @ states.T, lambda: states @ queries16.T,
            lambda: kernels.float32_scores(states, queries, block)]
    if store.packed() is not None:
        ways.append(lambda: store.packed().scores(queries))
    for matmul in ways:
        matmul()
        for _ in range(3):
            started = time.perf_counter()
            matmul()
            best = min(best, time.perf_counter() - started)
    return best


@contextlib.contextmanager
def forced_kernel(name: str | None):
    """UNLIMISUM_SCORE_KERNEL=name inside (kernels are calibrated per forced name, so both stay cached)."""
    before = os.environ.get("UNLIMISUM_SCORE_KERNEL")
    if name:
        os.environ["UNLIMISUM_SCORE_KERNEL"] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UNLIMISUM_SCORE_KERNEL", None)
        else:
            os.environ["UNLIMISUM_SCORE_KERNEL"] = before


def timed_both(loaded, store, k: int, new_tokens: int, versus: str | None, beams: int = 1) -> dict:
    """Seconds per token and retrieval share with the calibrated kernel and, with ``versus``, that kernel forced."""
    seconds, share = unlimisum_seconds_per_token(loaded, store, k, new_tokens, beams)
    out = dict(seconds_per_token=seconds, retrieval_share=share)
    if versus:
        with forced_kernel(versus):
            other, _ = unlimisum_seconds_per_token(loaded, store, k, new_tokens, beams)
        out.update(versus_kernel=versus, versus_seconds_per_token=other, speedup_vs_versus=other / seconds)
    return out


def run(n_values: list[int], new_tokens: int, led_tokens: int | None, versus: str | None = None) -> dict:
    loaded = random_model("bart-base")
    config = loaded.model.config
    layers, heads, d = config.decoder_layers, config.decoder_attention_heads, config.d_model
    rows = []
    baseline = None
    for index, n in enumerate(n_values):
        states = synthetic_states(n, d)
        store = exact_store(states)
        store.kernel()  # calibrated once, before the packing is timed
        started = time.perf_counter()
        packed = store.packed() is not None  # the packed kernel's copies, made here rather than in the first step
        packing_seconds = time.perf_counter() - started if packed else None
        if baseline is None:
            baseline = truncated_seconds_per_token(loaded, states, new_tokens)
            baseline_beams = truncated_seconds_per_token(loaded, states, new_tokens, beams=4)
        floor = layers * scores_matmul_seconds(store, heads) + baseline
        for k in (1024, n):
            timed = timed_both(loaded, store, k, new_tokens, versus)
            seconds = timed["seconds_per_token"]
            rows.append(dict(model="bart-base", n_tokens=n, k=k, beams=1, **timed, floor_seconds=floor,
                             vs_floor=seconds / floor, vs_baseline_rate=baseline / seconds,
                             kernel=store.kernel().scores, packing_seconds=packing_seconds))
            print(f"  N={n:,} k={k:,}: {seconds:.4f} s/token ({1 / seconds:.1f} tokens/s), floor {floor:.4f}"
                  + (f"; {versus} forced {timed['versus_seconds_per_token']:.4f}" if versus else ""), flush=True)
        if index == 0:
            timed = timed_both(loaded, store, 1024, new_tokens, versus, beams=4)
            seconds = timed["seconds_per_token"]
            greedy = next(r for r in rows if r["n_tokens"] == n and r["k"] == 1024)["seconds_per_token"]
            rows.append(dict(model="bart-base", n_tokens=n, k=1024, beams=4, **timed, floor_seconds=None,
                             vs_floor=None, vs_baseline_rate=baseline_beams / seconds, vs_greedy=seconds / greedy,
                             kernel=store.kernel().scores, packing_seconds=packing_seconds))
            print(f"  N={n:,} k=1,024 4 beams: {seconds:.4f} s/token = {seconds / greedy:.2f}x greedy", flush=True)
        del store, states
    if led_tokens:
        rows.extend(led_rows(led_tokens, new_tokens))
    choice = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, d)
    return dict(new_tokens=new_tokens, baseline_seconds_per_token=baseline, baseline_tokens_per_second=1 / baseline,
                baseline_4_beams_seconds_per_token=baseline_beams, kernel=choice.scores,
                kernel_reason=choice.reason, runs=rows)


LED_WINDOW = 16_384


def random_led():
    """A LoadedModel of LED-base's shape (d=768, 6+6 layers, 16,384-token window) with random weights."""
    from transformers import LEDConfig, LEDForConditionalGeneration

    from bench.common import VOCAB, word_tokenizer
    from unlimisum.models.architectures import architecture_for
    from unlimisum.models import LoadedModel

    config = LEDConfig(vocab_size=VOCAB, d_model=768, encoder_layers=6, decoder_layers=6,
                       encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                       decoder_ffn_dim=3072, max_encoder_position_embeddings=LED_WINDOW,
                       max_decoder_position_embeddings=1024, attention_window=1024)
    torch.manual_seed(0)
    return LoadedModel(model=LEDForConditionalGeneration(config).eval(), tokenizer=word_tokenizer(max_length=LED_WINDOW),
                       architecture=architecture_for(config), name="random led-base")


def led_rows(n: int, new_tokens: int) -> list[dict]:
    """LED-base's shape (random weights) decoding from N synthetic states with its default k (the window)."""
    loaded = random_led()
    store = exact_store(synthetic_states(n, 768))
    rows = []
    for k in (LED_WINDOW, 1024):  # the paper's default (the window), and unlimisum's capped default
        seconds, share = unlimisum_seconds_per_token(loaded, store, k, new_tokens)
        print(f"  LED-base shape, N={n:,} k={k:,}: {seconds:.4f} s/token", flush=True)
        rows.append(dict(model="led-base", n_tokens=n, k=k, beams=1, seconds_per_token=seconds, retrieval_share=share,
                         floor_seconds=None, vs_floor=None, vs_baseline_rate=None, kernel=store.kernel().scores))
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N = 16k only, 6 tokens, no LED row")
    parser.add_argument("--tokens", default=None, help="comma-separated input lengths")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--versus", choices=kernels.SCORE_KERNELS, default=None,
                        help="also time every bart-base row with this kernel forced (same store, same run)")
    args = parser.parse_args(argv)
    n_values = [int(n) for n in args.tokens.split(",")] if args.tokens else (
        [16_384] if args.quick else [16_384, 100_000, 300_000])
    new_tokens = args.new_tokens or (6 if args.quick else 16)
    result = run(n_values, new_tokens, None if args.quick else 100_000, args.versus)
    print(f"\ntruncated baseline (first {BASELINE_WINDOW:,} states): {result['baseline_tokens_per_second']:.1f} tokens/s"
          f"; kernel: {result['kernel_reason']}")
    print_table(
        ["model", "N", "k", "beams", "kernel", "s/token", "tokens/s", "retrieval", "floor s", "x floor",
         "x baseline rate", f"{args.versus or '-'} s/token", "speed-up"],
        [[r["model"], f"{r['n_tokens']:,}", f"{r['k']:,}", r["beams"], r["kernel"], f"{r['seconds_per_token']:.4f}",
          f"{1 / r['seconds_per_token']:.1f}", f"{r['retrieval_share']:.0%}",
          f"{r['floor_seconds']:.4f}" if r["floor_seconds"] else "-", f"{r['vs_floor']:.2f}" if r["vs_floor"] else "-",
          f"{r['vs_baseline_rate']:.2f}" if r["vs_baseline_rate"] else "-",
          f"{r['versus_seconds_per_token']:.4f}" if "versus_seconds_per_token" in r else "-",
          f"{r['speedup_vs_versus']:.2f}" if "speedup_vs_versus" in r else "-"] for r in result["runs"]],
    )
    print("wrote", write_result("decode_speed", result))
    return result


if __name__ == "__main__":
    main()
