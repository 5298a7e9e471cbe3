"""The decoder's linear layers in the form measured faster (unlimisum/models/projections.py) against F.linear.

    python -m bench.projections [--size bart-base] [--tokens 16384] [--new-tokens 64] [--beams 1,4] [--turns 3]

A model of ``--size``'s shape with random weights generates ``--new-tokens`` tokens from a synthetic store of
``--tokens`` states with per-layer keys (exact, k = 1,024), greedy and with 4 beams, once with the decoder's linear
layers and output projection in the form this machine measured faster and once with transformers' F.linear for
all of them, in turns (A B A B ...) in one process, so that a busy moment falls on both alike. Prints seconds per
token (the median of the turns) and the ratio, and each group's race at 1, 4 and 32 rows (what the measurement
found: F.linear against ``weight @ rows^T``). Writes bench/results/projections.json (``--name``: another name).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

from bench.common import print_table, random_model, write_result
from bench.index_choice import synthetic_store
from unlimisum.config import GenerationOptions, IndexConfig
from unlimisum.models import projections
from unlimisum.search.keys import build_key_store, key_weights
from unlimisum.summarizer import Summarizer


def run(size: str, n_tokens: int, new_tokens: int, beams_values: list[int], turns: int) -> dict:
    loaded = random_model(size)
    store = synthetic_store(n_tokens, loaded.model.config.d_model, IndexConfig(kind="exact", device="cpu"))
    store.keys = build_key_store(store.states(), key_weights(loaded.model, loaded.architecture))
    races = [{"group": group.name, "rows": rows, **group.race(rows)[0]}
             for group, _ in projections.groups(loaded.model) for rows in (1, 4, 32)]
    rows = []
    for beams in beams_values:
        generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams,
                                       do_sample=False)
        family = Summarizer(loaded, generation=generation).family

        def generate(measured: bool) -> float:
            with mock.patch.object(projections, "groups", projections.groups if measured else lambda model: []):
                started = time.perf_counter()
                family.generate([store], coverage=False)
                return (time.perf_counter() - started) / new_tokens

        generate(True), generate(False)  # warm: kernels measured, forms measured
        seconds = {True: [], False: []}
        for _ in range(turns):
            for measured in (True, False):
                seconds[measured].append(generate(measured))
        row = dict(beams=beams, measured_seconds_per_token=statistics.median(seconds[True]),
                   linear_seconds_per_token=statistics.median(seconds[False]), turns=seconds)
        row["speedup"] = row["linear_seconds_per_token"] / row["measured_seconds_per_token"]
        rows.append(row)
    return dict(size=size, n_tokens=n_tokens, new_tokens=new_tokens, races=races,
                runs=[dict(row, turns={"measured": row["turns"][True], "linear": row["turns"][False]})
                      for row in rows])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bart-base")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--name", default="projections")
    args = parser.parse_args(argv)
    result = run(args.size, args.tokens, args.new_tokens, [int(b) for b in args.beams.split(",")], args.turns)
    print(f"{args.size}, {args.tokens:,} tokens, per-layer keys, k = 1,024, {args.new_tokens} tokens; seconds per "
          "token, the median of the turns:")
    print_table(["beams", "measured", "F.linear", "speed-up"],
                [[row["beams"], f"{row['measured_seconds_per_token']:.4f}", f"{row['linear_seconds_per_token']:.4f}",
                  f"{row['speedup']:.2f}x"] for row in result["runs"]])
    print("each group's race (the best of its turns, ms):")
    print_table(["group", "rows", "F.linear", "weight @ rows^T", "chosen"],
                [[race["group"], race["rows"], f"{race['linear_seconds'] * 1e3:.2f}",
                  f"{race['columns_seconds'] * 1e3:.2f}", race["form"]] for race in result["races"]])
    path = write_result(args.name, result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
