"""One book's windows encoded across Ray workers against this process alone: cost per window, bytes moved.

    python -m bench.ray_windows [--quick] [--size bart-base] [--tokens 100000] [--workers 2] [--dtype auto]

A random model of a real size (saved as a folder the workers load, with the word tokenizer) and
random words. The encode as ``summarize`` runs it, through the library: first in this process
(torch on every core), then with ``summarize --engine ray``'s ``RayWindows`` on a local Ray
instance started here on 127.0.0.1, W workers of cores / W CPUs each, already started (their start
is measured apart). Checked: the store the driver assembled equals the local one bit for bit.

Reported: encode seconds both ways; the cost of one window on one worker (its wall time x workers
/ windows); what the driver does per 100k tokens (receiving the states and building the store and
the per-layer keys, which overlaps the workers' encoding); the bytes moved per 100k tokens; and the
speed-up expected on N machines like this one, from those figures: N machines encode N windows at
a time at this machine's cost per window, while the driver receives and assembles at its measured
rate and the states cross a network of 1 or 10 Gbit/s (the slowest of the three bounds the run).

Prints a table and writes bench/results/ray_windows.json (ray_windows_quick.json with --quick).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, print_table, random_text, write_result
from bench.ray_batch import save_random_bart
from unlimisum.runs.ray_windows import RayWindows

GBIT = 1e9 / 8  # bytes per second of a 1 Gbit/s link


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16,384 tokens, bart-base")
    parser.add_argument("--size", default="bart-base", choices=["bart-small", "bart-base", "bart-large"])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the model's dtype (auto: as summarize chooses)")
    args = parser.parse_args(argv)
    tokens = 16_384 if args.quick else args.tokens
    folder = Path(tempfile.mkdtemp(prefix="unlimisum-bench-ray-windows-"))
    try:
        result = run(folder, args.size, tokens, args.workers, args.dtype)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report(result)
    write_result("ray_windows_quick" if args.quick else "ray_windows", result)


def run(folder: Path, size: str, tokens: int, workers: int, dtype: str) -> dict:
    import ray

    from unlimisum.config import EncodingConfig, GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
    from unlimisum.document import Document
    from unlimisum.runs.ray import ANY_NUMBER_OF_PARTS, RayEngine, RaySettings, start_local_ray
    from unlimisum.runs.report import SilentReporter
    from unlimisum.runs.runner import BatchRunner, SummarizeSettings

    model_folder = save_random_bart(size, folder / "model")
    settings = SummarizeSettings(model=ModelConfig(name=str(model_folder), device="cpu", dtype=dtype),
                                 encoding=EncodingConfig(), index=IndexConfig(), retrieval=RetrievalConfig(),
                                 generation=GenerationOptions())
    runner = BatchRunner(settings, SilentReporter())
    runner.load_model()
    summarizer = runner.summarizer
    document = Document.from_text(random_text(tokens))
    summarizer.encode(Document.from_text(random_text(2048, seed=1)))  # warm: kernels compiled, pages touched

    started = time.perf_counter()
    local = summarizer.encode(document)
    local_seconds = time.perf_counter() - started
    n_windows = len(local.windows)

    cores = os.cpu_count() or 1
    instance = start_local_ray(ray, num_cpus=cores, log_to_driver=False, logging_level=logging.ERROR)
    try:
        engine = RayEngine(runner, RaySettings(workers=workers))
        engine._plan = engine._plan_workers(ANY_NUMBER_OF_PARTS)
        started = time.perf_counter()
        for _ in range(engine._plan.workers):
            engine._start_worker()
        ray.get([worker.start_ref for worker in engine._starting_workers()])
        start_seconds = time.perf_counter() - started
        windows = TimedRayWindows(engine)
        summarizer.family.window_encoder = windows
        started = time.perf_counter()
        spread = summarizer.encode(document)
        spread_seconds = time.perf_counter() - started
        summarizer.family.window_encoder = None
        engine._stop()
    finally:
        ray.shutdown()
        shutil.rmtree(instance, ignore_errors=True)

    same = torch.equal(spread.store.states(), local.store.states()) and (
        (spread.store.keys is None and local.store.keys is None)
        or torch.equal(spread.store.keys.keys, local.store.keys.keys))
    used = engine._plan.workers
    window_seconds = spread.seconds["encode"] * used / n_windows  # one worker's cost per window
    local_window_seconds = local.seconds["encode"] / n_windows  # this machine's (all cores) cost per window
    per_100k = 100_000 / tokens
    bytes_in, bytes_out = windows.bytes_in * per_100k, windows.bytes_out * per_100k
    driver_seconds = windows.driver_seconds * per_100k  # receiving and assembling, per 100k tokens
    windows_100k = n_windows * per_100k
    expected = {}
    for machines in (1, 2, 4, 8, 16, 32):
        encode = windows_100k * local_window_seconds / machines
        row = {}
        for gbits in (1, 10):
            network = (bytes_in + bytes_out) / (gbits * GBIT)
            bound = max(encode, driver_seconds, network)
            row[f"{gbits} Gbit/s"] = dict(seconds=bound, speed_up=windows_100k * local_window_seconds / bound)
        expected[str(machines)] = row
    return dict(
        machine=machine(), size=size, tokens=tokens, windows=n_windows, dtype=str(runner.summarizer.loaded.dtype),
        workers=used, cpus_per_worker=engine._plan.cpus, bitwise_equal=same,
        local_encode_seconds=local.seconds["encode"], local_seconds=local_seconds,
        ray_encode_seconds=spread.seconds["encode"], ray_seconds=spread_seconds, ray_worker_start_seconds=start_seconds,
        parts=windows.parts_encoded, seconds_per_window_one_worker=window_seconds,
        seconds_per_window_local=local_window_seconds,
        driver_seconds_per_100k=driver_seconds, bytes_back_per_100k=bytes_in, bytes_out_per_100k=bytes_out,
        expected_on_machines=expected,
    )


class TimedRayWindows(RayWindows):
    """``RayWindows`` that also adds up the driver's own time: receiving states and handing them to the sink."""

    driver_seconds = 0.0

    def encode(self, input_ids, plan, sink, *, batch_size, on_batch=None):
        def timed_sink(states):
            started = time.perf_counter()
            sink(states)
            self.driver_seconds += time.perf_counter() - started
        return super().encode(input_ids, plan, timed_sink, batch_size=batch_size, on_batch=on_batch)

    def _states(self, ref):  # the call has ended: this is the transfer and the copy
        started = time.perf_counter()
        states = super()._states(ref)
        self.driver_seconds += time.perf_counter() - started
        return states


