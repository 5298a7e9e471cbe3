"""Against truncation: the same model and input, plain generate() on the first window vs unlimisum.

    python -m bench.truncation [--quick] [--tokens N] [--new-tokens M]

Each side runs in its own process (clean peak RSS). The baseline reads only the first
window (what `generate` does with `truncation=True`); unlimisum reads all N tokens.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from bench.common import print_table, write_result


def child(mode: str, n_tokens: int, new_tokens: int, size: str) -> dict:
    import torch

    from bench.common import random_model, random_text
    from unlimisum.config import GenerationOptions
    from unlimisum.summarizer import Summarizer

    loaded = random_model(size)
    text = random_text(n_tokens)
    generation = GenerationOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    started = time.perf_counter()
    if mode == "truncated":
        tokens = loaded.tokenizer(text, truncation=True, max_length=loaded.max_source_length, return_tensors="pt")
        with torch.inference_mode():
            loaded.model.generate(**tokens, **generation.to_generate_kwargs())
        read = tokens.input_ids.shape[1]
    else:
        read = Summarizer(loaded, generation=generation).summarize(text).stats.input_tokens
    return dict(mode=mode, n_tokens=n_tokens, tokens_read=read, seconds=time.perf_counter() - started,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8k tokens, 8 new tokens")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--size", default="bart-base")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n_tokens = args.tokens or (8_192 if args.quick else 32_768)
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    if args.child:
        print(json.dumps(child(args.child, n_tokens, new_tokens, args.size)))
        return {}
    runs = {}
    for mode in ("truncated", "unlimisum"):
        command = [sys.executable, "-m", "bench.truncation", "--child", mode, "--tokens", str(n_tokens),
                   "--new-tokens", str(new_tokens), "--size", args.size]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        runs[mode] = json.loads(output.strip().splitlines()[-1])
    base, ours = runs["truncated"], runs["unlimisum"]
    result = dict(size=args.size, n_tokens=n_tokens, new_tokens=new_tokens, runs=runs,
                  time_ratio=ours["seconds"] / base["seconds"],
                  memory_ratio=ours["peak_rss_bytes"] / base["peak_rss_bytes"])
    print(f"against truncation: {args.size} (random weights), {n_tokens:,}-token input, {new_tokens} new tokens")
    print_table(
        ["", "tokens read", "seconds", "peak RSS MiB"],
        [[mode, f"{r['tokens_read']:,}", f"{r['seconds']:.1f}", f"{r['peak_rss_bytes'] / 2**20:,.0f}"]
         for mode, r in runs.items()],
    )
    print(f"unlimisum / truncated: time {result['time_ratio']:.1f}x, peak memory {result['memory_ratio']:.2f}x, "
          f"input read {ours['tokens_read'] / base['tokens_read']:.0f}x")
    print("wrote", write_result("truncation", result))
    return result


if __name__ == "__main__":
    main()
