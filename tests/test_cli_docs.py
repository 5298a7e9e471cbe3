"""docs/cli.md is the program's own `--help`, regenerated: it fails here when a command or option changed and
the file was not (`python -m unlimisum.cli.docs > docs/cli.md` brings it up to date)."""

from __future__ import annotations

import os
from pathlib import Path

from unlimisum.cli.docs import reference

REFERENCE = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_docs_cli_md_is_the_help_the_program_prints(monkeypatch):
    for name in [name for name in os.environ if name.startswith("UNLIMISUM_")] + ["RAY_ADDRESS"]:
        monkeypatch.delenv(name, raising=False)
    assert REFERENCE.read_text(encoding="utf-8") == reference(), (
        "docs/cli.md is stale: run `python -m unlimisum.cli.docs > docs/cli.md`")


def test_every_command_and_option_of_summarize_is_in_it():
    text = REFERENCE.read_text(encoding="utf-8")
    for heading in ("## `unlimisum summarize`", "## `unlimisum tc fit`", "## `unlimisum cache clear`",
                    "## `unlimisum train`", "## `unlimisum ingest`", "## `unlimisum info`"):
        assert heading in text
    for option in ("--format", "--html FILE", "--evidence-passages", "--engine", "--tc-params"):
        assert option in text
