# syntax=docker/dockerfile:1
# sensevoice-streamer in two variants (docs/deploy.md):
#
#   docker build -t sensevoice-streamer:cpu .
#   docker build -t sensevoice-streamer:cuda --build-arg EXTRAS='[gpu]' .
#
#   docker run -p 8000:8000 -v streamer-cache:/home/streamer/.cache sensevoice-streamer:cpu
#   docker run --gpus all -p 8000:8000 -v streamer-cache:/home/streamer/.cache \
#       sensevoice-streamer:cuda serve --host 0.0.0.0 --device cuda --dtype fp16
#
# The CPU variant is the plain install (`pip install .`: ONNX Runtime, no torch, about
# 350 MB); on first start it downloads sherpa-onnx's int8 export of SenseVoiceSmall
# (239 MB) from Hugging Face into the cache volume. The CUDA variant adds the [gpu] extra:
# PyPI's Linux torch carries the CUDA runtime itself, so it needs no CUDA base image, only
# the NVIDIA driver and container toolkit on the host (`--gpus`); its model
# (iic/SenseVoiceSmall, about 900 MB) comes from ModelScope on first start. Mount the same
# volume again and later starts skip the download.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# "" (the plain install) or "[gpu]" / "[torch]"
ARG EXTRAS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# with [torch]/[gpu], a few of funasr's dependencies (jieba, crcmod, oss2, antlr4) come as
# source only
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY constraints.txt /src/
COPY pyproject.toml README.md /src/
COPY streamer /src/streamer
COPY web_demo /src/web_demo
RUN pip install -c /src/constraints.txt "/src${EXTRAS}"

FROM ${PYTHON_IMAGE}
# libsndfile for soundfile (audio files); nothing else the server needs is outside the venv:
# no ffmpeg program either, since PyAV's wheel carries FFmpeg's libraries, which decode
# M4A, WebM, MP3 and the rest for uploads, live containers, `streamer client` and
# `streamer transcribe` (tests/test_audio_io.py reads M4A and WebM with no ffmpeg on PATH)
RUN apt-get update \
    && apt-get install -y --no-install-recommends libsndfile1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
# not root; the model caches (~/.cache/modelscope, ~/.cache/sensevoice-streamer) live on
# the volume
RUN useradd --create-home --uid 10001 streamer \
    && mkdir -p /home/streamer/.cache \
    && chown streamer:streamer /home/streamer/.cache
USER 10001
WORKDIR /home/streamer
VOLUME /home/streamer/.cache
EXPOSE 8000
# liveness: /healthz answers 200 as soon as the port is bound, also while the model
# loads (readiness is /readyz; balancers and Kubernetes ask that one). The port is the
# server's own: --port N (or --port=N) on PID 1's command line, else STREAMER_PORT, else 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request\nargs = open(sys.argv[1], 'rb').read().decode().split('\\0')\nport = os.environ.get('STREAMER_PORT', '8000')\nfor i, a in enumerate(args):\n    if a == '--port' and i + 1 < len(args): port = args[i + 1]\n    elif a.startswith('--port='): port = a.split('=', 1)[1]\nurllib.request.urlopen('http://127.0.0.1:%s/healthz' % port, timeout=4)", "/proc/1/cmdline"]
# streamer is PID 1 and handles SIGTERM itself: drain (--drain-s), then finish open
# segments (--shutdown-grace-s); give `docker stop -t` more than both together
ENTRYPOINT ["streamer"]
CMD ["serve", "--host", "0.0.0.0"]
