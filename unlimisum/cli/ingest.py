"""`unlimisum ingest PATH...`: show what unlimisum reads from each input.

Per input: title, author, format, encoding, chapters and character counts, and what was
left out (EPUB front/back matter, notes...; --keep-all keeps it). With --text, the
extracted text (under a ``==> path <==`` header each when there are several inputs); with
--json, one JSON object per input, the input named ``path`` as in `summarize --json`. A bad
input gets a one-line error on stderr and the batch goes on; the exit status is 1 if any
input failed.
"""

from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.cells import cell_len

from unlimisum.cli.app import EXIT_FAILURE, EXIT_USAGE, app, fail
from unlimisum.document import Document
from unlimisum.errors import ConfigError, UnlimisumError
from unlimisum.ingest import STDIN, read_document
from unlimisum.runs.jobs import plan_jobs
from unlimisum.runs.output import document_title
from unlimisum.visible import json_text, visible

_TITLE_WIDTH = 60  # chapter titles are cut to this many characters in the table


@app.command()
def ingest(
    paths: List[str] = typer.Argument(..., metavar="PATH...", help="Files, folders (searched recursively) or '-' for standard input."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per input (JSON Lines)."),
    text: bool = typer.Option(False, "--text", help="Print the extracted text (in --json: include it)."),
    password: Optional[str] = typer.Option(None, "--password", help="Password for encrypted PDFs."),
    keep_all: bool = typer.Option(
        False, "--keep-all", help="Keep what is left out by default: EPUB covers, front and back matter, notes, non-linear items."
    ),
) -> None:
    """Read inputs and report what was found: title, format, chapters, characters."""
    try:  # the inputs summarize would read: a folder's summaries that unlimisum wrote are not among them
        plan = plan_jobs(paths, None)
    except ConfigError as error:
        raise fail(error, EXIT_USAGE)
    if plan.own_outputs:
        count = len(plan.own_outputs)
        example = f" (e.g. {plan.own_outputs[0]})" if count > 1 else f": {plan.own_outputs[0]}"
        typer.echo(visible(f"unlimisum: not reading {count} {'summary' if count == 1 else 'summaries'} that "
                           f"unlimisum wrote{example}"), err=True)
    inputs = [job.source for job in plan.jobs]
    failures = printed = 0
    for job in plan.jobs:
        source = job.source
        try:
            if job.problem is not None:
                raise job.problem
            document = read_document(source, password=password, keep_all=keep_all)
        except UnlimisumError as error:
            failures += 1
            typer.echo(visible(f"unlimisum: error: {error}"), err=True)
            if as_json:
                typer.echo(json_line({"path": source, "error": error.problem, "error_type": type(error).__name__}))
            continue
        for warning in document.metadata.get("warnings", []):
            typer.echo(visible(f"unlimisum: warning: {source}: {warning}"), err=True)
        if as_json:
            typer.echo(json_line(document_record(document, with_text=text)))
        elif text:  # the book's own text and titles, their control characters shown as symbols (visible.py)
            header = f"==> {'standard input' if source == STDIN else source} <==\n" if len(inputs) > 1 else ""
            typer.echo(visible(("\n" if printed else "") + header + render_text(document)))
        else:
            typer.echo(visible(("\n" if printed else "") + render_summary(document)))
        printed += 1
    if failures:
        if len(inputs) > 1:
            raise fail(f"{failures} of {len(inputs)} inputs could not be read")
        raise typer.Exit(EXIT_FAILURE)


def json_line(record: dict) -> str:
    """One line of JSON: the document's exact text, every control character escaped (unlimisum/visible.py)."""
    return json_text(json.dumps(record, ensure_ascii=False))


def document_record(document: Document, with_text: bool = False) -> dict:
    """A JSON-ready description of a document (chapter texts only when ``with_text``).

    ``left_out`` lists what the reader left out (``[]`` when nothing was, or for text and PDF).
    """
    chapters = []
    for chapter in document.chapters:
        entry = {"title": chapter.title, "chars": len(chapter.text)}
        if with_text:
            entry["text"] = chapter.text
        chapters.append(entry)
    metadata = {key: value for key, value in document.metadata.items() if key != "left_out" and _json_safe(value)}
    return {
        "path": document.source,
        "format": document.format,
        "title": document_title(document),  # as summarize titles it: the document's own, else the file name
        "author": document.author,
        "chars": document.char_count,
        "chapters": chapters,
        "left_out": list(document.left_out),
        "metadata": metadata,
    }


def render_summary(document: Document) -> str:
    """Plain-text report of one document: readable in a terminal and when piped."""
    lines = [
        document.source,
        f"  title:      {document_title(document) or '(none)'}",
        f"  author:     {document.author or '(unknown)'}",
        f"  format:     {document.format}",
        *([f"  encoding:   {document.metadata['encoding']}"] if document.metadata.get("encoding") else []),
        f"  chapters:   {len(document.chapters)}",
        f"  characters: {document.char_count:,}",
    ]
    number_width = len(str(len(document.chapters)))
    for number, chapter in enumerate(document.chapters, start=1):
        title = chapter.title or "(untitled)"
        if len(title) > _TITLE_WIDTH:
            title = title[: _TITLE_WIDTH - 1] + "\u2026"
        padding = " " * max(0, _TITLE_WIDTH - cell_len(title))  # CJK characters are two cells wide
        lines.append(f"  {number:>{number_width}}  {title}{padding}  {len(chapter.text):>10,}")
    for index, description in enumerate(document.left_out):
        lines.append(f"  {'left out:' if index == 0 else '':<12}{description}")
    return "\n".join(lines)


def render_text(document: Document) -> str:
    """The extracted text, each chapter under its title."""
    parts = []
    for chapter in document.chapters:
        parts.append(f"{chapter.title}\n\n{chapter.text}" if chapter.title else chapter.text)
    return "\n\n\n".join(parts)


def _json_safe(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
