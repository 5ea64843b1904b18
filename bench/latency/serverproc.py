"""The server a latency run starts: :class:`bench.common.ManagedServer`, named here for the
modules that import it from this place."""

from bench.common import ManagedServer, ServerOptions, free_port, http_base, http_get

__all__ = ["ManagedServer", "ServerOptions", "free_port", "http_base", "http_get"]
