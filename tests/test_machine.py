"""`moerl run`'s layout over this machine's cores and GPUs (app/local/machine.py), with fake counts.

The GPUs and cores are given, not detected, so every layout (0, 1, 2, 4 and 8 GPUs; 2 and 16
cores) is checked here on the CPU; the CLI test fakes the detection and checks that a layout
that cannot work is one line before anything starts. What runs is checked by tests/test_run.py
(the CPU layout) and by scripts/gpu_onegpu.sh on a GPU.
"""

from __future__ import annotations

import pytest

from app.config import RunConfig
from app.local.machine import Machine, plan_local, sglang_argv
from app.local.run import embedded_default

EXPERTS = 8  # the tiny preset's


def plan(gpus: int, cores: int = 16, cfg: RunConfig | None = None, preset: bool = True, **kw):
    return plan_local(cfg or embedded_default(), Machine(cores=cores, gpus=gpus), EXPERTS, preset=preset,
                      sglang=kw.pop("sglang", False), **kw)


def test_two_cores_keep_the_tuned_cpu_default():
    cfg, layout = plan(0, cores=2)
    base = embedded_default()
    assert layout.trainer_ranks == 2 and layout.trainer_gpus == ()
    assert layout.engine_devices == ("cpu", "cpu") and layout.engine == "builtin"
    assert (layout.trainer_threads, layout.engine_threads) == (1, 1)
    assert cfg.trainer.groups_per_step == base.trainer.groups_per_step
    assert cfg.buffer.capacity_groups == base.buffer.capacity_groups
    assert cfg.weight_sync.mode == "store" and cfg.model.dtype == "float32"
    assert layout.trainer_env()["CUDA_VISIBLE_DEVICES"] == ""  # a GPU torch sees is not the CPU layout's


def test_sixteen_cores_are_used_on_the_cpu():
    cfg, layout = plan(0, cores=16)
    threads = layout.trainer_ranks * layout.trainer_threads + layout.workers * layout.engine_threads
    assert layout.workers == 4 and threads == 16  # not one thread per role on 16 cores
    base = embedded_default()
    # Twice the engines, twice the step's groups (and back-pressure bound): the per-step costs
    # are paid per more samples.
    assert cfg.trainer.groups_per_step == 2 * base.trainer.groups_per_step
    assert cfg.buffer.capacity_groups == 2 * base.buffer.capacity_groups


@pytest.mark.parametrize("gpus, cores, ranks, ep, engines, backend", [
    (1, 16, 1, 1, ("cuda:0",) * 4, "cuda:gloo"),  # one rank, engines beside it on the one GPU
    (1, 2, 1, 1, ("cuda:0",), "cuda:gloo"),
    (2, 16, 1, 1, ("cuda:1",) * 4, "nccl"),  # trainer GPU 0, engines GPU 1
    (4, 16, 2, 2, ("cuda:2", "cuda:3") * 3, "nccl"),
    (8, 16, 4, 4, ("cuda:4", "cuda:5", "cuda:6", "cuda:7"), "nccl"),
    (8, 128, 4, 4, ("cuda:4", "cuda:5", "cuda:6", "cuda:7") * 4, "nccl"),
])
def test_default_layout_per_gpu_count(gpus, cores, ranks, ep, engines, backend):
    cfg, layout = plan(gpus, cores)
    assert layout.trainer_ranks == ranks and layout.trainer_gpus == tuple(range(ranks))
    assert cfg.trainer.parallel.ep == ep and not layout.shared_gpu  # one NCCL rank per GPU, never two
    assert layout.engine_devices == engines
    ws = cfg.weight_sync
    assert (ws.mode, ws.backend, ws.store_every, ws.master_address) == ("network", backend, 10, "127.0.0.1")
    assert cfg.model.dtype == "bfloat16"  # compute; master weights stay fp32 in the trainer
    assert cfg.trainer.groups_per_step >= 32 * ranks and cfg.rollout.engine.max_running_requests >= 256
    # Two steps' groups in flight over the workers (whole groups).
    r = cfg.rollout
    assert r.inflight_tasks() * layout.workers <= 2 * cfg.trainer.groups_per_step
    assert r.inflight_tasks() * layout.workers > cfg.trainer.groups_per_step
    env = layout.trainer_env()
    # The trainer's ranks see only their GPUs (LOCAL_RANK picks among them); on one GPU, all of it.
    assert env.get("CUDA_VISIBLE_DEVICES") == (None if gpus == 1 else ",".join(map(str, range(ranks))))
    assert str(gpus) in layout.describe(cfg)


