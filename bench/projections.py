"""The decoder's linear layers in the form measured faster (unlimisum/search/projections.py) against F.linear.

    python -m bench.projections [--size bart-base] [--tokens 16384] [--new-tokens 64] [--beams 1,4] [--turns 3]
                                [--dtype float32|bfloat16|auto]

A model of ``--size``'s shape with random weights in ``--dtype`` (auto: what ``--dtype auto`` chooses here)
generates ``--new-tokens`` tokens from a synthetic store of ``--tokens`` states with per-layer keys (exact,
k = 1,024), greedy and with 4 beams, in three ways in turns (A B C A B C ...) in one process, so that a busy moment
falls on all alike: the decoder's linear layers and output projection in the form this machine measured faster
(F.linear, ``weight @ rows^T`` or the compiled product); the same without the compiled product (the faster of
the other two, as before it raced); and transformers' F.linear for all of them. Prints seconds per token (the
median of the turns) and the ratios, and each group's race at 1, 4 and 32 rows. Writes
bench/results/projections.json (``--name``: another name).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch

from bench.common import print_table, random_model, write_result
from bench.index_choice import synthetic_store
from unlimisum.config import GenerationOptions, IndexConfig
from unlimisum.search import projections
from unlimisum.models.loading import resolve_dtype
from unlimisum.search.keys import build_key_store, key_weights
from unlimisum.summarizer import Summarizer


VARIANTS = ("measured", "without compiled", "linear")


def run(size: str, n_tokens: int, new_tokens: int, beams_values: list[int], turns: int,
        dtype: str = "float32") -> dict:
    loaded = random_model(size)
    loaded.model.to(resolve_dtype(dtype, torch.device("cpu")))
    store = synthetic_store(n_tokens, loaded.model.config.d_model, IndexConfig(kind="exact", device="cpu"))
    store.keys = build_key_store(store.states(), key_weights(loaded.model, loaded.architecture))
    races = [{"group": group.name, "rows": rows, **group.race(rows)[0]}
             for group, _ in projections.groups(loaded.model) for rows in (1, 4, 32)]
    rows = []
    for beams in beams_values:
        generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=beams,
                                       do_sample=False)
        family = Summarizer(loaded, generation=generation).family

        def generate(variant: str) -> float:
            groups = {"measured": projections.groups, "without compiled": _without_compiled,
                      "linear": lambda model: []}[variant]
            with mock.patch.object(projections, "groups", groups):
                started = time.perf_counter()
                family.generate([store], coverage=False)
                return (time.perf_counter() - started) / new_tokens

        for variant in VARIANTS:  # warm: kernels measured, forms measured
            generate(variant)
        seconds = {variant: [] for variant in VARIANTS}
        for _ in range(turns):
            for variant in VARIANTS:
                seconds[variant].append(generate(variant))
        median = {variant: statistics.median(times) for variant, times in seconds.items()}
        rows.append(dict(beams=beams, measured_seconds_per_token=median["measured"],
                         without_compiled_seconds_per_token=median["without compiled"],
                         linear_seconds_per_token=median["linear"],
                         speedup=median["linear"] / median["measured"],
                         compiled_speedup=median["without compiled"] / median["measured"], turns=seconds))
    return dict(size=size, dtype=str(loaded.dtype).removeprefix("torch."), n_tokens=n_tokens,
                new_tokens=new_tokens, races=races, runs=rows)


_GROUPS = projections.groups


def _without_compiled(model):
    """The model's groups, each choosing the faster of F.linear and ``weight @ rows^T`` (raced here, kept for the
    process): the forms as they were before the compiled product raced."""
    found = []
    for group, members in _GROUPS(model):
        found.append((_TwoForms(group.name, group.weights), members))
    return found


class _TwoForms(projections.LinearGroup):
    _kept: dict[str, str] = {}

    def form(self, rows: int) -> str:
        name = self.measurement_name(projections.rows_class(rows))
        if name not in self._kept:
            with mock.patch.object(projections, "compiled_runs", lambda weights, rows: False):
                self._kept[name] = self.race(projections.rows_class(rows))[0]["form"]
        return self._kept[name]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="bart-base")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--beams", default="1,4")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--name", default="projections")
    args = parser.parse_args(argv)
    result = run(args.size, args.tokens, args.new_tokens, [int(b) for b in args.beams.split(",")], args.turns,
                 args.dtype)
    print(f"{args.size} in {result['dtype']}, {args.tokens:,} tokens, per-layer keys, k = 1,024, "
          f"{args.new_tokens} tokens; seconds per token, the median of the turns:")
    print_table(["beams", "measured", "without compiled", "F.linear", "compiled's gain", "x F.linear"],
                [[row["beams"], f"{row['measured_seconds_per_token']:.4f}",
                  f"{row['without_compiled_seconds_per_token']:.4f}", f"{row['linear_seconds_per_token']:.4f}",
                  f"{row['compiled_speedup']:.2f}x", f"{row['speedup']:.2f}x"] for row in result["runs"]])
    print("each group's race (the best of its turns, ms):")
    print_table(["group", "rows", "F.linear", "weight @ rows^T", "compiled", "chosen"],
                [[race["group"], race["rows"], f"{race['linear_seconds'] * 1e3:.2f}",
                  f"{race['columns_seconds'] * 1e3:.2f}",
                  f"{race['compiled_seconds'] * 1e3:.2f}" if "compiled_seconds" in race else "-", race["form"]]
                 for race in result["races"]])
    path = write_result(args.name, result)
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
