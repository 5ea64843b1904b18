"""Streams a raw PCM file with funasr-python 0.1.5 and prints what its callbacks got (JSON).

    python tests/funasr_python_driver.py ws://127.0.0.1:PORT/ 2pass speech.pcm

funasr-python installs the same top-level package as funasr-client (``funasr_client``),
so it lives in its own folder (``scripts/test.sh`` puts it in .cache/clients/funasr-python)
and runs in a process of its own with that folder first on ``PYTHONPATH``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

CHUNK_BYTES = 3200  # 100 ms at 16 kHz: what funasr-python's own streaming sends


async def main(uri: str, mode: str, path: str) -> list[list[str]]:
    import funasr_client

    if not hasattr(funasr_client, "AsyncSimpleCallback"):
        raise SystemExit(f"{funasr_client.__file__} is funasr-client, not funasr-python")
    from funasr_client import AsyncFunASRClient, AsyncSimpleCallback

    data = Path(path).read_bytes()
    got: list[list[str]] = []

    async def on_partial(result) -> None:
        got.append(["partial", result.text])

    async def on_final(result) -> None:
        got.append(["final", result.text])

    async def on_error(error) -> None:
        got.append(["error", str(error)])

    async def audio():
        for offset in range(0, len(data), CHUNK_BYTES):
            yield data[offset : offset + CHUNK_BYTES]

    client = AsyncFunASRClient(server_url=uri, mode=mode, timeout=20.0)
    try:
        callback = AsyncSimpleCallback(on_partial=on_partial, on_final=on_final, on_error=on_error)
        await client.recognize_stream(audio(), callback)
        await asyncio.sleep(0.1)  # its callbacks run as tasks: let the last ones finish
    finally:
        await client.close()
    return got


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4])), ensure_ascii=False))
