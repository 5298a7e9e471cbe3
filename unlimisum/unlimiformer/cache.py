"""A cache of encoded books: summarize the same book again with other options, without encoding it.

One entry per (text, model, tokenizer, window, overlap, storage dtype, model dtype, device type,
store format), in a folder of its own under the cache directory::

    <cache>/<key>/meta.json    what the entry is, sizes, checksums, chapters and windows
    <cache>/<key>/states.bin   [N, d] encoder states, raw little-endian 16- or 32-bit numbers
    <cache>/<key>/ids.bin      [N] token ids, raw little-endian int64
    <cache>/<key>/ends.bin     [N] each token's end character in the text, int64 (when the tokenizer
                               gives offsets: the chapters are mapped through them on loading)

Raw arrays plus JSON: nothing is unpickled. Entries are written in a temporary folder and
renamed into place; on loading, the sizes and CRC-32 checksums must match the metadata, else
the entry is reported in one line, removed, and the book encoded again. The states are memory-
mapped, so a cached 500k-token book costs no copy. Least recently used entries go first when
the cache exceeds its size cap.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

STORE_FORMAT_VERSION = 2  # 2: token end offsets, chapters mapped on loading. Bump when what an entry holds, or how states are computed, changes
_NUMPY_DTYPES = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_CHECKSUM_CHUNK = 64 * 2**20


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
    software: str = ""  # transformers and torch releases and the attention kernel
    format_version: int = STORE_FORMAT_VERSION

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
        except CacheEntryError as error:
            self.warn(f"cache entry {folder} is unusable ({error}); encoding again")
            shutil.rmtree(folder, ignore_errors=True)
            return None
        try:
            os.utime(folder / "meta.json")  # least recently used = oldest meta.json
        except OSError:  # a read-only cache is still a cache
            pass
        return entry

    def store(self, key: CacheKey, states: torch.Tensor, token_ids: torch.Tensor, meta: dict,
              token_ends: torch.Tensor | None = None) -> Path | None:
        """Write an entry (atomically: a temporary folder renamed into place); its folder, or None when the
        cache cannot be written (said in one warning line: the summary goes on)."""
        final = self.directory / key.digest
        temporary = self.directory / f".tmp-{uuid.uuid4().hex}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            temporary.mkdir()
            states_crc = _write_array(temporary / "states.bin", _as_numpy(states))
            ids_crc = _write_array(temporary / "ids.bin", token_ids.cpu().to(torch.int64).numpy())
            ends_crc = None
            if token_ends is not None:
                ends_crc = _write_array(temporary / "ends.bin", token_ends.cpu().to(torch.int64).numpy())
            record = dict(meta, key=key.__dict__, n_tokens=int(states.shape[0]), dim=int(states.shape[1]),
                          dtype=_DTYPE_NAMES[states.dtype], states_crc32=states_crc, ids_crc32=ids_crc,
                          ends_crc32=ends_crc, created=time.time())
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
        """Every readable entry, most recently used first."""
        found = []
        if not self.directory.is_dir():
            return found
        for folder in self.directory.iterdir():
            meta_path = folder / "meta.json"
            if folder.name.startswith(".") or not meta_path.is_file():
                continue
            try:
                meta = json.loads(meta_path.read_text(encoding="utf-8"))
                found.append(EntryInfo(folder.name, meta.get("title", ""), meta.get("source", ""),
                                       meta.get("key", {}).get("model", ""), int(meta.get("n_tokens", 0)),
                                       _folder_bytes(folder), meta_path.stat().st_mtime))
            except (OSError, ValueError):
                continue
        return sorted(found, key=lambda entry: entry.last_used, reverse=True)

    def clear(self, older_than_seconds: float | None = None) -> tuple[int, int]:
        """Remove entries (only those unused for ``older_than_seconds``, when given); (count, bytes) removed."""
        now, count, freed = time.time(), 0, 0
        for entry in self.entries():
            if older_than_seconds is not None and now - entry.last_used < older_than_seconds:
                continue
            shutil.rmtree(self.directory / entry.key, ignore_errors=True)
            count, freed = count + 1, freed + entry.nbytes
        for leftover in self.directory.glob(".tmp-*") if self.directory.is_dir() else ():
            if older_than_seconds is None or now - leftover.stat().st_mtime >= older_than_seconds:
                shutil.rmtree(leftover, ignore_errors=True)
        return count, freed

    def evict(self, keep: Path | None = None) -> int:
        """Remove least recently used entries until the cache fits ``max_bytes``; how many were removed."""
        if self.max_bytes is None:
            return 0
        entries = self.entries()
        total, removed = sum(entry.nbytes for entry in entries), 0
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
        meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CacheEntryError(f"unreadable meta.json: {error}") from None
    if meta.get("key") != key.__dict__:
        raise CacheEntryError("it belongs to another text, model or setting")
    try:
        n, d = int(meta["n_tokens"]), int(meta["dim"])
        dtype = {name: dtype for dtype, name in _DTYPE_NAMES.items()}[meta["dtype"]]
        states_crc, ids_crc = int(meta["states_crc32"]), int(meta["ids_crc32"])
    except (KeyError, ValueError, TypeError):
        raise CacheEntryError("incomplete meta.json") from None
    states_np = _map_array(folder / "states.bin", _NUMPY_DTYPES[dtype], (n, d), states_crc)
    ids_np = _map_array(folder / "ids.bin", np.int64, (n,), ids_crc)
    ends = None
    if meta.get("ends_crc32") is not None:
        ends = torch.from_numpy(np.array(_map_array(folder / "ends.bin", np.int64, (n,), int(meta["ends_crc32"]))))
    states = torch.from_numpy(states_np)
    if dtype == torch.bfloat16:
        states = states.view(torch.bfloat16)
    return CachedEncoding(states=states, token_ids=torch.from_numpy(np.array(ids_np)), meta=meta, token_ends=ends)


def _map_array(path: Path, dtype, shape: tuple[int, ...], crc: int) -> np.ndarray:
    expected = int(np.prod(shape)) * np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except OSError:
        raise CacheEntryError(f"{path.name} is missing") from None
    if size != expected:
        raise CacheEntryError(f"{path.name} has {size:,} bytes, not {expected:,}")
    array = np.memmap(path, dtype=dtype, mode="c", shape=shape)  # copy-on-write: the file stays as it is
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


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())
