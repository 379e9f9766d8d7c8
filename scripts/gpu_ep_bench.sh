#!/usr/bin/env bash
# Issue 8 on one 8-GPU H200 machine, in one call: the EP equivalence tests on 2, 4 and 8 GPUs
# (alltoall; deepep where `deep_ep` imports), then `moerl bench dispatch` (DeepSeek-V3 settings)
# and `moerl bench ep-train-step` (policy `small`, EP 8), each under torchrun --nproc-per-node 8.
#
# On the lent machine (python3 3.12 with torch and transformers, no venv, no pip index), from the
# repository root, carrying the pydantic wheels that scripts/gpu_bench.sh --fetch-wheels puts in .whl/bench:
#     run(command="bash scripts/gpu_ep_bench.sh", kind="nvidia-h200-x8", carry=[".whl/bench"], timeout_s=600)
# deep_ep is used when it imports. The (NOT yet tried) recipe in BENCHMARKS.md, "Making deep_ep
# importable", leaves deep_ep in DEEPEP_SITE (default /tmp/deepep-site, put on PYTHONPATH) and a newer
# NCCL in DEEPEP_NCCL (default /tmp/deepep-nccl; its libnccl.so.2 is preloaded, not put on PYTHONPATH,
# so its `nvidia` package directory cannot shadow the image's).
# DRY_RUN=1 prints the commands instead of running them (tests/test_bench_ep.py uses it).
#
# Writes into $OUT (default runs/bench-gpu-ep): results.json (a JSON list of every result document,
# rewritten after each step), gpu_ep_bench.log and the pytest output of the equivalence tests.
# Each step gets a timeout; once BUDGET_S seconds have passed no further step starts.
set -u -o pipefail

PY="${PYTHON:-python3}"
NPROC="${NPROC:-8}"
OUT="${OUT:-runs/bench-gpu-ep}"
BUDGET_S="${BUDGET_S:-540}"
SCRATCH="${SCRATCH:-runs/gpu-ep-bench-scratch}"
RESULTS="$SCRATCH/results"
LOG="$OUT/gpu_ep_bench.log"
DRY_RUN="${DRY_RUN:-0}"
DEEPEP_SITE="${DEEPEP_SITE:-/tmp/deepep-site}"
DEEPEP_NCCL="${DEEPEP_NCCL:-/tmp/deepep-nccl}"
START=$(date +%s)
STATUS=0

# NVLink multicast stays off on these shared machines (the benchmarks refuse to start otherwise).
MULTICAST_OFF="NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
# shellcheck disable=SC2086
export $MULTICAST_OFF
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ "$DRY_RUN" == 1 ]]; then
    echo "export $MULTICAST_OFF"
else
    mkdir -p "$OUT"; rm -rf "$SCRATCH"; mkdir -p "$RESULTS"
fi

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# step CAP_S LABEL CMD...: run CMD under a timeout (whole process group), log it, collect results.
step() { run_step "$@"; }

if [[ "$DRY_RUN" != 1 ]]; then
    say "gpu_ep_bench: OUT=$OUT budget ${BUDGET_S}s, $NPROC ranks; $MULTICAST_OFF"
    nvidia-smi -L 2>&1 | tee -a "$LOG"
    nvidia-smi topo -m 2>&1 | tee -a "$LOG"
    install_pydantic_wheels .whl/bench
    # deep_ep from the recipe's site dir, with the newer NCCL it was built against preloaded.
    if [[ -d "$DEEPEP_SITE" ]]; then
        export PYTHONPATH="$DEEPEP_SITE:$PYTHONPATH"
        say "deep_ep from $DEEPEP_SITE"
    fi
    nccl=$(find "$DEEPEP_NCCL" -name 'libnccl.so.2' -type f 2>/dev/null | head -n 1)
    if [[ -n "$nccl" ]]; then
        export LD_PRELOAD="$nccl${LD_PRELOAD:+:$LD_PRELOAD}"
        say "preloading $nccl"
    fi
    if ! "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), \
'nccl', '.'.join(map(str, torch.cuda.nccl.version())))" 2>&1 | tee -a "$LOG"; then
        say "ABORT: torch does not import or sees no CUDA device (see above)"
        exit 2
    fi
    "$PY" -c "import deep_ep; print('deep_ep', getattr(deep_ep, '__file__', '?'), \
'ElasticBuffer (V2)' if hasattr(deep_ep, 'ElasticBuffer') else 'Buffer (V1)')" 2>&1 | tee -a "$LOG" \
        || say "deep_ep does not import: deepep figures and tests will be skipped (see above)"
    check_imports app.cli app.bench.cli app.bench.dispatch app.bench.ep_train_step app.config \
        app.model.policy app.model.dispatch.alltoall app.trainer.train
fi

TORCHRUN=("$PY" -m torch.distributed.run "--nproc-per-node=$NPROC" --standalone)
[[ "$DRY_RUN" == 1 ]] && TORCHRUN=(python3 -m torch.distributed.run "--nproc-per-node=$NPROC" --standalone)

# The two benchmarks first (the issue's figures), then the equivalence tests.
step 200 "dispatch DeepSeek-V3 settings, $NPROC ranks" "${TORCHRUN[@]}" -m app.cli bench dispatch \
    --hidden 7168 --topk 8 --experts 256 --tokens 4096 --dtype bfloat16 --backends auto --fp8 \
    --iters 20 --warmup 5 --out-dir "$RESULTS"
# 8 groups x 8 completions x (128 + 384) tokens per rank: 32768 tokens per rank per step.
step 200 "ep-train-step small, EP $NPROC" "${TORCHRUN[@]}" -m app.cli bench ep-train-step \
    --model small --groups 8 --group-size 8 --prompt-len 128 --completion-len 384 --dtype bfloat16 \
    --backends auto --iters 5 --warmup 2 --out-dir "$RESULTS"
# EP 2 (NCCL) is in test_ep_equivalence.py; EP 4 and 8 (NCCL) and deepep at 2, 4, 8 in test_bench_ep.py.
# --noconftest: tests/conftest.py imports redis-py, which the image lacks; these tests need no fixture.
step 240 "EP equivalence on 2, 4, 8 GPUs" "$PY" -m pytest -q -p no:cacheprovider --noconftest -rs \
    tests/test_ep_equivalence.py::test_ep_matches_ep1_on_gpus_with_nccl \
    tests/test_bench_ep.py::test_alltoall_matches_ep1_on_more_gpus \
    tests/test_bench_ep.py::test_deepep_matches_ep1_on_gpus \
    --junitxml "$OUT/ep_equivalence.xml"

if [[ "$DRY_RUN" != 1 ]]; then
    collect
    rm -rf "$SCRATCH"
    say "gpu_ep_bench finished in $(elapsed)s, status $STATUS; results in $OUT/results.json"
fi
exit $STATUS
