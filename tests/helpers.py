"""Test helpers shared by several test files (trainer: test_trainer.py, test_ppo.py; engine:
test_engine.py, test_worker.py).

Imported as `helpers`: pytest puts this directory on sys.path (there is no tests/__init__.py),
and spawned worker processes inherit that path.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.request
from pathlib import Path

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families

from app.buffer.records import Group, Sample, Task
from app.buffer.redis_server import free_port


def single_rank_env(monkeypatch) -> None:
    """Environment of a 1-process torch.distributed world (rank 0, a free loopback port)."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)


def fake_groups(n_groups: int, group_size: int = 4, seed: int = 0, binary_reward: bool = True) -> list[Group]:
    """Groups with varied prompt/completion lengths, logprobs in [-6, -3) and rewards
    (deterministic for a seed). binary_reward: reward 0/1 (uniform > 0.5), else the uniform draw."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for t in range(n_groups):
        prompt = torch.randint(4, 100, (2 + t % 3,), generator=g).tolist()
        samples = []
        for i in range(group_size):
            n = 1 + int(torch.randint(0, 5, (1,), generator=g))
            completion = torch.randint(4, 100, (n,), generator=g).tolist()
            logprobs = (torch.rand(n, generator=g) * -3 - 3).tolist()
            u = torch.rand((), generator=g)
            samples.append(Sample(
                sample_id=f"r/t{t}/{i}/0", task_id=f"t{t}", index=i, attempt=0,
                prompt_ids=[1] + prompt, completion_ids=completion, logprobs=logprobs,
                reward=float(u > 0.5) if binary_reward else float(u), policy_version=0,
                finish_reason="stop",
            ))
        groups.append(Group(task_id=f"t{t}", attempt=0, samples=samples))
    return groups


def toy_rollout(model, gen: torch.Generator, task: str, prompt: list[int], group_size: int,
                n_new: int, target: int) -> Group:
    """One GRPO group sampled from `model` itself: `n_new` tokens per sample (multinomial with
    `gen`), the sampling logprobs recorded, reward = fraction of completion tokens == `target`."""
    ids = torch.tensor([prompt] * group_size)
    lps = []
    with torch.no_grad():
        for _ in range(n_new):
            lp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), -1)
            tok = torch.multinomial(lp.exp(), 1, generator=gen)
            lps.append(lp.gather(1, tok))
            ids = torch.cat([ids, tok], 1)
    comp, lps = ids[:, len(prompt):], torch.cat(lps, 1)
    return Group(task_id=task, attempt=0, samples=[
        Sample(sample_id=f"{task}/{i}", task_id=task, index=i, attempt=0, prompt_ids=prompt,
               completion_ids=comp[i].tolist(), logprobs=lps[i].tolist(),
               reward=float((comp[i] == target).float().mean()), policy_version=0,
               finish_reason="length")
        for i in range(group_size)])


def fake_producer(url: str, run_id: str, stop: threading.Event, group_size: int) -> None:
    """A fake rollout worker (run in a thread until `stop`): keeps tasks queued, leases them and
    publishes groups stamped with the announced policy version. Sample k has k+1 completion
    tokens and reward k % 2."""
    from app.buffer import ExperienceBuffer

    buf = ExperienceBuffer(url, run_id, capacity_groups=8, max_staleness=1)
    i = 0
    while not stop.is_set():
        if not buf.wait_for_capacity(timeout_s=0.2):
            continue
        buf.put_tasks([Task(task_id=f"p{i}", prompt_ids=[1, 4 + i % 50, 9], prompt="", answer="{}",
                            group_size=group_size)])
        i += 1
        for task in buf.lease("fake-worker", count=1, block_ms=200):
            current = buf.current_policy()
            version = current[0] if current else 0
            buf.publish(task, [
                Sample(sample_id=task.sample_id(run_id, k), task_id=task.task_id, index=k,
                       attempt=task.attempt, prompt_ids=task.prompt_ids,
                       completion_ids=[10 + k] * (1 + k), logprobs=[-4.6] * (1 + k),
                       reward=float(k % 2), policy_version=version, finish_reason="stop")
                for k in range(group_size)])


def tiny_moe_checkpoint(out: Path, seed: int, max_position_embeddings: int) -> Path:
    """A tiny random Qwen3-MoE (2 layers, hidden 32, 4 experts top-2, seeded with `seed`) saved
    at `out` as an HF dir with the character tokenizer. Returns `out`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from app.model.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_tokenizer

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=max_position_embeddings,
        pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
    )
    Qwen3MoeForCausalLM(cfg).save_pretrained(out)
    save_tokenizer(out)
    return out


def engine_argv(model_path: Path, port: int, *extra: str) -> list[str]:
    """`moerl engine` serving `model_path` on 127.0.0.1:`port` with one torch thread, then `extra`."""
    return [sys.executable, "-m", "app.cli", "engine", "--model-path", str(model_path), "--port", str(port),
            "--threads", "1", *extra]


def join_world(rank: int, world: int, port: int) -> None:
    """In a spawned rank: the torch.distributed environment of `rank` of `world` on
    127.0.0.1:`port`, one torch thread, and the (gloo) process group."""
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    from app.trainer.parallel import init_distributed

    init_distributed(timeout_s=120)


