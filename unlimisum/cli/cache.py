"""`unlimisum cache list|prune|clear`: the cache of encoded books (`summarize --cache-dir`), and the compiled
retrieval kernels kept in unlimisum's cache home.

    unlimisum cache list --cache-dir ~/.cache/unlimisum          # or UNLIMISUM_CACHE_DIR
    unlimisum cache prune                                        # what interrupted stores and old versions left
    unlimisum cache clear --older-than 30d
    unlimisum cache clear --kernels                              # the compiled kernels (compiled again when needed)

``list`` only reads: it changes nothing in the cache, not even what interrupted stores left.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Optional

import typer

from unlimisum.cli.app import EXIT_USAGE, UnlimisumGroup, UnlimisumTyper, app, fail
from unlimisum.cli.progress import format_bytes
from unlimisum.visible import json_text, visible

cache_app = UnlimisumTyper(
    name="cache", cls=UnlimisumGroup, help="The cache of encoded books (summarize --cache-dir): list, prune, clear.",
    no_args_is_help=True,
)
app.add_typer(cache_app, name="cache")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(value: str) -> float:
    """``30d`` -> seconds (s, m, h, d, w; a plain number is seconds); BadParameter otherwise."""
    match = _DURATION.match(value.lower())
    if not match:
        raise typer.BadParameter(f"'{value}' is not a duration; use e.g. 12h, 30d or 2w", param_hint="'--older-than'")
    return float(match[1]) * _SECONDS[match[2]]


def _cache_dir_option():
    return typer.Option(None, "--cache-dir", envvar="UNLIMISUM_CACHE_DIR", show_envvar=True, metavar="DIR",
                        file_okay=False, help="The cache folder (as given to summarize --cache-dir).")


def _open(cache_dir: Optional[Path]):
    from unlimisum.unlimiformer.cache import EncodedCache

    if cache_dir is None:
        raise fail("no cache folder: pass --cache-dir DIR or set UNLIMISUM_CACHE_DIR", EXIT_USAGE)
    if not cache_dir.expanduser().exists():  # a mistyped folder, or one no run has used yet: said, not made
        typer.echo(visible(f"unlimisum: no cache folder {cache_dir}: nothing in it (summarize --cache-dir makes it "
                           "on first use)"), err=True)
        raise typer.Exit(0)
    return EncodedCache(cache_dir)


@cache_app.command("list")
def list_entries(
    cache_dir: Optional[Path] = _cache_dir_option(),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per entry on stdout."),
) -> None:
    """The encoded books in the cache, most recently used first (the cache is only read)."""
    cache = _open(cache_dir)
    entries = cache.entries()
    if as_json:
        for entry in entries:
            typer.echo(json_text(json.dumps(entry.__dict__, ensure_ascii=False)))
        return
    now = time.time()
    for entry in entries:
        name = entry.title or entry.source or "(untitled)"  # a book's title: shown, never obeyed (visible.py)
        age = _age(now - entry.last_used)
        typer.echo(visible(f"{entry.key[:12]}  {format_bytes(entry.nbytes):>10}  {entry.n_tokens:>10,} tokens  "
                           f"used {age:>4} ago  {name}  [{entry.model}]"))
    total = sum(entry.nbytes for entry in entries)
    leftovers = cache.leftovers()
    writing = sum(nbytes for _, nbytes, stale in leftovers if not stale)
    left = [nbytes for _, nbytes, stale in leftovers if stale]
    under_way = f" (and {format_bytes(writing)} being stored)" if writing else ""
    typer.echo(f"{len(entries)} encoded book{'s' if len(entries) != 1 else ''}, {format_bytes(total)} "
               f"in {cache.directory}{under_way}", err=True)
    if left:
        typer.echo(f"{_folders(len(left))} of interrupted stores, {format_bytes(sum(left))}: "
                   "`unlimisum cache prune` removes them", err=True)
    stale = cache.stale()
    if stale:
        reasons = sorted({why for _, _, why in stale})
        typer.echo(visible(f"{len(stale)} entr{'y' if len(stale) == 1 else 'ies'} this release cannot read "
                           f"({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''}), "
                           f"{format_bytes(sum(nbytes for _, nbytes, _ in stale))}: `unlimisum cache prune` "
                           "removes them"), err=True)
    _kernels_line()


def _kernels_line() -> None:
    from unlimisum.diagnostics import compiled_kernels_in, files_bytes, stale_compiled_kernels
    from unlimisum.measurements import kernel_cache_folder

    files, size = compiled_kernels_in(kernel_cache_folder())
    if files:
        typer.echo(visible(f"compiled retrieval kernels: {files} files, {format_bytes(size)} in "
                           f"{kernel_cache_folder()} (`unlimisum cache clear --kernels` removes them)"), err=True)
    stale = stale_compiled_kernels()
    if stale:
        typer.echo(f"{len(stale)} of them, {format_bytes(files_bytes(stale))}, compiled from "
                   "another version of unlimisum: `unlimisum cache prune` removes those", err=True)


@cache_app.command("prune")
def prune(cache_dir: Optional[Path] = _cache_dir_option()) -> None:
    """Remove what interrupted stores left (the folders of a killed process's half-written entries), the entries
    this release cannot read (an older store format, another release's) and the compiled kernels of other versions
    of unlimisum; stores under way, encoded books it reads and this version's kernels are kept. Without a cache
    folder, only the kernels."""
    from unlimisum.diagnostics import clear_stale_compiled_kernels

    files, freed = clear_stale_compiled_kernels()
    if files:
        typer.echo(f"removed {files} compiled kernel file{'s' if files != 1 else ''} of other versions, "
                   f"{format_bytes(freed)}", err=True)
    if cache_dir is None:
        typer.echo("no cache folder (--cache-dir or UNLIMISUM_CACHE_DIR): encoded books left as they are", err=True)
        return
    cache = _open(cache_dir)
    removed, freed = cache.remove_leftovers()
    stale, stale_bytes = cache.remove_stale()
    typer.echo(f"removed {_folders(removed)} of interrupted stores, {format_bytes(freed)}", err=True)
    if stale:
        typer.echo(f"removed {stale} entr{'y' if stale == 1 else 'ies'} this release cannot read, "
                   f"{format_bytes(stale_bytes)}", err=True)


@cache_app.command("clear")
def clear(
    cache_dir: Optional[Path] = _cache_dir_option(),
    older_than: Optional[str] = typer.Option(
        None, "--older-than", metavar="AGE", help="Only entries unused for this long (e.g. 30d, 12h)."
    ),
    kernels: bool = typer.Option(
        False, "--kernels", help="Also remove the compiled retrieval kernels kept in unlimisum's cache home (the "
        "next long book compiles them again, about 10 s); no --cache-dir needed for them alone.",
    ),
) -> None:
    """Remove encoded books from the cache (all of them, or those unused for --older-than), and with --kernels
    the compiled retrieval kernels."""
    if kernels:
        from unlimisum.diagnostics import clear_compiled_kernels

        files, freed = clear_compiled_kernels()
        typer.echo(f"removed {files} compiled kernel file{'s' if files != 1 else ''}, {format_bytes(freed)}", err=True)
        if cache_dir is None:
            return
    cache = _open(cache_dir)
    seconds = parse_duration(older_than) if older_than is not None else None
    count, freed = cache.clear(older_than_seconds=seconds)
    typer.echo(f"removed {count} encoded book{'s' if count != 1 else ''}, {format_bytes(freed)}", err=True)


def _folders(count: int) -> str:
    return f"{count} folder{'s' if count != 1 else ''}"


def _age(seconds: float) -> str:
    for unit, size in (("w", 7 * 86400), ("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"
