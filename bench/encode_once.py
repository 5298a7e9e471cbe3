"""Encode a book once: --per-chapter against a plain run, and a warm cache of encoded books against a cold one.

    python -m bench.encode_once [--quick]

1. The needle model (tests/fixtures/needle, 64-token window) on an 8-chapter book of filler
   words with one needle: wall time of summarize() plain and with per_chapter=True.
2. The same at bart-base size (random weights, 1,024-token window) on an 8-chapter book of
   16,384 tokens (4,096 with --quick).
3. Time to the first generated token at bart-base size, 16,384 tokens: cold (tokenize, encode,
   build the store, write the cache entry) against warm (the entry read, memory-mapped).

Prints a table and writes bench/results/encode_once.json.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.common import print_table, random_model, random_text, write_result
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.document import Chapter, Document
from unlimisum.summarizer import Summarizer
from unlimisum.unlimiformer.cache import EncodedCache

NEEDLE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "needle"
CHAPTERS = 8


def needle_book(loaded, words: int, seed: int = 0) -> Document:
    """8 chapters of the needle model's filler words, a needle in chapter 6."""
    rng = random.Random(seed)
    filler = sorted(word for word in loaded.tokenizer.get_vocab() if word.isalpha())
    chapters = []
    for number in range(CHAPTERS):
        text = [rng.choice(filler) for _ in range(words // CHAPTERS)]
        if number == 5:
            text[len(text) // 2:len(text) // 2] = ["<needle>", "4", "9", "1", "7", "</needle>"]
        chapters.append(Chapter(f"Part {number + 1}", " ".join(text)))
    return Document(title="Haystack", chapters=tuple(chapters))


def random_book(tokens: int) -> Document:
    """8 chapters of random words (one token per word with bench.common's tokenizer)."""
    return Document(title="Random", chapters=tuple(
        Chapter(f"Part {number + 1}", random_text(tokens // CHAPTERS, seed=number)) for number in range(CHAPTERS)
    ))


def timed(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def per_chapter_row(name: str, summarizer: Summarizer, document: Document) -> dict:
    summarizer.summarize(Document.from_text(document.chapters[0].text[:2000]))  # warm up (calibration)
    plain = timed(lambda: summarizer.summarize(document))
    chaptered = timed(lambda: summarizer.summarize(document, per_chapter=True))
    print(f"  {name}: plain {plain:.1f} s, per-chapter {chaptered:.1f} s = {chaptered / plain:.2f}x", flush=True)
    return dict(case=name, plain_seconds=plain, per_chapter_seconds=chaptered, ratio=chaptered / plain)


def cache_row(loaded, tokens: int) -> dict:
    document = random_book(tokens)
    one_token = GenerationOptions(max_new_tokens=1, min_new_tokens=1, num_beams=1, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        cache = EncodedCache(folder)
        summarizer = Summarizer(loaded, generation=one_token, cache=cache)
        cold = timed(lambda: summarizer.summarize(document))
        warm = timed(lambda: summarizer.summarize(document))
        entry_bytes = sum(entry.nbytes for entry in cache.entries())
    print(f"  first token at {tokens:,} tokens: cold {cold:.2f} s, warm {warm:.2f} s = {cold / warm:.1f}x faster",
          flush=True)
    return dict(tokens=tokens, cold_seconds=cold, warm_seconds=warm, speedup=cold / warm, entry_bytes=entry_bytes)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller books")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    from unlimisum.models import load_model

    needle = load_model(ModelConfig(name=str(NEEDLE), device="cpu"))
    needle_summarizer = Summarizer(needle, generation=GenerationOptions(max_new_tokens=10, num_beams=1, do_sample=False),
                                   retrieval=RetrievalConfig(retrieval_k=16), index=IndexConfig(kind="exact"))
    rows = [per_chapter_row("needle model, 8 chapters", needle_summarizer,
                            needle_book(needle, 40_000 if args.quick else 200_000))]
    bart = random_model("bart-base")
    tokens = 4_096 if args.quick else 16_384
    bart_summarizer = Summarizer(bart, generation=GenerationOptions(max_new_tokens=16, min_new_tokens=16,
                                                                    num_beams=1, do_sample=False))
    rows.append(per_chapter_row(f"bart-base size, 8 chapters, {tokens:,} tokens", bart_summarizer, random_book(tokens)))
    cache = cache_row(bart, tokens)
    print_table(["case", "plain s", "per-chapter s", "per-chapter / plain"],
                [[r["case"], f"{r['plain_seconds']:.1f}", f"{r['per_chapter_seconds']:.1f}", f"{r['ratio']:.2f}x"]
                 for r in rows])
    print(f"time to the first generated token, {cache['tokens']:,} tokens, bart-base size: cold "
          f"{cache['cold_seconds']:.2f} s, warm cache {cache['warm_seconds']:.2f} s ({cache['speedup']:.1f}x), "
          f"entry {cache['entry_bytes'] / 2**20:.1f} MiB")
    result = dict(per_chapter=rows, cache=cache)
    print("wrote", write_result("encode_once", result))
    return result


if __name__ == "__main__":
    main()
