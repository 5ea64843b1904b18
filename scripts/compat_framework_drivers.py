"""Drive pipecat's and LiveKit's speech-to-text services against a server (one per run).

Runs inside a venv that has the framework (see scripts/compat_frameworks.sh), not the
project's: it imports nothing from ``streamer``. Reads 16 kHz mono s16le PCM from a file,
streams it the way the framework's users do, and prints one JSON object on stdout:
``{"client": ..., "finals": [...], "events": [...]}``.

    python compat_framework_drivers.py pipecat-deepgram --port 8000 --pcm speech.raw
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

RATE = 16000
KEY = "test-key"


def chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def _run_pipecat(stt, pcm: bytes, finals: list[str], events: list[str], commit: bool):
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        InputAudioRawFrame,
        InterimTranscriptionFrame,
        TranscriptionFrame,
        VADUserStartedSpeakingFrame,
        VADUserStoppedSpeakingFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor

    class Sink(FrameProcessor):
        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, TranscriptionFrame):
                finals.append(frame.text)
                events.append(f"TranscriptionFrame({frame.text!r})")
            elif isinstance(frame, InterimTranscriptionFrame):
                events.append(f"InterimTranscriptionFrame({frame.text!r})")
            elif isinstance(frame, ErrorFrame):
                events.append(f"ErrorFrame({frame.error!r})")
            await self.push_frame(frame, direction)

    task = PipelineTask(
        Pipeline([stt, Sink()]),
        params=PipelineParams(audio_in_sample_rate=RATE),
        idle_timeout_secs=None,
        enable_rtvi=False,
    )
    runner = PipelineRunner(handle_sigint=False)

    async def feed():
        await asyncio.sleep(1.0)  # let the service connect
        await task.queue_frame(VADUserStartedSpeakingFrame())
        for chunk in chunks(pcm, 640):  # 20 ms, as a transport delivers them
            await task.queue_frame(
                InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1)
            )
            await asyncio.sleep(0.004)
        # Deepgram: Finalize; OpenAI with turn_detection null: input_audio_buffer.commit
        await task.queue_frame(VADUserStoppedSpeakingFrame())
        await asyncio.sleep(3.0)
        await task.queue_frame(EndFrame())  # Deepgram: CloseStream, then pipecat closes

    await asyncio.wait_for(asyncio.gather(runner.run(task), feed()), 60)


async def pipecat_deepgram(port: int, pcm: bytes, finals: list[str], events: list[str]):
    from pipecat.services.deepgram.stt import DeepgramSTTService

    stt = DeepgramSTTService(api_key=KEY, base_url=f"ws://127.0.0.1:{port}")
    await _run_pipecat(stt, pcm, finals, events, commit=False)


async def pipecat_openai(port: int, pcm: bytes, finals: list[str], events: list[str]):
    from pipecat.services.openai.stt import OpenAIRealtimeSTTService

    stt = OpenAIRealtimeSTTService(
        api_key=KEY, model="gpt-4o-transcribe", base_url=f"ws://127.0.0.1:{port}/v1/realtime"
    )
    await _run_pipecat(stt, pcm, finals, events, commit=True)


async def _run_livekit(stt, pcm: bytes, finals: list[str], events: list[str], expected: int):
    from livekit import rtc

    stream = stt.stream()

    async def read():
        async for ev in stream:
            text = ev.alternatives[0].text if ev.alternatives else ""
            events.append(f"{ev.type.name}({text!r})" if text else ev.type.name)
            if ev.type.name == "FINAL_TRANSCRIPT":
                finals.append(text)
                if len(finals) >= expected:
                    return

    reader = asyncio.create_task(read())
    await asyncio.sleep(1.0)  # let the stream connect: frames pushed before may be dropped
    for chunk in chunks(pcm, 320):  # 10 ms rtc frames
        stream.push_frame(
            rtc.AudioFrame(data=chunk, sample_rate=RATE, num_channels=1,
                           samples_per_channel=len(chunk) // 2)
        )  # fmt: skip
        await asyncio.sleep(0.002)
    stream.flush()
    await asyncio.wait_for(reader, 30)
    stream.end_input()
    await stream.aclose()
    await stt.aclose()


async def livekit_deepgram(
    port: int, pcm: bytes, finals: list[str], events: list[str], expected: int
):
    import aiohttp
    from livekit.plugins import deepgram

    async with aiohttp.ClientSession() as http:
        stt = deepgram.STT(
            api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1/listen", http_session=http,
            utterance_end_ms=1000,
        )  # fmt: skip
        await _run_livekit(stt, pcm, finals, events, expected)


async def livekit_openai(
    port: int, pcm: bytes, finals: list[str], events: list[str], expected: int
):
    import aiohttp
    from livekit.agents import utils
    from livekit.plugins import openai as lk_openai

    async with aiohttp.ClientSession() as http:
        # outside an agent job the plugin finds its aiohttp session through this context var
        token = utils.http_context._ContextVar.set(lambda: http)
        try:
            stt = lk_openai.STT(
                api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1", model="gpt-4o-transcribe",
                use_realtime=True,
            )  # fmt: skip
            await _run_livekit(stt, pcm, finals, events, expected)
        finally:
            utils.http_context._ContextVar.reset(token)


CLIENTS = {
    "pipecat-deepgram": pipecat_deepgram,
    "pipecat-openai": pipecat_openai,
    "livekit-deepgram": livekit_deepgram,
    "livekit-openai": livekit_openai,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("client", choices=sorted(CLIENTS))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pcm", required=True, help="16 kHz mono s16le file")
    parser.add_argument("--expected", type=int, default=1, help="finals to wait for (livekit)")
    args = parser.parse_args()
    with open(args.pcm, "rb") as f:
        pcm = f.read()
    finals: list[str] = []
    events: list[str] = []
    run = CLIENTS[args.client]
    if args.client.startswith("livekit"):
        coro = run(args.port, pcm, finals, events, args.expected)
    else:
        coro = run(args.port, pcm, finals, events)
    error = None
    try:
        asyncio.run(coro)
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which fails the run
        error = f"{type(exc).__name__}: {exc}"
    json.dump({"client": args.client, "finals": finals, "events": events, "error": error},
              sys.stdout)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
