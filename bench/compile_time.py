"""Compile time of the retrieval kernels: what a machine's first run of a long book waits for.

    python -m bench.compile_time [--kernels select,top_k] [--dtypes bfloat16,float32] [--repeats 2]
                                 [--before REV] [--name compile_time]

Each (kernel, dtype) is compiled from an empty kernel cache (a fresh NUMBA_CACHE_DIR) in a fresh process, after
the kernels a run compiles before it in the same process (untimed, in the same dtype; ``AFTER``), so that each
figure is the time that kernel adds: the way ``unlimisum.search.compiled.COMPILE_SECONDS`` (the estimate a first
run shows) is measured. torch on one thread, as beside an encoding. The top-k reads fp32 scores whatever the
store holds: it is compiled once, as float32. ``select_grouped`` is timed also alone (a decoder-only run compiles
it first in its process). With ``--before REV`` the same processes run the code of git revision REV (a worktree
under bench/.cache) in turns with this tree's, so that each ratio comes from one run. Every figure also checks
the kernel (``compiled.ready``: it finds what torch finds on a small store). Writes bench/results/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import print_table, worktree, write_result
from unlimisum.search.compiled import KERNELS, SCORES_KERNELS

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "compile_time"
# the kernels compiled before each in its process (untimed): those a run compiles before it, or that share its
# helpers (select and scores share a driver: scores is timed after it, so the figure is what scores adds)
AFTER = {"select": ("select_grouped",), "select_grouped": ("select",), "scores": ("select",),
         "top_k": ("select", "select_grouped"), "weighted_sum": ("select", "select_grouped"),
         "attend_dense": ("select", "select_grouped"), "linear": ("select", "select_grouped"),
         "dense_sum": (), "head_dense_sum": ()}
ALONE = ("select_grouped",)  # also timed first in a process (numba's own start included)

# what one process runs: the kernels before (untimed), then the kernel timed; one JSON line on stdout
CHILD = """
import json, sys, time
import torch
torch.set_num_threads(1)
from unlimisum.search import compiled, jit
before, kernel, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
files = lambda: sum(1 for path in jit.CODE_FOLDER.rglob("*") if path.is_file())
empty = files() == 0
for name in filter(None, before.split(",")):
    compiled.ready(name, dtype)
started = time.perf_counter()
ready = compiled.ready(kernel, dtype)
print(json.dumps({"seconds": time.perf_counter() - started, "ready": ready, "empty_cache": empty,
                  "cached_files": files()}))
"""


def compile_once(code: Path, kernel: str, dtype: str, before: tuple[str, ...]) -> dict:
    """One fresh process, an empty kernel cache: the seconds ``kernel`` took to compile for ``dtype`` after
    ``before``, whether it is ready (checked against torch), and the files it left in the cache (an error where
    the cache was not empty at the start or nothing was written to it: then nothing was compiled there)."""
    with tempfile.TemporaryDirectory(prefix="unlimisum-compile-") as cache:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith("UNLIMISUM_") and key not in ("OMP_NUM_THREADS", "PYTHONPATH")}
        env.update(NUMBA_CACHE_DIR=cache, UNLIMISUM_CACHE_HOME=cache, PYTHONPATH=str(code), HF_HUB_OFFLINE="1")
        done = subprocess.run([sys.executable, "-c", CHILD, ",".join(before), kernel, dtype], env=env, cwd=cache,
                              capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not result["empty_cache"] or not result["cached_files"]:
        raise RuntimeError(f"{kernel}: the kernel cache was not a fresh folder of its own ({result})")
    return result


def cases(kernels: list[str], dtypes: list[str]) -> list[tuple[str, str, tuple[str, ...]]]:
    """(kernel, dtype, kernels compiled before it) to time: each kernel in each dtype it has (the top-k in
    float32 alone), after AFTER's, and ALONE's also first in a process."""
    found = []
    for kernel in kernels:
        for dtype in (["float32"] if kernel in SCORES_KERNELS else dtypes):
            found.append((kernel, dtype, AFTER[kernel]))
            if kernel in ALONE:
                found.append((kernel, dtype, ()))
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help="comma-separated kernels")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="comma-separated store dtypes")
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per kernel, dtype and tree")
    parser.add_argument("--before", default=None, help="a git revision to run beside this tree, in turns")
    parser.add_argument("--name", default="compile_time", help="the result file's name (bench/results/NAME.json)")
    args = parser.parse_args(argv)
    kernels = [name for name in args.kernels.split(",") if name]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"unknown kernels: {', '.join(unknown)} (one of {', '.join(KERNELS)})")
    trees = {"this tree": ROOT}
    if args.before:
        trees = {args.before: worktree(args.before, CACHE), **trees}
    rows = []
    for kernel, dtype, before in cases(kernels, [name for name in args.dtypes.split(",") if name]):
        times: dict[str, list[float]] = {name: [] for name in trees}
        files: dict[str, list[int]] = {name: [] for name in trees}
        ready = True
        for _ in range(args.repeats):
            for name, code in trees.items():  # in turns: a busy minute of the machine falls on both
                result = compile_once(code, kernel, dtype, before)
                times[name].append(result["seconds"])
                files[name].append(result["cached_files"])
                ready = ready and result["ready"]
        row = {"kernel": kernel, "dtype": dtype, "after": list(before), "ready": ready, "seconds": times,
               "median": {name: statistics.median(values) for name, values in times.items()}, "cached_files": files}
        rows.append(row)
        said = ", ".join(f"{name} {' / '.join(f'{value:.1f}' for value in values)} s" for name, values in times.items())
        print(f"  {kernel} ({dtype}, after {', '.join(before) or 'nothing'}): {said}", flush=True)
    names = list(trees)
    headers = ["kernel", "dtype", "after", *[f"{name} (s)" for name in names]]
    if len(names) == 2:
        headers.append("now / before")
    table = []
    for row in rows:
        line = [row["kernel"], row["dtype"], ", ".join(row["after"]) or "(first)",
                *[f"{row['median'][name]:.1f}" for name in names]]
        if len(names) == 2:
            line.append(f"{row['median'][names[1]] / row['median'][names[0]]:.2f}")
        table.append(line)
    print("\nseconds to compile from an empty kernel cache, a fresh process each (median of "
          f"{args.repeats}), torch on one thread:")
    print_table(headers, table)
    result = {"rows": rows, "repeats": args.repeats, "trees": {name: str(code) for name, code in trees.items()}}
    print(f"wrote {write_result(args.name, result)}")
    return result


if __name__ == "__main__":
    main()
