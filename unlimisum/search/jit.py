"""How the compiled kernels (compiled.py) are compiled: numba, the threading layer it runs them on, and where it
keeps their machine code.

numba chooses where a function's cache lives when the function is decorated (``numba.config.CACHE_DIR`` then):
``begin_decorations`` sets ours, a folder under kernels/ of unlimisum's cache home (never the installed package,
which may be read-only or shared), for compiled_loops.py's, score_loops.py's and top_k_loops.py's decorations only, and
``end_decorations`` gives the setting back, so other numba code in the process keeps its own. Where the folder
cannot be written the kernels are not cached at all (numba would fall back to the package) and every process
compiles them again.

numba keys a cached kernel on its own module's file alone (its time and size): a change to the intrinsics it
inlines (llvm.py), to a helper of another module, or to the flags here would load machine code of the old
source, in an editable install or a checkout. So the folder is named by a digest of every file that goes into the
kernels (``measurements.KERNEL_SOURCES``): other code, another folder.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable

import numba

from unlimisum.measurements import kernel_code_folder

if "NUMBA_THREADING_LAYER" not in os.environ:
    # OpenMP first: torch's own runtime where torch loaded it (compiled.py); numba's thread pool where it cannot
    numba.config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


CODE_FOLDER = kernel_code_folder()  # this code's machine code (named by a digest of KERNEL_SOURCES)
CACHED = _writable(CODE_FOLDER)  # whether the machine code is kept between processes
# the fp32 rules the kernels may bend: reassociation (to sum with vector registers) and fused multiply-adds,
# never the ones that assume no infinities or NaNs (the threshold starts at -inf)
FAST = {"reassoc", "contract", "nsz"}
_others_cache_dir: list[str] = []  # the setting begin_decorations replaced


def kernel(function: Callable) -> Callable:
    """``function`` compiled for one thread, cached."""
    return numba.njit(nogil=True, cache=CACHED, fastmath=FAST)(function)


def parallel_kernel(function: Callable) -> Callable:
    """``function`` compiled with its ``numba.prange`` loops spread over threads, cached."""
    return numba.njit(nogil=True, cache=CACHED, fastmath=FAST, parallel=True)(function)


def begin_decorations() -> None:
    """Point numba's cache at ours for the decorations that follow (until ``end_decorations``)."""
    _others_cache_dir.append(numba.config.CACHE_DIR)
    numba.config.CACHE_DIR = str(CODE_FOLDER) if CACHED else ""


def end_decorations() -> None:
    """Give numba's cache setting back: every kernel is decorated."""
    numba.config.CACHE_DIR = _others_cache_dir.pop()
