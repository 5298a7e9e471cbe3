"""A decoder-only prompt within the model's positions, end to end: `unlimisum summarize` against the plain model.

    python -m bench.decoder_prompt [--quick] [--tokens 16384] [--new-tokens 64] [--layers 24] [--turns 2]
                                   [--before REV] [--window W] [--json decoder_prompt]

A Qwen2.5-0.5B-shaped model (24 layers, hidden 896, 14 query heads on 2 key-value heads, vocabulary 151,936,
32,768 positions, tied embeddings) with random weights saved in bfloat16 as the hub's checkpoint is, and a
tokenizer of one token per word (bench/common.py; in a folder of its own, passed with --tokenizer: beside a
qwen2 config.json transformers would load Qwen2's tokenizer class over it), so that a prompt of random words is
exactly N tokens.
For each N, in turns (plain, then --before's unlimisum where given, then this tree's), each in a fresh process:

- **unlimisum**: `unlimisum summarize prompt.txt -m MODEL --tokenizer WORDS --json --min-new-tokens T
  --max-new-tokens T`, the
  default path (no --window: a prompt that fits is read exactly; --dtype auto), its stages from the JSON; with
  --window W, a window of W tokens and the far tokens retrieved, as a prompt beyond the positions is read;
- **plain**: the model loaded with AutoModelForCausalLM in the dtype unlimisum chose, its own `generate()` (SDPA
  attention) on the same prompt ids, T greedy tokens.

Both are whole-process wall times (loading included); the ratio is unlimisum's over the plain model's, in the same
turn. The prompt's reading is set against the plain model's too: unlimisum's `prefill` timing (all the prompt but
its last token) against the plain generate()'s time to its first stopping check (the prompt's forward and the
first token): the prefill's rate as a share of the plain forward's. Prints the table and writes
bench/results/<json>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, random_text, word_tokenizer, worktree, write_result

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench" / ".cache" / "decoder_prompt"
VOCAB = 151_936
QWEN_05B = dict(vocab_size=VOCAB, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                num_key_value_heads=2, max_position_embeddings=32_768, tie_word_embeddings=True,
                rope_theta=1_000_000.0)

PLAIN = r'''
import sys, time, json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
started = time.perf_counter()
folder, prompt_file, new_tokens, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
ids = torch.tensor(json.load(open(prompt_file))).unsqueeze(0)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype), attn_implementation="sdpa").eval()
loaded = time.perf_counter()
first = []  # when generate() first asks whether to stop: after the prompt's forward and the first token's
def note(input_ids, scores, **kwargs):
    first.append(time.perf_counter())
    return torch.zeros(input_ids.shape[0], dtype=torch.bool)
with torch.inference_mode():
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                   do_sample=False, num_beams=1, stopping_criteria=[note])
print(json.dumps({"load": loaded - started, "generate": time.perf_counter() - loaded, "prefill": first[0] - loaded}))
'''


TOKENIZER = CACHE / "word-tokenizer"


def tokenizer_folder() -> Path:
    """The word tokenizer of VOCAB tokens, saved (made once)."""
    if not (TOKENIZER / "tokenizer.json").exists():
        word_tokenizer(VOCAB, max_length=QWEN_05B["max_position_embeddings"]).save_pretrained(TOKENIZER)
    return TOKENIZER


def model_folder(layers: int) -> Path:
    """The saved random model of ``layers`` layers (made once)."""
    folder = CACHE / f"qwen2.5-0.5b-{layers}-layers"
    if (folder / "model.safetensors").exists():
        return folder
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = word_tokenizer(VOCAB, max_length=QWEN_05B["max_position_embeddings"])
    config = AutoConfig.for_model("qwen2", num_hidden_layers=layers, bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                  **QWEN_05B)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder


def prompt_files(n_tokens: int) -> tuple[Path, Path]:
    """(the text, the prompt ids unlimisum builds from it as JSON) for a prompt of about ``n_tokens``."""
    from transformers import AutoTokenizer

    from unlimisum.config import PromptConfig
    from unlimisum.decoder_only.prompting import build_prompt

    text_file = CACHE / f"prompt-{n_tokens}.txt"
    text = random_text(n_tokens, vocab_size=VOCAB)
    text_file.write_text(text, encoding="utf-8")
    prompt = build_prompt(AutoTokenizer.from_pretrained(tokenizer_folder()), text, PromptConfig(), str(text_file))
    ids_file = CACHE / f"prompt-{n_tokens}.json"
    ids_file.write_text(json.dumps(prompt.ids.tolist()))
    return text_file, ids_file


def environment(code: Path) -> dict:
    import os

    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(code))


def run_unlimisum(folder: Path, text_file: Path, new_tokens: int, code: Path, window: int | None) -> dict:
    command = [sys.executable, "-m", "unlimisum", "summarize", str(text_file), "-m", str(folder), "--tokenizer",
               str(tokenizer_folder()), "--json", "--max-new-tokens", str(new_tokens), "--min-new-tokens",
               str(new_tokens), *(["--window", str(window)] if window else [])]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environment(code), cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"unlimisum failed ({done.returncode}): {done.stderr[-2000:]}")
    stats = json.loads(done.stdout.splitlines()[0])["stats"]
    return dict(wall=wall, timings={name: round(seconds, 3) for name, seconds in stats["timings"].items()},
                window=stats["window"], windows=stats["windows"], tokens=stats["input_tokens"],
                dtype=stats["model_dtype"], generated=stats["generated_tokens"])


def run_plain(folder: Path, ids_file: Path, new_tokens: int, dtype: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PLAIN, str(folder), str(ids_file), str(new_tokens), dtype],
                          capture_output=True, text=True, env=environment(ROOT), cwd=tempfile.gettempdir())
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the plain model failed: {done.stderr[-2000:]}")
    return dict(wall=wall, **json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 4,096-token prompt, one turn (about a minute)")
    parser.add_argument("--tokens", default="16384", help="comma-separated prompt lengths (within 32,768)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--layers", type=int, default=24, help="layers of the model (24: Qwen2.5-0.5B's)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--before", default=None, help="a git revision whose unlimisum runs beside this tree's")
    parser.add_argument("--window", type=int, default=None, help="unlimisum's --window (default: none given)")
    parser.add_argument("--json", default="decoder_prompt", help="the name of the result file in bench/results")
    args = parser.parse_args(argv)
    if args.quick:  # its own file: the full run's figures stay
        args.tokens, args.turns = "4096", 1
        args.json = args.json if args.json != "decoder_prompt" else "decoder_prompt_quick"
    CACHE.mkdir(parents=True, exist_ok=True)
    folder = model_folder(args.layers)
    before = worktree(args.before, CACHE) if args.before else None
    rows, records = [], []
    for n_tokens in [int(part) for part in args.tokens.split(",")]:
        text_file, ids_file = prompt_files(n_tokens)
        for turn in range(1, args.turns + 1):
            ours = run_unlimisum(folder, text_file, args.new_tokens, ROOT, args.window)
            plain = run_plain(folder, ids_file, args.new_tokens, ours["dtype"])
            earlier = run_unlimisum(folder, text_file, args.new_tokens, before, args.window) if before else None
            record = dict(tokens=ours["tokens"], turn=turn, unlimisum=ours, plain=plain, before=earlier,
                          ratio=ours["wall"] / plain["wall"])
            if "prefill" in ours["timings"] and plain.get("prefill"):  # the prompt read, at the plain forward's rate
                record["prefill_rate"] = plain["prefill"] / ours["timings"]["prefill"]
            records.append(record)
            rows.append([turn, f"{ours['tokens']:,}", ours["dtype"], f"{ours['window']:,}", f"{ours['wall']:.1f}",
                         f"{ours['timings'].get('prefill', 0):.1f}", f"{ours['timings'].get('generate', 0):.1f}",
                         f"{plain['wall']:.1f}", f"{plain.get('prefill', 0):.1f}", f"{record['ratio']:.2f}",
                         f"{record['prefill_rate']:.2f}" if "prefill_rate" in record else "-",
                         f"{earlier['wall']:.1f}" if earlier else "-"])
            print(f"  turn {turn}, {ours['tokens']:,} tokens: unlimisum {ours['wall']:.1f} s, plain "
                  f"{plain['wall']:.1f} s", flush=True)
    print_table(["turn", "prompt", "dtype", "window", "unlimisum s", "prefill s", "generate s", "plain s",
                 "plain prefill s", "x plain", "prefill x plain rate", f"{args.before or 'before'} s"], rows)
    ratios = [record["ratio"] for record in records]
    print(f"unlimisum / plain: median {statistics.median(ratios):.2f}, {min(ratios):.2f}-{max(ratios):.2f}")
    path = write_result(args.json, dict(new_tokens=args.new_tokens, layers=args.layers, before=args.before,
                                        window=args.window, runs=records))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
