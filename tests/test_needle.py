"""Retrieval with learned weights: a tiny trained BART finds a needle in inputs 50-200 windows long.

The model in tests/fixtures/needle (trained by bench/train_needle.py) has a 64-token
window; its encoder only ever saw single windows: filler words with one span
``<needle> 4 9 1 7 </needle>`` somewhere in them, target ``4 9 1 7``. In the last 40% of
training its decoder read the encoder states of 8 windows at once (its own, and 7 others'
with their needles masked out): trained on single windows alone it copies the span within
a window but finds none at 50x. Here the span is
placed near the start, in the middle and at the end of inputs 50x and 200x the window
(3,200 and 12,800 tokens). unlimisum must copy it out exactly; the unmodified model
reading the first window (the truncated baseline) must fail whenever the span is beyond
that window; and a crippled retrieval (top-k 1) must fail, so these tests can fail.

Measured with bench/needle_eval.py (20 trials per position x length cell, 7 positions):
- within one window: unlimisum and truncated 100%;
- 50x-200x, top-k 16: 90-100% per cell, 97% over all (70 trials at 200x);
- 50x-200x, default top-k (64, the window): 50-95% per cell away from the start, 67% at 200x;
  more retrieved tokens hurt this model (top-k 128: 33%), whose cross-attention is not
  peaked enough to ignore the strongest of thousands of filler states;
- needle in the first window: 100% for every system and length;
- truncated beyond the first window: 0%; top-k 1 or 2: 0%.
The thresholds below leave a margin under those figures; the cases are fixed (seeded), so
a run passes or fails the same way every time.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "needle"
GENERATION = GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False)
INDEX = IndexConfig(kind="exact", device="cpu")
DIGITS = [str(d) for d in range(10)]


@pytest.fixture(scope="module")
def loaded():
    torch.set_num_threads(1)
    return load_model(ModelConfig(name=str(FIXTURE), device="cpu"))


@pytest.fixture(scope="module")
def filler(loaded):
    """The fixture's filler words: every word of its vocabulary but specials, markers and digits."""
    vocab = loaded.tokenizer.get_vocab()
    return sorted(word for word in vocab if word.isalpha())


def make_input(filler, n_tokens: int, position: float, seed: int) -> tuple[str, str, int]:
    """(text of ``n_tokens`` tokens, the needle's content, the token offset of ``<needle>``)."""
    rng = random.Random(seed)
    content = rng.sample(DIGITS, rng.choice((4, 5, 6)))
    span = ["<needle>", *content, "</needle>"]
    n_words = n_tokens - 2  # the tokenizer adds <s> and </s>
    at = round(position * (n_words - len(span)))
    words = [rng.choice(filler) for _ in range(n_words - len(span))]
    words[at:at] = span
    return " ".join(words), " ".join(content), at + 1


def unlimisum(loaded, text: str, top_k: int | None = None) -> str:
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=top_k), index=INDEX)
    return summarizer.summarize(text).text


def truncated(loaded, text: str) -> str:
    tokens = loaded.tokenizer(text, truncation=True, max_length=loaded.max_source_length, return_tensors="pt")
    with torch.inference_mode():
        out = loaded.model.generate(**tokens, **GENERATION.to_generate_kwargs())
    return loaded.tokenizer.decode(out[0], skip_special_tokens=True).strip()


def test_fixture_is_tiny_and_has_a_64_token_window(loaded):
    assert loaded.max_source_length == 64
    assert sum(path.stat().st_size for path in FIXTURE.iterdir()) < 2_000_000
    assert (FIXTURE / "model.safetensors").is_file()


@pytest.mark.parametrize("position", [0.0, 0.3, 0.6, 1.0])
def test_within_one_window_both_find_the_needle(loaded, filler, position):
    for seed in range(3):
        text, content, _ = make_input(filler, 64, position, seed)
        assert truncated(loaded, text) == content
        assert unlimisum(loaded, text) == content


LONG_CASES = [(windows, position) for windows in (50, 200) for position in (0.02, 0.25, 0.5, 0.75, 0.98, 1.0)]


def long_input(filler, windows: int, position: float, trial: int = 0):
    return make_input(filler, windows * 64, position, seed=windows * 1000 + round(position * 100) * 10 + trial)


@pytest.mark.parametrize("windows", [50, 200])
def test_needle_in_the_first_window_of_a_long_input_is_found_by_both(loaded, filler, windows):
    text, content, offset = long_input(filler, windows, 0.0)
    assert offset < 64
    assert truncated(loaded, text) == content
    summary = Summarizer(loaded, generation=GENERATION, index=INDEX).summarize(text)
    assert summary.stats.input_tokens == windows * 64 and summary.stats.retrieval_k == 64
    assert summary.text == content


def test_unlimisum_top_k_16_finds_the_needle_anywhere_in_long_inputs(loaded, filler):
    """24 needles beyond the first window of 50x and 200x inputs; measured 97%, asserted >= 21/24."""
    misses = []
    for windows, position in LONG_CASES:
        for trial in range(2):
            text, content, offset = long_input(filler, windows, position, trial)
            got = unlimisum(loaded, text, top_k=16)
            if got != content:
                misses.append(f"{windows}x, token {offset}: expected {content!r}, got {got!r}")
    assert len(misses) <= 3, misses


def test_unlimisum_default_top_k_finds_most_needles_in_long_inputs(loaded, filler):
    """The default top-k (64): measured 67% at 200x, 72% at 50x away from the start; asserted >= 6/12."""
    hits = sum(unlimisum(loaded, text) == content
               for text, content, _ in (long_input(filler, w, p) for w, p in LONG_CASES))
    assert hits >= 6


def test_truncated_baseline_fails_beyond_the_first_window(loaded, filler):
    for windows, position in LONG_CASES:
        text, content, offset = long_input(filler, windows, position)
        assert offset > 64
        assert truncated(loaded, text) != content


def test_crippled_retrieval_fails(loaded, filler):
    """With one retrieved token per head the span cannot be copied: the tests above have teeth."""
    for windows, position in LONG_CASES[:6]:
        text, content, _ = long_input(filler, windows, position)
        assert unlimisum(loaded, text, top_k=1) != content