def report(result: dict) -> None:
    mib = 2**20
    print(f"{result['size']}, {result['tokens']:,} tokens in {result['windows']} windows, {result['dtype']}, "
          f"{result['workers']} Ray workers x {result['cpus_per_worker']} CPUs on {result['machine']['cpu_kind']}; "
          f"store bit for bit the local one: {result['bitwise_equal']}")
    print_table(["", "seconds"], [
        ["encode here (all cores)", f"{result['local_encode_seconds']:.1f}"],
        ["encode on the Ray workers (started)", f"{result['ray_encode_seconds']:.1f}"],
        ["the workers' start (loading the model)", f"{result['ray_worker_start_seconds']:.1f}"],
        ["one window, one worker", f"{result['seconds_per_window_one_worker']:.3f}"],
        ["one window, here (all cores)", f"{result['seconds_per_window_local']:.3f}"],
        ["the driver's part per 100k tokens", f"{result['driver_seconds_per_100k']:.1f}"],
    ])
    print(f"moved per 100k tokens: {result['bytes_back_per_100k'] / mib:,.0f} MiB of states back, "
          f"{result['bytes_out_per_100k'] / mib:,.1f} MiB of tokens out")
    rows = []
    for machines, row in result["expected_on_machines"].items():
        rows.append([machines] + [f"{cell['seconds']:.1f} s ({cell['speed_up']:.1f}x)" for cell in row.values()])
    print_table(["machines", "100k tokens, 1 Gbit/s", "10 Gbit/s"], rows)


if __name__ == "__main__":
    main()
