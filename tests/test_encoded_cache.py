"""The cache of encoded books: round trip, memory-mapped states, and every unusable entry rebuilt."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from unlimisum.unlimiformer.cache import CacheKey, EncodedCache, text_sha256


def key(**changes) -> CacheKey:
    fields = dict(text_sha256=text_sha256("a book"), model="tiny@abc", tokenizer="tiny", window=64, overlap=0.5,
                  storage_dtype="bfloat16", model_dtype="float32", device_type="cpu")
    fields.update(changes)
    return CacheKey(**fields)


def entry(n: int = 300, d: int = 16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, d, generator=g).to(dtype), torch.randint(0, 1000, (n,), generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_for_bit_and_never_writes_the_file(tmp_path, dtype):
    cache = EncodedCache(tmp_path)
    states, ids = entry(dtype=dtype)
    folder = cache.store(key(storage_dtype=str(dtype)[6:]), states, ids, {"title": "A Book", "windows": [[0, 300]]})
    assert folder is not None and folder.is_dir() and not list(tmp_path.glob(".tmp-*"))
    loaded = cache.load(key(storage_dtype=str(dtype)[6:]))
    assert loaded is not None
    assert loaded.states.dtype == dtype and torch.equal(loaded.states, states)
    assert torch.equal(loaded.token_ids, ids) and loaded.meta["title"] == "A Book"
    loaded.states[0, 0] = 42  # copy-on-write: the file does not change
    assert torch.equal(cache.load(key(storage_dtype=str(dtype)[6:])).states, states)


def test_any_change_of_what_makes_the_states_is_another_entry(tmp_path):
    cache = EncodedCache(tmp_path)
    cache.store(key(), *entry(), {})
    for change in (dict(text_sha256=text_sha256("another book")), dict(model="tiny@def"), dict(window=128),
                   dict(overlap=0.25), dict(storage_dtype="float16"), dict(model_dtype="bfloat16"),
                   dict(device_type="cuda"), dict(tokenizer="other"), dict(format_version=999)):
        assert cache.load(key(**change)) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "foreign"])
def test_unusable_entries_are_reported_removed_and_never_loaded(tmp_path, damage):
    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    states, ids = entry()
    folder = cache.store(key(), states, ids, {})
    data = folder / "states.bin"
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-10])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "meta":
        (folder / "meta.json").write_text("{not json")
    else:  # an entry written for another model under this key's folder name
        meta = json.loads((folder / "meta.json").read_text())
        meta["key"]["model"] = "someone-else"
        (folder / "meta.json").write_text(json.dumps(meta))
    assert cache.load(key()) is None
    assert len(warnings) == 1 and "encoding again" in warnings[0] and "\n" not in warnings[0]
    assert not folder.exists()


def test_size_cap_evicts_the_least_recently_used(tmp_path):
    cache = EncodedCache(tmp_path)
    first = cache.store(key(window=1), *entry(), {})
    cache.store(key(window=2), *entry(), {})
    one_entry = sum(path.stat().st_size for path in first.iterdir())
    old = time.time() - 100
    os.utime(first / "meta.json", (old, old))
    cache.load(key(window=1))  # used now: the second one becomes the least recently used
    capped = EncodedCache(tmp_path, max_bytes=int(2.5 * one_entry))
    capped.store(key(window=3), *entry(), {})
    left = {entry.key for entry in capped.entries()}
    assert key(window=1).digest in left and key(window=3).digest in left and key(window=2).digest not in left


def test_list_and_clear_older_than(tmp_path):
    cache = EncodedCache(tmp_path)
    old = cache.store(key(window=1), *entry(), {"title": "Old", "source": "old.txt"})
    cache.store(key(window=2), *entry(), {"title": "New", "source": "new.txt"})
    then = time.time() - 40 * 86400
    os.utime(old / "meta.json", (then, then))
    listed = cache.entries()
    assert [entry.title for entry in listed] == ["New", "Old"] and listed[0].n_tokens == 300
    assert cache.clear(older_than_seconds=30 * 86400) == (1, listed[1].nbytes)
    assert [entry.title for entry in cache.entries()] == ["New"]
    assert cache.clear()[0] == 1 and cache.entries() == []
