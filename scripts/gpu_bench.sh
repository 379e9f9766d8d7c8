#!/usr/bin/env bash
# Issue 7 benchmarks on one H200, in one call: `moerl bench moe` for every issue-7 shape, then
# `moerl bench train-step` and `moerl bench engine`. Target: under 8 minutes of GPU wall time.
#
# On a machine with one H200 (python3 3.12 with torch and transformers, no venv, no pip index), from the
# repository root, carrying the pydantic wheels (see bench/README.md, "Running on a machine with one H200"):
#     bash scripts/gpu_bench.sh                     # with .whl/ copied along
# Here, once, to fetch those wheels into .whl/bench (git-ignored):
#     bash scripts/gpu_bench.sh --fetch-wheels
# DRY_RUN=1 prints the benchmark commands instead of running them (tests/test_bench.py uses it).
# STEPS="moe train-step engine" (the default) picks which benchmarks run, by their first word.
#
# Writes into $OUT (default runs/bench-gpu): results.json (a JSON list of every result document,
# rewritten after each step, so a cut-short run still returns what finished) and gpu_bench.log.
# Each step gets a timeout; once BUDGET_S seconds have passed no further step starts.
set -u -o pipefail

PY="${PYTHON:-python3}"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # Versions as in this checkout's .venv; cp312 manylinux x86_64 for the GPU image (KINDS.md).
    VPY="${VPY:-.venv/bin/python}"
    mkdir -p .whl/bench
    # transformers: the trainer relies on transformers 5.24's activation checkpointing (it checkpoints a
    # layer's forward, outside FSDP2's hooks); the image has 5.17.
    for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions transformers; do
        ver=$("$VPY" -c "from importlib.metadata import version; print(version('$pkg'))") || exit 1
        "$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl/bench "$pkg==$ver" || exit 1
    done
    ls -l .whl/bench
    exit 0
fi

OUT="${OUT:-runs/bench-gpu}"
BUDGET_S="${BUDGET_S:-420}"
SCRATCH="${SCRATCH:-runs/gpu-bench-scratch}"   # on the repository's disk (the engine bench reads it)
RESULTS="$SCRATCH/results"
LOG="$OUT/gpu_bench.log"
DRY_RUN="${DRY_RUN:-0}"
START=$(date +%s)
STATUS=0
KILL_AFTER_S=5

[[ "$DRY_RUN" == 1 ]] || { mkdir -p "$OUT"; rm -rf "$SCRATCH"; mkdir -p "$RESULTS"; }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

STEPS="${STEPS:-moe train-step engine}"  # also: real-qwen3 real-dsv3 real-moe (issue 13, real widths), weight-sync

# step CAP_S LABEL ARGS...: run `python3 -m app.cli bench ARGS...` under a timeout (if in STEPS).
step() {
    local cap=$1 label=$2
    shift 2
    [[ " $STEPS " == *" ${label%% *} "* ]] || return 0
    run_step "$cap" "$label" "$PY" -m app.cli bench "$@" --out-dir "$RESULTS"
}

if [[ "$DRY_RUN" != 1 ]]; then
    say "gpu_bench: OUT=$OUT budget ${BUDGET_S}s scratch $SCRATCH"
    { nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used \
        --format=csv; df -hT "$SCRATCH"; } 2>&1 | tee -a "$LOG"
    install_pydantic_wheels .whl
    if ! "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"; then
        say "ABORT: no CUDA device visible to torch (see above)"
        exit 2
    fi
    # What the three benchmarks import when they run, so a missing package stops us here, in seconds.
    check_imports app.cli app.bench.cli app.bench.moe app.bench.train_step app.bench.engine app.config \
        app.model.policy app.model.checkpoint app.trainer.train app.storage.policy app.engine.sampler \
        app.bench.weight_sync app.bench.weight_sync_gpu app.weight_group app.engine.receive
fi

GPU=(--dtype bfloat16 --device cuda)
MOE=(moe "${GPU[@]}" --iters 10 --warmup 3)
DSV3=(--family deepseek-v3 --hidden 7168 --intermediate 2048 --topk 8)
QWEN3=(--family qwen3 --hidden 2048 --intermediate 768 --experts 128 --topk 8)

