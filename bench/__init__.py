"""The benchmarks: run ``python -m bench`` from the repository root for the list.

Each is a module run as ``python -m bench.NAME`` (or ``python -m bench NAME``); what they
share (starting a server, ports, the CPU's name, arguments, results) is in
:mod:`bench.common`. Figures, with their commands, are in ``bench/RESULTS.md``.
"""
