"""The words of every message unlimisum writes: no word twice in a row ("trained with with --tokenizer")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import unlimisum

PACKAGE = Path(unlimisum.__file__).parent
DOUBLED = re.compile(r"\b([a-z]+)\s+\1\b")  # lower case: `--cache-dir DIR` names a value, it does not stutter
ENGLISH = {"that that", "had had"}  # doubled and correct


def _string_literals(path: Path):
    """(line, text) of every string literal in ``path``; an f-string's fixed parts joined around ``{}``."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_message_or_help_text_repeats_a_word():
    doubled = [f"{path.relative_to(PACKAGE.parent)}:{line}: {match.group(0)!r}"
               for path in sorted(PACKAGE.rglob("*.py")) for line, text in _string_literals(path)
               for match in DOUBLED.finditer(text) if match.group(0) not in ENGLISH]
    assert doubled == []
