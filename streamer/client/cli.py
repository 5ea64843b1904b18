"""``streamer client FILE``: stream an audio file to a server and show or save the result.

:func:`add_client_arguments` fills an argparse parser; :func:`run_client` runs it and
returns the exit code (:data:`EXIT_CODES`). The live view goes to stderr, so stdout only
ever carries results: JSON lines with ``--json``, the finals' text when stdout is not a
terminal, or a caption file with ``--output -``.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TextIO

import orjson

from streamer.audio_io import load_audio
from streamer.client.captions import FORMATS, CaptionWriter, display_width, format_for, make_writer
from streamer.client.connection import DEFAULT_URL, ClientOptions, Received, ServerUnreachable
from streamer.client.streaming import stream_file
from streamer.client.timeline import SessionResult
from streamer.core import hotwords
from streamer.core.protocol import (
    LANGUAGES,
    End,
    Error,
    Final,
    Notice,
    Partial,
    StreamOptions,
    message_dict,
    parse_stream_options,
)
from streamer.core.transcript import EMOTION_BADGES, EVENT_BADGES
from streamer.errors import (
    ClientError,
    ConfigError,
    ConnectionRefusedByServer,
    InvalidHotwords,
    InvalidOption,
    ServerClosed,
)

__all__ = [
    "EXIT_OK",
    "EXIT_SERVER_ERROR",
    "EXIT_USAGE",
    "EXIT_UNREACHABLE",
    "EXIT_AUTH",
    "EXIT_CODES",
    "add_client_arguments",
    "run_client",
    "LiveView",
    "tag_label",
]

EXIT_OK = 0
EXIT_SERVER_ERROR = 1  # the server reported a fatal error or closed the session abnormally
EXIT_USAGE = 2  # bad arguments, missing or unsupported audio file
EXIT_UNREACHABLE = 3  # nothing answered, or the server is unavailable (404, 503)
EXIT_AUTH = 4  # the server refused the token (401) or the origin (403)

EXIT_CODES = f"""\
exit codes:
  {EXIT_OK}  the whole file was transcribed
  {EXIT_SERVER_ERROR}  the server reported an error or closed the session abnormally
  {EXIT_USAGE}  bad arguments, missing or unsupported audio file
  {EXIT_UNREACHABLE}  server unreachable or unavailable (connection refused, timeout, HTTP 404/503)
  {EXIT_AUTH}  authentication refused (HTTP 401/403: wrong --token or origin)
"""

_UNREMARKABLE = {"NEUTRAL"}  # the terminal leaves out what most speech is
_CLEAR_LINE = "\r\x1b[2K"
_DIM = "\x1b[2m"
_RESET = "\x1b[0m"
_REDRAW_INTERVAL_S = 0.05  # progress redraws at most 20 times a second
_BAR_CELLS = 20


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``streamer client`` arguments (and the exit-code epilog) to ``parser``."""
    parser.add_argument("file", type=Path, help="audio file (wav, flac, ogg, mp3, m4a, webm, ...)")
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="server endpoint; without a path, /v1/asr (default: %(default)s)",
    )
    parser.add_argument(
        "--hotwords",
        default=None,
        metavar="PHRASES|FILE",
        help="phrases to favour: 'Kubernetes,Anthropic:3' (phrase or phrase:boost, "
        "comma-separated) or a file of one a line, as serve's --hotwords",
    )
    parser.add_argument(
        "--language", choices=LANGUAGES, default="auto", help="spoken language (default: auto)"
    )
    parser.add_argument(
        "--itn",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="inverse text normalisation: punctuation, digits (default: on)",
    )
    parser.add_argument(
        "--partials",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for partial results (default: on)",
    )
    parser.add_argument(
        "--endpoint-ms", type=int, default=None, help="trailing silence that ends an utterance"
    )
    parser.add_argument("--token", default=None, help="access token (Authorization: Bearer)")
    parser.add_argument(
        "--insecure", action="store_true", help="wss:// without checking the certificate"
    )
    pacing = parser.add_mutually_exclusive_group()
    pacing.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="stream N times faster than real time (default: 1, like a live microphone)",
    )
    pacing.add_argument(
        "--no-pace", action="store_true", help="send as fast as the server takes the audio"
    )
    parser.add_argument(
        "--chunk-ms", type=int, default=100, help="audio per frame (default: %(default)s)"
    )
    parser.add_argument(
        "--output",
        "-o",
        action="append",
        default=[],
        metavar="FILE",
        help="write the result to FILE ('-' for stdout); repeat for several files",
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=None,
        help="format of --output (default: from its extension)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print each final as a JSON line on stdout"
    )
    parser.add_argument(
        "--diarize",
        action="store_true",
        help="ask who speaks (a server with --diarize-model): speakers in the live view "
        "and in SRT/VTT output",
    )
    parser.add_argument(
        "--quiet",
        "-q",
        action="store_true",
        help="print nothing but errors: no live view, no summary, no transcript on a piped "
        "stdout (--json and --output - still write stdout)",
    )
    parser.add_argument(
        "--reconnects",
        type=int,
        default=20,
        help="reconnections when the connection drops mid-stream (default: %(default)s)",
    )
    parser.add_argument(
        "--reconnect-timeout-s",
        type=float,
        default=120.0,
        help="keep retrying a lost server this long (capped exponential backoff with "
        "jitter), then resume after the last final (default: %(default)s)",
    )
    parser.epilog = EXIT_CODES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


