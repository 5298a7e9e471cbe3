"""Evidence: every summary sentence points at the passages its retrieval attention went to.

The trained needle fixture (tests/fixtures/needle) copies a marked span out of inputs 50-200 windows long:
the sentence holding it must have the needle's passage as its first source, in the whole-book summary and
in the summary of the chapter holding it. Tiny random models check the records themselves: shares sum to
1, offsets cut the quote out of the chapter's text, a chapter alone and in a batch agree, and with beams
the evidence and coverage belong to the returned sequence.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from unlimisum.config import GenerationOptions, IndexConfig, RetrievalConfig
from unlimisum.document import Chapter, Document
from unlimisum.evidence import MAX_QUOTE_CHARS, quote, sentences
from unlimisum.summarizer import Summarizer
from tests.test_needle import DIGITS, GENERATION, INDEX, long_input, loaded, filler  # noqa: F401

WORDS = ("river stone lantern orchard winter harbour signal meadow copper violet thunder garden "
         "silver window marble cotton ember quiet hollow bright").split()


def book(chapters: int = 3, words: int = 120, seed: int = 0) -> Document:
    import random

    rng = random.Random(seed)
    parts = []
    for number in range(chapters):
        n = words // (1 + number % 2 * 3)  # chapters of different lengths: short ones end early in a batch
        sentences_ = [" ".join(rng.choice(WORDS) for _ in range(8)).capitalize() + "." for _ in range(n // 8)]
        parts.append(Chapter(f"Chapter {number + 1}", " ".join(sentences_)))
    return Document(title="Tiny", chapters=tuple(parts), source="tiny.txt")


def check_records(summary, document):
    """Shares of each sentence sum to 1, ordered by share; the offsets cut the quote out of the chapter."""
    assert summary.evidence, "a non-empty summary has evidence"
    for sentence in summary.evidence:
        assert summary.text[sentence.start:sentence.end] == sentence.sentence
        assert sentence.sources
        assert sum(source.share for source in sentence.sources) == pytest.approx(1.0)
        assert [s.share for s in sentence.sources] == sorted((s.share for s in sentence.sources), reverse=True)
        for source in sentence.sources:
            chapter = document.chapters[source.chapter_index]
            assert source.chapter == chapter.title
            assert 0 <= source.start_char < source.end_char <= len(chapter.text)
            assert source.quote == quote(chapter.text[source.start_char:source.end_char])


# -- the trained needle ------------------------------------------------------------------------


NEEDLE_CASES = [(50, 0.3), (50, 0.98), (200, 0.5), (200, 0.02)]


@pytest.mark.parametrize("windows, position", NEEDLE_CASES)
def test_the_needle_sentence_cites_the_needle_first(loaded, filler, windows, position):  # noqa: F811
    text, content, _ = long_input(filler, windows, position)
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16), index=INDEX)
    summary = summarizer.summarize(text)
    assert summary.text == content
    document = Document.from_text(text)
    check_records(summary, document)
    first = summary.evidence[0].sources[0]
    needle_at = text.index("<needle>")
    needle_end = text.index("</needle>") + len("</needle>")
    assert first.start_char <= text.index(content, needle_at) and needle_end - 9 <= first.end_char, first
    assert content in first.quote


def test_per_chapter_the_needle_chapter_cites_the_needle_first(loaded, filler):  # noqa: F811
    text, content, _ = long_input(filler, 60, 0.55)
    words = text.split(" ")
    cut = [0, len(words) // 3, 2 * len(words) // 3, len(words)]
    chapters = tuple(Chapter(f"Part {i + 1}", " ".join(words[a:b])) for i, (a, b) in enumerate(zip(cut, cut[1:])))
    document = Document(title="needle", chapters=chapters, source="needle.txt")
    holder = next(i for i, chapter in enumerate(chapters) if "<needle>" in chapter.text)
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16), index=INDEX)
    summary = summarizer.summarize(document, per_chapter=True)
    part = summary.chapters[holder]
    assert part.text == content
    check_records(part, document)
    first = part.evidence[0].sources[0]
    assert first.chapter_index == holder and content in first.quote


# -- tiny random models ------------------------------------------------------------------------


TINY = GenerationOptions(max_new_tokens=24, min_new_tokens=4, num_beams=1, do_sample=False)


def test_records_on_a_tiny_model(tiny_loaded):
    document = book()
    summary = Summarizer(tiny_loaded("bart"), generation=TINY, index=INDEX).summarize(document, per_chapter=True)
    for part in (summary, *summary.chapters):
        check_records(part, document)
    assert "evidence" in summary.stats.timings


def needle_book(filler, lengths=(4, 6, 5), windows: int = 4, seed: int = 7) -> Document:
    """Chapters each holding their own needle, of different lengths: their summaries end at different steps."""
    import random

    rng = random.Random(seed)
    chapters = []
    for number, length in enumerate(lengths):
        words = [rng.choice(filler) for _ in range(windows * 64 - length - 4)]
        words[rng.randrange(len(words)):0] = ["<needle>", *rng.sample(DIGITS, length), "</needle>"]
        chapters.append(Chapter(f"Part {number + 1}", " ".join(words)))
    return Document(title="needles", chapters=tuple(chapters), source="needles.txt")


def test_a_chapter_alone_and_in_a_batch_gives_the_same_coverage_and_evidence(loaded, filler):  # noqa: F811
    """In a batch a short chapter's summary ends early and its row is padded: the padding counts nowhere."""
    from unlimisum.unlimiformer.summarize import _Part

    document = needle_book(filler)
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16), index=INDEX)
    batched = summarizer.summarize(document, per_chapter=True).chapters
    assert len({len(part.text.split()) for part in batched}) == 3  # 4, 6 and 5 digits: two rows get padding
    family = summarizer.family
    encoded = family.encode(document)
    for chapter, together in zip(encoded.chapters, batched):
        alone = family._summarize_parts([_Part(chapter.title, document.source, encoded, document, chapter.start,
                                               chapter.end)])[0]
        assert alone.text == together.text
        for a, b in zip(alone.coverage + alone.window_coverage, together.coverage + together.window_coverage):
            assert a.share == pytest.approx(b.share, abs=1e-4)
        where = lambda s: [(x.chapter_index, x.start_char, x.end_char) for x in s.sources]  # noqa: E731
        assert [(s.sentence, where(s)) for s in alone.evidence] == [(s.sentence, where(s)) for s in together.evidence]
        for x, y in zip(alone.evidence, together.evidence):
            assert [s.share for s in x.sources] == pytest.approx([s.share for s in y.sources], abs=1e-4)
        check_records(together, document)
    # counted during generation instead, the padded rows' coverage differs alone and in the batch (the bug)
    old = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16, evidence=False),
                     index=INDEX)
    old_batched = old.summarize(document, per_chapter=True).chapters
    old_alone = [old.family._summarize_parts([_Part(c.title, document.source, encoded, document, c.start, c.end)])[0]
                 for c in encoded.chapters]
    assert any([s.share for s in a.window_coverage] != pytest.approx([s.share for s in b.window_coverage], abs=1e-3)
               for a, b in zip(old_alone, old_batched))


