"""One encoded document at the centre: per-chapter summaries read views of one store, the cache of
encoded books gives identical summaries without encoding, and coverage says where each summary looked."""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_needle import DIGITS, FIXTURE, GENERATION
from tests.tiny_models import SAMPLE_TEXT
from unlimisum.unlimiformer import encoder as encoder_module
from unlimisum.config import GenerationOptions, IndexConfig, ModelConfig, RetrievalConfig
from unlimisum.document import Chapter, Document
from unlimisum.unlimiformer.cache import EncodedCache
from unlimisum.models import load_model
from unlimisum.summarizer import Summarizer

FAST = GenerationOptions(max_new_tokens=6, min_new_tokens=6, num_beams=1, do_sample=False)
EXACT = IndexConfig(kind="exact", device="cpu")


def book(chapters: int = 4) -> Document:
    return Document(title="Book", source="book.txt", chapters=tuple(
        Chapter(f"Chapter {number}", f"Chapter {number} begins. " + SAMPLE_TEXT * 2) for number in range(1, chapters + 1)
    ))


@pytest.fixture
def encoder_calls(monkeypatch):
    """How many times documents were run through the encoder."""
    calls = []
    real = encoder_module.encode_windows

    def counting(*args, **kwargs):
        calls.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(encoder_module, "encode_windows", counting)
    return calls


def test_per_chapter_encodes_the_book_once(tiny_loaded, encoder_calls):
    summary = Summarizer(tiny_loaded("bart"), generation=FAST, index=EXACT).summarize(book(), per_chapter=True)
    assert len(encoder_calls) == 1
    assert [part.title for part in summary.chapters] == [f"Chapter {n}" for n in range(1, 5)]
    assert sum(part.stats.input_tokens for part in summary.chapters) == summary.stats.input_tokens


def test_a_chapter_summary_reads_exactly_its_own_tokens(tiny_loaded, monkeypatch):
    """A chapter's summary from the view equals one from a store holding only that chapter's encoded states."""
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "float32")
    loaded = tiny_loaded("bart")
    summarizer = Summarizer(loaded, generation=FAST, index=IndexConfig(kind="exact", device="cpu",
                                                                        storage_dtype="float32"))
    document = book()
    encoded = summarizer.encode(document)
    chapter = encoded.chapters[2]
    view = encoded.chapter_store(chapter)
    assert view.n_tokens == chapter.end - chapter.start
    assert view.states().data_ptr() == encoded.store.states()[chapter.start].data_ptr()
    from unlimisum.search.datastore import DatastoreBuilder, IndexPlan

    builder = DatastoreBuilder(view.n_tokens, view.dim, IndexPlan("exact", "cpu", "test"),
                               IndexConfig(storage_dtype="float32"))
    builder.add(encoded.store.states()[chapter.start:chapter.end].clone())
    alone = builder.finish()
    assert torch.equal(summarizer.generate([view]).token_ids, summarizer.generate([alone]).token_ids)
    # the chapter's text starts where its tokens do
    text = loaded.tokenizer.decode(encoded.token_ids[chapter.start:chapter.start + 3])
    assert text.strip().startswith("Chapter 3")


def test_cache_round_trip_gives_identical_summaries_without_encoding(tiny_loaded, tmp_path, encoder_calls):
    loaded = tiny_loaded("bart")
    cache = EncodedCache(tmp_path / "cache")
    first = Summarizer(loaded, generation=FAST, cache=cache).summarize(book(), per_chapter=True)
    assert len(encoder_calls) == 1 and not first.stats.cached and len(cache.entries()) == 1
    second = Summarizer(loaded, generation=FAST, cache=cache).summarize(book(), per_chapter=True)
    assert len(encoder_calls) == 1 and second.stats.cached and "cache_load" in second.stats.timings
    assert second.text == first.text and second.token_ids == first.token_ids
    assert [part.token_ids for part in second.chapters] == [part.token_ids for part in first.chapters]
    assert second.coverage == first.coverage
    # other generation options: still no encoding
    Summarizer(loaded, generation=GenerationOptions(max_new_tokens=4, num_beams=2), cache=cache).summarize(book())
    assert len(encoder_calls) == 1
    # another window changes the states: a new entry
    from unlimisum.config import EncodingConfig

    Summarizer(loaded, generation=FAST, cache=cache, encoding=EncodingConfig(overlap=0.25)).summarize(book())
    assert len(encoder_calls) == 2 and len(cache.entries()) == 2