def test_trainer_gpus_splits_the_gpus():
    cfg = embedded_default()
    cfg.local.trainer_gpus = 2
    out, layout = plan(2, cfg=cfg)
    assert layout.trainer_ranks == 2 and out.trainer.parallel.ep == 2
    assert set(layout.engine_devices) == {"cuda:0", "cuda:1"}  # every GPU: engines share the trainer's
    assert layout.colocated and out.weight_sync.backend == "cuda:gloo"


def test_a_users_config_keeps_its_recipe():
    cfg = RunConfig()
    cfg.trainer.groups_per_step = 5
    cfg.buffer.capacity_groups = 20
    out, layout = plan(1, cfg=cfg, preset=False)
    assert out.trainer.groups_per_step == 5 and out.weight_sync.mode == "store" and out.model.dtype == "float32"
    assert layout.trainer_ranks == 1 and layout.engine_devices[0] == "cuda:0"
    cfg.weight_sync.mode = "network"
    out, _ = plan(1, cfg=cfg, preset=False)
    assert out.weight_sync.backend == "cuda:gloo"  # auto, resolved for engines beside the trainer


def test_shared_gpu_keeps_the_several_ranks_test_layout():
    cfg, layout = plan(1, shared=True)
    assert layout.trainer_ranks == 2 and layout.shared_gpu and cfg.trainer.parallel.ep == 2
    assert cfg.weight_sync.backend == "cuda:gloo"


def test_workers_flag_sets_the_engines():
    _, layout = plan(2, workers=3)
    assert layout.engine_devices == ("cuda:1",) * 3
    _, layout = plan(0, cores=16, workers=1)
    assert layout.engine_devices == ("cpu",)


def _ep(n: int) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer.parallel.ep = n
    return cfg


def _split(n: int, **weight_sync) -> RunConfig:
    cfg = RunConfig()
    cfg.local.trainer_gpus = n
    for k, v in weight_sync.items():
        setattr(cfg.weight_sync, k, v)
    return cfg


@pytest.mark.parametrize("gpus, cfg, needle", [
    (0, _split(1), "local.trainer_gpus=1: this machine has no GPU"),
    (1, _ep(2), "trainer.parallel.ep=2 must divide trainer.parallel.dp_shard=1"),
    (1, _split(2), "local.trainer_gpus=2: this machine has 1 GPU"),
    (2, _split(3), "local.trainer_gpus=3: this machine has 2 GPUs"),
    (4, _ep(4), "trainer.parallel.ep=4 must divide trainer.parallel.dp_shard=2"),
    (8, _ep(3), "trainer.parallel.ep=3 must divide trainer.parallel.dp_shard=4"),
    (2, _split(2, mode="network", backend="nccl"), "weight_sync.backend=nccl: the engines share the trainer's GPU"),
])
def test_a_layout_that_cannot_work_is_one_line(gpus, cfg, needle):
    with pytest.raises(ValueError) as e:
        plan(gpus, cfg=cfg, preset=False)
    assert needle in str(e.value) and "\n" not in str(e.value)
    if gpus and "parallel" in needle:  # says why: one rank per GPU, and the way out
        assert "NCCL refuses two ranks on one GPU" in str(e.value) and "MOERL_SHARED_GPU=1" in str(e.value)


def test_sglang_servers_where_installed():
    cfg, layout = plan(1, sglang=True)
    assert layout.engine == "sglang"
    # SGLang takes versions over NCCL only, and NCCL refuses engines beside the trainer: the store.
    assert cfg.weight_sync.mode == "store"
    argv, env = sglang_argv(cfg, layout, 0, "/ckpt", 30001)
    assert argv[1:3] == ["-m", "sglang.launch_server"] and env == {"CUDA_VISIBLE_DEVICES": "0"}
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.1"  # 0.4 of the GPU over its 4 servers
    cfg, layout = plan(2, sglang=True)
    assert cfg.weight_sync.mode == "network" and cfg.weight_sync.backend == "nccl"


