#!/usr/bin/env bash
# Issue 8 on one 8-GPU H200 machine, in one call: the DeepEP first-run checklist (issue 20), then
# `moerl bench dispatch` (DeepSeek-V3 settings) and `moerl bench ep-train-step` (policy `small`,
# EP 8), each under torchrun --nproc-per-node 8, then the EP equivalence tests on 2, 4 and 8 GPUs
# (alltoall; deepep where `deep_ep` can run).
#
# On a machine with 8 GPUs (python3 3.12 with torch and transformers, no venv, no pip index), from the
# repository root, carrying the pydantic wheels that scripts/gpu_bench.sh --fetch-wheels puts in .whl/bench:
#     bash scripts/gpu_ep_bench.sh                  # with .whl/bench copied along
# deep_ep is used only where `deepep_unavailable_reason()` is None. The lent image (torch 2.11,
# NCCL 2.28.9) cannot load sgl-deep-ep 0.1.2.post1 (torch==2.14.1, NCCL 2.30.7 exactly): there the
# checklist prints why and the deepep parts are skipped (bench/results/ep.md, "What deep_ep needs").
# On a machine with the trainer image (images/trainer.Dockerfile) they run.
#
# CHECKLIST=1 runs the checklist and the equivalence tests without the two benchmarks.
# PREFLIGHT=1 runs only the checklist's CPU-side part (`scripts/deepep_checklist.py --preflight`:
# torch, the sgl-deep-ep wheel and its pins, NCCL pinned and loaded, nvcc) and exits; it needs no
# GPU. DRY_RUN=1 prints the commands instead of running them (tests/test_bench_ep.py uses it).
#
# Writes into $OUT (default runs/bench-gpu-ep): results.json (a JSON list of every result document,
# rewritten after each step), deepep_checklist.json, gpu_ep_bench.log and the pytest output of the
# equivalence tests. Each step gets a timeout; once BUDGET_S seconds have passed no further step starts.
set -u -o pipefail

PY="${PYTHON:-python3}"
NPROC="${NPROC:-8}"
OUT="${OUT:-runs/bench-gpu-ep}"
BUDGET_S="${BUDGET_S:-540}"
SCRATCH="${SCRATCH:-runs/gpu-ep-bench-scratch}"
RESULTS="$SCRATCH/results"
LOG="$OUT/gpu_ep_bench.log"
DRY_RUN="${DRY_RUN:-0}"
PREFLIGHT="${PREFLIGHT:-0}"
CHECKLIST="${CHECKLIST:-0}"
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

if [[ "$DRY_RUN" == 1 ]]; then
    echo "$PY scripts/deepep_checklist.py --preflight"
else
    install_pydantic_wheels .whl/bench
    # The checklist's CPU-side part: what decides whether deep_ep can load here.
    "$PY" scripts/deepep_checklist.py --preflight 2>&1 | tee -a "$LOG"
    [[ "$PREFLIGHT" == 1 ]] && exit 0
    say "gpu_ep_bench: OUT=$OUT budget ${BUDGET_S}s, $NPROC ranks; $MULTICAST_OFF"
    nvidia-smi -L 2>&1 | tee -a "$LOG"
    nvidia-smi topo -m 2>&1 | tee -a "$LOG"
    if ! "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'transformers', transformers.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), \
'nccl torch was built with', '.'.join(map(str, torch.cuda.nccl.version())))" 2>&1 | tee -a "$LOG"; then
        say "ABORT: torch does not import or sees no CUDA device (see above)"
        exit 2
    fi
    check_imports app.cli app.bench.cli app.bench.dispatch app.bench.ep_train_step app.config \
        app.model.policy app.model.dispatch.alltoall app.trainer.train
    DEEPEP_REASON=$("$PY" -c "from app.model.parallel import deepep_unavailable_reason as r; print(r(hidden_size=256) or '')" 2>&1)
fi

TORCHRUN=("$PY" -m torch.distributed.run "--nproc-per-node=$NPROC" --standalone)
[[ "$DRY_RUN" == 1 ]] && TORCHRUN=(python3 -m torch.distributed.run "--nproc-per-node=$NPROC" --standalone)

# The DeepEP first-run checklist (issue 20) on 2, 4 and 8 ranks, where deep_ep can run.
if [[ "$DRY_RUN" == 1 ]]; then
    echo "${TORCHRUN[*]} scripts/deepep_checklist.py --out $OUT --sizes 2,4,8"
elif [[ -n "${DEEPEP_REASON:-}" ]]; then
    say "SKIP deepep checklist: $DEEPEP_REASON"
else
    step 240 "deepep first-run checklist, EP 2, 4, 8" env EP_BUFFER_DEBUG=1 "${TORCHRUN[@]}" \
        scripts/deepep_checklist.py --out "$OUT" --sizes 2,4,8
fi

# The two benchmarks (the issue's figures), then the equivalence tests; CHECKLIST=1 skips the
# benchmarks (the checklist and the deepep equivalence tests then fit one call).
[[ "$CHECKLIST" == 1 ]] || step 200 "dispatch DeepSeek-V3 settings, $NPROC ranks" "${TORCHRUN[@]}" -m app.cli bench dispatch \
    --hidden 7168 --topk 8 --experts 256 --tokens 4096 --dtype bfloat16 --backends auto --fp8 \
    --iters 20 --warmup 5 --out-dir "$RESULTS"
# 8 groups x 8 completions x (128 + 384) tokens per rank: 32768 tokens per rank per step.
[[ "$CHECKLIST" == 1 ]] || step 200 "ep-train-step small, EP $NPROC" "${TORCHRUN[@]}" -m app.cli bench ep-train-step \
    --model small --groups 8 --group-size 8 --prompt-len 128 --completion-len 384 --dtype bfloat16 \
    --backends auto --iters 5 --warmup 2 --out-dir "$RESULTS"
# EP 2 (NCCL) is in test_ep_equivalence.py; EP 4 and 8 (NCCL) in test_bench_ep.py; deepep at 2, 4, 8
# in test_deepep.py (hidden 256, the smallest width DeepEP's combine accepts).
# --noconftest: tests/conftest.py imports redis-py, which the image lacks; these tests need no fixture.
step 240 "EP equivalence on 2, 4, 8 GPUs" "$PY" -m pytest -q -p no:cacheprovider --noconftest -rs \
    tests/test_ep_equivalence.py::test_ep_matches_ep1_on_gpus_with_nccl \
    tests/test_bench_ep.py::test_alltoall_matches_ep1_on_more_gpus \
    tests/test_deepep.py::test_deepep_matches_ep1_on_gpus \
    --junitxml "$OUT/ep_equivalence.xml"

if [[ "$DRY_RUN" != 1 ]]; then
    collect
    rm -rf "$SCRATCH"
    say "gpu_ep_bench finished in $(elapsed)s, status $STATUS; results in $OUT/results.json"
fi
exit $STATUS
