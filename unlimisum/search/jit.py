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

A parallel driver (``parallel_driver``: one call for all heads, spread over the threads) calls its kernels at
their addresses, passed to it at run time (``callee``), not by name: numba links a kernel called by name into its
caller's code and optimises and emits it again there, twice in a parallel caller, and that was most of a first
run's compile (the scan 13.9 -> 8.6 s, the dense attention 10.4 -> 4.4 s; ``python -m bench.compile_time``).
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


class _Entry:
    """Where ``kernel``'s machine code for one signature starts, compiled (or loaded from the cache) when first
    asked."""

    def __init__(self, kernel, signature: tuple):
        self.kernel, self.signature, self._address = kernel, signature, 0

    def __call__(self) -> int:
        if not self._address:
            self.kernel.compile(self.signature)
            result = self.kernel.overloads[self.signature]
            address = result.library.get_pointer_to_function(result.fndesc.llvm_func_name)
            if not address:
                raise RuntimeError(f"numba gave no address for {self.kernel.__name__}{self.signature}")
            self._address = address
        return self._address


def callee(kernel: Callable, *argument_types, returns=None):
    """The intrinsic a parallel driver calls ``kernel`` with at its address, ``call(address, (arguments...))``,
    the arguments' numba types exactly ``argument_types`` (``returns``: the kernel's return type, none by
    default); ``call.address()`` is that address, compiled (or loaded) on first asking, which the driver's caller
    passes (``parallel_driver``). Called by name, the scan's kernel (8.5 s to compile) was linked, optimised and
    emitted again into its parallel driver's loop body and the driver (7.0 s more); by address, 0.6 s more (a
    2-core EPYC Zen 4)."""
    from unlimisum.search.llvm import call_at_of

    signature = tuple(argument_types)
    call = call_at_of(signature, returns if returns is not None else numba.types.none)
    call.address = _Entry(kernel, signature)
    return call


class Driver:
    """A parallel kernel (``parallel_kernel``) whose loop calls kernels by address (``callee``): called with its
    own arguments, it passes their addresses after them, in order."""

    def __init__(self, function: Callable, calls: tuple):
        self.dispatcher, self.calls = parallel_kernel(function), calls

    def __call__(self, *args):
        return self.dispatcher(*args, *[call.address() for call in self.calls])

    @property
    def signatures(self) -> list:
        """The signatures the driver was compiled (or loaded) for in this process."""
        return self.dispatcher.signatures


def parallel_driver(*calls) -> Callable[[Callable], Driver]:
    """Decorates a ``Driver`` that calls kernels by the intrinsics ``calls`` (``callee``'s): its last arguments
    are their addresses."""
    return lambda function: Driver(function, calls)
