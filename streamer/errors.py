"""The one exception tree of the package.

::

    StreamerError
    ├── ConfigError                 bad server/recognizer options (CLI exits 2)
    ├── ModelError                  model weights missing, unloadable or inconsistent
    ├── DecodeError                 one decode failed; that segment's final carries it
    │   ├── ModelProcessGone            the model process it was sent to died or was killed
    │   └── DecodeInterrupted           a partial's decode stopped so that a final goes first
    ├── FileRefused                 a file upload cannot be transcribed now (has ``code``)
    ├── HttpError                   a request answered with an HTTP status instead of being
    │   │                             served (has ``status``, a JSON ``body``, ``headers``)
    │   ├── BadRequest                  a request the server cannot make sense of (400)
    │   └── BodyError                   a request body that cannot be read (400, 408, 413)
    ├── ApiError                    a file API's refusal, in that API's own error shape
    │                                 (has ``status``, ``code``; answered as an HttpError)
    ├── ClientError                 raised by :mod:`streamer.client`
    │   ├── ConnectionRefusedByServer   handshake refused (auth, capacity, origin)
    │   ├── ServerUnreachable           nothing answered at the URL
    │   └── ServerClosed                the server ended the session with an error
    └── ProtocolError               something a client sent is wrong (has ``code``)
        ├── MalformedMessage            non-JSON or unknown text message (not fatal)
        │   └── MessageTooBig               a frame or line over its size limit
        ├── InvalidOption               an option value is wrong (close 1008)
        │   └── InvalidHotwords             a hotword phrase or boost is wrong (not fatal)
        ├── UnsupportedSampleRate       sample rate not supported (close 1003)
        ├── UndecodableAudio            audio bytes that are not the declared or detected
        │   │                             encoding, or a corrupt container (close 1003)
        │   └── AudioTooLong                an uploaded file longer than the server takes
        └── UnexpectedMessage           valid message at the wrong time (not fatal)

Each :class:`ProtocolError` names its wire ``code`` and whether it ends the session;
:func:`close_code_for` maps it to a WebSocket close code in one place.
"""

from __future__ import annotations

import http
from collections.abc import Mapping

__all__ = [
    "StreamerError",
    "ConfigError",
    "ModelError",
    "DecodeError",
    "ModelProcessGone",
    "DecodeInterrupted",
    "FileRefused",
    "HttpError",
    "BadRequest",
    "BodyError",
    "ApiError",
    "ClientError",
    "ConnectionRefusedByServer",
    "ServerClosed",
    "ServerUnreachable",
    "ProtocolError",
    "MalformedMessage",
    "MessageTooBig",
    "InvalidOption",
    "UnsupportedSampleRate",
    "InvalidHotwords",
    "UnexpectedMessage",
    "UndecodableAudio",
    "AudioTooLong",
    "close_code_for",
]

# WebSocket close codes (RFC 6455 section 7.4.1).
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_UNSUPPORTED_DATA = 1003
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013


class StreamerError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(StreamerError):
    """An option given to the server, recognizer or CLI is invalid."""


class ModelError(StreamerError):
    """The model cannot be loaded, or would silently produce garbage."""


class DecodeError(StreamerError):
    """Decoding one utterance failed; the session goes on."""


class ModelProcessGone(DecodeError):
    """The model process (``serve --model-process``) died or was killed: the worker
    starts another or fails; the message says why, and there is no traceback to show."""


class DecodeInterrupted(DecodeError):
    """The worker stopped a partial's decode midway because a final was queued behind
    it (:meth:`~streamer.model.interface.SpeechRecognizer.interrupt`): not a failure,
    the partial is dropped and the session asks for a newer one."""


