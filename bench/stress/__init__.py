"""Reliability stress suite (issue 9) and the mixed soak (issue 32), against a ``streamer
serve`` it starts: attacks one after the other, or every kind of client at once for minutes.

    python -m bench.stress                          # scaled run, into bench/RESULTS.md
    python -m bench.stress --clients 8 --minutes 15 --model random:small --quantize int8
    python -m bench.stress soak --minutes 20        # the mixed soak (bench/stress/soak.py)

``attacks.py`` holds the attacks (each a row: expected, observed, verdict, finals lost,
peak RSS), ``soak.py`` the soak; every client talks to 127.0.0.1 only, and every loop is
bounded in count and time.
"""

from bench.stress.attacks import main

__all__ = ["main"]
