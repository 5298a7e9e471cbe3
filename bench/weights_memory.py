"""Peak memory of 16-bit weights against 32-bit ones, stage by stage, and what the packed copies cost and give.

    python -m bench.weights_memory [--quick] [--tokens 16384,100000] [--encode-limit 16384] [--new-tokens 8]

A bart-base-sized model with random weights is saved once as a float32 safetensors checkpoint (as most
checkpoints on the hub are) and loaded from it the way the CLI loads a folder (``load_model``). Each row
runs in its own process (its peak RSS is that run's, sampled every 5 ms per stage, and the kernel's own
maximum): up to ``--encode-limit`` tokens the whole pipeline (tokenize, encode, index, generate), above it
a store of synthetic states of the same shape (the encoder holds one batch of windows at a time).

- ``float32``: ``--dtype float32``, with the retrieval kernel the ``after`` row chose forced (calibrations on
  a shared machine can differ between processes, and the packed copies would count in one row only);
- ``bf16, before``: ``--dtype bfloat16`` as the previous release ran it on a CPU with bf16 units: the
  checkpoint memory-mapped and converted by transformers, the packed kernel (which its calibration chose
  there, at 1.25x the native scores) forced;
- ``bf16, after``: this release: the checkpoint read one tensor at a time (unlimisum/models/weights.py), the
  kernel chosen by the calibration with memory in the rule (unlimisum/search/kernels.py).

The ``after`` rows also time, in the same process and in turns on their own store, one layer's exact
retrieval (12 queries, k=1,024) with the packed copies and with the best unpacked kernel: the speed the
copies would buy. Writes bench/results/weights_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import print_table, write_result

MODES = ("float32", "bf16, before", "bf16, after")


class StageSampler:
    """The largest resident set seen in each stage (named by the progress events), sampled every 5 ms."""

    def __init__(self):
        import psutil

        self._process = psutil.Process()
        self.stage = "start"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            rss = self._process.memory_info().rss
            self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
            time.sleep(0.005)

    def enter(self, stage: str) -> None:
        rss = self._process.memory_info().rss
        self.peaks[self.stage] = max(self.peaks.get(self.stage, 0), rss)
        self.stage = stage

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def child(mode: str, folder: str, n_tokens: int, encode: bool, new_tokens: int) -> dict:
    import torch

    sampler = StageSampler()
    if mode == "bf16, before":
        os.environ["UNLIMISUM_SCORE_KERNEL"] = "packed"
    elif mode == "bf16, after":
        os.environ.pop("UNLIMISUM_SCORE_KERNEL", None)
    from bench.common import random_text
    from bench.index_choice import synthetic_states, synthetic_store
    from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig
    from unlimisum.models import load_model, weights
    from unlimisum.summarizer import Summarizer
    from unlimisum.search import kernels

    if mode == "bf16, before":
        weights.load_converted = lambda *args, **kwargs: None  # transformers' own memory-mapped conversion
    sampler.enter("load")
    loaded = load_model(ModelConfig(name=folder, device="cpu", dtype="float32" if mode == "float32" else "bfloat16"))
    sampler.enter("loaded")
    d = loaded.model.config.d_model
    summarizer = Summarizer(loaded, generation=GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
                            progress=lambda event: sampler.enter(event.stage))
    started = time.perf_counter()
    with torch.inference_mode():
        if encode:
            summary = summarizer.summarize(random_text(n_tokens))
            store = None
            store_bytes, packed_bytes = summary.stats.datastore_bytes, summary.stats.packed_bytes
        else:
            sampler.enter("index")
            store = synthetic_store(n_tokens, d, IndexConfig(kind="exact"), chunk=16_384)
            summarizer.generate([store])
            store_bytes, packed_bytes = store.nbytes, store.packed_nbytes
    seconds = time.perf_counter() - started
    sampler.enter("done")
    peaks = sampler.stop()
    choice = kernels.kernel_for(torch.device("cpu"), torch.bfloat16, d)
    row = dict(mode=mode, n_tokens=n_tokens, encoded=encode, seconds=seconds, kernel=choice.scores,
               kernel_reason=choice.reason, datastore_bytes=store_bytes, packed_bytes=packed_bytes,
               peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, stage_peaks=peaks,
               model_dtype=str(loaded.dtype).removeprefix("torch."))
    if mode == "bf16, after":
        states = store.states() if store is not None else synthetic_states(n_tokens, d).bfloat16()
        row["packed_speedup"] = packed_speedup(states, choice)
    return row


def packed_speedup(states, choice) -> dict:
    """Seconds of one layer's exact retrieval (12 queries, k=1,024) with packed copies of ``states`` and with the
    best unpacked kernel, in turns in this process; the copies are made here and freed after."""
    import torch

    from unlimisum.search import kernels, packed

    if not packed.available():
        return {}
    copies = packed.PackedStates(states)
    queries = torch.randn(12, states.shape[1])
    packed_choice = kernels.KernelChoice("packed", choice.block_rows, choice.tokens_major, choice.gather_row_cost,
                                         choice.dense_row_cost, dense_block_rows=choice.dense_block_rows,
                                         fallback=choice.fallback)
    unpacked = packed_choice.unpacked()
    times = kernels._race({"packed": lambda: kernels.attend(states, queries, 1024, packed_choice, packed=copies),
                           unpacked.scores: lambda: kernels.attend(states, queries, 1024, unpacked)},
                          torch.device("cpu"), repeats=5)
    return dict(times, ratio=times[unpacked.scores] / times["packed"])


def save_checkpoint(folder: Path) -> None:
    from bench.common import random_model, save_model

    loaded = random_model("bart-base")
    save_model(loaded.model, loaded.tokenizer, folder)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16k tokens only")
    parser.add_argument("--tokens", default=None)
    parser.add_argument("--encode-limit", type=int, default=16_384)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--save", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--n", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--encode", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.save:
        save_checkpoint(Path(args.save))
        return {}
    if args.child:
        print(json.dumps(child(args.child, args.folder, args.n, args.encode, args.new_tokens)))
        return {}
    n_values = [int(n) for n in args.tokens.split(",")] if args.tokens else ([16_384] if args.quick else
                                                                               [16_384, 100_000])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "bart-base-fp32"
        # in a process of its own: a child's peak RSS starts at its parent's (fork), so the parent stays small
        subprocess.run([sys.executable, "-m", "bench.weights_memory", "--save", str(folder)], check=True)
        for n in n_values:
            kernel = None
            for mode in ("bf16, after", "float32", "bf16, before"):
                command = [sys.executable, "-m", "bench.weights_memory", "--child", mode, "--folder", str(folder),
                           "--n", str(n), "--new-tokens", str(args.new_tokens)]
                if n <= args.encode_limit:
                    command.append("--encode")
                env = dict(os.environ, HF_HUB_OFFLINE="1")
                if mode == "float32":  # the kernel the bf16 run chose: the rows differ in the weights' dtype alone
                    env["UNLIMISUM_SCORE_KERNEL"] = kernel
                done = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
                rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
                kernel = kernel or rows[-1]["kernel"]
                print(f"  N={n:,} {mode}: peak RSS {rows[-1]['peak_rss_bytes'] / 2**20:,.0f} MiB", flush=True)
    mib = 2**20
    stages = ("load", "encode", "prepare", "generate")
    print(f"peak RSS by stage, random bart-base from a float32 checkpoint, {args.new_tokens} new tokens (MiB)")
    rows.sort(key=lambda r: (r["n_tokens"], MODES.index(r["mode"])))
    print_table(["N", "run", "kernel", *stages, "peak", "vs float32", "store", "packed copies"],
                [[f"{r['n_tokens']:,}", r["mode"], r["kernel"],
                  *(f"{r['stage_peaks'].get(s, 0) / mib:,.0f}" if s in r["stage_peaks"] else "-" for s in stages),
                  f"{r['peak_rss_bytes'] / mib:,.0f}",
                  f"{r['peak_rss_bytes'] / next(b['peak_rss_bytes'] for b in rows if b['n_tokens'] == r['n_tokens'] and b['mode'] == 'float32'):.2f}x",
                  f"{r['datastore_bytes'] / mib:,.0f}", f"{r['packed_bytes'] / mib:,.0f}"] for r in rows])
    for r in rows:
        if r.get("packed_speedup"):
            s = r["packed_speedup"]
            print(f"N={r['n_tokens']:,}: one layer's retrieval, packed {s['packed'] * 1e3:.1f} ms against "
                  f"{ {k: round(v * 1e3, 1) for k, v in s.items() if k not in ('packed', 'ratio')} } ms unpacked: "
                  f"{s['ratio']:.2f}x")
    result = dict(n_values=n_values, new_tokens=args.new_tokens, runs=rows)
    print("wrote", write_result("weights_memory", result))
    return result


if __name__ == "__main__":
    main()
