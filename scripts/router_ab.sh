#!/usr/bin/env bash
# The router A/B of bench/README.md (`moerl bench rollout --router-url`) on an idle machine: two pinned built-in engines, SGLang's router.
set -u
cd "$(dirname "$0")/.."
B=.venv/bin
O=${OUT:-runs/router-ab}; rm -rf "$O/ck" "$O/out"; mkdir -p "$O/out"
PYTHONPATH=tests $B/python -c "from pathlib import Path; from helpers import tiny_moe_checkpoint; print(tiny_moe_checkpoint(Path('$O/ck'), 0, max_position_embeddings=64))" > $O/ckpath
CK=$(tail -1 $O/ckpath)
$B/python -c "from app.config import RunConfig; RunConfig().save('$O/run.yaml')"
taskset -c 0 $B/moerl engine --model-path "$CK" --port 31001 --threads 1 --max-running-requests 64 > $O/e1.log 2>&1 &
E1=$!
taskset -c 1 $B/moerl engine --model-path "$CK" --port 31002 --threads 1 --max-running-requests 64 > $O/e2.log 2>&1 &
E2=$!
$B/python -m sglang_router.launch_router --host 127.0.0.1 --port 31000 --policy cache_aware \
    --prometheus-port 31009 --request-timeout-secs 60 --log-level warn \
    --worker-urls http://127.0.0.1:31001 http://127.0.0.1:31002 --balance-abs-threshold 2 > $O/r.log 2>&1 &
R=$!
sleep 20
for waits in "--env-wait-s 0.4 --env-wait-s 0" "--env-wait-s 0.2"; do
  uptime
  $B/moerl bench rollout --url http://127.0.0.1:31001 --url http://127.0.0.1:31002 \
    --router-url http://127.0.0.1:31000 --config $O/run.yaml --concurrency 4 \
    $waits --seconds 10 --repeats 3 --out-dir $O/out 2>&1 | tail -25
done
kill $E1 $E2 $R; wait