class FileRefused(StreamerError):
    """The server cannot transcribe a file now: every file slot is taken
    (``too_many_files``), or it stopped the file's transcription (``shutting_down``, a
    model failure). The HTTP APIs answer it with 429 or 503 and ``Retry-After``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class HttpError(StreamerError):
    """A request answered with ``status`` and ``body`` (JSON) instead of being served;
    ``headers`` go with the answer. Raised by the HTTP side of a port and answered
    where the request is handled: the text is ours, never the request's."""

    def __init__(
        self,
        status: http.HTTPStatus,
        body: Mapping[str, object],
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(f"{status.value} {status.phrase}")
        self.status = status
        self.body = dict(body)
        self.headers = dict(headers or {})


class BadRequest(HttpError):
    """A request the server cannot make sense of (a repeated single header, a target
    that is no URL): answered 400 with ``message``, which is ours, never text from the
    request."""

    def __init__(self, message: str) -> None:
        super().__init__(http.HTTPStatus.BAD_REQUEST, {"error": "bad_request", "message": message})
        self.message = message


class BodyError(HttpError):
    """The request's body cannot be read: it ended early or is malformed (400), the
    client stopped sending (408), or it is too large (413)."""

    def __init__(self, status: http.HTTPStatus, message: str) -> None:
        super().__init__(status, {"error": "bad_request", "message": message})
        self.message = message


class ApiError(StreamerError):
    """A file API refused the request: ``status`` and ``code`` (OpenAI's or Deepgram's),
    ``message``, the form field it is about (``param``), and when to retry
    (``retry_after_s``). The API's ``error_shape`` builds the body; the file routes
    answer it as an :class:`HttpError`."""

    def __init__(
        self,
        status: http.HTTPStatus,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s


class ClientError(StreamerError):
    """An error seen by :mod:`streamer.client`."""


class ConnectionRefusedByServer(ClientError):
    """The server refused the WebSocket handshake (``status`` is the HTTP status)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"server refused the connection: HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


class ServerUnreachable(ClientError):
    """Nothing answered at the URL (refused, DNS failure, timeout, TLS failure)."""


class ServerClosed(ClientError):
    """The server closed the session abnormally (``code`` is the close code)."""

    def __init__(self, code: int | None, reason: str) -> None:
        super().__init__(f"server closed the session: {code} {reason}".strip())
        self.code = code
        self.reason = reason


class ProtocolError(StreamerError):
    """Something a client sent violates protocol v1.

    ``code`` is the machine-readable code sent in the ``error`` message; ``fatal``
    says whether the session ends because of it.
    """

    code = "protocol_error"
    fatal = True

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class MalformedMessage(ProtocolError):
    """A text frame that is not JSON, not an object, or has an unknown ``type``."""

    code = "bad_message"
    fatal = False


class MessageTooBig(MalformedMessage):
    """A frame, line or payload larger than the server accepts."""

    code = "message_too_big"


class UnexpectedMessage(ProtocolError):
    """A valid message sent when it has no meaning (audio after ``stop``, ...)."""

    code = "unexpected_message"
    fatal = False


class InvalidOption(ProtocolError):
    """An option has a wrong name, type or value."""

    code = "invalid_option"


class InvalidHotwords(InvalidOption):
    """A hotword phrase is empty, too long or cannot be tokenized, a boost is not a
    number in range, or there are too many phrases. Not fatal where the protocol lets
    the session go on (a v1 ``config`` message is refused whole; a handshake is refused)."""

    code = "invalid_hotwords"
    fatal = False


class UnsupportedSampleRate(InvalidOption):
    """The declared sample rate is not one the server resamples from."""

    code = "unsupported_sample_rate"


class UndecodableAudio(ProtocolError):
    """Audio that cannot be decoded: not the declared encoding, a corrupt or truncated
    container, a header that never completes, or a change of format mid-stream."""

    code = "undecodable_audio"


class AudioTooLong(UndecodableAudio):
    """An uploaded file whose audio is longer than the server's duration limit (known
    from its header, or found while decoding it). A kind of :class:`UndecodableAudio`
    (the file is refused, not decoded), so a handler of that refuses it too; one that
    tells the two apart catches this first."""

    code = "audio_too_long"


def close_code_for(error: BaseException) -> int:
    """The WebSocket close code that ends a session because of ``error``."""
    if isinstance(error, UnsupportedSampleRate | UndecodableAudio):
        return CLOSE_UNSUPPORTED_DATA
    if isinstance(error, ProtocolError):
        return CLOSE_POLICY_VIOLATION
    return CLOSE_INTERNAL_ERROR
