# Shared by scripts/gpu_bench.sh and scripts/gpu_ep_bench.sh (sourced, not run): logging, the
# budgeted step runner, result collection and the pre-flight checks on the GPU image.
# Uses the caller's globals: PY, OUT, RESULTS, LOG, BUDGET_S, DRY_RUN, START, STATUS (set here on
# failure) and KILL_AFTER_S (seconds between timeout's TERM and KILL; default 10).

elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[$(date -u +%H:%M:%S) +$(elapsed)s] $*" | tee -a "$LOG"; }

collect() {
    # Every result file so far -> $OUT/results.json (temporary name, then rename).
    "$PY" - "$RESULTS" "$OUT/results.json" <<'EOF'
import json, os, sys
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
docs = [json.loads(p.read_text()) for p in sorted(src.glob("*.json"))]
tmp = dst.with_name(dst.name + ".tmp")
tmp.write_text(json.dumps(docs, indent=1))
os.replace(tmp, dst)
EOF
}

# run_step CAP_S LABEL CMD...: run CMD under a timeout of CAP_S seconds (less if the budget has
# less left), log it, collect results. DRY_RUN=1 prints CMD instead.
run_step() {
    local cap=$1 label=$2
    shift 2
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "$*"
        return
    fi
    local left=$(( BUDGET_S - $(elapsed) ))
    if (( left < 20 )); then
        say "SKIP $label: budget of ${BUDGET_S}s spent"
        STATUS=1
        return
    fi
    local limit=$(( cap < left ? cap : left ))
    say "START $label (timeout ${limit}s): $*"
    timeout --kill-after="${KILL_AFTER_S:-10}" "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if (( rc == 0 )); then say "DONE $label"; else say "FAILED $label (exit $rc)"; STATUS=1; fi
    collect
}

# install_pydantic_wheels DIR: install the wheels carried under DIR (pydantic, which the image lacks
# and app.config needs, and a newer transformers), once per name, into /tmp/moerl-site, put first on
# PYTHONPATH so they win over the image's own. Exits 2 if pydantic is missing and DIR holds no wheels.
install_pydantic_wheels() {
    local dir=$1 wheels
    wheels=$(find "$dir" -type f -name '*.whl' 2>/dev/null | awk -F/ '{split($NF, a, "-"); if (!seen[tolower(a[1])]++) print}')
    if [[ -z "$wheels" ]]; then
        "$PY" -c "import pydantic" 2>/dev/null && return
        say "ABORT: pydantic is missing and no wheels under $dir (copy $dir along; see bench/README.md)"
        exit 2
    fi
    # shellcheck disable=SC2086
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/moerl-site $wheels 2>&1 | tee -a "$LOG"
    export PYTHONPATH="/tmp/moerl-site:$PYTHONPATH"
}

# check_imports MODULE...: import them all in one process, so a missing package stops the run
# here, in seconds, not minutes into a benchmark. Exits 2 if any fails.
check_imports() {
    local mods
    mods=$(IFS=,; echo "$*")
    if ! "$PY" -c "import ${mods//,/, }" 2>&1 | tee -a "$LOG"; then
        say "ABORT: the benchmark modules do not import here (see above)"
        exit 2
    fi
}

# install_carried DIR...: every wheel under the DIRs (the first of each name), and the sdists under
# DIR/src (built here, for this Python: pycosat), into /tmp/moerl-site, put first on PYTHONPATH so they
# win over the image's own; where DIR/redis holds Debian's redis-server and its libraries, make
# /usr/bin/redis-server (REDIS_BIN) run it (app/buffer/redis_server.py starts that one; the machine is
# ours, and bare).
install_carried() {
    local wheels dir
    # shellcheck disable=SC2086
    wheels=$(find "$@" -maxdepth 1 -type f -name '*.whl' 2>/dev/null | awk -F/ '{split($NF, a, "-"); if (!seen[tolower(a[1])]++) print}')
    # shellcheck disable=SC2086
    [[ -z "$wheels" ]] || "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/moerl-site $wheels 2>&1 | tail -3 | tee -a "$LOG"
    for dir in "$@"; do
        if compgen -G "$dir/src/*" >/dev/null; then
            "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/moerl-site \
                "$dir"/src/* 2>&1 | tail -3 | tee -a "$LOG"
        fi
        if [[ -f "$dir/redis/redis-server" ]]; then
            chmod +x "$dir/redis/redis-server"
            printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/$dir/redis/lib" "$PWD/$dir/redis/redis-server" \
                > "${REDIS_BIN:-/usr/bin/redis-server}" && chmod +x "${REDIS_BIN:-/usr/bin/redis-server}"
        fi
    done
    export PYTHONPATH="/tmp/moerl-site${PYTHONPATH:+:$PYTHONPATH}"
}
