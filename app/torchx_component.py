"""TorchX components of a moerl job: the trainer gang, the rollout workers and the prompt source.

    torchx run -s local_cwd app/torchx_component.py:trainer --nproc_per_node 2 --config run.yaml
    torchx run -s local_cwd app/torchx_component.py:rollout --config run.yaml --model_path <hf dir>
    torchx run -s local_cwd app/torchx_component.py:job --config run.yaml --model_path <hf dir>
    torchx run -s kubernetes -cfg queue=default,namespace=moerl,service_account=<the run's, below> \
        app/torchx_component.py:trainer --image <ecr>/moerl/trainer:<tag> --nnodes 16 --nproc_per_node 8 ...

(the run's service account: DeploymentConfig.trainer_service_account_of(run_id), infra/config.py;
one per trainer_runs entry, whose Pod Identity role writes that entry's runs only)

The commands below are the single source of the containers' command lines: charts8s/ builds
its rollout Deployment from `engine_command` / `worker_command` and its trainer Volcano Job from
`trainer()` (through TorchX's own Kubernetes renderer), so `kubectl apply -f dist/` and
`torchx run -s kubernetes` start the same images with the same arguments and resources.
API: torchx.specs (AppDef, Role, Resource, macros), https://pytorch.org/torchx/latest/specs.html
"""

# No `from __future__ import annotations`: TorchX reads the component's parameter types at run time.
import shlex
import sys

import torchx.specs as specs

from app.config import EngineProfile
from app.names import CLUSTER_CONFIG
from app.rollout.engine_args import EngineLayout, builtin_command, sglang_command

TRAINER_ROLE = "trainer"
ROLLOUT_ROLE = "rollout"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
MIB = 1024 * 1024


def moerl_cmd(python: str = "") -> list[str]:
    """How a role starts `moerl`: the image's console script on PATH, or ``python -m app.cli``
    when an interpreter is given (a local venv run without the venv on PATH)."""
    return [python, "-m", "app.cli"] if python else ["moerl"]


def trainer_command(config: str, nnodes: int, nproc_per_node: int, rdzv_port: int, resume: bool,
                    run_dir: str = "", python: str = "", metrics_port: int = 0) -> str:
    """The trainer's shell command: torchrun starting `moerl train` on every GPU of the node.

    Rendezvous is c10d on rank 0's host; `${rank0_env}` is a TorchX macro that becomes
    TORCHX_RANK0_HOST (set to localhost) on replica 0 and VC_TRAINER_0_HOSTS elsewhere: replica 0's
    DNS name, set by Volcano's svc plugin (`torchx run -s kubernetes`) or by charts8s/trainer.py
    (torchx.specs.macros, torchx.components.dist.ddp).
    torchrun's own restarts are off: a failed rank restarts the whole gang, which resumes.
    run_dir: `moerl train --run-dir` (metrics, local staging); "" keeps its default.
    metrics_port: `moerl train --metrics-port` (rank 0's Prometheus endpoint); 0: none.
    python: "" runs the image's `torchrun` and `moerl` from PATH; an interpreter path runs
        ``python -m torch.distributed.run ... -m app.cli train`` (nothing taken from PATH).
    """
    endpoint = f"${{{specs.macros.rank0_env}:=localhost}}:{rdzv_port}"
    launcher = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    script = ["-m", "app.cli"] if python else ["--no-python", "moerl"]
    cmd = [
        *launcher, f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={specs.macros.app_id}",
        "--max-restarts=0", *script, "train", "--config", config,
    ]
    if run_dir:
        cmd += ["--run-dir", run_dir]
    if metrics_port:
        cmd += ["--metrics-port", str(metrics_port)]
    if resume:
        cmd.append("--resume")
    # Quote everything except the endpoint, whose ${...} bash must expand.
    return " ".join(a if a.startswith("--rdzv-endpoint") else shlex.quote(a) for a in cmd)


def engine_command(engine: str, model_path: str | None, port: int, tp_size: int, python: str = "") -> list[str]:
    """The rollout engine of this component: SGLang with tensor parallelism over ``tp_size``
    GPUs, or the built-in `moerl engine` locally; both on loopback (only the worker beside it
    talks to it). The command lines come from `app.rollout.engine_args` (charts8s renders
    every engine profile, multi-node ones included, from the same functions); ``python`` runs the
    built-in engine as ``python -m app.cli`` instead of the ``moerl`` script (see `moerl_cmd`).

    Raises:
        ValueError: unknown engine, or no model_path.
    """
    if engine not in ("sglang", "builtin"):
        raise ValueError(f"engine must be 'sglang' or 'builtin', got {engine!r}")
    if not model_path:
        raise ValueError(f"engine {engine!r} needs model_path (an HF id or a local checkpoint directory)")
    profile = EngineProfile(tp_size=tp_size)
    if engine == "builtin":
        return [*moerl_cmd(python), *builtin_command(profile, model_path, port=port)[1:]]
    return sglang_command(EngineLayout(profile, gpus_per_node=tp_size), model_path, port=port)


