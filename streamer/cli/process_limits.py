"""The process's own limits that ``streamer serve`` raises or checks at start."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# descriptors beyond one per session: the model's files, ports, half-open handshakes
FD_HEADROOM = 256


def raise_open_files_limit(max_sessions: int) -> None:
    """Raise the soft limit on open files to the hard one (many systems start processes
    at 1024) and warn when even that cannot hold ``max_sessions`` sockets: past the
    limit new connections are reset, and uvloop says nothing about it."""
    try:
        import resource
    except ImportError:  # not POSIX
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as error:
            logger.debug("could not raise the open-files limit: %s", error)
    needed = max_sessions + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "only %d open files allowed (ulimit -n): --max-sessions %d needs about %d; "
            "connections past the limit are reset (process_open_fds in /metrics)",
            soft,
            max_sessions,
            needed,
        )
