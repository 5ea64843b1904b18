# syntax=docker/dockerfile:1
# sensevoice-streamer: the same package as `pip install -c constraints.txt .`, in two
# variants that differ only in where torch comes from (docs/deploy.md):
#
#   docker build -t sensevoice-streamer:cpu .
#   docker build -t sensevoice-streamer:cuda --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
#
#   docker run -p 8000:8000 -v streamer-cache:/home/streamer/.cache sensevoice-streamer:cpu
#   docker run --gpus all -p 8000:8000 -v streamer-cache:/home/streamer/.cache \
#       sensevoice-streamer:cuda serve --host 0.0.0.0 --device cuda --dtype fp16
#
# The CPU variant takes torch's CPU-only wheel (about 200 MB instead of about 3 GB); PyPI's
# Linux torch carries the CUDA runtime itself, so the CUDA variant needs no CUDA base
# image, only the NVIDIA driver and container toolkit on the host (`--gpus`).
# The model (iic/SenseVoiceSmall, about 900 MB) is downloaded from ModelScope on first
# start into the cache volume; mount the same volume again and later starts skip it.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a few dependencies (jieba, crcmod, oss2, antlr4) come as source only
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY constraints.txt /src/
# torch first, from the variant's index, at the release the tests are verified with
RUN pip install --index-url "${TORCH_INDEX_URL}" -c /src/constraints.txt torch
COPY pyproject.toml README.md /src/
COPY streamer /src/streamer
COPY web_demo /src/web_demo
RUN pip install -c /src/constraints.txt /src

FROM ${PYTHON_IMAGE}
# libsndfile for soundfile (audio files); nothing else the server needs is outside the venv
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
# loads (readiness is /readyz; balancers and Kubernetes ask that one)
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('STREAMER_PORT', '8000'), timeout=4)"]
# streamer is PID 1 and handles SIGTERM itself: drain (--drain-s), then finish open
# segments (--shutdown-grace-s); give `docker stop -t` more than both together
ENTRYPOINT ["streamer"]
CMD ["serve", "--host", "0.0.0.0"]
