"""Decoder-only retrieval with learned weights: a tiny trained Llama finds a needle in prompts 50-200 windows long.

The model in tests/fixtures/needle_decoder (trained by bench/train_decoder_needle.py) has 256
positions and a 64-token local window by default; it was trained on prompts of at most 200
tokens: filler words with one span ``<needle> 4 9 1 7 </needle>`` somewhere, then ``<ask>``; its
answer is the span. Here the span is placed near the start, in the middle and at the end of prompts
50x and 200x the window (3,200 and 12,800 tokens, far beyond its positions: the retrieved tokens
sit at a fixed distance of one window). unlimisum must copy it out exactly; the model reading only
the last window of the prompt must fail whenever the span is before that window; and retrieval that
leaves the far tokens at their true distances (which the model never saw) must fail, so these tests
can fail.

Measured with bench/needle_decoder_eval.py: BENCHMARKS.md ("Needle in a long prompt: decoder-only").
Retrieval is sharp for this model: k = 1 per key-value head finds the span as well as k = 64, since
each answer token needs exactly one retrieved token (the one after the token just written).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, PromptConfig, RetrievalConfig
from unlimisum.decoder_only import reading
from unlimisum.decoder_only.prompting import build_prompt
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "needle_decoder"
GENERATION = GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False)
PROMPT = PromptConfig(template="{text} <ask>")
INDEX = IndexConfig(device="cpu")
DIGITS = [str(d) for d in range(10)]
WINDOW = 64


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model(ModelConfig(name=str(FIXTURE), device="cpu"))


@pytest.fixture(scope="module")
def filler(loaded):
    """The fixture's filler words: every word of its vocabulary but specials, markers and digits."""
    return sorted(word for word in loaded.tokenizer.get_vocab() if word.isalpha())


def make_input(filler, n_tokens: int, position: float, seed: int) -> tuple[str, str, int]:
    """(text whose prompt is ``n_tokens`` tokens, the needle's content, the prompt position of ``<needle>``)."""
    rng = random.Random(seed)
    content = rng.sample(DIGITS, rng.choice((4, 5, 6)))
    span = ["<needle>", *content, "</needle>"]
    n_words = n_tokens - 2  # the prompt adds <s> and <ask>
    at = round(position * (n_words - len(span)))
    words = [rng.choice(filler) for _ in range(n_words - len(span))]
    words[at:at] = span
    return " ".join(words), " ".join(content), at + 1


def unlimisum(loaded, text: str, k: int | None = None) -> str:
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=k), index=INDEX,
                            prompt=PROMPT)
    return summarizer.summarize(text).text


def last_window(loaded, text: str) -> str:
    """The model's own generate() on the prompt's last window: <s>, the text's last words, <ask>."""
    words = text.split()[-(WINDOW - 2):]
    ids = loaded.tokenizer(" ".join(words) + " <ask>", return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**ids, **GENERATION.to_generate_kwargs())
    return loaded.tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def test_fixture_is_tiny_and_reads_a_64_token_window(loaded):
    assert loaded.is_decoder_only and loaded.max_source_length == 256
    assert sum(path.stat().st_size for path in FIXTURE.iterdir()) < 2_000_000
    summary = Summarizer(loaded, generation=GENERATION, prompt=PROMPT).summarize(make_input(
        [w for w in loaded.tokenizer.get_vocab() if w.isalpha()], 600, 0.5, 0)[0])
    assert summary.stats.window == WINDOW and summary.stats.retrieval_k == WINDOW
    assert summary.stats.positions == f"fixed distance {WINDOW}"


@pytest.mark.parametrize("position", [0.0, 0.5, 1.0])
def test_within_the_models_positions_both_find_the_needle(loaded, filler, position):
    for seed in range(2):
        text, content, _ = make_input(filler, 60, position, seed)
        assert last_window(loaded, text) == content
        assert unlimisum(loaded, text) == content


LONG_CASES = [(windows, position) for windows in (50, 200) for position in (0.02, 0.5, 0.98)]


def long_input(filler, windows: int, position: float, trial: int = 0):
    return make_input(filler, windows * WINDOW, position, seed=windows * 1000 + round(position * 100) * 10 + trial)


def test_unlimisum_finds_the_needle_anywhere_in_long_prompts(loaded, filler):
    misses = []
    for windows, position in LONG_CASES:
        text, content, offset = long_input(filler, windows, position)
        got = unlimisum(loaded, text)
        if got != content:
            misses.append(f"{windows}x, token {offset}: expected {content!r}, got {got!r}")
    assert len(misses) <= 1, misses


def test_the_last_window_alone_does_not_find_it(loaded, filler):
    for windows, position in LONG_CASES:
        text, content, offset = long_input(filler, windows, position)
        assert offset < windows * WINDOW - WINDOW
        assert last_window(loaded, text) != content


def test_at_their_true_distances_the_far_tokens_are_not_found(loaded, filler):
    """The same reading with true positions: the retrieved span sits thousands of positions back, farther than
    the model ever looked, and it is not copied. The fixed distance is what makes the retrieval work."""
    import dataclasses

    summarizer = Summarizer(loaded, generation=GENERATION, index=INDEX, prompt=PROMPT).family
    for windows, position in LONG_CASES[:3]:
        text, content, _ = long_input(filler, windows, position)
        prompt = build_prompt(loaded.tokenizer, text, PROMPT)
        plan = dataclasses.replace(summarizer.plan(prompt), fixed_distance=None)
        with torch.inference_mode(), reading.session(loaded.model, loaded.architecture, plan) as cache:
            reading.prefill(loaded.model, cache, prompt.ids[:-1])
            cache.finish_prefill()
            out = reading.generate(loaded.model, cache, prompt.ids, **GENERATION.to_generate_kwargs())
        assert loaded.tokenizer.decode(out[0, prompt.n_tokens:], skip_special_tokens=True).strip() != content


def test_one_retrieved_token_per_kv_head_is_enough_for_this_model(loaded, filler):
    text, content, _ = long_input(filler, 200, 0.5)
    assert unlimisum(loaded, text, k=1) == content
