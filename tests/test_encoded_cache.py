"""The cache of encoded books: round trip, memory-mapped states, and every unusable entry rebuilt."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import unlimisum.version
from unlimisum.unlimiformer import cache as cache_module
from unlimisum.unlimiformer.cache import CacheKey, EncodedCache, text_sha256


def key(**changes) -> CacheKey:
    fields = dict(text_sha256=text_sha256("a book"), model="tiny@abc", tokenizer="tiny", window=64, overlap=0.5,
                  storage_dtype="bfloat16", model_dtype="float32", device_type="cpu")
    fields.update(changes)
    return CacheKey(**fields)


def meta(title: str = "A Book", source: str = "book.txt", n: int = 300) -> dict:
    """What the encoder stores with an entry: title, source and the windows' kept ranges."""
    return {"title": title, "source": source, "windows": [[0, n // 3], [n // 3, n]]}


def entry(n: int = 300, d: int = 16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, d, generator=g).to(dtype), torch.randint(0, 1000, (n,), generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_is_bit_for_bit_and_never_writes_the_file(tmp_path, dtype):
    cache = EncodedCache(tmp_path)
    states, ids = entry(dtype=dtype)
    folder = cache.store(key(storage_dtype=str(dtype)[6:]), states, ids, meta())
    assert folder is not None and folder.is_dir() and not list(tmp_path.glob(".tmp-*"))
    loaded = cache.load(key(storage_dtype=str(dtype)[6:]))
    assert loaded is not None
    assert loaded.states.dtype == dtype and torch.equal(loaded.states, states)
    assert torch.equal(loaded.token_ids, ids) and loaded.meta["title"] == "A Book"
    loaded.states[0, 0] = 42  # copy-on-write: the file does not change
    assert torch.equal(cache.load(key(storage_dtype=str(dtype)[6:])).states, states)


def test_any_change_of_what_makes_the_states_is_another_entry(tmp_path):
    cache = EncodedCache(tmp_path)
    cache.store(key(), *entry(), meta())
    for change in (dict(text_sha256=text_sha256("another book")), dict(model="tiny@def"), dict(window=128),
                   dict(overlap=0.25), dict(storage_dtype="float16"), dict(model_dtype="bfloat16"),
                   dict(device_type="cuda"), dict(tokenizer="other"), dict(format_version=999),
                   dict(unlimisum="0.0.1"), dict(software="transformers 5.15; encoder another")):
        assert cache.load(key(**change)) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "meta", "foreign"])
def test_unusable_entries_are_reported_removed_and_never_loaded(tmp_path, damage):
    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    states, ids = entry()
    folder = cache.store(key(), states, ids, meta())
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
        record = json.loads((folder / "meta.json").read_text())
        record["key"]["model"] = "someone-else"
        (folder / "meta.json").write_text(json.dumps(record))
    assert cache.load(key()) is None
    assert len(warnings) == 1 and "encoding again" in warnings[0] and "\n" not in warnings[0]
    assert not folder.exists()


def test_size_cap_evicts_the_least_recently_used(tmp_path):
    cache = EncodedCache(tmp_path)
    first = cache.store(key(window=1), *entry(), meta())
    cache.store(key(window=2), *entry(), meta())
    one_entry = sum(path.stat().st_size for path in first.iterdir())
    old = time.time() - 100
    os.utime(first / "meta.json", (old, old))
    cache.load(key(window=1))  # used now: the second one becomes the least recently used
    capped = EncodedCache(tmp_path, max_bytes=int(2.5 * one_entry))
    capped.store(key(window=3), *entry(), meta())
    left = {entry.key for entry in capped.entries()}
    assert key(window=1).digest in left and key(window=3).digest in left and key(window=2).digest not in left


def test_list_and_clear_older_than(tmp_path):
    cache = EncodedCache(tmp_path)
    old = cache.store(key(window=1), *entry(), meta("Old", "old.txt"))
    cache.store(key(window=2), *entry(), meta("New", "new.txt"))
    then = time.time() - 40 * 86400
    os.utime(old / "meta.json", (then, then))
    listed = cache.entries()
    assert [entry.title for entry in listed] == ["New", "Old"] and listed[0].n_tokens == 300
    assert cache.clear(older_than_seconds=30 * 86400) == (1, listed[1].nbytes)
    assert [entry.title for entry in cache.entries()] == ["New"]
    assert cache.clear()[0] == 1 and cache.entries() == []


def test_entries_this_release_cannot_read_are_listed_with_their_size_and_pruned(tmp_path, monkeypatch):
    """After an upgrade: an entry of an older store format (format 3 had no per-layer keys), one another release
    encoded, and one whose metadata is damaged never load; `cache list` shows them, `cache prune` removes them."""
    from typer.testing import CliRunner

    from unlimisum.cli import app

    cache = EncodedCache(tmp_path)
    kept = cache.store(key(window=1), *entry(), meta("Kept", "kept.txt"))
    older = cache.store(key(window=2), *entry(), meta("Older", "older.txt"))
    record = json.loads((older / "meta.json").read_text())
    record["key"]["format_version"] = 3
    record.pop("keys")
    (older / "meta.json").write_text(json.dumps(record))
    monkeypatch.setattr(unlimisum.version, "__version__", "0.0.1")
    other = cache.store(key(window=3), *entry(), meta("Other", "other.txt"))
    monkeypatch.undo()
    damaged = cache.store(key(window=4), *entry(), meta("Damaged", "damaged.txt"))
    (damaged / "meta.json").write_text("{not json")
    assert [entry.title for entry in cache.entries()] == ["Kept"]
    stale = {folder.name: why for folder, _, why in cache.stale()}
    assert stale == {older.name: "an older store format (3)",
                     other.name: "encoded by unlimisum 0.0.1, not this release",
                     damaged.name: stale[damaged.name]} and "metadata cannot be read" in stale[damaged.name]
    listed = CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(tmp_path)])
    assert listed.exit_code == 0 and "1 encoded book" in listed.stderr
    assert "3 entries this release cannot read" in listed.stderr and "`unlimisum cache prune` removes them" in listed.stderr
    pruned = CliRunner().invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path)])
    assert pruned.exit_code == 0 and "removed 3 entries this release cannot read" in pruned.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == [kept.name] and cache.load(key(window=1)) is not None


