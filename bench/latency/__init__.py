"""Streaming latency bench: time to first token and final latency under N real-time clients.

Run ``python -m bench.latency --help`` from the repository root; ``bench/README.md``
explains the options and outputs.
"""