def test_with_beams_coverage_and_evidence_belong_to_the_returned_sequence(loaded, filler):  # noqa: F811
    """The pass reads the returned ids only: re-reading them alone gives the same coverage."""
    document = needle_book(filler, lengths=(5, 4), windows=6, seed=11)
    beams = GenerationOptions(max_new_tokens=10, num_beams=4, do_sample=False)
    summarizer = Summarizer(loaded, generation=beams, index=INDEX)
    summary = summarizer.summarize(document)
    family = summarizer.family
    encoded = family.encode(document)
    reading = family.read_summary(encoded.store, summary.token_ids)
    from unlimisum.coverage import spans

    expected = spans(reading.coverage, [(c.title, c.start, c.end) for c in encoded.chapters])
    assert [span.share for span in summary.coverage] == pytest.approx([span.share for span in expected], abs=1e-5)
    every_step = Summarizer(loaded, generation=beams, index=INDEX,
                            retrieval=RetrievalConfig(evidence=False)).summarize(document)
    assert every_step.evidence == () and every_step.text == summary.text
    # counted during generation, the dropped beams' attention is in it: not the returned sequence's
    assert [span.share for span in every_step.coverage] != pytest.approx([span.share for span in expected], abs=1e-3)
    check_records(summary, document)


def test_no_evidence_skips_the_pass(tiny_loaded):
    summary = Summarizer(tiny_loaded("bart"), generation=TINY, index=INDEX,
                         retrieval=RetrievalConfig(evidence=False)).summarize(book())
    assert summary.evidence == () and "evidence" not in summary.stats.timings
    assert sum(span.share for span in summary.coverage) == pytest.approx(1.0)
    from unlimisum import summarize

    one = summarize(book(), tiny_loaded("bart"), index="exact", index_device="cpu", max_new_tokens=24,
                    min_new_tokens=4, evidence_passages=1)
    assert one.evidence and all(len(sentence.sources) == 1 for sentence in one.evidence)
    assert summarize(book(), tiny_loaded("bart"), max_new_tokens=8, evidence=False).evidence == ()


