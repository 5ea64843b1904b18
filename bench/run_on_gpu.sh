#!/usr/bin/env bash
# The GPU machine's benches in one device call (<= 9 minutes); results land in $OUT.
#
# Here, once:   bash bench/fetch_gpu_wheels.sh        (fills .whl/, git-ignored)
# Device call:  command "bash bench/run_on_gpu.sh", carry [".whl"], timeout_s 600
# Dry run here: BENCH_DRY=1 OUT=/tmp/gpu-dry flock -x /work/locks/cpu bash bench/run_on_gpu.sh
#               (the same script paths on --device cpu with random:tiny and 1-2 clients)
#
# It installs the carried wheels into /tmp/site, builds the real-size random model
# (random:small: real compute, no weights to download) and runs, each phase under its own
# time limit so that a slow phase cannot eat the next one's (SIGINT: results still written):
#   1. real-time clients 1 -> 1000 on cuda, fp32, without batching (--max-batch 1);
#   2. the same with batching (--max-batch $MAX_BATCH, when `streamer serve` has the flag)
#      and the model in its own process (--model-process, when it has that flag: at
#      hundreds of streams the loop and the features would otherwise share one GIL),
#      and fp16 and bf16 next to fp32 at 1 and 200 clients;
#   3. on the 16 CPU cores: --workers 1/2/4 with the 16 threads shared out, int8.
# A sweep stops at the first step whose final-latency p95 passes 2 s. Files back (the
# device tool returns at most 8): table.txt and summary.md of every run merged
# (bench.latency --merge), phases.txt, results.tgz (each run's results.json, table.txt,
# summary.md), logs.tgz. Budget: 120 s model build + 120 + 150
# + 120 s of phases + installs, about 8 minutes at most.
set -uo pipefail
OUT=${OUT:-bench/out/gpu}
WORK=/tmp/gpu-bench
DRY=${BENCH_DRY:-0}
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export STREAMER_CACHE_DIR=${STREAMER_CACHE_DIR:-$WORK/cache}
if compgen -G ".whl/*.whl" > /dev/null && [ "$DRY" != 1 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
PY=${PY:-python3}
# Without an install, streamer.web_demo (mapped from web_demo/ by pyproject) is missing.
$PY -c "import streamer.web_demo" 2> /dev/null || ln -sfn ../web_demo streamer/web_demo

if [ "$DRY" = 1 ]; then
    DEVICE=cpu MODEL=random:tiny CLIENTS=1,2 COMPARE=1 DURATION=3 STAGGER=0.5
    PRECISIONS=fp32 CPU_CLIENTS=1,2 CPU_SPLITS="1:2 2:1" MAX_BATCH=4
    T_BUILD=60 T_GPU=60 T_BATCH=60 T_CPU=90
else
    DEVICE=cuda MODEL=random:small CLIENTS=1,10,50,100,200,400,700,1000 COMPARE=1,200
    DURATION=10 STAGGER=3 PRECISIONS=fp32,fp16,bf16 CPU_CLIENTS=16,32,48
    CPU_SPLITS="1:16 2:8 4:4" MAX_BATCH=${MAX_BATCH:-32}
    T_BUILD=120 T_GPU=120 T_BATCH=150 T_CPU=120
fi
{
    date
    nproc
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$WORK/env.txt"

if $PY -m streamer serve --help 2>/dev/null | grep -q -- "--max-batch"; then
    HAS_BATCH=1
else
    HAS_BATCH=0
    echo "streamer serve has no --max-batch yet: the batched run is skipped" | tee -a "$WORK/env.txt"
fi

process=()
if $PY -m streamer serve --help 2>/dev/null | grep -q -- "--model-process"; then
    process=(--server-arg=--model-process)
fi

# bench NAME LIMIT_S ARGS...: one bench.latency run into $WORK/NAME, stopped at LIMIT_S.
bench() {
    local name=$1 limit=$2
    shift 2
    mkdir -p "$WORK/$name"
    echo "== $name (limit ${limit} s): $*" | tee -a "$WORK/phases.txt"
    timeout -s INT -k 15 "$limit" $PY -m bench.latency --model "$MODEL" \
        --duration-s "$DURATION" --stagger-s "$STAGGER" --pause-s 1 --max-clients 1000 \
        --out "$WORK/$name" "$@" > "$WORK/$name/bench.log" 2>&1
    echo "   $name: exit $? at $(date +%T)" | tee -a "$WORK/phases.txt"
}

status=0
# build the model (and its int8 ONNX export for the CPU phase) outside the timed phases
timeout -k 10 "$T_BUILD" $PY -m streamer build-model "${MODEL#random:}" \
    > "$WORK/build.log" 2>&1 || echo "build-model: exit $?" | tee -a "$WORK/phases.txt"
nobatch=()
[ "$HAS_BATCH" = 1 ] && nobatch=(--server-arg=--max-batch --server-arg=1)
bench gpu-nobatch "$T_GPU" --device "$DEVICE" --variants fp32 --clients "$CLIENTS" \
    "${nobatch[@]}" || status=1
if [ "$HAS_BATCH" = 1 ]; then
    bench gpu-batch "$T_BATCH" --device "$DEVICE" --variants "$PRECISIONS" \
        --clients "$CLIENTS" --compare-clients "$COMPARE" \
        --server-arg=--max-batch --server-arg="$MAX_BATCH" "${process[@]}" || status=1
else
    bench gpu-precisions "$T_BATCH" --device "$DEVICE" --variants "$PRECISIONS" \
        --clients "$COMPARE" || status=1
fi
runs=("$WORK"/gpu-*)
for split in $CPU_SPLITS; do
    workers=${split%%:*} threads=${split##*:}
    name=cpu-w${workers}t${threads}
    # the whole CPU budget is shared between the splits
    bench "$name" $((T_CPU / $(echo $CPU_SPLITS | wc -w))) --device cpu --variants int8 \
        --clients "$CPU_CLIENTS" --compare-clients same \
        --server-arg=--workers --server-arg="$workers" \
        --server-arg=--threads --server-arg="$threads" || status=1
    runs+=("$WORK/$name")
done

$PY -m bench.latency --merge "${runs[@]}" --out "$OUT" > "$WORK/report.log" 2>&1 || status=1
cp "$WORK/phases.txt" "$OUT/" 2> /dev/null
(cd "$WORK" && tar czf "$OUT/results.tgz" --ignore-failed-read */results.json */table.txt \
    */summary.md env.txt 2> /dev/null)
tar czf "$OUT/logs.tgz" -C "$WORK" --exclude cache --exclude results.json . \
    2> /dev/null
ls -l "$OUT"
exit "$status"