def test_a_corrupt_cache_entry_is_rebuilt_with_a_warning(tiny_loaded, tmp_path, encoder_calls):
    loaded = tiny_loaded("bart")
    warnings = []
    cache = EncodedCache(tmp_path / "cache", warn=warnings.append)
    first = Summarizer(loaded, generation=FAST, cache=cache).summarize(book())
    (entry,) = (tmp_path / "cache").iterdir()
    raw = bytearray((entry / "states.bin").read_bytes())
    raw[10] ^= 0x55
    (entry / "states.bin").write_bytes(bytes(raw))
    again = Summarizer(loaded, generation=FAST, cache=cache).summarize(book())
    assert len(warnings) == 1 and "checksum" in warnings[0]
    assert len(encoder_calls) == 2 and not again.stats.cached and again.token_ids == first.token_ids


def test_coverage_sums_to_one_per_summary(tiny_loaded):
    summary = Summarizer(tiny_loaded("bart"), generation=FAST).summarize(book(), per_chapter=True)
    for part in (summary, *summary.chapters):
        for spans in (part.coverage, part.window_coverage):
            assert spans and sum(span.share for span in spans) == pytest.approx(1.0)
            assert spans[0].start_token == 0 and spans[-1].end_token == part.stats.input_tokens
    assert [span.title for span in summary.coverage] == [f"Chapter {n}" for n in range(1, 5)]


def test_coverage_peaks_at_the_chapter_holding_the_needle():
    torch.set_num_threads(1)
    loaded = load_model(ModelConfig(name=str(FIXTURE), device="cpu"))
    filler = sorted(word for word in loaded.tokenizer.get_vocab() if word.isalpha())
    rng = random.Random(3)
    content = rng.sample(DIGITS, 5)
    chapters = []
    for number in range(8):
        words = [rng.choice(filler) for _ in range(400)]
        if number == 5:
            words[200:200] = ["<needle>", *content, "</needle>"]
        chapters.append(Chapter(f"Part {number}", " ".join(words)))
    document = Document(title="Haystack", chapters=tuple(chapters))
    summary = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16),
                         index=IndexConfig(kind="exact", device="cpu")).summarize(document)
    assert summary.text == " ".join(content)
    shares = [span.share for span in summary.coverage]
    assert shares.index(max(shares)) == 5 and shares[5] > 2 * sorted(shares)[-2]


def test_the_same_text_in_other_chapters_gets_its_own_chapters_from_the_cache(tiny_loaded, tmp_path, encoder_calls):
    loaded = tiny_loaded("bart")
    cache = EncodedCache(tmp_path / "cache")
    chaptered = book()
    one_chapter = Document.from_text(chaptered.text, title="Book")
    Summarizer(loaded, generation=FAST, cache=cache).summarize(one_chapter)
    again = Summarizer(loaded, generation=FAST, cache=cache).summarize(chaptered, per_chapter=True)
    assert len(encoder_calls) == 1 and again.stats.cached  # the same text: no second encoding
    assert [part.title for part in again.chapters] == [f"Chapter {n}" for n in range(1, 5)]
    assert [span.title for span in again.coverage] == [f"Chapter {n}" for n in range(1, 5)]


def test_a_cache_that_cannot_be_written_is_a_warning_and_the_summary_goes_on(tiny_loaded, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    warnings = []
    summary = Summarizer(tiny_loaded("bart"), generation=FAST,
                         cache=EncodedCache(blocker / "cache", warn=warnings.append)).summarize(book())
    assert summary.text is not None and len(warnings) == 1 and "could not write to the cache" in warnings[0]


def test_chapter_boundaries_with_sentencepiece_offsets():
    """SentencePiece tokens (▁Chapter) start at the space before a word; the chapter still starts at that
    token, not one later (byte-level BPE tokens start after the space: tested through the tiny models)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from unlimisum.coverage import chapter_token_ranges, token_char_ends

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace("\n", " ")  # as T5's and PEGASUS's normalise whitespace
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator([SAMPLE_TEXT * 5, "Chapter One Two Three begins"],
                                  trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False))
    document = Document(title="", chapters=(Chapter("One", "The keeper counted ships."),
                                            Chapter("Two", "Chapter Two begins here.")))
    encoding = tokenizer.encode(document.text)
    chapter_start = document.text.index("Chapter")
    (position,) = [i for i, token in enumerate(encoding.tokens) if token == "▁Chapter"]
    assert encoding.offsets[position][0] < chapter_start  # the token starts at the space before the word
    first, second = chapter_token_ranges(document, token_char_ends(encoding.offsets), len(encoding.ids))
    assert second.start == position and first.end == position
    assert not any("Chapter" in token for token in encoding.tokens[first.start:first.end])
