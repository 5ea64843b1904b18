"""One answer per burst of the same non-fatal error (I/O-free).

Repeats of the same code before any valid input are counted, and the count is reported
once the burst ends (the next valid input, another code, or the end), so a client
flooding junk gets one answer, not one per frame.
"""

from __future__ import annotations

from streamer.core.protocol import Error


class ErrorBurst:
    """The non-fatal error being repeated, and how many repeats were not sent."""

    def __init__(self) -> None:
        self.code: str | None = None  # the code of the non-fatal errors being counted
        self.suppressed = 0  # errors of that code not sent since the last one

    def record(self, code: str, message: str) -> list[Error]:
        """One more non-fatal error: what to send now (nothing for a repeat)."""
        if code == self.code:
            self.suppressed += 1
            return []
        out = self.end()
        self.code = code
        out.append(Error(code=code, message=message, fatal=False))
        return out

    def end(self) -> list[Error]:
        """The burst is over: the count of what was not sent, if anything was not."""
        out = []
        if self.suppressed:
            n = self.suppressed
            out.append(
                Error(
                    code=self.code or "bad_message",
                    message=f"{n} more errors like the previous one were not sent one by one",
                    fatal=False,
                    suppressed=n,
                )
            )
        self.code = None
        self.suppressed = 0
        return out
