"""Read members of an untrusted zip (an EPUB) with every size bounded and no path tricks.

Nothing is ever extracted to disk: members are read by name, into memory, in chunks,
and reading stops as soon as a member or the whole book passes its cap.
"""

from __future__ import annotations

import posixpath
import zipfile
from typing import BinaryIO

from unlimisum.ingest.limits import DEFAULT_LIMITS, MiB, IngestLimits


class ZipProblem(Exception):
    """Base for problems found in a zip; ``unsafe`` tells attacks from mere damage."""

    unsafe = False


class UnsafeZip(ZipProblem):
    unsafe = True


class MissingMember(ZipProblem, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class SafeZip:
    """A zip opened for bounded, name-checked reading. Use as a context manager."""

    def __init__(self, file: str | BinaryIO, limits: IngestLimits = DEFAULT_LIMITS):
        self.limits = limits
        self._bytes_read = 0
        try:
            self._zip = zipfile.ZipFile(file)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
            raise ZipProblem(f"not a readable zip archive ({error})") from None
        try:
            self._members = self._check_members()
        except BaseException:
            self._zip.close()
            raise

    def _check_members(self) -> dict[str, zipfile.ZipInfo]:
        infos = self._zip.infolist()
        if len(infos) > self.limits.max_zip_members:
            raise UnsafeZip(f"zip holds {len(infos):,} members (limit {self.limits.max_zip_members:,})")
        members: dict[str, zipfile.ZipInfo] = {}
        declared_total = 0
        for info in infos:
            name = info.filename
            if not is_safe_member_name(name):
                raise UnsafeZip(f"unsafe member name {name!r} (absolute path or '..')")
            declared_total += info.file_size
            members.setdefault(name, info)
        if declared_total > self.limits.max_book_bytes:
            raise UnsafeZip(
                f"members decompress to {declared_total / MiB:,.0f} MiB "
                f"(limit {self.limits.max_book_bytes / MiB:,.0f} MiB; zip bomb?)"
            )
        return members

    def __enter__(self) -> "SafeZip":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    def names(self) -> list[str]:
        """Member names, in archive order."""
        return list(self._members)

    def has(self, name: str) -> bool:
        return name in self._members

    def read(self, name: str, max_bytes: int | None = None) -> bytes:
        """A member's bytes, read in chunks; raises UnsafeZip past the member or book cap."""
        info = self._members.get(name)
        if info is None:
            raise MissingMember(f"the archive has no member {name!r}")
        cap = min(max_bytes or self.limits.max_member_bytes, self.limits.max_member_bytes)
        if info.file_size > cap:
            raise UnsafeZip(f"member {name!r} would decompress to {info.file_size / MiB:,.1f} MiB (limit {cap / MiB:,.0f} MiB)")
        chunks: list[bytes] = []
        size = 0
        try:
            with self._zip.open(info) as member:
                while chunk := member.read(self.limits.read_chunk_bytes):
                    size += len(chunk)
                    self._bytes_read += len(chunk)
                    if size > cap:  # the header lied about the size: a zip bomb
                        raise UnsafeZip(f"member {name!r} decompresses past {cap / MiB:,.0f} MiB (zip bomb?)")
                    if self._bytes_read > self.limits.max_read_bytes:
                        raise UnsafeZip(f"book decompresses past {self.limits.max_read_bytes / MiB:,.0f} MiB (zip bomb?)")
                    chunks.append(chunk)
        except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError, RuntimeError) as error:
            # bad CRC, truncated data, unsupported compression, encrypted member
            raise ZipProblem(f"member {name!r} cannot be read ({error})") from None
        return b"".join(chunks)


def is_safe_member_name(name: str) -> bool:
    """False for absolute paths, drive letters, backslashes tricks and '..' components."""
    if not name or "\x00" in name:
        return False
    unified = name.replace("\\", "/")
    if unified.startswith("/") or (len(unified) > 1 and unified[1] == ":"):
        return False
    return ".." not in unified.split("/")


def resolve_href(base_dir: str, href: str) -> str | None:
    """Join a relative href to the folder of the file that holds it; None if it escapes the root."""
    if not href or href.startswith("/") or "://" in href or href.startswith(("data:", "mailto:")):
        return None
    joined = posixpath.normpath(posixpath.join(base_dir, href)) if base_dir else posixpath.normpath(href)
    if joined.startswith("../") or joined == ".." or joined.startswith("/"):
        return None
    return joined