def test_sentences_and_quotes():
    text = "Mr. Ahab met Dr. Smith at 3.5 knots. He said \"stop.\" Then it sank!"
    assert [text[a:b] for a, b in sentences(text)] == ["Mr. Ahab met Dr. Smith at 3.5 knots.", 'He said "stop."',
                                                        "Then it sank!"]
    long = " ".join(["word"] * 200)
    cut = quote("  " + long + "  ")
    assert len(cut) <= MAX_QUOTE_CHARS and cut.endswith("…") and long.startswith(cut[:-1])
    assert quote("  short passage ") == "short passage"


# -- the command line ---------------------------------------------------------------------------


def test_cli_json_markdown_and_no_evidence(loader, tiny_model_dir, tmp_path):
    """--json: every summary object has "evidence" whose offsets cut the quote out of `ingest --json --text`'s
    chapter text; --evidence: footnotes in the Markdown; --no-evidence: none."""
    import json

    from typer.testing import CliRunner

    from tests.cli_helpers import write_small_books
    from unlimisum.cli import app

    books = write_small_books(tmp_path / "books")
    runner = CliRunner()
    base = ["summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu", "--max-new-tokens", "8",
            "--min-new-tokens", "6"]
    result = runner.invoke(app, [*base, "--json", "--per-chapter", "--evidence-passages", "2", str(books["epub"])])
    assert result.exit_code == 0, result.output
    record = json.loads(result.stdout.splitlines()[0])
    ingest = runner.invoke(app, ["ingest", "--json", "--text", str(books["epub"])])
    chapters = json.loads(ingest.stdout.splitlines()[0])["chapters"]
    for part in (record, *record["chapters"]):
        assert part["evidence"], part["summary"]
        for sentence in part["evidence"]:
            assert part["summary"][sentence["start"]:sentence["end"]] == sentence["sentence"]
            assert 1 <= len(sentence["sources"]) <= 2
            assert abs(sum(source["share"] for source in sentence["sources"]) - 1) < 1e-6
            for source in sentence["sources"]:
                assert set(source) == {"chapter_index", "chapter", "start_char", "end_char", "share", "quote",
                                       "start_token", "end_token"}
                assert 0 <= source["start_token"] < source["end_token"] <= record["stats"]["input_tokens"]
                chapter = chapters[source["chapter_index"]]
                assert chapter["title"] == source["chapter"]
                assert chapter["text"][source["start_char"]:source["end_char"]].strip() == source["quote"]
    marked = runner.invoke(app, [*base, "--evidence", str(books["text"])])
    assert marked.exit_code == 0, marked.output
    assert "[^1]" in marked.stdout and "\n[^1]: " in marked.stdout and "“" in marked.stdout
    plain = runner.invoke(app, [*base, str(books["text"])])
    assert "[^1]" not in plain.stdout
    skipped = runner.invoke(app, [*base, "--json", "--no-evidence", str(books["text"])])
    assert json.loads(skipped.stdout.splitlines()[0])["evidence"] == []


def test_an_approximate_index_gives_evidence_too(loaded, filler):  # noqa: F811
    """The pass reads a faiss index (HNSW here) through the same search as generation."""
    text, _, _ = long_input(filler, 50, 0.6)
    summarizer = Summarizer(loaded, generation=GENERATION, retrieval=RetrievalConfig(retrieval_k=16),
                            index=IndexConfig(kind="hnsw", device="cpu"))
    summary = summarizer.summarize(text)
    assert summary.stats.index_kind == "hnsw"  # approximate: it need not copy the needle, but it cites
    check_records(summary, Document.from_text(text))


def test_in_a_terminal_evidence_shows_each_sentence_with_its_passages(tiny_model_dir, tmp_path):
    from tests.test_cli_terminal import console_script, run_in_terminal
    from tests.tiny_models import SAMPLE_TEXT

    (tmp_path / "book.txt").write_text(SAMPLE_TEXT, encoding="utf-8")
    command = [*console_script(), "summarize", "-m", str(tiny_model_dir("bart")), "--device", "cpu",
               "--max-new-tokens", "8", "--min-new-tokens", "6", "--evidence", "--evidence-passages", "2", "book.txt"]
    code, screen = run_in_terminal(command, tmp_path)
    text = "\n".join(screen)
    assert code == 0, text
    rows = [line for line in screen if line.strip()]
    start = next(i for i, line in enumerate(rows) if line.strip() == "evidence")
    assert rows[start + 1].lstrip().startswith("[1] "), text
    passages = [line for line in rows[start + 2:] if "%" in line and "\u201c" in line]
    assert 1 <= len(passages) <= 2 * sum(line.lstrip().startswith("[") for line in rows[start + 1:]), text
    assert "[^1]" in text  # the Markdown on stdout has its footnotes too


