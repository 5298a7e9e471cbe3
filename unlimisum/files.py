"""Writing output files so that an interruption never leaves half of one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` all at once: a temporary file in the same folder, then os.replace.

    An interrupted or failed write removes the temporary file, so ``path`` is either the old
    file, or absent, or complete. The temporary file is hidden (leading dot) so that a later
    run over the folder does not read it. Missing parent folders are created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o666 & ~_current_umask())  # mkstemp makes 0600; give it a normal file's mode
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    return path


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
