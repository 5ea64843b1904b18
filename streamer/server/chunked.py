"""The sizes a chunked request body declares, checked as the bytes arrive (no I/O).

h11 parses a chunked body and hands its data on as it comes, but says nothing of a chunk's
declared size: a chunk-size line of 20 hex digits (h11 accepts that many) followed by
nothing leaves the request waiting for data that can never be within the body limit, and
the client is told only when the read timeout runs out. :class:`ChunkSizes` walks the same
bytes beside h11, only far enough to read each chunk-size line, and refuses one that could
not fit in what the body may still hold as soon as its digits are seen. h11 stays the
parser: this never decides what the body is, only that it is too large to wait for.
"""

from __future__ import annotations

import http

MAX_SIZE_DIGITS = 16  # significant hex digits of a 64-bit size; more is not a size at all
MAX_LINE_BYTES = 4096  # a chunk-size line with its extensions (h11 bounds it too)
HEX_DIGITS = frozenset(b"0123456789abcdefABCDEF")


class ChunkSizeError(Exception):
    """A chunk-size line that refuses the body: ``status`` (400 or 413) and ``message``."""

    def __init__(self, status: http.HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ChunkSizes:
    """Feed it the raw bytes of a chunked body (from the first byte after the head), in
    order, with :meth:`feed`; it raises :class:`ChunkSizeError` for a chunk that could not
    fit in ``limit_bytes`` with the chunks before it. After the last chunk it reads no more.
    """

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._declared = 0  # the sizes of the chunks whose lines were read
        self._skip = 0  # bytes of the current chunk's data and its CRLF still to pass
        self._line = 0  # bytes of the size line under way
        self._size = 0  # its value so far
        self._digits = 0  # its significant hex digits so far
        self._in_digits = True  # still reading the size's digits (not the extensions)
        self._done = False  # the last chunk (size 0) was declared

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view and not self._done:
            if self._skip:
                step = min(self._skip, len(view))
                self._skip -= step
                view = view[step:]
                continue
            # a size line is short: only its first MAX_LINE_BYTES (+1) are searched
            end = bytes(view[: MAX_LINE_BYTES + 1]).find(b"\n")
            line = view[: MAX_LINE_BYTES + 1] if end < 0 else view[: end + 1]
            self._read_line(bytes(line), complete=end >= 0)
            view = view[len(line) :]

    def _check_size(self) -> None:
        if self._declared + self._size > self.limit_bytes:
            raise ChunkSizeError(
                http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the request body is larger than {self.limit_bytes} bytes",
            )

    def _read_line(self, part: bytes, *, complete: bool) -> None:
        self._line += len(part)
        if self._line > MAX_LINE_BYTES:
            raise ChunkSizeError(http.HTTPStatus.BAD_REQUEST, "a chunk-size line is too long")
        for byte in part:
            if not self._in_digits:
                break
            if byte not in HEX_DIGITS:
                self._in_digits = False
                self._check_size()  # the size's digits are all here
                break
            self._size = self._size * 16 + int(chr(byte), 16)
            self._digits += self._size > 0
            if self._digits > MAX_SIZE_DIGITS:
                raise ChunkSizeError(
                    http.HTTPStatus.BAD_REQUEST, "a chunk size is not a valid size"
                )
        if not complete:
            return
        if self._size == 0:
            self._done = True  # the last chunk: trailers follow, which h11 reads
            return
        self._declared += self._size
        self._skip = self._size + 2  # the data and its CRLF
        self._line = self._size = self._digits = 0
        self._in_digits = True
