"""Speed choices measured once per machine, kept in the user's cache folder; races that stop early.

unlimisum chooses its speed settings by measuring (the CPU dtype under ``--dtype auto``, the exact
retrieval kernel and its block sizes), never by the CPU's name. Measuring costs a second at most, and
only once per machine: what a measurement found is kept in ``measurements.json`` under the user's cache
folder (``$UNLIMISUM_CACHE_HOME``, else ``$XDG_CACHE_HOME/unlimisum``, else ``~/.cache/unlimisum``), under
a key naming the machine as the measurement saw it: CPU model and flags, torch release, threads, and the
settings that change which CPU instructions the libraries use (``ATEN_CPU_CAPABILITY``,
``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS``...). Another machine, another torch or another thread
count measures again; ``unlimisum info`` lists what was measured and when, and ``unlimisum info
--remeasure`` forgets every entry of this machine (whatever its thread count or settings). A file that
cannot be read or written, or that holds something else than measurements, only costs the measurement
again (said once per process): a choice of speed never fails a run. Processes that write at once (Ray
workers starting together, two terminals) take turns under a lock and each merges what the others wrote.

A kept choice is checked against the live run that uses it (``LiveCheck``): where it runs
``LIVE_SLOWER_FACTOR`` times slower than its measurement found (measured while the machine was busy, or the
machine changed), it is forgotten and measured again when next needed.

``race`` times candidates in turns and stops timing one as soon as it is clearly the loser, so that a
candidate tens of times slower than the others (a 16-bit matmul on a CPU without 16-bit units) costs
one call, not many.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Mapping, TypeVar

from unlimisum.errors import UnlimisumWarning
from unlimisum.files import atomic_write_bytes
from unlimisum.version import __version__

FILE_NAME = "measurements.json"
KERNEL_FOLDER = "kernels"  # beside it: numba's machine code of the compiled retrieval kernels
# What an entry's value means changes with the code that measured it: entries of another format are ignored.
FORMAT_VERSION = 1
# Settings that change which instructions torch, oneDNN, MKL and numba (the compiled kernels) use: a measurement
# under one is not another's.
INSTRUCTION_SETTINGS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
                        "MKL_CBWR", "OMP_NUM_THREADS", "NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES")
# A race stops timing a candidate whose best time is this many times the leader's: it will not be chosen.
GIVE_UP_FACTOR = 4.0
# ... and after its first call only from this many times: a first call may carry one-time costs (a oneDNN kernel's
# code generated, buffers faulted in): a bfloat16 matmul's first call in a calibration took 5.3x its later ones on an
# EPYC Zen 5, and the packed kernel was chosen over it; a CPU without 16-bit units runs it 50x slower
FIRST_CALL_GIVE_UP_FACTOR = 16.0
# A kept choice whose live cost is this many times what its measurement found is measured again (``LiveCheck``),
# judged on the median of its first LIVE_SAMPLES calls in a process.
LIVE_SLOWER_FACTOR = 1.5
LIVE_SAMPLES = 8
# What identifies the machine itself in an entry's identity: ``forget`` drops every entry that matches on these
# (other thread counts and instruction settings of the same machine included).
MACHINE_FIELDS = ("cpu", "cpu_flags", "machine")

Clock = Callable[[], float]


class MeasurementsWarning(UnlimisumWarning):
    """The file of measurements could not be used as it was: what it held is measured again."""


def cache_home() -> Path:
    """The user's cache folder for unlimisum: $UNLIMISUM_CACHE_HOME, else $XDG_CACHE_HOME/unlimisum, else
    ~/.cache/unlimisum."""
    explicit = os.environ.get("UNLIMISUM_CACHE_HOME", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "unlimisum"


def kernel_cache_folder() -> Path:
    """Where the compiled retrieval kernels are kept (unlimisum/search/compiled.py): $NUMBA_CACHE_DIR where it
    is set, else the folder ``kernels`` of the cache home (never the installed package)."""
    explicit = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    return Path(explicit).expanduser() if explicit else cache_home() / KERNEL_FOLDER


# the files of unlimisum/search whose code numba compiles into the kernels (search/jit.py): the decorated modules,
# the intrinsics and helpers they inline, jit.py's flags
KERNEL_SOURCES = ("compiled_loops.py", "score_loops.py", "top_k_loops.py", "linear_loops.py", "grouped_loops.py",
                  "llvm.py", "jit.py")


def kernel_code_folder() -> Path:
    """Where this code's compiled kernels are kept: the folder of ``kernel_cache_folder()`` named by a digest of
    KERNEL_SOURCES (numba keys a cached kernel on its own module's file alone: other code, another folder)."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / "search" / name).read_bytes())
    return kernel_cache_folder() / f"code-{digest.hexdigest()[:16]}"


def machine_identity() -> dict[str, str]:
    """What a measurement depends on beside the code: the CPU, the torch build, its threads, the instruction
    settings in the environment."""
    import torch

    cpu, flags = _cpu_description()
    identity = {
        "cpu": cpu,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": str(torch.get_num_threads()),
        "unlimisum": __version__,
        "format": str(FORMAT_VERSION),
    }
    for name in INSTRUCTION_SETTINGS:
        value = os.environ.get(name)
        if value is not None:
            identity[name] = value
    return identity


def machine_key(identity: Mapping[str, str] | None = None) -> str:
    """A short digest of ``machine_identity()``: the key this machine's entries are kept under."""
    fields = json.dumps(dict(identity or machine_identity()), sort_keys=True)
    return hashlib.sha256(fields.encode()).hexdigest()[:20]


def _cpu_description() -> tuple[str, str]:
    """(CPU model name, its flags) from /proc/cpuinfo where there is one, else what platform says."""
    name, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as file:
            for line in file:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and name in ("", platform.machine(), platform.processor()):
                    name = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = " ".join(sorted(value.split()))
                if name and flags and key == "":
                    break
    except OSError:
        pass
    return name, flags


@dataclass(frozen=True)
class Measurement:
    """One thing measured on this machine: its value, when, what it cost, and what was found."""

    name: str  # e.g. "cpu-dtype", "kernel cpu bfloat16 768"
    value: object  # plain JSON data
    measured_at: str  # ISO 8601, UTC
    seconds: float  # what measuring took
    reason: str  # one line: what was timed and what won
    kept: bool = False  # read from the file (an earlier process measured it), not measured by this process


class MeasurementStore:
    """``measurements.json`` in the cache folder: per machine key, the measurements made there.

    Reads and writes never raise for a missing, unreadable, damaged or wrongly shaped file: the measurement is
    made again (and kept in memory for the process), and a ``MeasurementsWarning`` says so once. Writes are
    atomic, taken in turns with other processes (a lock file beside it) and merge with what they wrote.
    """

    def __init__(self, path: Path | None = None, key: str | None = None):
        self.path = path if path is not None else cache_home() / FILE_NAME
        self._key = self._explicit_key = key
        self._lock = threading.Lock()
        self._memory: dict[str, Measurement] = {}  # this process's own, also when the file is not writable
        self._warned = False

    @property
    def key(self) -> str:
        if self._key is None:
            self._key = machine_key()
        return self._key

    def get(self, name: str) -> Measurement | None:
        """This machine's measurement ``name``, or None."""
        if name in self._memory:
            return self._memory[name]
        entry = self._read().get(self.key, {}).get("measurements", {}).get(name)
        measurement = _parse(name, entry)
        if measurement is not None:
            self._memory[name] = measurement
        return measurement

    def put(self, measurement: Measurement) -> None:
        """Keep ``measurement`` for this machine (in memory at least)."""
        with self._lock:
            self._memory[measurement.name] = measurement
            with self._file_lock():
                data = self._read()
                entry = data.setdefault(self.key, {})
                if self._explicit_key is None:  # what the key stands for, for a person reading the file
                    entry["machine"] = machine_identity()
                entry.setdefault("measurements", {})[measurement.name] = {
                    "value": measurement.value, "measured_at": measurement.measured_at,
                    "seconds": measurement.seconds, "reason": measurement.reason,
                }
                self._write(data)

    def all(self) -> list[Measurement]:
        """This machine's measurements, oldest first."""
        stored = self._read().get(self.key, {}).get("measurements", {})
        found = {name: _parse(name, entry) for name, entry in stored.items()}
        found.update(self._memory)
        return sorted((m for m in found.values() if m is not None), key=lambda m: m.measured_at)

    def forget(self) -> int:
        """Drop every measurement of this machine (this key's, and every other key's whose identity names the same
        CPU: other thread counts and instruction settings, Ray workers' among them); they are made again when next
        needed. Returns how many were dropped."""
        with self._lock, self._file_lock():
            data = self._read()
            mine = machine_identity() if self._explicit_key is None else {}
            same = [key for key, entry in data.items() if key == self.key or (
                mine and all(entry.get("machine", {}).get(field) == mine[field] for field in MACHINE_FIELDS))]
            dropped = sum(len(data.pop(key).get("measurements", {})) for key in same)
            dropped = max(dropped, len(self._memory))
            self._memory.clear()
            self._write(data)
            return dropped

    def forget_one(self, name: str) -> None:
        """Drop this machine's measurement ``name`` (measured again when next needed, in this process too)."""
        with self._lock, self._file_lock():
            self._memory.pop(name, None)
            data = self._read()
            if data.get(self.key, {}).get("measurements", {}).pop(name, None) is not None:
                self._write(data)

    def _read(self) -> dict:
        """The file's entries: {key: {"machine": {...}, "measurements": {name: {...}}}}, only those of that shape;
        {} for a missing file. A file that is not JSON, or holds something else, is read as what of it has that
        shape (nothing, often), and a warning says so once."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:  # unreadable, or not UTF-8
            self._warn(f"it cannot be read ({type(error).__name__})")
            return {}
        try:
            data = json.loads(text)
        except ValueError:
            self._warn("it is not JSON")
            return {}
        kept = _well_formed(data)
        if kept != data:
            self._warn("it holds entries of another shape")
        return kept

    def _warn(self, problem: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"unlimisum: warning: {self.path}: {problem}; the speed choices it should hold are measured "
                          "again",
                          MeasurementsWarning, stacklevel=4)

    def _write(self, data: dict) -> None:
        try:
            atomic_write_bytes(self.path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode("utf-8"))
        except OSError:
            pass  # kept in memory for this process; measured again by the next one

    @contextmanager
    def _file_lock(self):
        """Other processes' reads and writes of the file wait (a lock on ``measurements.json.lock`` beside it,
        where the system has one: fcntl); without a lock file, writes still merge with the file as read."""
        try:
            import fcntl

            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path.with_name(self.path.name + ".lock"), "a")
        except (ImportError, OSError):
            yield
            return
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX)
            except OSError:
                pass
            yield  # the lock goes with the handle


def _well_formed(data) -> dict:
    """The entries of ``data`` shaped as the store writes them (see ``MeasurementStore._read``)."""
    if not isinstance(data, dict):
        return {}
    kept = {}
    for key, entry in data.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("measurements", {}), dict):
            continue
        if "machine" in entry and not isinstance(entry["machine"], dict):
            continue
        measurements = {name: item for name, item in entry.get("measurements", {}).items()
                        if _parse(name, item) is not None}
        if measurements != entry.get("measurements", {}):
            continue  # one damaged item: the whole entry is measured again rather than half trusted
        kept[key] = entry
    return kept


def _parse(name: str, entry) -> Measurement | None:
    if not isinstance(entry, dict) or "value" not in entry:
        return None
    try:
        return Measurement(name, entry["value"], str(entry.get("measured_at", "")), float(entry.get("seconds", 0.0)),
                           str(entry.get("reason", "")), kept=True)
    except (TypeError, ValueError):
        return None


_DEFAULT_STORE: MeasurementStore | None = None


def default_store() -> MeasurementStore:
    """The store in the user's cache folder (made on first use; follows UNLIMISUM_CACHE_HOME as it was then)."""
    global _DEFAULT_STORE
    if _DEFAULT_STORE is None or _DEFAULT_STORE.path != cache_home() / FILE_NAME:
        _DEFAULT_STORE = MeasurementStore()
    return _DEFAULT_STORE


