"""Command-line paths to the list of inputs: files as given, directories expanded."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

SUPPORTED_SUFFIXES = frozenset({".txt", ".text", ".md", ".markdown", ".epub", ".pdf"})
STDIN = "-"


def expand_paths(paths: Iterable[str | Path]) -> list[Path | str]:
    """Turn the paths a user gave into the inputs to read, in order.

    - ``"-"`` stays ``"-"`` (standard input).
    - A directory becomes the supported files under it (by suffix, case-insensitive;
      files without a suffix are skipped there), recursively, sorted, skipping hidden
      files and folders, anything that is not a regular file, and symlinked folders
      already visited (no loops). A directory with no supported file is returned as it
      is, so that reading it reports the problem.
    - Anything else, including paths that do not exist, is returned as given: the
      error comes from ``read_document`` for that one input, so a batch goes on past it.
    """
    inputs: list[Path | str] = []
    for raw in paths:
        if str(raw) == STDIN:
            inputs.append(STDIN)
            continue
        path = Path(raw)
        if path.is_dir():
            found = _walk(path)
            inputs.extend(found if found else [path])
        else:
            inputs.append(path)
    return inputs


def is_supported(path: Path) -> bool:
    """True when the file name has one of SUPPORTED_SUFFIXES (any case)."""
    return path.suffix.lower() in SUPPORTED_SUFFIXES


def _walk(root: Path) -> list[Path]:
    found: list[Path] = []
    visited: set[tuple[int, int]] = set()
    pending = [root]
    while pending:
        folder = pending.pop()
        try:
            info = folder.stat()
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in visited:  # a symlink loop or a second link to it
            continue
        visited.add((info.st_dev, info.st_ino))
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith("."):
                continue
            try:
                if entry.is_dir():  # follows symlinks; the visited set stops loops
                    pending.append(Path(entry.path))
                elif stat.S_ISREG(os.stat(entry.path).st_mode) and is_supported(Path(entry.name)):
                    found.append(Path(entry.path))
            except OSError:  # dangling symlink, permission denied
                continue
    return sorted(found)