def worker_command(config: str, worker_id: str, pause_marker: str | None = None, python: str = "",
                   metrics_port: int = 0) -> list[str]:
    """The moerl rollout worker (leases prompt groups, calls the engine on loopback, publishes).

    worker_id: unique per worker (its task-lease consumer name), e.g. the pod name.
    pause_marker: the file the engine's probes read while the worker holds it paused
        (`app.rollout.probe`); None: no marker.
    metrics_port: the worker's Prometheus endpoint (`moerl rollout --metrics-port`); 0: none.
    """
    cmd = [*moerl_cmd(python), "rollout", "--config", config, "--worker-id", worker_id]
    if pause_marker:
        cmd += ["--pause-marker", pause_marker]
    return cmd + (["--metrics-port", str(metrics_port)] if metrics_port else [])


def trainer_resource(gpus: int, efa: int, hugepages_mib: int, cpu: int, mem_mb: int) -> specs.Resource:
    """One trainer pod: `gpus` GPUs, `efa` EFA devices, hugepages (MiB), `cpu` vCPU, `mem_mb` MB.

    TorchX writes `devices` into the container's limits verbatim, so hugepages go in bytes.
    """
    devices = {}
    if efa:
        devices[EFA_RESOURCE] = efa
    if hugepages_mib:
        devices[HUGEPAGES_RESOURCE] = hugepages_mib * MIB
    return specs.Resource(cpu=cpu, gpu=gpus, memMB=mem_mb, devices=devices)


# PyTorch NCCL watchdog of the trainer: tear the process down on a collective error of its
# training groups (a hang must fail the job, which Volcano restarts), and dump the flight recorder
# on a timeout (torch.distributed docs, "TORCH_NCCL_*" environment variables). The weight-update
# group that rank 0 shares with the engines is made with its own handling (app/weight_group.py
# GROUP_NCCL_ENV): a dead or frozen engine aborts that group only, and the trainer goes on.
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/tmp/nccl_trace_rank_",
}
# The engine pods' (SGLang's ranks): CleanUpOnly, so that a weight-update group whose source died
# or timed out aborts its communicator and /update_weights_from_distributed answers a failure
# (the worker then reloads the version from the store, app/rollout/weights.py) instead of torch's
# default tearing the scheduler down (a restart; for two-node engines an LWS recreate and another
# copy of the model). A hang of the engine's own TP/EP groups then fails its next collective, and
# the scheduler exits or the liveness probe restarts the engine, as before.
ENGINE_NCCL_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
# The CUDA caching allocator with expandable segments: its reserve (app/plan/memory.py
# FRAGMENTATION_EXPANDABLE 1.16, against 1.33 with the default allocator) is what lets DeepSeek-V3 fit
# 16 x 8 H200 at EP 32 with 8K-token micro-batches (docs/plan.md).
GPU_ALLOC_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
# EFA through libfabric and the aws-ofi-nccl plugin (EC2 user guide, "Get started with EFA and
# NCCL"); NCCL_NET makes NCCL fail instead of silently falling back to TCP sockets.
EFA_ENV = {
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
    "NCCL_NET": "AWS Libfabric",
    "NCCL_SOCKET_IFNAME": "^lo,docker",
}
# DeepEP over EFA: NVSHMEM's libfabric transport on the EFA provider, bootstrapped by unique id
# (awslabs/awsome-distributed-ai 3.test_cases/pytorch/sglang/dsr1-deepep-efa; NVSHMEM
# environment variables doc). The image must carry a DeepEP/NVSHMEM build for EFA (images/).
NVSHMEM_EFA_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "libfabric",
    "NVSHMEM_LIBFABRIC_PROVIDER": "efa",
    "NVSHMEM_BOOTSTRAP": "UID",
}


