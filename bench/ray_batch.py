"""A batch on a local Ray instance against one local process: books per second and the share of the CPUs used.

    python -m bench.ray_batch [--quick] [--size bart-small] [--books 6] [--tokens 2048]

The same books (random words, one token each) summarized by the `unlimisum` command, run as a
user runs it: once with the local engine (one process, torch on every core), then with
``--engine ray`` on one Ray instance started here on 127.0.0.1 (``--ray-address``) as
W workers x T torch threads (1 x cores, cores x 1 and, from 4 cores, 2 x cores/2). Wall time
is the command's, from start to exit: model loading in every worker included, Ray's own start
not (the instance is shared by the Ray rows). CPU share = CPU seconds of the command and of the
Ray instance's processes (raylet, GCS, workers) over wall time x cores. Random weights of a
real size: weights do not change cost.

Prints a table and writes bench/results/ray_batch.json.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from bench.common import SIZES, VOCAB, print_table, random_text, word_tokenizer, write_result

# between bart-tiny and bart-base: a few seconds a book on one core (bench.common.SIZES has the others)
BART_SMALL = dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                  decoder_attention_heads=4, encoder_ffn_dim=1024, decoder_ffn_dim=1024)


def save_random_bart(size: str, folder: Path, window: int = 1024) -> Path:
    """A random BART of ``size`` with the word tokenizer, saved as a model folder the workers load."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    dims = BART_SMALL if size == "bart-small" else SIZES[size]
    config = BartConfig(vocab_size=VOCAB, max_position_embeddings=window, **dims)
    BartForConditionalGeneration(config).eval().save_pretrained(folder)
    word_tokenizer(max_length=window).save_pretrained(folder)
    return folder


class TreeCpu:
    """CPU seconds of this process's descendants (the Ray instance), sampled in a thread; ``skip``: pids left out."""

    def __init__(self, interval: float = 0.2):
        self.interval = interval
        self.last: dict[tuple, float] = {}  # (pid, create time) -> user + system seconds at the last sample
        self.skip: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.sample()
            time.sleep(self.interval)

    def sample(self) -> None:
        for process in psutil.Process().children(recursive=True):
            try:
                if process.pid in self.skip or process.ppid() in self.skip:
                    continue
                times = process.cpu_times()
                self.last[(process.pid, process.create_time())] = times.user + times.system
            except psutil.Error:
                continue

    def total(self) -> float:
        self.sample()
        return sum(self.last.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run_command(command: list[str], cwd: Path, tree: TreeCpu) -> dict:
    """Run one configuration; its wall seconds and CPU seconds (the command's own, exactly, plus Ray's)."""
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    before_tree = tree.total()
    environment = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "RAY_ADDRESS")}
    environment.update(HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=cwd, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
    tree.skip.add(process.pid)
    _, stderr = process.communicate()
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{stderr}")
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after_children.ru_utime + after_children.ru_stime) - (before_children.ru_utime + before_children.ru_stime)
    time.sleep(tree.interval * 2)  # the workers' last samples, taken before they were killed
    return dict(wall_seconds=wall, cpu_seconds=own + tree.total() - before_tree)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bart-small, 6 books of 2,048 tokens, 16 new tokens")
    parser.add_argument("--size", choices=["bart-tiny", "bart-small", *[s for s in SIZES if s != "bart-tiny"]],
                        default=None, help="model size (default: bart-base; bart-small with --quick)")
    parser.add_argument("--books", type=int, default=None, help="books in the batch (default 8; 6 with --quick)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per book (default 8,192; 2,048 with --quick)")
    parser.add_argument("--new-tokens", type=int, default=None, help="summary tokens (default 32; 16 with --quick)")
    args = parser.parse_args(argv)
    size = args.size or ("bart-small" if args.quick else "bart-base")
    books = args.books or (6 if args.quick else 8)
    tokens = args.tokens or (2_048 if args.quick else 8_192)
    new_tokens = args.new_tokens or (16 if args.quick else 32)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    import ray

    from unlimisum.runs.ray import start_local_ray

    work = Path(tempfile.mkdtemp(prefix="bench-ray-batch-"))
    tree = TreeCpu()
    ray_folder = None
    try:
        model = save_random_bart(size, work / "model")
        (work / "books").mkdir()
        for number in range(books):
            (work / "books" / f"book{number:02d}.txt").write_text(random_text(tokens, seed=number), encoding="utf-8")
        base = [sys.executable, "-I", "-m", "unlimisum", "summarize", "books", "-m", str(model), "--device", "cpu",
                "--max-new-tokens", str(new_tokens), "--min-new-tokens", str(new_tokens), "--num-beams", "1",
                "--no-sample", "-q"]
        shapes = [(1, cores), (cores, 1)] + ([(2, cores // 2)] if cores >= 4 else [])
        ray_folder = start_local_ray(ray, num_cpus=cores, log_to_driver=False, logging_level=logging.ERROR)
        address = ray.get_runtime_context().gcs_address
        rows = []
        configurations = [("local process", None)] + [(f"ray {w} x {t}", (w, t)) for w, t in shapes]
        for name, shape in configurations:
            output = work / f"out-{len(rows)}"
            command = base + ["-o", str(output)]
            if shape is not None:
                command += ["--engine", "ray", "--ray-address", address, "--workers", str(shape[0]),
                            "--cpus-per-worker", str(shape[1])]
            measured = run_command(command, work, tree)
            written = len(list(output.glob("*.summary.md")))
            assert written == books, f"{name}: {written} of {books} summaries written"
            rows.append(dict(configuration=name, workers=shape[0] if shape else 1,
                             threads=shape[1] if shape else cores, books=books, **measured,
                             books_per_second=books / measured["wall_seconds"],
                             cpu_share=measured["cpu_seconds"] / (measured["wall_seconds"] * cores)))
        local = rows[0]["books_per_second"]
        for row in rows:
            row["speedup"] = row["books_per_second"] / local
    finally:
        tree.close()
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        if ray_folder is not None:
            shutil.rmtree(ray_folder, ignore_errors=True)
    print(f"{books} books of {tokens:,} tokens, {size} (random weights), {new_tokens} summary tokens, {cores} cores")
    print_table(["configuration", "workers x threads", "wall s", "books/s", "CPU share", "vs local"],
                [[r["configuration"], f"{r['workers']} x {r['threads']}", f"{r['wall_seconds']:.1f}",
                  f"{r['books_per_second']:.3f}", f"{100 * r['cpu_share']:.0f} %", f"{r['speedup']:.2f}x"]
                 for r in rows])
    result = dict(size=size, books=books, tokens=tokens, new_tokens=new_tokens, cores=cores, ray=ray.__version__,
                  rows=rows)
    print("wrote", write_result("ray_batch", result))
    return result


if __name__ == "__main__":
    main()