# ---------------------------------------------------------------------------
# Live terminal view


def tag_label(language: str | None, emotion: str | None, event: str | None, emoji: bool) -> str:
    """``[en 😊 👏]`` (or ``[en HAPPY Laughter]`` without emoji); neutral tags are left out."""
    parts = [language] if language else []
    for value, table in ((emotion, EMOTION_BADGES), (event, EVENT_BADGES)):
        if value is not None and value in table and value not in _UNREMARKABLE:
            parts.append(table[value][0] if emoji else value)
    return f"[{' '.join(parts)}]" if parts else ""


def _clock(ms: float) -> str:
    seconds = max(0.0, ms / 1000)
    minutes, seconds = divmod(seconds, 60)
    return f"{int(minutes):02d}:{seconds:04.1f}"


def _tail(text: str, width: int) -> str:
    """The end of ``text`` that fits ``width`` columns, with an ellipsis when cut."""
    if display_width(text) <= width:
        return text
    kept = ""
    for char in reversed(text):
        if display_width(kept) + display_width(char) + 1 > width:
            break
        kept = char + kept
    return "…" + kept


class LiveView:
    """Finals committed line by line; the partial and a progress bar rewritten in place.

    On a non-terminal stream only finals, notices and the summary are written.
    """

    def __init__(
        self,
        stream: TextIO,
        *,
        total_samples: int,
        sample_rate: int,
        interactive: bool,
        emoji: bool,
        width: int = 80,
    ) -> None:
        self._stream = stream
        self._total_samples = max(1, total_samples)
        self._sample_rate = sample_rate
        self._interactive = interactive
        self._emoji = emoji
        self._width = max(40, width)
        self._sent_samples = 0
        self._partial: Partial | None = None
        self._status_shown = False
        self._last_draw_s = 0.0

    def progress(self, end_sample: int) -> None:
        """The audio sent so far (redrawn at most every 50 ms)."""
        self._sent_samples = max(self._sent_samples, end_sample)
        now = time.monotonic()
        if self._interactive and now - self._last_draw_s >= _REDRAW_INTERVAL_S:
            self._draw_status()

    def message(self, message: object) -> None:
        """Show a server message: partials in place, finals and errors as lines."""
        if isinstance(message, Partial):
            self._partial = message
            if self._interactive:
                self._draw_status()
        elif isinstance(message, Final):
            self._partial = None
            line = self.final_line(message)
            if line:
                self.line(line)
            elif self._interactive:
                self._draw_status()
        elif isinstance(message, Error):
            self.line(f"server {'error' if message.fatal else 'warning'}: {message.code}: "
                      f"{message.message}")  # fmt: skip
        elif isinstance(message, Notice):
            self.line(f"server warning: {message.code}: {message.message}")

    def final_line(self, final: Final) -> str:
        """``00:01.2 [en 😊] Text`` for a final; empty for a final without text or error."""
        stamp = _clock(final.start_ms)
        if final.error:
            return f"{stamp} (decoding failed: {final.error.get('message', final.error)})"
        if not final.text.strip():
            return ""
        label = tag_label(final.language, final.emotion, final.event, self._emoji)
        if final.speaker:
            stamp = f"{stamp} {final.speaker}:"
        return f"{stamp} {label} {final.text.strip()}" if label else f"{stamp} {final.text}"

    def line(self, text: str) -> None:
        """Commit a line above the status line."""
        if self._status_shown:
            self._stream.write(_CLEAR_LINE)
            self._status_shown = False
        self._stream.write(text + "\n")
        if self._interactive:
            self._draw_status()
        self._stream.flush()

    def close(self) -> None:
        """Remove the status line."""
        if self._status_shown:
            self._stream.write(_CLEAR_LINE)
            self._status_shown = False
        self._stream.flush()

    def status_text(self) -> tuple[str, str, str]:
        """(progress, stable partial, rest of the partial), cut to fit the width."""
        fraction = min(1.0, self._sent_samples / self._total_samples)
        filled = int(fraction * _BAR_CELLS)
        seconds = self._sent_samples / self._sample_rate
        total_s = self._total_samples / self._sample_rate
        bar = "█" * filled + "░" * (_BAR_CELLS - filled)
        progress = f"{fraction:4.0%} {bar} {seconds:5.1f}/{total_s:.1f}s"
        if self._partial is None or not self._partial.text:
            return progress, "", ""
        text = self._partial.text
        room = self._width - display_width(progress) - 4
        shown = _tail(text, room)
        hidden = len(text) - len(shown.lstrip("…")) if shown.startswith("…") else 0
        stable = self._partial.stable_text if text.startswith(self._partial.stable_text) else ""
        cut = max(0, len(stable) - hidden)
        prefix = "…" if shown.startswith("…") else ""
        body = shown[len(prefix) :]
        return f"{progress} │ ", prefix + body[:cut], body[cut:]

    def _draw_status(self) -> None:
        progress, stable, rest = self.status_text()
        rest_styled = f"{_DIM}{rest}{_RESET}" if rest else ""
        self._stream.write(f"{_CLEAR_LINE}{progress}{stable}{rest_styled}")
        self._stream.flush()
        self._status_shown = True
        self._last_draw_s = time.monotonic()


