"""A FunASR client streaming a long file unpaced: does every utterance and the is_final
arrive? (issue 20: websockets' keepalive on the FunASR port closed it at 40 s with 1011).

    flock /tmp/bench.lock python -m bench.funasr_unpaced --model random:small --quantize int8

Starts ``streamer serve --funasr-port``, speaks ``--utterances`` English sentences with
espeak-ng (about 145 s with the defaults), streams them as funasr-client's
``file_asr_stream`` does (60 ms frames, unpaced, ``ping_interval=None``) in ``2pass``
mode and counts the ``2pass-offline`` utterances, the ``is_final`` and the close.
"""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from bench import common
from streamer.testkit import speech as synth

SUBJECTS = ["the old captain", "my neighbour", "a quiet student", "the tired engineer",
            "our new teacher", "the small child", "a careful driver"]  # fmt: skip
ACTIONS = ["carried the heavy box up the stairs", "read the morning paper by the window",
           "painted the fence before the rain came", "found a letter under the door",
           "cooked a large dinner for the whole family"]  # fmt: skip
CHUNK_BYTES = 1920  # 60 ms at 16 kHz: funasr-client's chunk_size [5, 10, 5]


def sentences(n: int) -> list[str]:
    return [f"{SUBJECTS[i % len(SUBJECTS)]} {ACTIONS[i % len(ACTIONS)]}" for i in range(n)]


async def stream(uri: str, pcm: np.ndarray, timeout_s: float) -> dict[str, object]:
    data = pcm.astype("<i2").tobytes()
    utterances, final, close = 0, None, None
    started = time.monotonic()
    first = {"mode": "2pass", "wav_name": "bench", "is_speaking": True, "audio_fs": 16000}
    try:
        async with connect(uri, subprotocols=["binary"], ping_interval=None) as ws:  # type: ignore[list-item]
            await ws.send(json.dumps(first))

            async def send() -> None:
                for i in range(0, len(data), CHUNK_BYTES):
                    await ws.send(data[i : i + CHUNK_BYTES])
                await ws.send(json.dumps({"is_speaking": False}))

            sender = asyncio.create_task(send())
            async with asyncio.timeout(timeout_s):
                while final is None:
                    message = orjson.loads(await ws.recv())
                    if message.get("mode") == "2pass-offline" and message.get("text"):
                        utterances += 1
                    if message.get("is_final"):
                        final = message
            await sender
    except ConnectionClosed as closed:
        close = (closed.rcvd.code, closed.rcvd.reason) if closed.rcvd else ("no close frame",)
    except TimeoutError:
        close = ("timed out",)
    return {
        "utterances": utterances,
        "is_final": final is not None,
        "closed_early": close,
        "wall_s": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = common.parser(__doc__)
    common.add_server_args(parser)
    common.add_output_args(parser, out="bench/out/funasr_unpaced")
    parser.add_argument("--utterances", type=int, default=34)
    parser.add_argument("--gap-ms", type=int, default=1400)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    common.setup_logging()
    texts = sentences(args.utterances)
    clips = [("en", t, synth.speak(t, "en", cache_dir=args.cache_dir / "speech")) for t in texts]
    pcm, truth = synth.join_with_silence(clips, args.gap_ms)
    port = common.free_port()
    server = common.started_server(
        args, args.out / "server.log", extra_args=("--funasr-port", str(port))
    )
    with server:
        result = asyncio.run(stream(f"ws://127.0.0.1:{port}/", pcm, args.timeout_s))
    result |= {"audio_s": round(pcm.size / 16000, 1), "spoken_utterances": len(truth)}
    result |= {"server_args": args.server_arg}
    common.write_results(args.out, result, args)
    print(json.dumps(result))  # noqa: T201  (a bench's report)
    return 0 if result["is_final"] and not result["closed_early"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