def test_another_release_of_unlimisum_never_reads_the_entries_of_this_one(tmp_path, monkeypatch):
    cache = EncodedCache(tmp_path)
    cache.store(key(), *entry(), meta())
    assert cache.load(key()) is not None
    monkeypatch.setattr(unlimisum.version, "__version__", "99.0.0")  # a release that may compute states otherwise
    assert cache.load(key()) is None


def test_the_encoders_code_path_is_in_the_key(tiny_loaded):
    """LED encodes through unlimisum's blocked local attention: a key says so, and another path is another key."""
    import dataclasses

    from unlimisum.unlimiformer.encoder import software_identity

    led = tiny_loaded("led")
    assert "encoder unlimisum.models.local_attention.blocked_local_attention" in software_identity(led)
    plain = dataclasses.replace(led, architecture=dataclasses.replace(led.architecture, fast_encoding=None))
    assert "encoder the model's own" in software_identity(plain)
    assert software_identity(plain, int8=True) == software_identity(plain) + "; linear layers int8"  # --encode-int8
    assert "the last layer on the kept rows" not in software_identity(led)
    assert "encoder the model's own, the last layer on the kept rows" in software_identity(tiny_loaded("bart"))


DAMAGED_META = {
    "no windows": lambda record: record.pop("windows"),
    "a gap between windows": lambda record: record.update(windows=[[0, 100], [101, 300]]),
    "windows short of the end": lambda record: record.update(windows=[[0, 100], [100, 299]]),
    "a window that is not a pair": lambda record: record.update(windows=[[0, 100, 7], [100, 300]]),
    "a title that is a list": lambda record: record.update(title=["A", "Book"]),
    "a source that is a number": lambda record: record.update(source=7),
    "n_tokens as text": lambda record: record.update(n_tokens="300"),
    "a checksum that is a flag": lambda record: record.update(ids_crc32=True),
    "no dtype": lambda record: record.pop("dtype"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_META) + ["not an object"])
def test_metadata_of_the_wrong_shape_is_reported_removed_and_rebuilt(tmp_path, damage):
    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    folder = cache.store(key(), *entry(), meta())
    record = json.loads((folder / "meta.json").read_text())
    if damage == "not an object":
        record = [record]
    else:
        DAMAGED_META[damage](record)
    (folder / "meta.json").write_text(json.dumps(record))
    assert cache.entries() == []  # `cache list` does not fail on it either
    if damage == "no windows":  # `cache clear` removes it too
        nbytes = sum(path.stat().st_size for path in folder.iterdir())
        assert cache.clear() == (1, nbytes)
        assert not folder.exists()
        return
    assert cache.load(key()) is None
    assert len(warnings) == 1 and "encoding again" in warnings[0] and "\n" not in warnings[0], warnings
    assert not folder.exists()
    assert cache.store(key(), *entry(), meta()) is not None and cache.load(key()) is not None  # rebuilt


