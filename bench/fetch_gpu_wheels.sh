#!/usr/bin/env bash
# Fill .whl/ with the wheels bench/run_on_gpu.sh installs on the CUDA machine.
#
# That machine has Python 3.12 with torch (CUDA), numpy, scipy, transformers, matplotlib,
# tqdm, psutil, prometheus-client, uvloop and sentencepiece, and no network. What the
# server and the bench import beyond that is listed below (found by recording the
# distributions loaded by `streamer serve --model random:tiny` serving one bench session);
# versions are those of this checkout's virtual environment. Pure-Python projects that
# publish no wheel are built into one here.
#
#   bash bench/fetch_gpu_wheels.sh            # then carry ".whl" in the device run
#
# .whl/ must stay out of git: the script adds it to .git/info/exclude.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=.whl
# (jaraco.*, more-itertools and backports.tarfile also show up: setuptools vendors them.)
PACKAGES=(
    funasr modelscope modelscope-hub httpx2 httpcore2 truststore cryptography cffi pycparser
    hydra-core omegaconf antlr4-python3-runtime jaconv jamo jieba kaldiio kaldi-native-fbank
    librosa rapidfuzz tensorboardX torch-complex soundfile soxr orjson websockets
    webrtcvad-wheels
)
grep -qxF "/$DEST/" .git/info/exclude 2>/dev/null || echo "/$DEST/" >> .git/info/exclude
mkdir -p "$DEST"
PLATFORMS=()
for tag in manylinux_2_5_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
           manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
    PLATFORMS+=(--platform "$tag")
done
for name in "${PACKAGES[@]}"; do
    version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$name" 2>/dev/null || true)
    spec=$name${version:+==$version}
    if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp "${PLATFORMS[@]}" -d "$DEST" "$spec"; then
        echo "no wheel for $spec: building one" >&2
        "$PY" -m pip wheel -q --no-deps -w "$DEST" "$spec"
    fi
done
du -sh "$DEST"
