"""A cache of encoded books: summarize the same book again with other options, without encoding it.

One entry per (text, model, tokenizer, window, overlap, storage dtype, model dtype, device type,
store format), in a folder of its own under the cache directory::

    <cache>/<key>/meta.json    what the entry is, sizes, checksums, chapters and windows
    <cache>/<key>/states.bin   [N, d] encoder states, raw little-endian 16- or 32-bit numbers
    <cache>/<key>/ids.bin      [N] token ids, raw little-endian int64
    <cache>/<key>/ends.bin     [N] each token's end character in the text, int64 (when the tokenizer
                               gives offsets: the chapters are mapped through them on loading)
    <cache>/<key>/keys.bin     [L, H, N, d_head] the per-layer key store (unlimisum/search/keys.py),
                               in the states' dtype, when the run that encoded the book built it and the
                               entry with it stays within the cache's size cap and half the free disk
                               (``keys_fit``); a hit without it rebuilds the keys from the states

Raw arrays plus JSON: nothing is unpickled. Entries are written in a temporary folder
(``.tmp-<pid>-<host>-<id>``) and renamed into place; on loading, every field of the metadata must
have its type (the windows tiling the tokens) and the sizes and CRC-32 checksums must match, else
the entry is reported in one line, removed, and the book encoded again; an entry removed by another
process while it is read is a miss. The states are memory-mapped, so a cached 500k-token book costs
no copy. Least recently used entries go first when the cache exceeds its size cap, which counts the
folders of stores under way too; those a killed writer left (older than an hour, or whose writer is
gone) are removed on every store and eviction and by ``cache prune``. Entries no run of this release can
read (``stale``: an older store format, another release's states, metadata that cannot be read) are listed
by ``cache list`` with their size and removed by ``cache prune`` and ``cache clear``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import sys
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# Bump when what an entry holds, or how its tokens or states are computed, changes (tests/test_encoded_cache.py
# holds a fingerprint of the tokens of a fixed text): 2: token end offsets, chapters mapped on loading;
# 3: the strings of added tokens in a text (special or not) tokenized as text; 4: the per-layer key store
# (keys.bin, meta "keys").
STORE_FORMAT_VERSION = 4
_NUMPY_DTYPES = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_CHECKSUM_CHUNK = 64 * 2**20
_TEMPORARY = ".tmp-"  # prefix of the folder an entry is written in, before it is renamed into place
STALE_SECONDS = 3600  # a temporary folder untouched this long belongs to a writer that was killed
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # tells this machine's writers apart


class CacheEntryError(Exception):
    """An entry that cannot be used: corrupt, truncated, or not what its key promises."""


@dataclass(frozen=True)
class CacheKey:
    """Everything that changes the encoded states of a text."""

    text_sha256: str
    model: str  # name and revision (hub commit) or a fingerprint of the weights
    tokenizer: str
    window: int
    overlap: float
    storage_dtype: str
    model_dtype: str
    device_type: str
    software: str = ""  # transformers and torch releases, the attention kernel, the encoder's code path
    format_version: int = STORE_FORMAT_VERSION
    # The release that computed the states: a release that computes them otherwise never reads old entries.
    unlimisum: str = field(default_factory=lambda: _unlimisum_version())

    @property
    def digest(self) -> str:
        """The entry's folder name."""
        fields = json.dumps(self.__dict__, sort_keys=True)
        return hashlib.sha256(fields.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class CachedEncoding:
    """What an entry holds, loaded: states memory-mapped, ids in memory, and the metadata."""

    states: torch.Tensor  # [N, d], memory-mapped (copy-on-write: the file is never changed)
    token_ids: torch.Tensor  # [N] int64
    meta: dict
    token_ends: torch.Tensor | None = None  # [N] int64 end characters, when the entry has them
    keys: torch.Tensor | None = None  # [L, H, N, dh] per-layer keys, memory-mapped, when the entry has them


@dataclass(frozen=True)
class EntryInfo:
    """One entry, for `unlimisum cache list`."""

    key: str
    title: str
    source: str
    model: str
    n_tokens: int
    nbytes: int
    last_used: float  # seconds since the epoch


def _unlimisum_version() -> str:
    from unlimisum.version import __version__

    return __version__


def text_sha256(text: str) -> str:
    """The hash that keys a text."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class EncodedCache:
    """The cache directory: look up, store, list, clear, and keep it under ``max_bytes``."""

    def __init__(self, directory: str | Path, *, max_bytes: int | None = None,
                 warn: Callable[[str], None] | None = None):
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes  # None: no cap
        self.warn = warn or (lambda message: print(f"unlimisum: warning: {message}", file=sys.stderr))

    # -- one entry -------------------------------------------------------------------------------

    def load(self, key: CacheKey) -> CachedEncoding | None:
        """The entry for ``key``, or None when there is none or it cannot be used (then it is removed)."""
        folder = self.directory / key.digest
        if not folder.is_dir():
            return None
        try:
            entry = _read_entry(folder, key)
        except FileNotFoundError:  # removed by another process (evicted) while it was being read: a miss
            return None
        except CacheEntryError as error:
            if not (folder / "meta.json").exists():  # removed meanwhile, not damaged
                return None
            self.warn(f"cache entry {folder} is unusable ({error}); encoding again")
            shutil.rmtree(folder, ignore_errors=True)
            return None
        try:
            os.utime(folder / "meta.json")  # least recently used = oldest meta.json
        except OSError:  # a read-only cache is still a cache
            pass
        return entry

    def keys_fit(self, entry_bytes: int, keys_bytes: int) -> bool:
        """Whether an entry of ``entry_bytes`` may hold ``keys_bytes`` of per-layer keys too: within the size cap
        (when there is one) and half the free disk space."""
        if self.max_bytes is not None and entry_bytes + keys_bytes > self.max_bytes:
            return False
        try:
            free = shutil.disk_usage(self.directory if self.directory.exists() else self.directory.parent).free
        except OSError:
            return False
        return keys_bytes <= free / 2

    def store(self, key: CacheKey, states: torch.Tensor, token_ids: torch.Tensor, meta: dict,
              token_ends: torch.Tensor | None = None, keys: torch.Tensor | None = None) -> Path | None:
        """Write an entry (atomically: a temporary folder renamed into place); its folder, or None when the
        cache cannot be written (said in one warning line: the summary goes on). ``keys`` [L, H, N, dh], the
        per-layer key store, is written with it where ``keys_fit``."""
        final = self.directory / key.digest
        temporary = self.directory / f"{_TEMPORARY}{os.getpid()}-{_HOST}-{uuid.uuid4().hex}"
        entry_bytes = states.numel() * states.element_size() + token_ids.numel() * 8 * (2 if token_ends is not None else 1)
        if keys is not None and not self.keys_fit(entry_bytes, keys.numel() * keys.element_size()):
            keys = None
        keys_record = None
        if keys is not None:
            if keys.dim() != 4 or keys.shape[2] != states.shape[0] or keys.dtype != states.dtype:
                raise ValueError(f"keys must be [L, H, {states.shape[0]}, dh] {states.dtype}, got "
                                 f"{keys.dtype} {list(keys.shape)}")
            keys_record = {"layers": int(keys.shape[0]), "heads": int(keys.shape[1]), "head_dim": int(keys.shape[3]),
                           "crc32": 0}
        record = dict(meta, key=key.__dict__, n_tokens=int(states.shape[0]), dim=int(states.shape[1]),
                      dtype=_DTYPE_NAMES[states.dtype], states_crc32=0, ids_crc32=0,
                      ends_crc32=0 if token_ends is not None else None, keys=keys_record, created=time.time())
        check_meta(record)  # ValueError: what the caller gives must make an entry that can be read back
        self.remove_leftovers()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            temporary.mkdir()
            states_crc = _write_array(temporary / "states.bin", _as_numpy(states))
            ids_crc = _write_array(temporary / "ids.bin", token_ids.cpu().to(torch.int64).numpy())
            ends_crc = None
            if token_ends is not None:
                ends_crc = _write_array(temporary / "ends.bin", token_ends.cpu().to(torch.int64).numpy())
            if keys is not None:
                keys_record["crc32"] = _write_array(temporary / "keys.bin", _as_numpy(keys))
            record.update(states_crc32=states_crc, ids_crc32=ids_crc, ends_crc32=ends_crc)
            (temporary / "meta.json").write_text(json.dumps(record, ensure_ascii=False, indent=1), encoding="utf-8")
            os.rename(temporary, final)
        except OSError as error:
            shutil.rmtree(temporary, ignore_errors=True)
            if final.is_dir():  # another run stored the same entry meanwhile
                return final
            self.warn(f"could not write to the cache {self.directory} ({error.strerror or error})")
            return None
        self.evict(keep=final)
        return final

    # -- the whole cache -----------------------------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        """Every usable entry, most recently used first."""
        return self._scan()[0]

    def stale(self) -> list[tuple[Path, int, str]]:
        """(folder, bytes, why) of every entry no run of this release can read: written in an older store format
        or by another release (its key can never match), or whose metadata cannot be read."""
        return self._scan()[1]

    def remove_stale(self) -> tuple[int, int]:
        """Remove the ``stale`` entries; (count, bytes) removed."""
        count = freed = 0
        for folder, nbytes, _ in self.stale():
            shutil.rmtree(folder, ignore_errors=True)
            count, freed = count + 1, freed + nbytes
        return count, freed

    def _scan(self) -> tuple[list[EntryInfo], list[tuple[Path, int, str]]]:
        """(usable entries, most recently used first; stale ones: folder, bytes, why)."""
        found, stale = [], []
        if not self.directory.is_dir():
            return found, stale
        for folder in self.directory.iterdir():
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            meta_path = folder / "meta.json"
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                why = _stale_format(meta)
                if why is None:
                    check_meta(meta)
                    found.append(EntryInfo(folder.name, meta.get("title") or "", meta.get("source") or "",
                                           str(meta["key"].get("model", "")), meta["n_tokens"],
                                           _folder_bytes(folder), meta_path.stat().st_mtime))
                    continue
            except FileNotFoundError:  # removed meanwhile, or a folder being removed
                continue
            except (OSError, ValueError) as error:
                why = f"its metadata cannot be read ({' '.join(str(error).split())[:80]})"
            try:
                stale.append((folder, _folder_bytes(folder), why))
            except OSError:  # removed meanwhile
                continue
        return sorted(found, key=lambda entry: entry.last_used, reverse=True), stale

    def leftovers(self) -> list[tuple[Path, int, bool]]:
        """(folder, bytes, whether it may be removed) of every entry being written, or left half-written by a
        writer that was killed: removable when untouched for STALE_SECONDS or when its writer is gone."""
        found = []
        if not self.directory.is_dir():
            return found
        now = time.time()
        for folder in self.directory.glob(f"{_TEMPORARY}*"):
            try:
                files = [path.stat() for path in folder.iterdir()]
                touched = max([folder.stat().st_mtime] + [info.st_mtime for info in files])
            except OSError:  # renamed into place or removed meanwhile
                continue
            stale = now - touched >= STALE_SECONDS or _writer_gone(folder.name)
            found.append((folder, sum(info.st_size for info in files), stale))
        return found

    def remove_leftovers(self) -> tuple[int, int]:
        """Remove what killed writers left (see ``leftovers``); (count, bytes) removed."""
        count = freed = 0
        for folder, nbytes, stale in self.leftovers():
            if stale:
                shutil.rmtree(folder, ignore_errors=True)
                count, freed = count + 1, freed + nbytes
        return count, freed

    def clear(self, older_than_seconds: float | None = None) -> tuple[int, int]:
        """Remove entries (only those unused for ``older_than_seconds``, when given); (count, bytes) removed."""
        now, count, freed = time.time(), 0, 0
        entries, stale = self._scan()
        damaged = [folder for folder, _, _ in stale]
        for entry in entries:
            if older_than_seconds is not None and now - entry.last_used < older_than_seconds:
                continue
            shutil.rmtree(self.directory / entry.key, ignore_errors=True)
            count, freed = count + 1, freed + entry.nbytes
        # damaged entries count as entries; the folders of stores (interrupted or under way) do not
        temporary = list(self.directory.glob(f"{_TEMPORARY}*")) if self.directory.is_dir() else []
        for folder, counted in [(folder, True) for folder in damaged] + [(folder, False) for folder in temporary]:
            try:
                if older_than_seconds is None or now - folder.stat().st_mtime >= older_than_seconds:
                    nbytes = _folder_bytes(folder)
                    shutil.rmtree(folder, ignore_errors=True)
                    if counted:
                        count, freed = count + 1, freed + nbytes
            except OSError:  # renamed into place or removed meanwhile
                continue
        return count, freed

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used entries until the cache fits ``max_bytes``; how many were removed."""
        self.remove_leftovers()
        if self.max_bytes is None:
            return 0
        entries, stale = self._scan()
        for folder, _, _ in stale:  # never loadable: they go first
            shutil.rmtree(folder, ignore_errors=True)
        writing = sum(nbytes for _, nbytes, _ in self.leftovers())  # stores under way will be entries
        total, removed = sum(entry.nbytes for entry in entries) + writing, 0
        for entry in reversed(entries):  # oldest first
            if total <= self.max_bytes:
                break
            if keep is not None and entry.key == keep.name:
                continue
            shutil.rmtree(self.directory / entry.key, ignore_errors=True)
            total, removed = total - entry.nbytes, removed + 1
        return removed


def _read_entry(folder: Path, key: CacheKey) -> CachedEncoding:
    try:
        text = (folder / "meta.json").read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except OSError as error:
        raise CacheEntryError(f"unreadable meta.json: {error.strerror or error}") from None
    try:
        meta = json.loads(text)
    except ValueError as error:
        raise CacheEntryError(f"unreadable meta.json: {error}") from None
    try:
        check_meta(meta)
    except ValueError as error:
        raise CacheEntryError(f"meta.json: {error}") from None
    if meta["key"] != key.__dict__:
        raise CacheEntryError("it belongs to another text, model or setting")
    n, d = meta["n_tokens"], meta["dim"]
    dtype = {name: dtype for dtype, name in _DTYPE_NAMES.items()}[meta["dtype"]]
    states_np = _map_array(folder / "states.bin", _NUMPY_DTYPES[dtype], (n, d), meta["states_crc32"])
    ids_np = _map_array(folder / "ids.bin", np.int64, (n,), meta["ids_crc32"])
    ends = None
    if meta["ends_crc32"] is not None:
        ends = torch.from_numpy(np.array(_map_array(folder / "ends.bin", np.int64, (n,), meta["ends_crc32"])))
    keys = None
    if meta["keys"] is not None:
        shape = (meta["keys"]["layers"], meta["keys"]["heads"], n, meta["keys"]["head_dim"])
        keys = _as_tensor(_map_array(folder / "keys.bin", _NUMPY_DTYPES[dtype], shape, meta["keys"]["crc32"]), dtype)
    return CachedEncoding(states=_as_tensor(states_np, dtype), token_ids=torch.from_numpy(np.array(ids_np)), meta=meta,
                          token_ends=ends, keys=keys)


def _as_tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The torch tensor over a mapped array of ``dtype`` numbers (bfloat16 is stored as uint16); no copy."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if dtype == torch.bfloat16 else tensor


def _stale_format(meta) -> str | None:
    """Why an entry with metadata ``meta`` can never be read by this release (an older store format, another
    release's states), or None."""
    key = meta.get("key") if isinstance(meta, dict) else None
    if not isinstance(key, dict):
        return None  # check_meta says what is wrong
    version = key.get("format_version")
    if version != STORE_FORMAT_VERSION:
        return f"an older store format ({version})" if isinstance(version, int) and version < STORE_FORMAT_VERSION \
            else f"another store format ({version})"
    if key.get("unlimisum") != _unlimisum_version():
        return f"encoded by unlimisum {key.get('unlimisum')}, not this release"
    return None


def check_meta(meta) -> None:
    """ValueError (one line) unless ``meta`` is a whole entry's metadata: every field of its type, the windows'
    kept ranges tiling the tokens in order. Fields it does not know are left alone."""
    if not isinstance(meta, dict):
        raise ValueError(f"not a JSON object but {type(meta).__name__}")

    def integer(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    expected = {
        "key": (lambda value: isinstance(value, dict), "an object"),
        "n_tokens": (lambda value: integer(value) and value >= 1, "a positive integer"),
        "dim": (lambda value: integer(value) and value >= 1, "a positive integer"),
        "dtype": (lambda value: value in _DTYPE_NAMES.values(), f"one of {', '.join(_DTYPE_NAMES.values())}"),
        "states_crc32": (integer, "an integer"),
        "ids_crc32": (integer, "an integer"),
        "ends_crc32": (lambda value: value is None or integer(value), "an integer or null"),
        "keys": (lambda value: value is None or isinstance(value, dict) and set(value) == {"layers", "heads",
                 "head_dim", "crc32"} and all(integer(value[name]) and (value[name] >= 1 or name == "crc32")
                                              for name in value),
                 "null or an object of positive integers layers, heads, head_dim and an integer crc32"),
        "title": (lambda value: value is None or isinstance(value, str), "text or null"),
        "source": (lambda value: value is None or isinstance(value, str), "text or null"),
        "windows": (lambda value: isinstance(value, list), "a list"),
        "created": (lambda value: isinstance(value, (int, float)) and not isinstance(value, bool), "a number"),
    }
    for name, (valid, kind) in expected.items():
        if name not in meta:
            raise ValueError(f"no '{name}'")
        if not valid(meta[name]):
            raise ValueError(f"'{name}' is not {kind}")
    position = 0
    for window in meta["windows"]:
        if not (isinstance(window, list) and len(window) == 2 and all(integer(bound) for bound in window)) \
                or window[0] != position or window[1] <= window[0]:
            raise ValueError(f"the windows do not tile the {meta['n_tokens']:,} tokens (at {window!r})")
        position = window[1]
    if position != meta["n_tokens"]:
        raise ValueError(f"the windows cover {position:,} of the {meta['n_tokens']:,} tokens")


def _map_array(path: Path, dtype, shape: tuple[int, ...], crc: int) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except OSError:
        raise CacheEntryError(f"{path.name} is missing") from None
    if size != expected:
        raise CacheEntryError(f"{path.name} has {size:,} bytes, not {expected:,}")
    # copy-on-write: the file stays as it is; FileNotFoundError when the entry was evicted since the stat
    array = np.memmap(path, dtype=dtype, mode="c", shape=shape)
    if _crc32(array) != crc:
        raise CacheEntryError(f"{path.name} does not match its checksum")
    return array


def _as_numpy(states: torch.Tensor) -> np.ndarray:
    states = states.detach().cpu().contiguous()
    if states.dtype == torch.bfloat16:
        return states.view(torch.uint16).numpy()
    return states.numpy()


def _write_array(path: Path, array: np.ndarray) -> int:
    with open(path, "wb") as handle:
        array.tofile(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return _crc32(array)


def _crc32(array: np.ndarray) -> int:
    flat = array.reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.shape[0], _CHECKSUM_CHUNK):
        crc = zlib.crc32(flat[start:start + _CHECKSUM_CHUNK], crc)
    return crc


def _writer_gone(name: str) -> bool:
    """Whether the process that writes the temporary folder ``name`` (``.tmp-<pid>-<host>-<id>``) has ended:
    known only for writers on this machine."""
    parts = name[len(_TEMPORARY):].split("-")
    if os.name != "posix" or len(parts) != 3 or parts[1] != _HOST or not parts[0].isdigit():
        return False  # (on Windows signal 0 would not ask but interrupt)
    try:
        os.kill(int(parts[0]), 0)  # signal 0: only whether the process exists
    except ProcessLookupError:
        return True
    except (OSError, OverflowError):  # alive under another user, or not a pid at all
        return False
    return False


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
