"""Streaming latency bench: time to first token and final latency under N real-time clients;
side by side through each protocol (``--protocol``) and encoding (``--encoding``), or on
continuous speech (``--audio continuous``).

Run ``python -m bench.latency --help`` from the repository root; ``bench/README.md``
explains the options and outputs.
"""
