#!/usr/bin/env bash
# pipecat's and LiveKit Agents' speech-to-text services against the real server, with the
# tagged test model: their transcripts must equal protocol v1's (see compat_frameworks.py).
#   bash scripts/compat_frameworks.sh             # both frameworks
#   bash scripts/compat_frameworks.sh pipecat     # one of them
# Not part of the test suite: pipecat would downgrade soxr, soundfile and protobuf, and
# livekit-agents brings grpc, OpenTelemetry, PyAV and native RTC libraries, so each gets
# its own venv under $COMPAT_VENVS (default .cache/compat-venvs, git-ignored). Needs the
# project's venv (.venv, as scripts/test.sh makes it) and espeak-ng for the test speech.
set -euo pipefail
cd "$(dirname "$0")/.."

venvs=${COMPAT_VENVS:-.cache/compat-venvs}
python=${PYTHON:-.venv/bin/python}
which=("${@:-pipecat livekit}")
args=()
for framework in ${which[@]}; do
  venv="$venvs/$framework"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    case "$framework" in
      pipecat)
        # pipecat-ai's full requirements pin older soxr/soundfile/protobuf: install it
        # without them, plus only what its Deepgram and OpenAI services import
        "$venv/bin/pip" install -q --no-deps pipecat-ai==1.14.0
        "$venv/bin/pip" install -q deepgram-sdk==7.16.0 'openai>=3.57,<4' websockets numpy \
          loguru docstring_parser Markdown python-dotenv pyyaml wait_for2 aiofiles aiohttp \
          soxr loudness sentencex Pillow pydantic
        ;;
      livekit)
        "$venv/bin/pip" install -q livekit-agents==1.8.9 livekit-plugins-deepgram==1.8.9 \
          livekit-plugins-openai==1.8.9 websockets numpy
        ;;
      *) echo "unknown framework: $framework (pipecat or livekit)" >&2; exit 2 ;;
    esac
  fi
  args+=("--$framework-python" "$venv/bin/python")
done
exec "$python" scripts/compat_frameworks.py "${args[@]}" --cache-dir "${STREAMER_CACHE_DIR:-.cache}"
