"""Helpers for the CLI tests: small books in every format, and a model loader that loads each folder once.

The CLI loads its model once per invocation; the in-process tests run many invocations, so
``CachedLoader`` keeps the real ``load_model`` result per configuration for the whole
session (and counts the calls, so tests can check that one invocation loads once).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from tests.tiny_models import SAMPLE_TEXT

REPO = Path(__file__).resolve().parent.parent
SAMPLES = REPO / "samples"

SMALL_STORY = f"""The Keeper's Book

by A. Tester

Chapter 1: The Storm

{SAMPLE_TEXT}

Chapter 2: The Letter

{SAMPLE_TEXT}
"""


def write_small_books(folder: Path) -> dict[str, Path]:
    """``{"text": .txt, "epub": .epub, "pdf": .pdf}``: one short two-chapter story in each format.

    EPUB and PDF are rendered with samples/make_samples.py (the ingestion engineer's generator);
    when it is missing, the committed samples are used instead.
    """
    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "small.txt"
    text.write_text(SMALL_STORY, encoding="utf-8")
    generator = SAMPLES / "make_samples.py"
    if generator.exists():
        spec = importlib.util.spec_from_file_location("unlimisum_make_samples", generator)
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault(spec.name, module)  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        story = module.parse_story(SMALL_STORY)
        module.write_epub(story, folder / "small.epub")
        module.write_pdf(story, folder / "small.pdf")
        return {"text": text, "epub": folder / "small.epub", "pdf": folder / "small.pdf"}
    return {"text": text, "epub": SAMPLES / "story.epub", "pdf": SAMPLES / "story.pdf"}


class CachedLoader:
    """A stand-in for ``unlimisum.models.load_model`` that loads each configuration once per session."""

    def __init__(self, real_load):
        self.real_load = real_load
        self.loaded: dict = {}
        self.calls = 0

    def __call__(self, config, progress=None):
        self.calls += 1
        key = (config.name, config.tokenizer, config.device, config.dtype, config.trust_remote_code)
        if key not in self.loaded:
            self.loaded[key] = self.real_load(config, progress)
        return self.loaded[key]