def sharded_trainer(cfg, device: torch.device | str = "cpu"):
    """The sharded policy of a preset run config on the current process group (as the trainer
    builds it: layout, mesh, EP context, FSDP2) and its mesh, on ``device``. Returns (model, mesh, ep)."""
    import torch.distributed as dist

    from app.layout import resolve_layout
    from app.model.config import num_routed_experts
    from app.model.parallel import init_ep
    from app.trainer.models import build_policy_model, policy_config
    from app.trainer.parallel import build_mesh

    config = policy_config(cfg, None)
    layout = resolve_layout(cfg.trainer.parallel, dist.get_world_size(), num_routed_experts(config))
    device = torch.device(device)
    mesh = build_mesh(layout, device.type)
    ep = mesh.ep_context(init_ep(cfg.trainer.parallel, group=mesh.ep.get_group()).backend)
    return build_policy_model(cfg, None, ep, mesh, device), mesh, ep


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter of a (possibly sharded) model as a full tensor (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    from app.trainer.parallel import gather

    return {k: (gather(v) if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


def spawn(worker, world: int, *args) -> None:
    """Run `worker(rank, world, port, *args)` on `world` spawned processes and wait for them."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=True)


def assert_params_match(got: dict, ref: dict, atol: float, rtol: float) -> None:
    """Every tensor of `got` equals the same-named one of `ref`. The absolute tolerance of a
    tensor is `atol`, or 1e-6 x its largest reference entry if that is larger: summing the same
    terms in another order (per rank, then reduce-scatter) moves an fp32 result by about eps x the
    sum of its terms' magnitudes, so an entry that cancels to near zero in a tensor of scale 100
    differs by ~1e-5 between two correct orders; a missing token or expert moves entries by far
    more."""
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))[:5]
    for name, g_ref in ref.items():
        tol = dict(rtol=rtol, atol=max(atol, 1e-6 * float(g_ref.abs().max())))
        torch.testing.assert_close(got[name], g_ref, **tol, msg=lambda m, n=name: f"{n}: {m}")


class EnvServer:
    """`moerl env`'s app (app/envs/openenv_server.py ``build_app(cfg)``), or another ASGI ``app``
    (an OpenEnv server of a test's own), served by uvicorn on a free loopback port in a daemon
    thread; ``url`` is its base URL."""

    def __init__(self, cfg=None, app=None):
        import time

        import uvicorn

        from app.envs.openenv_server import build_app

        self.port = free_port()
        self.app = app if app is not None else build_app(cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "env server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class Recorder(httpx.AsyncBaseTransport):
    """The built-in engine in-process (ASGI); keeps every (path, request JSON, status, response JSON)."""

    def __init__(self, app):
        self.inner = httpx.ASGITransport(app=app)
        self.calls: list[tuple[str, object, int, object]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        sent = json.loads(request.content) if request.content else None
        try:
            got = json.loads(body)
        except ValueError:
            got = body.decode()
        self.calls.append((request.url.path, sent, response.status_code, got))
        return httpx.Response(response.status_code, headers=response.headers, content=body, request=request)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET http://127.0.0.1:port/metrics and parse it with prometheus_client's own text parser:
    (sample name, sorted label items) -> value."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def keys_files(pod: dict, pod_env: dict[str, str], secret_values: dict[str, str], out_dir: Path) -> dict[str, Path]:
    """Run the pod's "keys" init container (app/rollout/keys.py) as the kubelet would: its command
    with ``$(VAR)`` expanded from ``pod_env`` (POD_NAME, POD_INDEX) and its Secret variables set to
    ``secret_values[key]``; returns {the keys file's path in the pod: where it was written here},
    or {} for a pod without one."""
    import os
    from unittest.mock import patch

    from app.rollout import keys

    init = [c for c in pod.get("initContainers", []) if c["name"] == "keys"]
    if not init:
        return {}
    (c,) = init
    env = {e["name"]: secret_values[e["valueFrom"]["secretKeyRef"]["key"]] for e in c["env"]
           if "secretKeyRef" in e.get("valueFrom", {})}
    argv = []
    for a in c["command"][3:]:
        for k, v in pod_env.items():
            a = a.replace(f"$({k})", v)
        argv.append(a)
    in_pod = argv[argv.index("--out") + 1]
    here = out_dir / f"{len(list(out_dir.glob('*')))}-{Path(in_pod).name}"
    argv[argv.index("--out") + 1] = str(here)
    with patch.dict(os.environ, env):
        assert keys.main(argv) == 0
    return {in_pod: here}


def guess_number_at(tmp_path: Path, url: str, **task) -> Path:
    """examples/guess_number/run.yaml with ``env.url`` a server at ``url`` (a test's own) instead of
    `moerl env`, without its demonstrations file, ``task`` fields changed; written to
    ``tmp_path/run.yaml``, whose path is returned."""
    import yaml

    root = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((root / "examples/guess_number/run.yaml").read_text())
    cfg["env"] = {**cfg["env"], "name": "guess-number", "url": url}
    cfg["env"].pop("demos_path")
    cfg["task"].update(task)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "run.yaml"


def moerl_run_fails_in_one_line(tmp_path: Path, config: Path, timeout_s: float = 600) -> str:
    """Run ``moerl run --config CONFIG --out tmp_path/run --cache tmp_path/cache`` and return its
    one stderr line, after checking that it exited 2 and left no run directory and nothing in the
    warm-up cache."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "app.cli", "run", "--config", str(config), "--out",
                           str(tmp_path / "run"), "--cache", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=timeout_s, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stdout, proc.stdout[-3000:] + proc.stderr
    assert not (tmp_path / "run").exists() and not list((tmp_path / "cache").glob("*"))
    if "run directory:" in proc.stdout:  # named at the start: its removal is told too
        assert f"run directory {tmp_path / 'run'} removed" in proc.stdout, proc.stdout[-3000:]
    return lines[0]
