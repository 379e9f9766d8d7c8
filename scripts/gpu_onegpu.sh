#!/usr/bin/env bash
# moerl on one GPU machine (issue 40), in one call of at most 9 minutes on the lent H200 (16 cores):
#
#   run            `moerl run` as a user starts it: no flags, no MOERL_* variables. It lays the
#                  embedded default over the GPU (app/local/machine.py: one trainer rank, engines
#                  beside it, versions pushed over cuda:gloo and stored every 10) and prints its
#                  summary (held-out reward before and after RL).
#   bench          `moerl bench loop --device cuda --task gpu`: moerl against TRL's GRPOTrainer on
#                  the GPU-sized preset (gpu-qwen3-moe, 424 M parameters), BENCH_SECONDS of training
#                  each, one round: samples/s, tokens/s, GPU busy and peak memory, held-out gain,
#                  where each leg's time goes.
#   bench-default  the same on the embedded default (not in the default STEPS: a second call).
#
# Here, once, from the repository root (needs pip's index; .whl/ is git-ignored; about 45 MiB):
#     bash scripts/gpu_onegpu.sh --fetch   # .whl/ranks (scripts/gpu_ranks.sh --fetch: pydantic, the newer
#                                          # transformers, FastAPI, redis-py, reasoning-gym, redis-server)
#                                          # and .whl/onegpu: TRL and what it needs beyond the image
#     bash scripts/gpu_onegpu.sh --check   # the same TRL set for this Python, installed into a clean
#                                          # --target dir and imported from there
# On the device:   run(command="bash scripts/gpu_onegpu.sh", carry=[".whl"], timeout_s=600)
# Elsewhere:       DRY_RUN=1 bash scripts/gpu_onegpu.sh   prints the commands (tests/test_gpu_onegpu.py)
#                  STEPS="bench-default" BENCH_SECONDS=90 bash scripts/gpu_onegpu.sh   (a second call)
#
# Writes $OUT (default runs/gpu-onegpu): gpu_onegpu.log (everything printed, timestamped steps,
# nvidia-smi before and after), run_summary.json, run_metrics.jsonl, run_logs.tar.gz (the run's
# logs/, run.yaml, plot.png), results.json (the bench result documents), bench_logs.tar.gz.
# Each step has a timeout; no step starts once BUDGET_S seconds have passed.
set -u -o pipefail

PY="${PYTHON:-python3}"
VPY="${VPY:-.venv/bin/python}"
# TRL's GRPOTrainer and what it needs that the GPU image lacks (the image has torch, accelerate's
# older release, pyarrow, pandas, numpy, pyyaml, tqdm, jinja2); psutil and xxhash are small and carried
# to be sure. Versions: this checkout's venv.
TRL_SET="trl datasets dill multiprocess accelerate fsspec psutil xxhash"

versions() {
    local pkg ver
    for pkg in $TRL_SET; do
        ver=$("$VPY" -c "from importlib.metadata import version; print(version('$pkg'))") || return 1
        echo "$pkg==$ver"
    done
}

if [[ "${1:-}" == "--fetch" ]]; then
    bash "$(dirname "${BASH_SOURCE[0]}")/gpu_ranks.sh" --fetch || exit 1
    pins=$(versions) || exit 1
    mkdir -p .whl/onegpu
    # shellcheck disable=SC2086
    "$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl/onegpu $pins || exit 1
    du -sh .whl/ranks .whl/onegpu
    exit 0
fi

if [[ "${1:-}" == "--check" ]]; then
    # The set for THIS interpreter (the device's are cp312 builds of the same versions), into a clean
    # --target dir; every module must import from there.
    pins=$(versions) || exit 1
    tmp=$(mktemp -d)
    # shellcheck disable=SC2086
    "$VPY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp/wheels" $pins || exit 1
    "$VPY" -m pip install -q --no-index --no-deps --no-compile --target "$tmp/site" "$tmp"/wheels/*.whl || exit 1
    PYTHONPATH="$tmp/site" "$VPY" - "$tmp/site" <<'EOF' || exit 1
import importlib, sys
site = sys.argv[1]
for name in ("trl", "datasets", "dill", "multiprocess", "accelerate", "fsspec", "psutil", "xxhash"):
    module = importlib.import_module(name)
    assert module.__file__.startswith(site), f"{name} imported from {module.__file__}, not {site}"
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer
Dataset.from_list([{"prompt": "abc=", "spec": "{}"}])
print(f"the TRL set imports from a clean --target dir: {site}")
EOF
    rm -rf "$tmp"
    exit 0
fi

OUT="${OUT:-runs/gpu-onegpu}"
BUDGET_S="${BUDGET_S:-540}"
BENCH_SECONDS="${BENCH_SECONDS:-45}"
STEPS="${STEPS:-run bench}"
SCRATCH="${SCRATCH:-runs/gpu-onegpu-scratch}"
RESULTS="$SCRATCH/results"
LOG="$OUT/gpu_onegpu.log"
DRY_RUN="${DRY_RUN:-0}"
START=$(date +%s)
STATUS=0

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

want() { [[ " $STEPS " == *" $1 "* ]]; }

if [[ "$DRY_RUN" != 1 ]]; then
    mkdir -p "$OUT"
    rm -rf "$SCRATCH" && mkdir -p "$RESULTS"
    { nvidia-smi -L; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv; nproc; } 2>&1 | tee "$LOG"
    export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
    install_carried .whl/ranks .whl/onegpu
    # As a user starts it: none of moerl's own variables (MOERL_SHARED_GPU would pick the test layout).
    unset MOERL_SHARED_GPU MOERL_TRACEBACK
    check_imports app.local.run app.bench.loop trl datasets fastapi uvicorn redis reasoning_gym psutil
    # The run's plot and TensorBoard events, written last: say so now if they cannot be.
    "$PY" -c "import matplotlib, torch.utils.tensorboard" 2>&1 | tail -1 | tee -a "$LOG"
    "$PY" -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'trl', trl.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
fi

if want run; then
    run_step 330 "moerl run (no flags)" "$PY" -m app.cli run
    if [[ "$DRY_RUN" != 1 ]]; then
        # The run directory `moerl run` chose (runs/<task>-<time>), newest first.
        dir=$(ls -td runs/spell-backward-*/ 2>/dev/null | head -1)
        if [[ -n "$dir" ]]; then
            cp "$dir/summary.json" "$OUT/run_summary.json" 2>/dev/null
            cp "$dir/metrics.jsonl" "$OUT/run_metrics.jsonl" 2>/dev/null
            tar -czf "$OUT/run_logs.tar.gz" -C "$dir" logs run.yaml plot.png 2>/dev/null
        fi
    fi
fi
bench() {  # bench LABEL ARGS...: moerl bench loop on the GPU, one round, its result into $RESULTS
    local label=$1
    shift
    run_step 330 "$label" "$PY" -m app.cli bench loop --device cuda --seconds "$BENCH_SECONDS" --rounds 1 \
        --cache "$SCRATCH/cache" --work-dir "$SCRATCH/$label" --out-dir "$RESULTS" "$@"
}
want bench && bench "bench-gpu" --task gpu
want bench-default && bench "bench-default"
if [[ "$DRY_RUN" != 1 ]]; then
    tar -czf "$OUT/bench_logs.tar.gz" --exclude='*.safetensors' --exclude='*.distcp' --exclude=redis \
        -C "$SCRATCH" . 2>/dev/null
    nvidia-smi --query-gpu=name,memory.used --format=csv 2>&1 | tee -a "$LOG"
    say "finished with status $STATUS after $(elapsed)s"
fi
exit "$STATUS"