def trainer(
    image: str = "moerl-trainer:local",
    nnodes: int = 1,
    nproc_per_node: int = 1,
    gpus: int = 0,
    config: str = CLUSTER_CONFIG,
    resume: bool = True,
    run_dir: str = "",
    efa: int = 0,
    hugepages_mib: int = 0,
    cpu: int = 2,
    mem_mb: int = 4096,
    rdzv_port: int = 29500,
    max_retries: int = 10,
    name: str = "moerl-trainer",
    python: str = "",
    metrics_port: int = 0,
    ep: int = 1,
) -> specs.AppDef:
    """The trainer gang: `nnodes` replicas x `nproc_per_node` ranks of `moerl train --config`.

    Any replica's failure restarts every replica (RetryPolicy.APPLICATION; Volcano RestartJob),
    up to `max_retries` times; `--resume` makes each restart continue from the last checkpoint.

    Args:
        image: container image (local_cwd ignores it and runs in the current directory).
        gpus: GPUs per replica (0 on CPU: the ranks use gloo).
        efa, hugepages_mib: EFA devices and 2 MiB hugepages (MiB) per replica; 0 locally.
        cpu, mem_mb: vCPU and memory (MB) per replica.
        python: "" (images: `torchrun` and `moerl` on PATH) or the interpreter to run them with.
        metrics_port: rank 0's Prometheus endpoint (`moerl train --metrics-port`); 0: none.
        ep: the run's trainer.parallel.ep: with GPUs, EP groups within a node get
            EP_DISABLE_GIN=1 (`app.model.parallel.deepep_gin_env`).

    Raises:
        ValueError: a count below 1, or gpus neither 0 nor nproc_per_node.
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"nnodes and nproc_per_node must be >= 1, got {nnodes}, {nproc_per_node}")
    if gpus not in (0, nproc_per_node):
        raise ValueError(f"gpus={gpus}: one rank per GPU, so gpus must be 0 or nproc_per_node={nproc_per_node}")
    env = dict(NCCL_ENV)
    if efa:
        env.update(EFA_ENV)
    if gpus:
        # torch: charts8s renders this component without it
        from app.model.parallel import deepep_gin_env

        env.update(GPU_ALLOC_ENV)
        env.update(deepep_gin_env(ep, nproc_per_node))
    role = specs.Role(
        name=TRAINER_ROLE,
        image=image,
        entrypoint="bash",
        args=["-c", trainer_command(config, nnodes, nproc_per_node, rdzv_port, resume, run_dir, python, metrics_port)],
        num_replicas=nnodes,
        resource=trainer_resource(gpus, efa, hugepages_mib, cpu, mem_mb),
        port_map={"c10d": rdzv_port},
        max_retries=max_retries,
        retry_policy=specs.RetryPolicy.APPLICATION,
        env=env,
    )
    return specs.AppDef(name=name, roles=[role])


def _pair(engine: list[str], worker: list[str]) -> str:
    # One container runs both (the chart runs them as two containers of one pod): the engine in
    # the background, the worker in front; SIGTERM reaches the worker, which drains, then the
    # engine is stopped and the worker's exit status is the role's.
    return (
        # The trap comes first, so a SIGTERM that arrives while the two start is not lost (it
        # would kill this shell and leave both running); one that came before $worker was
        # known is passed on once it is.
        "stop() { [ -n \"$worker\" ] && kill -TERM $worker 2>/dev/null; }; "
        "trap 'term=1; stop' TERM INT; "
        f"{shlex.join(engine)} & engine=$!; "
        f"{shlex.join(worker)} & worker=$!; "
        "[ -n \"$term\" ] && stop; "
        # A trapped signal interrupts `wait` (status > 128): wait again while the worker runs,
        # then once more for the status bash kept of it (127: none kept, rc is its own). Not
        # `while rc > 128`: a worker that died of a signal (OOM kill: 137) made that loop spin.
        "wait $worker; rc=$?; while [ $rc -gt 128 ] && kill -0 $worker 2>/dev/null; do wait $worker; rc=$?; done; "
        "if [ $rc -gt 128 ]; then wait $worker; r=$?; [ $r -ne 127 ] && rc=$r; fi; "
        "kill $engine 2>/dev/null; wait $engine 2>/dev/null; exit $rc"
    )


def rollout(
    image: str = "moerl-rollout:local",
    replicas: int = 1,
    config: str = CLUSTER_CONFIG,
    engine: str = "builtin",
    model_path: str = "",
    port: int = 30000,
    tp_size: int = 1,
    gpus: int = 0,
    efa: int = 0,
    cpu: int = 2,
    mem_mb: int = 4096,
    max_retries: int = 1000,
    name: str = "moerl-rollout",
    python: str = "",
) -> specs.AppDef:
    """Rollout workers: `replicas` x (engine on loopback + `moerl rollout --config`).

    A replica restarts alone (RetryPolicy.REPLICA): its leased tasks return to the queue when
    their leases expire, so other replicas go on (docs/ARCHITECTURE.md, "Task lease").

    Args:
        engine: "builtin" (`moerl engine`, CPU, local) or "sglang" (the cluster's engine).
        model_path: what the engine loads (SGLang: HF id or directory; built-in: HF directory).
        gpus, efa, cpu, mem_mb: per replica.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    role = specs.Role(
        name=ROLLOUT_ROLE,
        image=image,
        entrypoint="bash",
        args=["-c", _pair(engine_command(engine, model_path, port, tp_size, python),
                          worker_command(config, f"{specs.macros.app_id}-{specs.macros.replica_id}", python=python))],
        num_replicas=replicas,
        resource=trainer_resource(gpus, efa, 0, cpu, mem_mb),
        max_retries=max_retries,
        retry_policy=specs.RetryPolicy.REPLICA,
        env=dict(EFA_ENV) if efa else {},
    )
    return specs.AppDef(name=name, roles=[role])


def feeder(
    image: str = "moerl-rollout:local",
    config: str = CLUSTER_CONFIG,
    run_dir: str = "",
    engine_url: str = "",
    cpu: int = 1,
    mem_mb: int = 4096,
    name: str = "moerl-feed",
    python: str = "",
) -> specs.AppDef:
    """The prompt source (`moerl feed`, app/feed.py): one replica, restarted alone on failure
    (it is restart-safe); it exits 0 once the trainer is done. ``engine_url``: an engine for
    held-out evaluation (``feed.eval_every`` > 0), "" for none. ``run_dir``: issued.jsonl and
    heldout.jsonl; "" is `moerl feed`'s default, ``runs/<run_id>/feed``."""
    args = [*moerl_cmd(python), "feed", "--config", config] + (["--run-dir", run_dir] if run_dir else [])
    if engine_url:
        args += ["--engine-url", engine_url]
    role = specs.Role(
        name="feed", image=image, entrypoint=args[0], args=args[1:], num_replicas=1,
        resource=specs.Resource(cpu=cpu, gpu=0, memMB=mem_mb), max_retries=100,
        retry_policy=specs.RetryPolicy.REPLICA,
    )
    return specs.AppDef(name=name, roles=[role])


def with_exit_line(role: specs.Role) -> specs.Role:
    """``role`` run through bash so that its last line says how it ended: ``moerl: role NAME
    exited with status N`` (`torchx run` shows each role's lines, prefixed by the role, but no
    exit codes). The shell's traps are handlers, not ignores, so its children keep the default
    SIGTERM/SIGINT (TorchX stops an app by signalling its process group: every process gets it)."""
    argv = shlex.join([role.entrypoint, *role.args])
    role.entrypoint, role.args = "bash", [
        "-c", f"trap 'true' TERM INT; {argv}; rc=$?; echo \"moerl: role {role.name} exited with status $rc\"; exit $rc"]
    return role


def job(
    trainer_image: str = "moerl-trainer:local",
    rollout_image: str = "moerl-rollout:local",
    config: str = CLUSTER_CONFIG,
    model_path: str = "",
    nproc_per_node: int = 2,
    rollout_replicas: int = 1,
    python: str = sys.executable,
    run_dir: str = "",
    rdzv_port: int = 29500,
    engine_port: int = 30000,
) -> specs.AppDef:
    """The trainer, the rollout workers and the prompt source in one AppDef, for `torchx run -s
    local_cwd` on one machine (CPU, built-in engine). The buffer is not a role: start
    redis-server first and put its URL in the config's ``buffer.redis_url`` (docs/local-run.md).

    python: the interpreter every role runs (default: the one running torchx, so
    `.venv/bin/torchx` works without the venv on PATH).
    run_dir: the run's directory: the trainer's metrics.jsonl and trained.jsonl, the feeder's
        ``feed/`` (issued.jsonl); "" keeps each command's default (``runs/<run_id>``). A new
        run needs a new one: the trainer and the feeder refuse to append to an earlier run's.
    rdzv_port, engine_port: the trainer's rendezvous port and the engine's (the config's
        ``rollout.engine_url`` must name the same port), for several jobs on one machine.
    Each role's last line is its exit status (`with_exit_line`).

    In the cluster submit `trainer` and `rollout` separately: one AppDef becomes one Volcano gang,
    and rollout pods on Spot must not be tied to the trainer's gang.
    """
    t = trainer(image=trainer_image, nproc_per_node=nproc_per_node, config=config, python=python,
                run_dir=run_dir, rdzv_port=rdzv_port).roles[0]
    r = rollout(image=rollout_image, replicas=rollout_replicas, config=config, model_path=model_path,
                python=python, port=engine_port).roles[0]
    f = feeder(image=rollout_image, config=config, python=python,
               run_dir=f"{run_dir.rstrip('/')}/feed" if run_dir else "").roles[0]
    return specs.AppDef(name="moerl", roles=[with_exit_line(t), with_exit_line(r), with_exit_line(f)])
