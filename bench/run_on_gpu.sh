#!/usr/bin/env bash
# The streaming-latency sweep on a CUDA machine, in one call; results land in $OUT.
#
# Here, once:   bash bench/fetch_gpu_wheels.sh        (fills .whl/, git-ignored)
# Device call:  command "bash bench/run_on_gpu.sh", carry [".whl"], timeout_s 600
#
# It installs the carried wheels into /tmp/site, builds the real-size random model
# (random:small: real compute, no weights to download), sweeps fp32 over 1, 2, 4, ...
# real-time clients until final-latency p95 passes 2 s (then bisects), adds a step at
# 50 clients (the target), and compares partials off and fp16 at 1 and 50 clients.
# The sweep is stopped with SIGINT at BENCH_BUDGET_S so that results are still written.
# Files back (at most 8): results.json, table.txt, summary.md, three PNGs, logs.tgz.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
BUDGET_S=${BENCH_BUDGET_S:-480}
WORK=/tmp/gpu-bench
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
# Without an install, streamer.web_demo (mapped from web_demo/ by pyproject) is missing.
python3 -c "import streamer.web_demo" 2> /dev/null || ln -sfn ../web_demo streamer/web_demo
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$WORK/env.txt"
timeout -s INT -k 60 "$BUDGET_S" python3 -m bench.latency \
    --model random:small --device cuda \
    --variants fp32,fp32:nopartials,fp16 \
    --clients auto --max-clients 256 --also-clients 50 --compare-clients 1,50 \
    --duration-s 20 --stagger-s 4 --out "$WORK" "$@" 2>&1 | tee "$WORK/bench.log"
status=${PIPESTATUS[0]}
for f in results.json table.txt summary.md cdf.png compare.png vs_clients.png; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"
done
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude '*.png' --exclude results.json . 2> /dev/null
exit "$status"