def test_sglang_command_is_the_charts_one_and_sglang_parses_it():
    """The servers' command comes from app/rollout/engine_args.py (what charts8s renders) and
    SGLang 0.5.23's own argument definitions accept it. Not runnable here: no GPU, and the
    sglang wheel is installed without its dependencies."""
    from app.rollout.engine_args import EngineLayout, sglang_command
    from sglang_oracle import parse_launch_server

    for gpus in (1, 2, 8):
        cfg, layout = plan(gpus, sglang=True)
        for i, device in enumerate(layout.engine_devices):
            argv, env = sglang_argv(cfg, layout, i, "/ckpt/v0", 30000 + i)
            ns = parse_launch_server(["python3", *argv[1:]])
            assert (ns.model_path, ns.port, ns.tp_size, ns.weight_version) == ("/ckpt/v0", 30000 + i, 1, "0")
            assert ns.max_running_requests == cfg.rollout.engine.max_running_requests >= 256
            assert env["CUDA_VISIBLE_DEVICES"] == device.split(":")[1]
            share = float(argv[argv.index("--mem-fraction-static") + 1])
            assert 0 < share * layout.engines_on(device) <= 0.85  # the servers on one GPU fit it together
            profile = cfg.rollout.engine.model_copy(update={"mem_fraction_static": share})
            charts = sglang_command(EngineLayout(profile, 1), "/ckpt/v0", port=30000 + i)
            assert argv[1:] == charts[1:]


def test_the_loop_starts_each_role_where_the_layout_says(tmp_path, monkeypatch):
    """`EmbeddedLoop` with a GPU layout: the trainer's ranks, threads and GPUs; each engine's
    device and dtype (captured argv; nothing is started)."""
    from app.local.embedded import EmbeddedLoop

    started = {}
    cfg, layout = plan(2, cores=16)
    loop = EmbeddedLoop(cfg, tmp_path, layout=layout)
    monkeypatch.setattr(loop.sup, "start", lambda name, argv, env=None: started.setdefault(name, (argv, env)))
    loop.start_trainer()
    argv, env = started["trainer"]
    assert "--nproc-per-node=1" in argv and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["OMP_NUM_THREADS"] == str(layout.trainer_threads)
    for i in range(loop.workers):
        loop.start_engine(i, tmp_path / "ckpt")
        argv, env = started[f"engine-{i}"]
        assert argv[argv.index("--device") + 1] == "cuda:1" and argv[argv.index("--dtype") + 1] == "bfloat16"
    assert loop.workers == 4
    sg_cfg, sg_layout = plan(1, sglang=True)
    loop = EmbeddedLoop(sg_cfg, tmp_path / "sg", layout=sg_layout)
    monkeypatch.setattr(loop.sup, "start", lambda name, argv, env=None: started.setdefault(name + "-sg", (argv, env)))
    loop.start_engine(0, tmp_path / "ckpt")
    argv, env = started["engine-0-sg"]
    assert argv == sglang_argv(sg_cfg, sg_layout, 0, str(tmp_path / "ckpt"), loop.engine_ports[0])[0]
    assert env["CUDA_VISIBLE_DEVICES"] == "0"


def test_moerl_run_refuses_a_layout_that_cannot_work_before_anything_starts(tmp_path, monkeypatch, capsys):
    """On a (faked) one-GPU machine, a config asking for EP 2 is one line and exit 2; no run
    directory, no process."""
    import app.local.machine as machine
    from app.cli import main

    monkeypatch.delenv("MOERL_SHARED_GPU", raising=False)
    monkeypatch.setattr(machine, "detect_machine", lambda: Machine(cores=16, gpus=1))
    config = tmp_path / "run.yaml"
    _ep(2).save(config)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", str(config), "--out", str(out), "--cache", str(tmp_path / "cache")])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trainer.parallel.ep=2" in err and "NCCL refuses" in err, err
    assert not out.exists()
