"""TorchX local as docs/local-run.md documents it: `.venv/bin/torchx run -s local_cwd
app/torchx_component.py:job ...` with redis-server started first and the venv NOT on PATH. The
trainer makes its steps (so the feeder queued prompts and the rollout role generated them), the
trainer leaves its done marker and the feeder exits on it; Ctrl-C stops the rest."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.buffer.redis_server import free_port
from app.local.chaos import make_base_policy
from app.local.run import embedded_default
from app.storage import open_store, read_done

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def test_torchx_local_job_trains_with_the_feeder_and_no_venv_on_path(local_redis, tmp_path):
    cfg = embedded_default()
    cfg.run_id, cfg.trainer.steps = "torchx", 3
    cfg.buffer.redis_url = local_redis.url
    cfg.store_url = f"file://{tmp_path / 'store'}"
    cfg.rollout.policy_cache_dir = str(tmp_path / "policy-cache")
    cfg.task.train_size = 100
    # free ports: other tests (and `make test -n 2`'s other worker) run engines and torchrun too
    rdzv_port, engine_port = free_port(), free_port()
    cfg.rollout.engine_url = f"http://127.0.0.1:{engine_port}"
    base = make_base_policy(cfg, tmp_path / "base")
    cfg.model.path = str(base)
    cfg.save(tmp_path / "run.yaml")
    torchx = Path(sys.executable).parent / "torchx"
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([str(torchx), "run", "-s", "local_cwd", "app/torchx_component.py:job",
                             "--config", str(tmp_path / "run.yaml"), "--model_path", str(base),
                             "--run_dir", str(tmp_path / "run"), "--rdzv_port", str(rdzv_port),
                             "--engine_port", str(engine_port)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    version = len([s for s in range(1, 4) if s % cfg.trainer.publish_every == 0 or s == 3])
    # torchx tails each role's log on its own, so the roles' lines interleave in any order: wait
    # for all three instead of stopping at the feeder's last line.
    wanted = {"feeder's last line": lambda x: x.startswith("feed/0") and '"feed":' in x,
              "trainer's step 3": lambda x: f"rank0 step 3 v{version}" in x,
              "trainer's done line": lambda x: x.startswith("trainer/0") and '{"done": true' in x,
              # each role's exit status, which `torchx run` does not show (docs/local-run.md)
              "trainer's exit status": lambda x: x.startswith("trainer/0") and "role trainer exited with status 0" in x,
              "feeder's exit status": lambda x: x.startswith("feed/0") and "role feed exited with status 0" in x}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and reader.is_alive():
            if all(any(seen(x) for x in list(lines)) for seen in wanted.values()):
                break
            time.sleep(0.5)
        out = "".join(lines)
        assert "command not found" not in out, out[-3000:]
        missing = [name for name, seen in wanted.items() if not any(seen(x) for x in lines)]
        assert not missing, f"missing {missing}:\n{out[-3000:]}"
        feed = json.loads(next(x for x in lines if '"feed":' in x).split(" ", 1)[1])["feed"]
        assert feed["done"] is True and feed["queued"] > 0
        assert read_done(open_store(cfg.store_url), cfg.run_id)["step"] == 3
        # the run's records are in its own directory
        assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3
        assert (tmp_path / "run" / "feed" / "issued.jsonl").read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: torchx stops every role it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