def test_a_summary_from_an_entry_without_windows_is_rebuilt_with_a_warning(tiny_loaded, tmp_path):
    from unlimisum.config import GenerationOptions
    from unlimisum.summarizer import Summarizer

    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    fast = GenerationOptions(max_new_tokens=4, num_beams=1, do_sample=False)
    text = "The keeper counted the ships. " * 30
    first = Summarizer(tiny_loaded("bart"), generation=fast, cache=cache).summarize(text)
    (folder,) = [path for path in tmp_path.iterdir() if not path.name.startswith(".")]
    record = json.loads((folder / "meta.json").read_text())
    del record["windows"]
    (folder / "meta.json").write_text(json.dumps(record))
    again = Summarizer(tiny_loaded("bart"), generation=fast, cache=cache).summarize(text)
    assert not again.stats.cached and again.token_ids == first.token_ids
    assert len(warnings) == 1 and "no 'windows'" in warnings[0]
    assert Summarizer(tiny_loaded("bart"), generation=fast, cache=cache).summarize(text).stats.cached


def test_an_entry_evicted_between_stat_and_memory_map_is_a_miss(tmp_path, monkeypatch):
    warnings = []
    cache = EncodedCache(tmp_path, warn=warnings.append)
    folder = cache.store(key(), *entry(), meta())
    real = cache_module.np.memmap

    def evicted_meanwhile(path, *args, **kwargs):
        import shutil

        shutil.rmtree(folder)  # another process's eviction, right after this one's stat
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cache_module.np, "memmap", evicted_meanwhile)
    assert cache.load(key()) is None and warnings == []


def leftover(directory, name: str, nbytes: int, age: float = 0.0):
    """A temporary folder as a writer leaves it: a partly written states.bin."""
    folder = directory / name
    folder.mkdir(parents=True)
    (folder / "states.bin").write_bytes(b"\0" * nbytes)
    then = time.time() - age
    for path in (folder / "states.bin", folder):
        os.utime(path, (then, then))
    return folder


def gone_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_leftovers_of_killed_writers_are_removed_on_store_and_by_cache_prune_never_by_cache_list(tmp_path):
    from typer.testing import CliRunner

    from unlimisum.cli.app import app

    host = getattr(cache_module, '_HOST', '')
    cache = EncodedCache(tmp_path)
    old = leftover(tmp_path, ".tmp-0123abcd", 10_000, age=getattr(cache_module, "STALE_SECONDS", 3600) + 60)  # an earlier release's name
    dead = leftover(tmp_path, f".tmp-{gone_pid()}-{host}-cafe", 10_000)  # fresh, but its writer has ended
    live = leftover(tmp_path, f".tmp-{os.getpid()}-{host}-beef", 10_000)  # a store under way: kept
    cache.store(key(), *entry(), meta())
    assert not old.exists() and not dead.exists() and live.exists()
    again = leftover(tmp_path, ".tmp-4567ef01", 5_000, age=2 * getattr(cache_module, "STALE_SECONDS", 3600))

    def snapshot():  # every path in the cache, with its size and modification time
        return {path: (path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(tmp_path.rglob("*"))}

    before = snapshot()
    listed = CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(tmp_path)])
    assert listed.exit_code == 0, listed.output
    assert snapshot() == before  # listing changes nothing, not even what an interrupted store left
    assert "1 folder of interrupted stores, 4.9 KiB: `unlimisum cache prune` removes them" in listed.stderr
    assert "being stored" in listed.stderr
    pruned = CliRunner().invoke(app, ["cache", "prune", "--cache-dir", str(tmp_path)])
    assert pruned.exit_code == 0, pruned.output
    assert not again.exists() and live.exists() and cache.load(key()) is not None
    assert pruned.stderr == "removed 1 folder of interrupted stores, 4.9 KiB\n"
    assert "interrupted" not in CliRunner().invoke(app, ["cache", "list", "--cache-dir", str(tmp_path)]).stderr


