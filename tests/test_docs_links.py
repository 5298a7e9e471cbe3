"""The documents a reader meets: the README's first two commands stay what they are, and every relative link
of the README, BENCHMARKS.md and docs/ leads to a file that exists and, with a #fragment, to a heading in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIRST_COMMANDS = ("pip install torch==2.13.0 && pip install -e . && unlimisum summarize samples/story.epub",
                  'pip install -e ".[test]" && python -m pytest -q')


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of a Markdown file (code blocks left out)."""
    found, counts, fenced = set(), {}, False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"^#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            number = counts.get(slug, 0)
            counts[slug] = number + 1
            found.add(slug if number == 0 else f"{slug}-{number}")
    return found


def test_the_readme_opens_with_its_two_commands():
    first_screen = ROOT.joinpath("README.md").read_text(encoding="utf-8").splitlines()[:25]
    fenced = [line for line in first_screen if not line.startswith(("#", "`")) and line.strip()]
    assert [line for line in fenced if line in FIRST_COMMANDS] == list(FIRST_COMMANDS)


def test_every_relative_link_resolves():
    documents = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for document in documents:
        for link in re.findall(r"\]\(([^)\s]+)\)", document.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", link):
                continue
            target, _, fragment = link.partition("#")
            path = (document.parent / target).resolve() if target else document
            if not path.exists():
                broken.append(f"{document.name}: {link} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{document.name}: {link} (no such heading)")
    assert not broken, broken
