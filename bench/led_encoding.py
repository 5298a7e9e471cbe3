"""Where LED's encoder time and memory go, and unlimisum's blocked sliding attention against transformers'.

    python -m bench.led_encoding [--quick] [--tokens 32768] [--windows 16384,4096]

LED-base's shape (d=768, 6+6 layers, 12 heads, a 16,384-token window, sliding attention of 1,024
tokens, random weights: weights do not change cost) encodes the same N tokens with overlap 0.5
in windows of each size, one window per pass, each run in a fresh process so that its peak
resident memory (the process's maximum, model included) is its own. LED's encoder attends to
512 tokens on each side of a token (attention_window / 2) whatever the window, so shorter
windows change only which learned positions a token gets.
Each size runs twice: with transformers' own LEDEncoderSelfAttention and with unlimisum's
blocked computation of the same numbers (unlimisum/models/local_attention.py, what `summarize`
uses). Printed: seconds, input tokens/s, peak RSS, and the share of a window's encoding spent
in the self-attention (cProfile of the first window). Writes bench/results/led_encoding.json.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import subprocess
import sys
import time

import torch

from bench.common import VOCAB, print_table, write_result

LED_WINDOW = 16_384


def led_model():
    from transformers import LEDConfig, LEDForConditionalGeneration

    from unlimisum.models.compat import quiet_transformers

    quiet_transformers()
    torch.manual_seed(0)
    config = LEDConfig(vocab_size=VOCAB, d_model=768, encoder_layers=6, decoder_layers=6,
                       encoder_attention_heads=12, decoder_attention_heads=12, encoder_ffn_dim=3072,
                       decoder_ffn_dim=3072, max_encoder_position_embeddings=LED_WINDOW,
                       max_decoder_position_embeddings=1024, attention_window=1024)
    return LEDForConditionalGeneration(config).eval()


def measure_one(n_tokens: int, window: int, blocked: bool) -> dict:
    """Encode n_tokens in windows of ``window`` in this process: seconds, peak RSS, attention share."""
    import inspect
    from contextlib import nullcontext

    import resource

    from unlimisum.models.architectures import architecture_for
    from unlimisum.models.local_attention import BlockedLocalSelfAttention, blocked_local_attention
    from unlimisum.unlimiformer.encoding import encode_windows, plan_windows
    from transformers.models.led import modeling_led

    model = led_model()
    encoder = model.get_encoder()
    encoder_inputs = architecture_for(model.config).encoder_inputs  # global attention on each window's first token
    input_ids = torch.randint(4, VOCAB, (n_tokens,))
    plan = plan_windows(n_tokens, window, 0.5)
    def keep(states):
        pass

    attention_forward = BlockedLocalSelfAttention.forward if blocked else modeling_led.LEDEncoderSelfAttention.forward
    attention_line = inspect.getsourcelines(attention_forward)[1]
    attention_file = inspect.getsourcefile(attention_forward)
    with blocked_local_attention(encoder) if blocked else nullcontext():
        profiler = cProfile.Profile()
        profiler.enable()
        encode_windows(encoder, input_ids[:window], plan_windows(window, window, 0.5), keep, batch_size=1,
                       encoder_inputs=encoder_inputs)
        profiler.disable()
        started = time.perf_counter()
        encode_windows(encoder, input_ids, plan, keep, batch_size=1, encoder_inputs=encoder_inputs)
        seconds = time.perf_counter() - started
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (..., cumulative seconds, ...)
    attention = sum(entry[3] for (filename, line, _), entry in stats.items()
                    if filename == attention_file and line == attention_line)
    whole = sum(entry[3] for (_, _, name), entry in stats.items() if name == "encode_windows")
    return dict(window=window, attention="unlimisum blocked" if blocked else "transformers", windows=plan.n_windows,
                seconds=seconds, input_tokens_per_s=n_tokens / seconds,
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
                attention_share=attention / whole if whole else None)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4,096 tokens in windows of 4,096")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--windows", default=None)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child: one window size
    parser.add_argument("--blocked", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n_tokens = args.tokens or (4_096 if args.quick else 32_768)
    if args.one:
        print(json.dumps(measure_one(n_tokens, args.one, args.blocked)))
        return {}
    windows = [int(w) for w in args.windows.split(",")] if args.windows else (
        [4_096] if args.quick else [16_384, 4_096])
    rows = []
    for window in windows:
        for blocked in (False, True):
            command = [sys.executable, "-m", "bench.led_encoding", "--tokens", str(n_tokens), "--one", str(window)]
            child = subprocess.run(command + ["--blocked"] * blocked, capture_output=True, text=True, check=True)
            row = json.loads(child.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"  window {window:,}, {row['attention']}: {row['seconds']:.1f} s, "
                  f"{row['input_tokens_per_s']:.0f} tokens/s, peak RSS {row['peak_rss_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    for row in rows:
        own = next(r for r in rows if r["window"] == row["window"] and r["attention"] == "transformers")
        row["speedup_vs_transformers"] = own["seconds"] / row["seconds"]
        row["peak_rss_vs_transformers"] = row["peak_rss_bytes"] / own["peak_rss_bytes"]
    print_table(["encode window", "self-attention", "windows", "seconds", "input tokens/s", "peak RSS GiB",
                 "attention share", "speed", "peak RSS"],
                [[f"{r['window']:,}", r["attention"], r["windows"], f"{r['seconds']:.1f}",
                  f"{r['input_tokens_per_s']:.0f}", f"{r['peak_rss_bytes'] / 2**30:.2f}",
                  f"{r['attention_share']:.0%}" if r["attention_share"] is not None else "-",
                  f"{r['speedup_vs_transformers']:.2f}x", f"{r['peak_rss_vs_transformers']:.2f}x"] for r in rows])
    result = dict(model="LED-base shape (random weights)", n_tokens=n_tokens, overlap=0.5, runs=rows)
    print("wrote", write_result("led_encoding", result))
    return result


if __name__ == "__main__":
    main()
