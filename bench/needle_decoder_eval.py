"""Decoder-only needle accuracy by position x prompt length: unlimisum vs the last window, with learned weights.

    nice -n 10 python -m bench.needle_decoder_eval [--quick] [--trials 4] [--lengths 1,50,100,200]

The model is the tiny Llama of bench/train_decoder_needle.py (256 positions, trained on prompts of
at most 200 tokens; unlimisum's default local window is 64 tokens). Each prompt is filler words
with one span ``<needle> d d d d </needle>`` at a relative position of the text, then ``<ask>``;
its length is given in windows (1 = 64 tokens, within the model's positions; 200 = 12,800 tokens).
A trial is a hit when the summary equals the span's digits exactly. Greedy, 10 new tokens at most.

- unlimisum: the Summarizer with the default k (the window, 64) and with k = 1 per KV head;
- last window: the unmodified model on the prompt's last 64 tokens;
- true positions (ablation, at the longest length): unlimisum's reading with the far tokens left at
  their true distances instead of one window before the query.

Writes bench/results/needle_decoder.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import torch

from bench.common import print_table, write_result
from bench.train_decoder_needle import ASK, FIXTURE, PROMPT_TEMPLATE
from bench.train_needle import CLOSE, CONTENT_LENGTHS, DIGITS, FILLER, OPEN
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, PromptConfig, RetrievalConfig
from unlimisum.decoder_only import reading
from unlimisum.decoder_only.prompting import build_prompt
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

POSITIONS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
GENERATION = GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False)
PROMPT = PromptConfig(template=PROMPT_TEMPLATE)
WINDOW = 64


def case(n_tokens: int, position: float, rng: random.Random) -> tuple[str, str]:
    """(text of a prompt of ``n_tokens`` tokens with the span at ``position``, its digits)."""
    content = rng.sample(DIGITS, rng.choice(CONTENT_LENGTHS))
    span = [OPEN, *content, CLOSE]
    words = [rng.choice(FILLER) for _ in range(n_tokens - 2 - len(span))]
    at = round(position * len(words))
    words[at:at] = span
    return " ".join(words), " ".join(content)


def last_window(loaded, text: str) -> str:
    ids = loaded.tokenizer(" ".join(text.split()[-(WINDOW - 2):]) + f" {ASK}", return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**ids, **GENERATION.to_generate_kwargs())
    return loaded.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def true_positions(loaded, text: str) -> str:
    summarizer = Summarizer(loaded, generation=GENERATION, prompt=PROMPT, index=IndexConfig(device="cpu"))
    prompt = build_prompt(loaded.tokenizer, text, PROMPT)
    plan = dataclasses.replace(summarizer.family.plan(prompt), fixed_distance=None)
    with torch.inference_mode(), reading.session(loaded.model, loaded.architecture, plan) as cache:
        reading.prefill(loaded.model, cache, prompt.ids[:-1])
        cache.finish_prefill()
        out = reading.generate(loaded.model, cache, prompt.ids, **GENERATION.to_generate_kwargs())
    return loaded.tokenizer.decode(out[0, prompt.n_tokens:], skip_special_tokens=True).strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 trials, lengths 1 and 50")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--lengths", default="1,50,100,200")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    trials, lengths = (2, [1, 50]) if args.quick else (args.trials, [int(n) for n in args.lengths.split(",")])
    loaded = load_model(ModelConfig(name=str(FIXTURE), device="cpu"))
    systems = {
        "unlimisum k=64": lambda text: Summarizer(loaded, generation=GENERATION, prompt=PROMPT).summarize(text).text,
        "unlimisum k=1": lambda text: Summarizer(loaded, generation=GENERATION, prompt=PROMPT,
                                                 retrieval=RetrievalConfig(retrieval_k=1)).summarize(text).text,
        "last window": lambda text: last_window(loaded, text),
    }
    hits = {name: {n: {p: 0 for p in POSITIONS} for n in lengths} for name in systems}
    ablation = {p: 0 for p in POSITIONS}
    for n in lengths:
        for position in POSITIONS:
            rng = random.Random(n * 1000 + round(position * 100))
            for _ in range(trials):
                text, content = case(max(n * WINDOW, 16), position, rng)
                for name, system in systems.items():
                    hits[name][n][position] += system(text) == content
                if n == lengths[-1] and n > 1:
                    ablation[position] += true_positions(loaded, text) == content
    for name in systems:
        print(f"\n{name}: exact matches of {trials} per cell")
        print_table(["position"] + [f"{n}x ({n * WINDOW:,} tok)" for n in lengths],
                    [[f"{p:.2f}"] + [hits[name][n][p] for n in lengths] for p in POSITIONS])
    print(f"\ntrue positions at {lengths[-1]}x: {sum(ablation.values())}/{trials * len(POSITIONS)}")
    result = dict(window=WINDOW, trials=trials, lengths=lengths, positions=list(POSITIONS),
                  hits={name: {str(n): {str(p): v for p, v in cells.items()} for n, cells in by_n.items()}
                        for name, by_n in hits.items()},
                  true_positions_at_longest={str(p): v for p, v in ablation.items()})
    print(f"wrote {write_result('needle_decoder', result)}")


if __name__ == "__main__":
    main()