# ---------------------------------------------------------------------------
# The command


@dataclass(frozen=True)
class _Output:
    writer: CaptionWriter
    stream: TextIO
    owned: bool  # close the stream at the end


def _stream_options(args: argparse.Namespace) -> StreamOptions:
    params: dict[str, object] = {
        "language": args.language,
        "itn": args.itn,
        "partials": args.partials,
    }
    if args.endpoint_ms is not None:
        params["endpoint_ms"] = args.endpoint_ms
    if getattr(args, "diarize", False):
        params["diarize"] = True
    options = parse_stream_options(params)
    if args.hotwords:
        words = read_hotwords_argument(args.hotwords)
        try:
            hotwords.as_query(words)  # the client sends them in the URL
        except InvalidHotwords as error:
            raise ConfigError(f"--hotwords: {error.message}") from None
        options = replace(options, hotwords=words)
    return options


def read_hotwords_argument(value: str) -> hotwords.Hotwords:
    """``--hotwords``: a file of one ``phrase`` or ``phrase:boost`` a line when ``value``
    names one, else a comma-separated list of them (ConfigError if malformed)."""
    from streamer.cli.common import read_hotwords

    path = Path(value).expanduser()
    if path.is_file():
        return read_hotwords(path)
    try:
        return hotwords.parse_v1(value, strings=True)
    except InvalidHotwords as error:
        raise ConfigError(f"--hotwords: {error.message}") from None


@contextlib.contextmanager
def _outputs(paths: list[str], explicit_format: str | None) -> Iterator[list[_Output]]:
    if explicit_format and len(paths) > 1:
        raise ConfigError("--format applies to a single --output; use file extensions instead")
    formats = [format_for(path, explicit_format) for path in paths]
    outputs: list[_Output] = []
    try:
        for path, fmt in zip(paths, formats, strict=True):
            if path == "-":
                outputs.append(_Output(make_writer(sys.stdout, fmt), sys.stdout, owned=False))
                continue
            try:
                stream = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
            except OSError as exc:
                raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from exc
            outputs.append(_Output(make_writer(stream, fmt), stream, owned=True))
        yield outputs
    finally:
        for output in outputs:
            output.writer.close()
            if output.owned:
                output.stream.close()


def _summary(result: SessionResult, wall_s: float) -> str:
    """One line that explains itself: what was transcribed, how fast, how late."""
    if result.end is not None:
        audio_s = result.end.audio_ms / 1000
    else:
        audio_s = max((c.end_sample for c in result.sends), default=0) / result.sample_rate
    utterances = sum(1 for f in result.finals if f.text.strip())
    parts = [f"{utterances} utterance{'s' if utterances != 1 else ''} transcribed"]
    speed = f" ({audio_s / wall_s:.1f}× real time)" if wall_s > 0 else ""
    parts.append(f"{audio_s:.1f} s of audio sent in {wall_s:.1f} s{speed}")
    ttfp = result.time_to_first_partial_s()
    if ttfp is not None:
        parts.append(f"first result {ttfp * 1000:.0f} ms after its speech began (as sent)")
    latency = result.median_final_latency_s()
    if latency is not None:
        parts.append(f"finals {latency * 1000:.0f} ms after their speech ended (median)")
    if result.end is not None and result.end.partials_skipped:
        skipped = result.end.partials_skipped
        parts.append(
            f"{skipped} partial update{'s' if skipped != 1 else ''} skipped while the "
            "server was busy (finals are never skipped)"
        )
    if result.reconnects:
        parts.append(f"{result.reconnects} reconnect{'s' if result.reconnects != 1 else ''}")
    return " · ".join(parts)