def remembered(name: str, measure: Callable[[], tuple[object, str]], *, store: MeasurementStore | None = None,
               clock: Clock = time.perf_counter) -> Measurement:
    """This machine's measurement ``name``: kept from an earlier run, else made now by ``measure()`` (which
    returns the value, plain JSON data, and a one-line reason) and kept. ``Measurement.kept`` says which."""
    store = store if store is not None else default_store()
    found = store.get(name)
    if found is not None:
        return found
    started = clock()
    value, reason = measure()
    measurement = Measurement(name, value, datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              clock() - started, reason)
    store.put(measurement)
    return measurement


_Choice = TypeVar("_Choice")  # a measured choice: a dataclass with a ``reason``


def remembered_choice(name: str, measure: Callable[[], _Choice], kind: type[_Choice]) -> tuple[_Choice, bool | None]:
    """``remembered`` for a choice that ``measure()`` makes as a dataclass of ``kind`` with a ``reason``: (the
    choice, whether it was kept from an earlier run), or, where the kept entry is another release's (its fields
    are not ``kind``'s), (a choice measured again for this process, None)."""
    found = remembered(name, lambda: (asdict(choice := measure()), choice.reason))
    try:
        return kind(**found.value), found.kept
    except TypeError:
        return measure(), None


class LiveCheck:
    """What a kept choice costs in the live run, against what its measurement found: ``observe(seconds,
    expected)`` for each live call (``expected``: what the measurement predicts for that call); once LIVE_SAMPLES
    calls are seen, a median ratio over LIVE_SLOWER_FACTOR drops the kept measurement ``name``, so that the next
    run that needs it measures again (a choice measured while the machine was busy is not kept forever), and
    says so once; ``slower`` is then True. The check of a measurement made by this process (``kept`` False) is
    idle, as is every check once decided."""

    def __init__(self, name: str, kept: bool = True, store: MeasurementStore | None = None):
        self.name = name
        self.store = store
        self.ratios: list[float] = []
        self.done = not kept
        self.slower = False

    def observe(self, seconds: float, expected: float) -> None:
        if self.done or not expected > 0:
            return
        self.ratios.append(seconds / expected)
        if len(self.ratios) < LIVE_SAMPLES:
            return
        self.done = True
        typical = sorted(self.ratios)[len(self.ratios) // 2]
        if typical > LIVE_SLOWER_FACTOR:
            self.slower = True
            (self.store if self.store is not None else default_store()).forget_one(self.name)
            warnings.warn(f"unlimisum: note: the speed choice '{self.name}' ran {typical:.1f}x slower than when it was "
                          "measured; it is measured again next time", MeasurementsWarning, stacklevel=2)


def race(candidates: Mapping[str, Callable[[], object]], *, turns: int = 3, give_up: float = GIVE_UP_FACTOR,
         clock: Clock = time.perf_counter, timer: Callable[[Callable[[], object]], float] | None = None,
         ) -> dict[str, float]:
    """The best time of each candidate, timed in turns (a b c a b c ...) so that a busy moment of a shared
    machine falls on all alike. The first turn also warms up (buffers grow, kernels are picked), so every
    candidate is called at least twice, except one whose first call already took FIRST_CALL_GIVE_UP_FACTOR
    (or ``give_up``, if more) times the leader's best: it is clearly the loser and is not called again. After
    that, a candidate ``give_up`` times slower than the leader is not timed again. ``timer(run)``: seconds of one
    call (default: ``clock`` around it); a candidate not timed again keeps its best (slow) time, so it is not
    chosen."""
    timed = timer if timer is not None else (lambda run: _time_with(clock, run))
    best: dict[str, float] = {}
    for name, run in candidates.items():
        best[name] = timed(run)
    for turn in range(turns):
        leader = min(best.values())
        factor = max(give_up, FIRST_CALL_GIVE_UP_FACTOR) if turn == 0 else give_up
        for name, run in candidates.items():
            if best[name] <= factor * leader:
                best[name] = min(best[name], timed(run))
    return best


def _time_with(clock: Clock, run: Callable[[], object]) -> float:
    started = clock()
    run()
    return clock() - started
