#!/usr/bin/env bash
# The serving tests against the oldest websockets pyproject.toml admits
# (constraints-floor.txt), beside the newest one the suite runs with: the floor is a
# version these tests have passed on. About a minute on 2 cores.
#   bash scripts/test_floor.sh           # after scripts/test.sh has made the venv
#   bash scripts/test_floor.sh -x        # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

version=$(sed -n 's/^websockets==//p' constraints-floor.txt)
floor=.cache/floor/websockets-$version  # a folder of its own, put first on the path
[ -d "$floor/websockets-$version.dist-info" ] ||
  .venv/bin/python -m pip install -q --no-deps --target "$floor" "websockets==$version"
export PYTHONPATH="$PWD:$PWD/$floor${PYTHONPATH:+:$PYTHONPATH}"
.venv/bin/python -c "import websockets, sys; sys.exit(websockets.__version__ != '$version')"
exec .venv/bin/python -m pytest -q tests/test_server.py tests/test_transports.py \
  tests/test_http_hostile.py tests/test_file_api_limits.py tests/test_compat_server.py \
  tests/test_websocket.py tests/test_compat_ports.py tests/test_front.py "$@"