def _error(stream: TextIO, text: str) -> None:
    stream.write(f"error: {text}\n")
    stream.flush()


async def run_client(args: argparse.Namespace) -> int:
    """Run ``streamer client`` with parsed ``args``; returns the exit code (see EXIT_CODES)."""
    err: TextIO = sys.stderr
    out: TextIO = sys.stdout
    try:
        stream_options = _stream_options(args)
        if args.speed is not None and args.speed <= 0:
            raise ConfigError("--speed must be positive")
        pcm = load_audio(args.file, target_rate=stream_options.sample_rate)
    except (ConfigError, InvalidOption) as exc:
        _error(err, str(exc))
        return EXIT_USAGE
    options = ClientOptions(
        url=args.url,
        stream=stream_options,
        token=args.token,
        insecure=args.insecure,
        max_reconnects=max(0, args.reconnects),
        reconnect_timeout_s=max(0.0, args.reconnect_timeout_s),
    )
    results_on_terminal = out.isatty() and (args.json or "-" in args.output)
    # The in-place status line would be torn by results written to the same terminal.
    interactive = err.isatty() and not args.quiet and not results_on_terminal
    encoding = (getattr(err, "encoding", None) or "").lower()
    view = LiveView(
        err,
        total_samples=pcm.size,
        sample_rate=stream_options.sample_rate,
        interactive=interactive,
        emoji=encoding.startswith("utf"),
        width=shutil.get_terminal_size((80, 24)).columns,
    )
    # piped stdout gets the transcript, unless -q (nothing but what was asked for)
    stdout_text = not args.json and not args.quiet and not out.isatty() and "-" not in args.output
    started_s = time.monotonic()

    try:
        with _outputs(args.output, args.format) as outputs:

            def on_message(item: Received) -> None:
                arrival_s = item.arrival_s - started_s
                for output in outputs:
                    output.writer.write(item.message, arrival_s)
                message = item.message
                if isinstance(message, Final):
                    if args.json:
                        record = {"arrival_s": round(arrival_s, 6), **message_dict(message)}
                        out.write(orjson.dumps(record).decode() + "\n")
                        out.flush()
                    elif stdout_text and message.text.strip():
                        out.write(message.text.strip() + "\n")
                        out.flush()
                if not args.quiet and not isinstance(message, End):
                    view.message(message)

            def on_reconnect(count: int, resume_sample: int, error: BaseException | None) -> None:
                if not args.quiet:
                    view.line(
                        f"connection lost ({error or 'server ended the session'}); reconnecting,"
                        f" resuming at {resume_sample / stream_options.sample_rate:.1f} s"
                    )

            try:
                result = await stream_file(
                    options,
                    pcm,
                    sample_rate=stream_options.sample_rate,
                    speed=None if args.no_pace else args.speed,
                    chunk_ms=args.chunk_ms,
                    on_message=on_message,
                    on_chunk_sent=lambda end, _t: view.progress(end) if interactive else None,
                    on_reconnect=on_reconnect,
                )
            finally:
                view.close()
                descriptions = [output.writer.describe() for output in outputs]
    except ConfigError as exc:
        _error(err, str(exc))
        return EXIT_USAGE
    except ConnectionRefusedByServer as exc:
        _error(err, str(exc))
        return EXIT_AUTH if exc.status in (401, 403) else EXIT_UNREACHABLE
    except ServerUnreachable as exc:
        _error(err, str(exc))
        return EXIT_UNREACHABLE
    except (ServerClosed, ClientError) as exc:
        _error(err, str(exc))
        return EXIT_SERVER_ERROR
    if not args.quiet:
        err.write(_summary(result, time.monotonic() - started_s) + "\n")
        for path, written in zip(args.output, descriptions, strict=True):
            if path != "-":
                fmt = format_for(path, args.format)
                err.write(f"wrote {path} ({fmt}): {written}\n")
        err.flush()
    return EXIT_OK
