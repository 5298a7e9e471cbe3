"""Run every benchmark: ``python -m bench.all [--quick]`` (quick: under ~10 minutes on 2 CPU cores).

Each benchmark prints its table and writes bench/results/<name>.json; then bench/plot.py
renders the figures when matplotlib is installed (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

import argparse
import importlib
import time

BENCHMARKS = [
    "encoding", "led_encoding", "decode_speed", "decoding", "index_choice", "memory", "truncation", "profile",
    "encode_once", "weights_memory", "needle_eval", "evidence", "tc_recall", "tc_decoder", "decoder_only",
    "needle_decoder_eval", "decoder_prompt", "time_to_summary", "key_store",
]

# What --quick leaves out to stay under ten minutes: the prefill table of bench.decoder_only takes about
# twelve on two cores (run it alone: python -m bench.decoder_only --quick --table prefill).
QUICK_FLAGS = {"decoder_only": ["--table", "decode"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated subset of " + ", ".join(BENCHMARKS))
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else BENCHMARKS
    flags = ["--quick"] if args.quick else []
    for name in names:
        print(f"\n=== bench.{name} {' '.join(flags)}", flush=True)
        started = time.perf_counter()
        importlib.import_module(f"bench.{name}").main(flags + (QUICK_FLAGS.get(name, []) if args.quick else []))
        print(f"=== bench.{name}: {time.perf_counter() - started:.0f} s", flush=True)
    from bench import plot

    plot.main([])


if __name__ == "__main__":
    main()
