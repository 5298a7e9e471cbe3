"""Figures for BENCHMARKS.md from bench/results/*.json: decode latency vs N and memory vs N.

    python -m bench.plot      (needs matplotlib: pip install -e ".[bench]")
"""

from __future__ import annotations

import argparse
import json

from bench.common import RESULTS


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def plot_decoding(plt, data: dict) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    for kind in dict.fromkeys(r["kind"] for r in data["runs"]):
        runs = [r for r in data["runs"] if r["kind"] == kind]
        axis.plot([r["n_tokens"] for r in runs], [r["seconds_per_token"] for r in runs], marker="o", label=kind)
    axis.set(xscale="log", yscale="log", xlabel="input tokens N", ylabel="seconds per generated token",
             title=f"Decoding, {data['size']}-sized model, k={data['top_k']}")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "decoding.png", dpi=110)


def plot_memory(plt, data: dict) -> None:
    runs = data["runs"]
    n = [r["n_tokens"] for r in runs]
    mib = 2**20
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(n, [r["peak_rss_bytes"] / mib for r in runs], marker="o", label="unlimisum peak RSS")
    axis.plot(n, [r["datastore_bytes"] / mib for r in runs], marker="o", label="unlimisum datastore")
    axis.plot(n, [r["naive_bytes"] / mib for r in runs], marker="o", linestyle="--", label="naive keys+values 2LNd fp32")
    axis.set(xscale="log", yscale="log", xlabel="input tokens N", ylabel="MiB",
             title=f"Memory, {data['size']}-sized model")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(RESULTS / "memory.png", dpi=110)


def main(argv=None) -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench.plot: matplotlib is not installed (pip install -e '.[bench]'); no figures drawn")
        return
    for name, draw in (("decoding", plot_decoding), ("memory", plot_memory)):
        data = _load(name)
        if data is None:
            print(f"bench.plot: no {name}.json yet; run python -m bench.{name}")
            continue
        draw(plt, data)
        print("wrote", RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()