def test_the_size_cap_counts_stores_under_way_and_removes_leftovers(tmp_path):
    cache = EncodedCache(tmp_path)
    first = cache.store(key(window=1), *entry(), meta())
    one_entry = sum(path.stat().st_size for path in first.iterdir())
    old = time.time() - 100
    os.utime(first / "meta.json", (old, old))
    live = leftover(tmp_path, f".tmp-{os.getpid()}-{getattr(cache_module, '_HOST', '')}-beef", one_entry)
    stale = leftover(tmp_path, ".tmp-89abcdef", 50 * one_entry, age=getattr(cache_module, "STALE_SECONDS", 3600) + 1)
    capped = EncodedCache(tmp_path, max_bytes=int(2.5 * one_entry))
    capped.store(key(window=2), *entry(), meta())
    # the stale leftover is gone; the live one counts, so the oldest entry goes to make room for it
    assert not stale.exists() and live.exists()
    assert [entry.key for entry in capped.entries()] == [key(window=2).digest]


# -- the tokens an entry holds ----------------------------------------------------------------------------

TOKENIZATION = Path(__file__).resolve().parent / "fixtures" / "tokenization"
# The texts whose tokens are fingerprinted: special and added token strings (Qwen3's non-special <tool_call>),
# alone and glued to words, non-ASCII letters and runs of white space; the second in the needle fixture's words.
FIXED_TEXTS = {
    TOKENIZATION: "The keeper wrote.</s><s> a<tool_call>b <think>x</think> <mask><pad> h\u00e9llo \u00e0 l'\u00eele\n\n"
                  "  Then\tthe storm<unk>came. " * 3,
    TOKENIZATION.parent / "needle": "bene beni </s> beno<s> berabu <tool_call> besi <needle> bevubu </needle> bibi "
                                    "bibire bido <unk> bifale bigigi bitu bivo bizadu bizolo bobi bogepu boka " * 2,
}


def tokenization_fingerprint(loaded) -> str:
    """sha256 of the tokens and end offsets the encoder gives each fixed text with its tokenizer (the byte-level
    BPE of tests/fixtures/tokenization, with BART's specials and Qwen3's added tokens, and the needle's word-level
    one): what a cache entry's ids.bin and ends.bin hold."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from unlimisum.document import Document
    from unlimisum.summarizer import Summarizer

    digest = hashlib.sha256()
    for folder, text in FIXED_TEXTS.items():
        view = replace(loaded, tokenizer=AutoTokenizer.from_pretrained(folder), tokenizer_fingerprint=None)
        ids, ends = Summarizer(view).family._encoder().tokenize(Document.from_text(text))
        digest.update(json.dumps({"ids": ids.tolist(), "ends": ends}).encode())
    return digest.hexdigest()


def test_the_tokens_of_a_fixed_text_change_only_with_the_store_format_version(tiny_loaded):
    """Entries are keyed by STORE_FORMAT_VERSION, not by how unlimisum tokenizes: a release that tokenizes a text
    otherwise must bump it, or entries written before (other tokens, states of other tokens) are served."""
    recorded = json.loads((TOKENIZATION / "fingerprint.json").read_text())
    now = tokenization_fingerprint(tiny_loaded("bart"))
    assert (cache_module.STORE_FORMAT_VERSION, now) == (recorded["store_format_version"], recorded["sha256"]), (
        "the tokens of the fixed texts or the store format changed: bump STORE_FORMAT_VERSION "
        "(unlimisum/unlimiformer/cache.py) when the tokens changed, then record in tests/fixtures/tokenization/"
        f'fingerprint.json: {{"store_format_version": {cache_module.STORE_FORMAT_VERSION}, "sha256": "{now}"}}')


@pytest.mark.parametrize("command", [["list"], ["prune"], ["clear"], ["list", "--json"]])
def test_a_cache_folder_that_does_not_exist_is_said_and_not_made(tmp_path, command):
    """A mistyped --cache-dir (or one no run has used yet) is named, not reported as an empty cache."""
    from typer.testing import CliRunner

    from unlimisum.cli import app

    missing = tmp_path / "no-such-cache"
    result = CliRunner().invoke(app, ["cache", *command, "--cache-dir", str(missing)])
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.strip() == (f"unlimisum: no cache folder {missing}: nothing in it (summarize --cache-dir "
                                     "makes it on first use)")
    assert not missing.exists()


def test_an_age_that_is_no_duration_names_its_option(tmp_path):
    from typer.testing import CliRunner

    from unlimisum.cli import app

    result = CliRunner().invoke(app, ["cache", "clear", "--cache-dir", str(tmp_path), "--older-than", "5x"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("unlimisum: error: invalid value for '--older-than': '5x' is not a duration; "
                                     "use e.g. 12h, 30d or 2w")
