"""A stand-in for the Hugging Face hub's file API on loopback, for tests of the fetch.

huggingface_hub's ``hf_hub_download`` asks ``HEAD {endpoint}/{repo}/resolve/{revision}/
{file}`` for the commit (``X-Repo-Commit``), the ETag (``X-Linked-Etag`` and
``X-Linked-Size`` for LFS files: the SHA-256 and size) and then ``GET``s the same URL,
with ``Range: bytes=N-`` when it resumes a dropped transfer; a missing repository or file
is a 404 with ``X-Error-Code: RepoNotFound`` / ``EntryNotFound``. This server answers
those requests from files in memory, and can drop the first transfer of a file halfway
or serve bytes that do not match their ETag.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.timing import timeout_s

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_MIN_BYTES = 10_000  # files at least this big are served as LFS files (SHA-256 ETag)


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


@dataclass
class Hub:
    repos: dict[str, dict[str, bytes]]  # repo id -> file name -> content
    drop_first_get: set[str] = field(default_factory=set)  # files whose first GET breaks off
    corrupt: set[str] = field(default_factory=set)  # files served with a wrong byte
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    url: str = ""

    def etag(self, data: bytes) -> str:
        return (
            hashlib.sha256(data).hexdigest() if len(data) >= LFS_MIN_BYTES else git_blob_sha1(data)
        )


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def do_GET(self) -> None:
            self._answer(body=True)

        def _answer(self, *, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            repo, sep, rest = self.path.lstrip("/").partition("/resolve/")
            _revision, _, name = rest.partition("/")
            files = hub.repos.get(repo) if sep else None
            if files is None or name not in files:
                code = "RepoNotFound" if files is None else "EntryNotFound"
                self.send_response(404)
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", f"{code}: {self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = files[name]
            etag = hub.etag(data)
            if name in hub.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            start = 0
            ranged = self.headers.get("Range")
            if body and ranged and ranged.startswith("bytes="):
                start = int(ranged[len("bytes=") :].split("-")[0])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            if len(data) >= LFS_MIN_BYTES:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("ETag", f'"{etag}"')
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            if name in hub.drop_first_get:
                hub.drop_first_get.discard(name)
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.close()
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def running(hub: Hub) -> Iterator[Hub]:
    """Serve ``hub`` on 127.0.0.1 (a free port) while the block runs; ``hub.url`` is set."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="hub-standin", daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout_s(5))
