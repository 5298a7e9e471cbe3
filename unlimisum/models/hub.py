"""Fetching a checkpoint's files from the Hugging Face hub into its cache, with progress, failing fast.

``Hub.fetch`` turns a hub name into the local snapshot folder that ``from_pretrained`` then reads,
so that transformers itself never talks to the hub:

- ``HF_HUB_OFFLINE`` set: the cached snapshot, no request at all;
- otherwise one quick request lists the repository (it is the probe: when the hub cannot be
  reached it fails within ``PROBE_SECONDS``, without huggingface_hub's retries), then the files
  the model needs that are not cached yet are downloaded one by one, each reporting its bytes as
  ``ProgressEvent("download", ...)``s; a hub that cannot be reached falls back to the cache.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from unlimisum.events import ProgressCallback, ProgressEvent
from unlimisum.models import compat

# How long the listing request may take before the hub counts as unreachable (seconds). It is
# the only request before a download, so a machine without network is told so at once. A slow link (or a
# busy machine) can give it longer: $UNLIMISUM_HUB_TIMEOUT seconds.
PROBE_SECONDS = 5.0
PROBE_SETTING = "UNLIMISUM_HUB_TIMEOUT"


def probe_seconds() -> float:
    """PROBE_SECONDS, or $UNLIMISUM_HUB_TIMEOUT where it is a positive number of seconds."""
    try:
        value = float(os.environ.get(PROBE_SETTING, ""))
    except ValueError:
        return PROBE_SECONDS
    return value if value > 0 else PROBE_SECONDS
# Bytes read from the connection between two progress reports of a file (huggingface_hub reads 10 MiB).
READ_CHUNK_BYTES = 1024 * 1024
# Top-level files that are not weights and that config, tokenizer and generation settings are made of.
TEXT_SUFFIXES = (".json", ".txt", ".model", ".spm", ".jinja", ".tiktoken")


class HubUnavailable(Exception):
    """A repository that is neither in the cache nor downloadable; ``reason`` says why, in a few words.
    ``cache_only``: the hub could not be asked (offline, unreachable, the connection lost), so a
    download on a connected machine is the remedy; False when the hub said no."""

    def __init__(self, repo_id: str, reason: str, *, cache_only: bool = True):
        super().__init__(f"{repo_id}: {reason}")
        self.repo_id = repo_id
        self.reason = reason
        self.cache_only = cache_only


@dataclass(frozen=True)
class _Listing:
    commit: str  # the commit the files are taken from
    sizes: dict  # top-level file name -> bytes (None when the hub did not say)


class Hub:
    """One loading's view of the hub: whether it was reachable (asked once), and the progress callback."""

    def __init__(self, progress: ProgressCallback | None = None, *, code: bool = False):
        self.progress = progress
        self.code = code  # trust_remote_code: the repository's Python files are needed too
        self._reachable: bool | None = None  # None: not asked yet
        self._listings: dict[str, _Listing | None] = {}
        self._problem = ""  # what the hub answered when it answered with an error

    @property
    def offline(self) -> bool:
        return compat.hub_offline()

    def unavailable_reason(self) -> str:
        """Why only the cache was searched (for messages)."""
        if self.offline:
            return "HF_HUB_OFFLINE is set, so only the local cache is searched"
        from huggingface_hub import constants

        if self._problem:
            return f"the Hugging Face hub ({constants.ENDPOINT}) answered {self._problem}"
        return f"the Hugging Face hub ({constants.ENDPOINT}) cannot be reached"

    def fetch(self, repo_id: str, *, weights: bool) -> Path:
        """The local snapshot folder of ``repo_id`` with its config and tokenizer files, and its weights
        when ``weights``; downloads what is missing. Raises HubUnavailable."""
        try:
            listing = self._listing(repo_id)
        except HubUnavailable:  # the hub said no (private, gated...): a copy in the cache still serves
            folder = cached_snapshot(repo_id)
            if folder is None:
                raise
            return folder
        if listing is None:
            folder = cached_snapshot(repo_id)
            if folder is None:
                raise HubUnavailable(repo_id, self.unavailable_reason())
            return folder
        wanted = needed_files(listing.sizes, weights=weights, code=self.code)
        if weights and not any(_is_weights(name) for name in wanted):
            raise HubUnavailable(repo_id, "it has no PyTorch weights on the hub (model.safetensors or "
                                          "pytorch_model.bin)", cache_only=False)
        missing = [name for name in wanted if not _cached(repo_id, name, listing.commit)]
        if missing:
            self._download(repo_id, missing, listing)
        folder = cached_snapshot(repo_id, listing.commit)
        if folder is None:  # nothing to download, nothing cached: a repository without any usable file
            raise HubUnavailable(repo_id, "it has none of the files a model needs on the hub", cache_only=False)
        return folder

    # -- internals ---------------------------------------------------------------------------

    def _listing(self, repo_id: str) -> _Listing | None:
        """The repository's commit and files, or None when only the cache can be used."""
        if repo_id in self._listings:
            return self._listings[repo_id]
        listing = None
        if not self.offline and self._reachable is not False:
            listing = self._ask(repo_id)
        self._listings[repo_id] = listing
        return listing

    def _ask(self, repo_id: str) -> _Listing | None:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

        try:
            info = HfApi().model_info(repo_id, revision="main", files_metadata=True, timeout=probe_seconds())
        except compat.hub_connection_errors():
            self._reachable = False
            return None
        except GatedRepoError:
            raise HubUnavailable(repo_id, "it is gated on the hub: accept its terms and log in (`hf auth login`)",
                                 cache_only=False) from None
        except RepositoryNotFoundError:
            raise HubUnavailable(repo_id, "there is no such model on the hub (or it is private: `hf auth login`)",
                                 cache_only=False) from None
        except HfHubHTTPError as error:  # the hub is down (5xx), a proxy answers... the cache may still serve
            self._reachable = False
            response = getattr(error, "response", None)
            status = getattr(response, "status_code", None)
            self._problem = f"HTTP {status}" if status else _first_line(error)
            return None
        self._reachable = True
        sizes = {sibling.rfilename: getattr(sibling, "size", None) for sibling in info.siblings or []
                 if "/" not in sibling.rfilename}
        return _Listing(commit=info.sha, sizes=sizes)

    def _download(self, repo_id: str, names: list[str], listing: _Listing) -> None:
        """Download ``names`` (of ``repo_id`` at the listed commit), reporting their bytes together."""
        from huggingface_hub import hf_hub_download

        report = self.progress or (lambda event: None)
        sizes = [listing.sizes.get(name) or 0 for name in names]
        total = sum(sizes)
        info = {"repo": repo_id, "files": len(names)}
        report(ProgressEvent("download", 0, total, repo_id, dict(info, file=names[0])))
        done = 0
        for number, (name, size) in enumerate(zip(names, sizes)):
            bar = _bar_class(lambda completed, name=name, base=done: report(
                ProgressEvent("download", min(base + completed, total), total, repo_id, dict(info, file=name))))
            # The first file through "main" records main's commit in the cache (offline runs look it up there).
            revision = "main" if number == 0 else listing.commit
            try:
                with _read_chunk(READ_CHUNK_BYTES):
                    hf_hub_download(repo_id, name, revision=revision, tqdm_class=bar)
            except Exception as error:  # noqa: BLE001  (network lost, disk full...: one line, not a traceback)
                raise HubUnavailable(repo_id, f"downloading {name} failed ({_first_line(error)})") from None
            done += size
        report(ProgressEvent("download", total, total, repo_id, dict(info, file=names[-1])))


