"""The samples in samples/: the same story as text, EPUB and PDF, regenerated identically."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from unlimisum.ingest import read_document

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_samples", SAMPLES / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def words(text: str) -> list[str]:
    return [word.strip(".,;:!?\"'()").lower() for word in text.split()]


def test_three_formats_give_the_same_story():
    documents = {name: read_document(SAMPLES / f"story.{name}") for name in ("txt", "epub", "pdf")}
    for document in documents.values():
        assert document.title == "The Cartographer of Low Tide"
        assert document.author == "the unlimisum authors"
        # the same four chapters in every format: the title lines before "Chapter 1" are no chapter
        assert [chapter.title.split(":")[0] for chapter in document.chapters] == [f"Chapter {n}" for n in (1, 2, 3, 4)]
    reference = words(documents["txt"].chapters[-1].text)
    for name in ("epub", "pdf"):
        assert words(documents[name].chapters[-1].text) == reference, name


def test_committed_epub_matches_the_generator(tmp_path):
    generator = load_generator()
    story = generator.parse_story((SAMPLES / "story.txt").read_text(encoding="utf-8"))
    assert len(story.chapters) == 4 and 2000 < sum(len(" ".join(p).split()) for _, p in story.chapters) < 6000
    generator.write_epub(story, tmp_path / "story.epub")
    assert (tmp_path / "story.epub").read_bytes() == (SAMPLES / "story.epub").read_bytes()


def test_committed_pdf_matches_the_generator(tmp_path):
    pytest.importorskip("fpdf")
    generator = load_generator()
    story = generator.parse_story((SAMPLES / "story.txt").read_text(encoding="utf-8"))
    generator.write_pdf(story, tmp_path / "story.pdf")
    assert read_document(tmp_path / "story.pdf").chapters == read_document(SAMPLES / "story.pdf").chapters
