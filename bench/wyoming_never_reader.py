"""Server memory under Wyoming clients that never read: is the outbox bounded?

Each client connects to the Wyoming port with a 4 KiB receive buffer, sends ``describe``
events as fast as the socket takes them (each answered with a ~660-byte ``info``) and
reads nothing, for ``--seconds``. The bench samples the server's resident memory (VmRSS)
every 50 ms and reports the peak growth over the idle server's, and how each client ended
(the server closed it, or it was still open at the end). Issue 20 measured +36 MB in 10 s
for one such client and +80 MB for eight, when the Wyoming outbox had no bound; the pump's
outbox now holds at most ``ConnectionLimits.max_outbox_bytes`` (1 MiB) per session, and
``--write-timeout-s`` (15 s) closes a client whose writes block that long.

``--old-code DIR`` runs the same steps against a second server whose ``streamer`` package
comes from DIR (e.g. ``git archive 1131bf8 | tar -x -C /tmp/old``), in the same run::

    python -m bench.wyoming_never_reader --clients 1,8 --seconds 10 --old-code /tmp/old
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from pathlib import Path
from typing import Any

from bench import common
from streamer.core.compat.wyoming import WyomingEvent, encode_event

logger = logging.getLogger("bench.wyoming_never_reader")

DESCRIBE = encode_event(WyomingEvent("describe"))
SAMPLE_S = 0.05


async def never_reader(port: int, seconds: float) -> dict[str, Any]:
    """One client: flood describe, read nothing; how long until the server closed it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    started = time.monotonic()
    sent = 0
    closed_after_s: float | None = None
    try:
        while time.monotonic() - started < seconds:
            writer.write(DESCRIBE * 50)
            sent += 50
            await asyncio.wait_for(writer.drain(), timeout=seconds)
            await asyncio.sleep(0.002)
    except (ConnectionError, OSError):
        closed_after_s = round(time.monotonic() - started, 2)
    except TimeoutError:
        pass  # the server stopped reading us: still open
    writer.transport.abort()
    return {"describes_sent": sent, "closed_by_server_after_s": closed_after_s}


async def step(pid: int, port: int, clients: int, seconds: float) -> dict[str, Any]:
    with common.PeakRss(pid, SAMPLE_S) as memory:
        runs = await asyncio.gather(*(never_reader(port, seconds) for _ in range(clients)))
    await asyncio.sleep(1.0)  # let the server notice the aborts
    after = common.rss_mb(pid)
    closed = [r["closed_by_server_after_s"] for r in runs if r["closed_by_server_after_s"]]
    return {
        "clients": clients,
        "seconds": seconds,
        "rss_idle_mb": round(memory.start_mb, 1),
        "rss_peak_growth_mb": round(memory.growth_mb, 1),
        "rss_after_mb": round(after, 1),
        "closed_by_server": len(closed),
        "closed_after_s": sorted(closed),
        "describes_sent": sum(r["describes_sent"] for r in runs),
    }


def run(args: Any, code: str, code_dir: Path | None) -> list[dict[str, Any]]:
    port = common.free_port()
    extra = ("--wyoming-port", str(port))
    server = common.started_server(
        args, args.out / f"server-{code}.log", extra_args=extra, code_dir=code_dir
    )
    rows = []
    with server:
        assert server.pid is not None
        for clients in args.clients:
            logger.info("%s code: %d never-reading clients for %.0f s", code, clients, args.seconds)
            rows.append({"code": code} | asyncio.run(step(server.pid, port, clients, args.seconds)))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| code | clients | idle RSS MB | peak growth MB | closed by the server | after s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        after = ", ".join(f"{s:g}" for s in r["closed_after_s"]) or "-"
        lines.append(
            f"| {r['code']} | {r['clients']} | {r['rss_idle_mb']} | {r['rss_peak_growth_mb']} "
            f"| {r['closed_by_server']} of {r['clients']} | {after} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = common.parser(__doc__)
    common.add_server_args(parser, model="random:tiny", quantize=None)
    common.add_output_args(parser, out="bench/out/wyoming_never_reader")
    parser.add_argument("--clients", type=common.int_list, default=[1, 8])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--old-code", type=Path, default=None, help="a second server's code")
    args = parser.parse_args()
    common.setup_logging()
    rows = run(args, "new", None)
    if args.old_code is not None:
        rows += run(args, "old", args.old_code.resolve())
    common.write_results(args.out, {"rows": rows}, args)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
