"""A stand-in for the Hugging Face hub on 127.0.0.1: folders served as model repositories.

It answers what huggingface_hub asks when it lists and downloads a model (read from its source,
huggingface_hub 2.x): ``GET /api/models/{repo}[/revision/{rev}]`` (the listing, with file sizes),
``GET /api/models/{repo}/tree/{rev}`` (the files, as transformers asks for chat templates), and ``HEAD``/``GET /{repo}/resolve/{rev}/{file}`` with the headers it checks (``X-Repo-Commit``,
``ETag``, ``Content-Length``); an unknown repository or file is a 404 with the hub's
``X-Error-Code``. Every request is recorded; ``bytes_per_second`` slows the bodies down so that
a download lasts long enough to be seen; a file named in ``cut`` loses its connection before its
first byte, as on a network that goes away.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


class StandInHub:
    """``with StandInHub({"org/name": folder}) as hub:`` serves at ``hub.url``; ``hub.requests`` lists
    ``(method, path)`` of every request."""

    def __init__(self, repos: dict[str, Path], *, bytes_per_second: float | None = None, cut: tuple = ()):
        self.repos = {name: _Repo(Path(folder)) for name, folder in repos.items()}
        self.bytes_per_second = bytes_per_second
        self.cut = set(cut)
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "StandInHub":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Repo:
    def __init__(self, folder: Path):
        self.files = {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.is_file()}
        digest = hashlib.sha1()
        for name, data in self.files.items():
            digest.update(name.encode() + hashlib.sha256(data).digest())
        self.commit = digest.hexdigest()  # 40 hex digits, as a git commit


def _handler(hub: StandInHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the test reads hub.requests
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
                return self._tree("/".join(parts[2:4]), body)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._listing("/".join(parts[2:4]), body)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file("/".join(parts[:2]), "/".join(parts[4:]), body)
            self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, body)

        def _listing(self, name: str, body: bool) -> None:
            repo = hub.repos.get(name)
            if repo is None:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            siblings = [{"rfilename": file, "size": len(data)} for file, data in repo.files.items()]
            data = json.dumps({"id": name, "modelId": name, "sha": repo.commit, "siblings": siblings}).encode()
            self._send(200, data, {"Content-Type": "application/json"}, body)

        def _tree(self, name: str, body: bool) -> None:
            repo = hub.repos.get(name)
            if repo is None:
                return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            entries = [{"type": "file", "path": file, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                       for file, data in repo.files.items()]
            self._send(200, json.dumps(entries).encode(), {"Content-Type": "application/json"}, body)

        def _file(self, name: str, file: str, body: bool) -> None:
            repo = hub.repos.get(name)
            if repo is None:
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, body)
            if file not in repo.files:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit}, body)
            data = repo.files[file]
            headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}
            if body and file in hub.cut:
                return self._send(200, data, headers, body, cut=True)
            self._send(200, data, headers, body, slow=True)

        def _send(self, status: int, data: bytes, headers: dict, body: bool, slow: bool = False,
                  cut: bool = False) -> None:
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if cut:
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(2)  # socket.SHUT_RDWR: the body never comes
                return
            if not body:
                return
            piece = 64 * 1024
            for start in range(0, len(data), piece):
                self.wfile.write(data[start:start + piece])
                if slow and hub.bytes_per_second:
                    time.sleep(piece / hub.bytes_per_second)

    return Handler