# Issue 13: the trainer's step at real widths, 8 rollouts x 8192 tokens, against stock transformers.
# Qwen3-30B-A3B: every width real, 4 of 48 layers. DeepSeek-V3: every width real, 2 of 61 layers
# (1 dense + 1 MoE), 32 routed experts = what one GPU holds at EP 8 (all 256 do not fit one H200).
ROLL=(--groups 1 --group-size 8 --prompt-len 512 --completion-len 7680 --micro-batch-tokens 16384 --iters 3 --warmup 1)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True   # less allocator slack (moerl plan's FRAGMENTATION)
# --profile: one more step of ours and of the stock model under torch.profiler, split by kernel family.
step 150 "real-qwen3 qwen3-30b-a3b AC none" train-step --model qwen3-30b-a3b --layers 4 --profile "${ROLL[@]}" "${GPU[@]}"
step 120 "real-qwen3 qwen3-30b-a3b AC full" train-step --model qwen3-30b-a3b --layers 4 --activation-checkpointing full \
    "${ROLL[@]}" "${GPU[@]}"
step 180 "real-dsv3 deepseek-v3 AC full" train-step --model deepseek-v3 --layers 2 --experts 32 --activation-checkpointing full \
    --profile "${ROLL[@]}" "${GPU[@]}"
step 150 "real-dsv3 deepseek-v3 AC selective" train-step --model deepseek-v3 --layers 2 --experts 32 \
    --activation-checkpointing selective "${ROLL[@]}" "${GPU[@]}"
step 60 "real-moe deepseek-v3 accuracy" "${MOE[@]}" "${DSV3[@]}" --experts 32 --tokens 4096
step 60 "real-moe qwen3-30b-a3b accuracy" "${MOE[@]}" "${QWEN3[@]}" --tokens 4096
unset PYTORCH_CUDA_ALLOC_CONF

# The 4096-token MoE shapes first, then the two other benchmarks, then the 16384-token shapes:
# if the budget runs out, every benchmark has figures.
step 75 "moe deepseek-v3 E=32 T=4096" "${MOE[@]}" "${DSV3[@]}" --experts 32 --tokens 4096 --profile
step 60 "moe deepseek-v3 E=8 T=4096" "${MOE[@]}" "${DSV3[@]}" --experts 8 --tokens 4096
step 60 "moe qwen3-30b-a3b E=128 T=4096" "${MOE[@]}" "${QWEN3[@]}" --tokens 4096 --profile
# 64 rollouts of 128 + 384 tokens = 32768 tokens per step (logits alone: 2.1 GB bf16, 4.3 GB fp32).
step 120 "train-step small" train-step --model small --groups 8 --group-size 8 --prompt-len 128 \
    --completion-len 384 --iters 5 --warmup 2 --profile "${GPU[@]}"
step 120 "engine small" engine --model small --batch-sizes 1,8,64 --prompt-len 128 --output-len 128 --repeats 3 \
    --work-dir "$SCRATCH/engine" "${GPU[@]}"
# Not in the default STEPS (run it with STEPS=weight-sync): a Qwen3-30B-A3B-width version (2 layers,
# 3.7 GB bf16) from this process's GPU memory to a second process on the same GPU (issue 21).
step 300 "weight-sync qwen3-30b-a3b" weight-sync --model qwen3-30b-a3b --layers 2 --versions 3 --bucket-mb 512 \
    --work-dir "$SCRATCH/weight-sync" "${GPU[@]}"
step 75 "moe deepseek-v3 E=32 T=16384" "${MOE[@]}" "${DSV3[@]}" --experts 32 --tokens 16384
step 60 "moe deepseek-v3 E=8 T=16384" "${MOE[@]}" "${DSV3[@]}" --experts 8 --tokens 16384
step 60 "moe qwen3-30b-a3b E=128 T=16384" "${MOE[@]}" "${QWEN3[@]}" --tokens 16384 --profile

if [[ "$DRY_RUN" != 1 ]]; then
    nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
    collect
    rm -rf "$SCRATCH"
    say "gpu_bench finished in $(elapsed)s, status $STATUS; results in $OUT/results.json"
fi
exit $STATUS
