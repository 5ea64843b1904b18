"""funasr without its side effects: it configures logging and prints while it loads.

:func:`import_funasr` is the one place funasr is imported for the first time;
:func:`quiet_funasr` wraps every call into it that may log or print.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["import_funasr", "quiet_funasr"]


def import_funasr() -> Any:
    """``import funasr`` without letting it configure logging (it calls basicConfig)."""
    with quiet_funasr():
        import funasr

    return funasr


class _FunasrLogFilter(logging.Filter):
    """Demotes records funasr logs straight on the root logger to DEBUG on ours."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        logger.debug("funasr: %s", record.getMessage())
        return False


@contextlib.contextmanager
def quiet_funasr() -> Iterator[None]:
    """Keep funasr from configuring logging or printing while it loads.

    AutoModel calls ``logging.basicConfig`` (and root-logger helpers that call it when
    the root has no handler), logs chatter on the root logger and prints to stdout.
    Only our CLI configures logging.
    """
    root = logging.getLogger()
    log_filter = _FunasrLogFilter()
    captured = io.StringIO()
    original = logging.basicConfig
    logging.basicConfig = _no_basic_config
    root.addFilter(log_filter)
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        logging.basicConfig = original
        root.removeFilter(log_filter)
        for line in captured.getvalue().splitlines():
            if line.strip():
                logger.debug("funasr printed: %s", line)


def _no_basic_config(*args: Any, **kwargs: Any) -> None:
    return None