def needed_files(sizes: dict, *, weights: bool, code: bool = False) -> list[str]:
    """Which of a repository's top-level files ``from_pretrained`` reads: config, tokenizer and generation
    files, Python files with ``code``, and with ``weights`` transformers' safetensors (``model.safetensors``
    or its shards), else its PyTorch pickles (``pytorch_model.bin`` or shards); other formats, and other
    programs' copies of the weights (``consolidated.safetensors``), are left on the hub."""
    names = sorted(sizes)
    wanted = [name for name in names if name.endswith(TEXT_SUFFIXES) or (code and name.endswith(".py"))]
    if weights:
        safetensors = [name for name in names if _is_weights(name) and name.endswith(".safetensors")]
        pickles = [name for name in names if _is_weights(name) and name.endswith(".bin")]
        wanted += safetensors or pickles
    return wanted


def cached_snapshot(repo_id: str, commit: str | None = None) -> Path | None:
    """The cache's snapshot folder of ``repo_id`` (at ``commit``, else the one ``main`` points at), or None.
    Reads the cache's layout (``models--org--name/refs/main``, ``snapshots/<commit>``); no request."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    if commit is None:
        try:
            commit = (storage / "refs" / "main").read_text(encoding="utf-8").strip()
        except OSError:
            return None
    folder = storage / "snapshots" / commit
    return folder if commit and folder.is_dir() else None


def _cached(repo_id: str, name: str, commit: str) -> bool:
    folder = cached_snapshot(repo_id, commit)
    return folder is not None and (folder / name).is_file()


@contextmanager
def _read_chunk(size: int) -> Iterator[None]:
    """huggingface_hub reads (and reports) a download in pieces of ``constants.DOWNLOAD_CHUNK_SIZE``:
    smaller pieces within the block, so that a slow connection still moves the bar."""
    from huggingface_hub import constants

    before = getattr(constants, "DOWNLOAD_CHUNK_SIZE", None)
    constants.DOWNLOAD_CHUNK_SIZE = min(size, before or size)
    try:
        yield
    finally:
        if before is not None:
            constants.DOWNLOAD_CHUNK_SIZE = before


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _is_weights(name: str) -> bool:
    """transformers' weight files: model.safetensors, model-00001-of-00002.safetensors, pytorch_model*.bin."""
    return (name.startswith("model") and name.endswith(".safetensors")) or \
        (name.startswith("pytorch_model") and name.endswith(".bin"))


class _ForwardingBar:
    """What huggingface_hub takes as ``tqdm_class``: it counts the bytes written and reports them;
    nothing is drawn. ``update_transfer`` (network bytes of Xet downloads) is not counted twice."""

    report: Callable[[int], None]  # set on the subclass made for each file
    min_interval = 0.1  # seconds between two reports (Xet reports often)

    def __init__(self, *args, total=None, initial=0, desc=None, **kwargs):
        self.total = total
        self.n = initial or 0
        self.desc = desc
        self._reported_at = float("-inf")

    def update(self, n=1) -> None:
        self.n += n or 0
        now = time.monotonic()
        if now - self._reported_at >= self.min_interval or (self.total and self.n >= self.total):
            self._reported_at = now
            type(self).report(self.n)

    def update_transfer(self, n=1) -> None:
        pass

    def refresh(self, *args, **kwargs) -> None:
        pass

    def set_description(self, *args, **kwargs) -> None:
        pass

    set_description_str = set_postfix_str = set_transfer_postfix_str = set_postfix = set_description

    def close(self) -> None:
        pass

    def __enter__(self) -> "_ForwardingBar":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _bar_class(report: Callable[[int], None]) -> type:
    """A ``_ForwardingBar`` class that reports to ``report`` (huggingface_hub wants a class, and asks the
    class itself whether it takes ``update_transfer``)."""
    return type("_FileBar", (_ForwardingBar,), {"report": staticmethod(report)})