def _spy_gathers(monkeypatch, states):
    """Record the row counts of every 2-D gather of rows out of ``states`` (``states[ids]`` with ids [nq, k] or
    ids [n])."""
    gathered = []
    original = torch.Tensor.__getitem__

    def spy(tensor, index):
        if tensor.data_ptr() == states.data_ptr() and isinstance(index, torch.Tensor):
            gathered.append(index.numel())
        return original(tensor, index)

    monkeypatch.setattr(torch.Tensor, "__getitem__", spy)
    return gathered


@pytest.mark.parametrize("kernel", ["float32", "packed"])
def test_a_search_by_a_widening_kernel_returns_its_own_fp32_scores_without_gathering(monkeypatch, kernel):
    """The float32 and packed kernels score in fp32 already: the evidence pass's many queries gather nothing."""
    from unlimisum.search import packed
    from unlimisum.search.datastore import TorchExactDatastore

    if kernel == "packed" and not packed.available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", kernel)
    torch.manual_seed(0)
    states = torch.randn(300, 16).to(torch.bfloat16)
    store = TorchExactDatastore(states, "exact", "cpu", states.numel() * 2)
    store.prepare()
    queries = torch.randn(50, 16)
    gathered = _spy_gathers(monkeypatch, states)
    scores, ids = store.search(queries, 8)
    monkeypatch.undo()
    assert gathered == []
    exact = torch.einsum("qkd,qd->qk", states[ids].float(), queries)
    torch.testing.assert_close(scores, exact, rtol=1e-4, atol=1e-4)
    assert (scores[:, :-1] >= scores[:, 1:]).all()


def test_the_native_kernels_winners_are_rescored_reading_each_once_in_bounded_blocks(monkeypatch):
    """The native kernel's scores are rounded to 16 bits: the winners are scored again in fp32, each distinct
    state read once (blocks within RESCORE_BYTES), never queries x k x d at once."""
    from unlimisum.search import datastore
    from unlimisum.search.datastore import TorchExactDatastore

    monkeypatch.setenv("UNLIMISUM_SCORE_KERNEL", "native")
    torch.manual_seed(0)
    states = torch.randn(300, 16).to(torch.bfloat16)
    store = TorchExactDatastore(states, "exact", "cpu", states.numel() * 2)
    queries = torch.randn(50, 16)
    whole = store.search(queries, 8)
    monkeypatch.setattr(datastore, "RESCORE_BYTES", 4 * (50 + 16) * 20)  # 20 distinct states at a time
    gathered = _spy_gathers(monkeypatch, states)
    blocked = store.search(queries, 8)
    monkeypatch.undo()
    assert torch.equal(whole[1], blocked[1]) and torch.allclose(whole[0], blocked[0])
    assert gathered and max(gathered) <= 20 and sum(gathered) == len(torch.unique(whole[1]))
    exact = torch.einsum("qkd,qd->qk", states[whole[1]].float(), queries)
    torch.testing.assert_close(whole[0], exact, rtol=1e-5, atol=1e-5)


def test_an_approximate_search_for_many_queries_gathers_in_bounded_blocks(monkeypatch):
    """HNSW and IVF score their candidates in fp32 by gathering them: in blocks of queries, so the evidence pass's
    hundreds of queries do not hold queries x k x d fp32 numbers at once (#34: 3x the memory of exact)."""
    from unlimisum.search import datastore
    from unlimisum.search.datastore import DatastoreBuilder, plan_index

    torch.manual_seed(0)
    states = torch.randn(300, 16)
    config = IndexConfig(kind="hnsw", device="cpu", storage_dtype="bfloat16")
    builder = DatastoreBuilder(300, 16, plan_index(300, 16, config), config)
    builder.add(states)
    store = builder.finish()
    queries = torch.randn(50, 16)
    whole = store.search(queries, 8)
    monkeypatch.setattr(datastore, "RESCORE_BYTES", 4 * 8 * 16 * 7)  # 7 queries' candidates at a time
    gathered = _spy_gathers(monkeypatch, store.states())
    blocked = store.search(queries, 8)
    monkeypatch.undo()
    assert torch.equal(whole[1], blocked[1]) and torch.allclose(whole[0], blocked[0])
    assert gathered and max(gathered) <= 7 * 8
