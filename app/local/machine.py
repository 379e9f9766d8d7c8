"""What `moerl run` starts where on this machine: the layout of its roles over the cores and GPUs.

`plan_local` turns a run config and a `Machine` (its cores and GPUs, `detect_machine`) into a
`LocalLayout`: how many trainer ranks on which GPUs, how many engines (each with its rollout
worker) on which devices, how many CPU threads each role gets, and how policy versions reach the
engines. A layout that cannot work raises one ValueError naming the field, before anything starts.

The GPUs (``local.trainer_gpus``, one field; app/config.py ``LocalConfig``):

* no GPU: the CPU layout (the cluster's roles as processes: the trainer gang over gloo with
  ``trainer.parallel``'s ranks, built-in engines on the CPU);
* one GPU: ONE trainer rank on it (NCCL refuses two ranks on one GPU) and the engines on the same
  GPU beside it; policy versions are pushed to the engines over a weight-update group on the
  GPU (``cuda:gloo``: NCCL refuses a group whose members share a device), and stored every
  `STORE_EVERY` versions, as in the cluster;
* several GPUs: one trainer rank per trainer GPU (NCCL), the engines on the others (half of the
  GPUs each by default), versions pushed over NCCL; with ``local.trainer_gpus`` equal to the GPU
  count the engines share the trainer's GPUs (pushed over cuda:gloo).

``MOERL_SHARED_GPU=1`` (app/trainer/parallel.py) keeps the several-ranks-on-one-GPU layout for
tests and debugging: ``trainer.parallel``'s ranks spread over the trainer's GPUs, cuda:gloo.

Sizing (the presets of `moerl run`, `preset=True`; a config of the user's keeps its own recipe
and weight_sync section, and only its processes and threads are sized):

* CPU: half the cores to the trainer's ranks (``OMP_NUM_THREADS``), the other half to
  2..8 engines (one per 4 cores); the step's batch grows with the engines (2 engines: the
  preset's batch), so the per-step fixed costs (publish, save, collectives) are paid per more
  samples;
* GPU: engines per engine GPU from the cores left (two per engine and its worker) and the model's
  size (`ENGINE_PARAMS_PER_GPU`), at most `MAX_ENGINES_PER_GPU`, each decoding at least
  `GPU_RUNNING_REQUESTS` sequences together; the step's batch at least `GPU_GROUPS_PER_RANK` groups
  per trainer rank, two steps' groups in flight over the workers, bf16 compute (fp32 master weights).
* ``--workers`` (engines, each with its rollout worker) is refused above one per core on the CPU
  (`max_cpu_engines`) and `MAX_ENGINES_PER_GPU` per engine GPU.

Nothing here imports torch but `detect_machine`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass

from app.config import RunConfig
from app.layout import default_world, resolve_layout
from app.model.source import resolve_model_path
from app.rollout.engine_args import EngineLayout, sglang_command

# Engines per GPU at most: each is one process with its own CUDA context and model copy.
MAX_ENGINES_PER_GPU = 4
# Model parameters the engine copies on one GPU may hold together: every version is pushed once per
# engine, and copies of a large model split the GPU's decode between processes (the GPU-sized
# preset's 424 M: two engines per GPU; the tiny ones: `MAX_ENGINES_PER_GPU`).
ENGINE_PARAMS_PER_GPU = 1_000_000_000
# Sequences one engine on a GPU decodes together (its --max-running-requests).
GPU_RUNNING_REQUESTS = 256
# GRPO groups per trainer rank and step on a GPU, at least: fewer leave a GPU step to launch overhead.
GPU_GROUPS_PER_RANK = 32
# With engines on GPUs, every version is pushed and every STORE_EVERY-th (and the last) is stored.
STORE_EVERY = 10
# Where the trainer's source rank serves the weight-update groups on one machine.
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Machine:
    """The resources of this machine that `moerl run` lays its roles over."""

    cores: int
    gpus: int


def detect_machine() -> Machine:
    """The cores this process may use and the GPUs torch sees (``CUDA_VISIBLE_DEVICES`` applies)."""
    import torch  # only here: the layout rules below need no torch

    return Machine(cores=len(os.sched_getaffinity(0)), gpus=torch.cuda.device_count())


@dataclass(frozen=True)
class LocalLayout:
    """Where each role of one `moerl run` runs.

    Attributes:
        machine: the machine it was planned for.
        trainer_ranks: torchrun's ``--nproc-per-node``.
        trainer_gpus: the GPU indices the trainer's ranks use (empty: the CPU).
        shared_gpu: several trainer ranks per GPU over cuda:gloo (``MOERL_SHARED_GPU=1``).
        engine_devices: one per engine (and rollout worker): ``cpu`` or ``cuda:K``.
        engine: ``builtin`` (`moerl engine`) or ``sglang`` (SGLang servers, where installed).
        trainer_threads, engine_threads: CPU threads of each trainer rank and each engine.
    """

    machine: Machine
    trainer_ranks: int
    trainer_gpus: tuple[int, ...]
    shared_gpu: bool
    engine_devices: tuple[str, ...]
    engine: str
    trainer_threads: int
    engine_threads: int

    @property
    def workers(self) -> int:
        return len(self.engine_devices)

    @property
    def colocated(self) -> bool:
        """Engines on a GPU the trainer uses."""
        return any(d == f"cuda:{g}" for d in self.engine_devices for g in self.trainer_gpus)

    def trainer_env(self) -> dict[str, str]:
        """Environment of the trainer gang: its threads, and its GPUs when it does not take them
        all (ranks pick their GPU by LOCAL_RANK among the visible ones)."""
        env = {"OMP_NUM_THREADS": str(self.trainer_threads), "MKL_NUM_THREADS": str(self.trainer_threads)}
        if not self.trainer_gpus:  # the CPU layout: a GPU torch would pick up is not the trainer's
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif len(self.trainer_gpus) < self.machine.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_ids(self.trainer_gpus))
        return env

    def engines_on(self, device: str) -> int:
        return sum(d == device for d in self.engine_devices)

    def describe(self, cfg: RunConfig) -> str:
        """One line: what runs where, and how versions reach the engines."""
        m = self.machine
        where = (f"GPU {','.join(map(str, self.trainer_gpus))}" if self.trainer_gpus else "the CPU")
        backend = "NCCL" if self.trainer_gpus and not self.shared_gpu else (
            "cuda:gloo" if self.trainer_gpus else "gloo")
        devices = sorted(set(self.engine_devices))
        engines = f"{self.workers} {'SGLang' if self.engine == 'sglang' else 'built-in'} engine" + (
            "s" if self.workers > 1 else "") + " on " + ", ".join(
            d.replace("cuda:", "GPU ") if d != "cpu" else "the CPU" for d in devices)
        ws = cfg.weight_sync
        sync = (f"versions pushed over {ws.backend}, stored every {ws.store_every}" if ws.mode == "network"
                else "versions loaded from the store")
        return (f"{m.gpus} GPU{'s' if m.gpus != 1 else ''}, {m.cores} cores: trainer {self.trainer_ranks} "
                f"rank{'s' if self.trainer_ranks > 1 else ''} on {where} ({backend}, {self.trainer_threads} "
                f"thread{'s' if self.trainer_threads > 1 else ''} each), {engines}, {self.workers} rollout worker{'s' if self.workers > 1 else ''}; {sync}")


# Share of a GPU's memory SGLang's servers take together (--mem-fraction-static, split between
# the servers on one GPU): less where the trainer computes on the same GPU.
SGLANG_MEMORY_SHARE = {"beside the trainer": 0.4, "alone": 0.85}


def sglang_argv(cfg: RunConfig, layout: LocalLayout, i: int, model_path: str, port: int,
                version: int = 0) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of SGLang server ``i`` of the layout: the command charts8s renders for the
    run's engine profile (app/rollout/engine_args.py `sglang_command`) on one GPU, run by this
    interpreter, with ``CUDA_VISIBLE_DEVICES`` its GPU and, unless the profile sets one, a
    ``--mem-fraction-static`` that leaves room for the other servers (and the trainer) there.

    Raises:
        ValueError: the profile does not fit one GPU (`EngineLayout.check`).
    """
    device = layout.engine_devices[i]
    gpu = int(device.split(":")[1])
    profile = cfg.rollout.engine
    if profile.mem_fraction_static is None:
        share = SGLANG_MEMORY_SHARE["beside the trainer" if gpu in layout.trainer_gpus else "alone"]
        profile = profile.model_copy(update={"mem_fraction_static": round(share / layout.engines_on(device), 3)})
    cmd = sglang_command(EngineLayout(profile, gpus_per_node=1), model_path, port=port, weight_version=str(version),
                         routing_replay=cfg.rollout.routing_replay)
    return [sys.executable, *cmd[1:]], {"CUDA_VISIBLE_DEVICES": visible_ids((gpu,))[0]}


def visible_ids(gpus: tuple[int, ...]) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries of GPU indices as this process sees them (through its
    own ``CUDA_VISIBLE_DEVICES``, if set)."""
    own = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    return [own[g] if g < len(own) else str(g) for g in gpus]


def default_trainer_gpus(gpus: int) -> int:
    """``local.trainer_gpus`` when unset: the one GPU (shared with the engines), else half."""
    return 1 if gpus == 1 else gpus // 2


def cpu_engines(cores: int) -> int:
    """Engines of the CPU layout: one per 4 cores, 2 to 8."""
    return min(8, max(2, cores // 4))


def max_cpu_engines(cores: int) -> int:
    """Most engines (``--workers``) of the CPU layout: one per core, and the default's 2 on fewer."""
    return max(cores, cpu_engines(cores))


def gpu_engines_per_gpu(cores: int, trainer_ranks: int, engine_gpus: int, params: int) -> int:
    """Engines on each engine GPU: two cores per engine and its worker, out of what the trainer's
    ranks and the rest (redis-server, the supervisor) leave, and `ENGINE_PARAMS_PER_GPU` over the
    model's ``params``; 1 to `MAX_ENGINES_PER_GPU`."""
    spare = max(0, cores - trainer_ranks - 2)
    return max(1, min(MAX_ENGINES_PER_GPU, spare // 2 // engine_gpus, ENGINE_PARAMS_PER_GPU // max(params, 1)))


def expert_parallel(world: int, num_experts: int) -> int:
    """EP degree of a preset on ``world`` GPUs: every rank an EP rank when the experts split
    evenly, else the largest divisor of both."""
    return math.gcd(world, num_experts)


def plan_local(cfg: RunConfig, machine: Machine, num_experts: int, *, preset: bool, workers: int | None = None,
               shared: bool = False, sglang: bool | None = None, params: int = 0) -> tuple[RunConfig, LocalLayout]:
    """Lay the roles of ``cfg`` over ``machine``.

    Args:
        cfg: the run config (not changed; the returned copy carries what the layout sets).
        machine: cores and GPUs (`detect_machine`).
        num_experts: routed experts per MoE layer of the policy.
        preset: ``cfg`` is one of `moerl run`'s presets: its batch, engine batch, compute dtype,
            expert parallelism and weight sync follow the machine (see the module doc).
        workers: rollout workers (one engine each) as given by ``--workers``; None: sized.
        shared: ``MOERL_SHARED_GPU=1``.
        sglang: start SGLang servers (None: where the ``sglang`` package is installed and there
            is a GPU).
        params: the policy's parameters (0: unknown; engines per GPU from the cores alone).

    Returns:
        ``(config, layout)``.

    Raises:
        ValueError: one line naming the field (``local.trainer_gpus``, ``trainer.parallel``,
            ``--workers``) that this machine cannot run.
    """
    cfg = cfg.model_copy(deep=True)
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    split = cfg.local.trainer_gpus
    if machine.gpus == 0:
        if split is not None:
            raise ValueError(f"local.trainer_gpus={split}: this machine has no GPU that torch sees; leave it unset "
                             "to train on the CPU")
        return cfg, _cpu_layout(cfg, machine, num_experts, preset, workers)
    split = default_trainer_gpus(machine.gpus) if split is None else split
    if split > machine.gpus:
        raise ValueError(f"local.trainer_gpus={split}: this machine has {machine.gpus} GPU"
                         f"{'s' if machine.gpus > 1 else ''}")
    trainer_gpus = tuple(range(split))
    engine_gpus = trainer_gpus if split == machine.gpus else tuple(range(split, machine.gpus))
    par = cfg.trainer.parallel
    if shared:
        world = default_world(par)
    else:
        world = split
        if preset:
            par.ep, par.dp_shard, par.dp_replicate = expert_parallel(world, num_experts), -1, 1
    _check_world(par, world, num_experts, split, machine, shared)
    if sglang is None:
        sglang = importlib.util.find_spec("sglang") is not None
    per_gpu = gpu_engines_per_gpu(machine.cores, world, len(engine_gpus), params)
    most = MAX_ENGINES_PER_GPU * len(engine_gpus)
    if workers is not None and workers > most:
        raise ValueError(f"--workers {workers}: at most {most} here ({MAX_ENGINES_PER_GPU} engines per engine GPU, "
                         f"each a process with its own CUDA context and model copy; {len(engine_gpus)} engine "
                         f"GPU{'s' if len(engine_gpus) > 1 else ''})")
    count = workers or per_gpu * len(engine_gpus)
    devices = tuple(f"cuda:{engine_gpus[i % len(engine_gpus)]}" for i in range(count))
    layout = LocalLayout(machine=machine, trainer_ranks=world, trainer_gpus=trainer_gpus, shared_gpu=shared,
                         engine_devices=devices, engine="sglang" if sglang else "builtin",
                         trainer_threads=max(1, min(4, machine.cores // (4 * world))), engine_threads=1)
    if preset:
        cfg.model.dtype = "bfloat16"  # compute; master weights and optimizer state stay fp32
        _scale_batch(cfg, max(cfg.trainer.groups_per_step, GPU_GROUPS_PER_RANK * world))
        # Two steps' groups in flight over the workers: enough to keep the trainer fed, not so many
        # that finished groups wait for versions to pass them (max_staleness).
        r = cfg.rollout
        r.inflight_sequences = max(1, 2 * cfg.trainer.groups_per_step // layout.workers) * r.group_size
        r.engine.max_running_requests = max(r.engine.max_running_requests or 0, GPU_RUNNING_REQUESTS,
                                            r.inflight_sequences)
        # SGLang's update from a distributed group is NCCL's, and NCCL refuses engines that share
        # the trainer's GPU: those SGLang servers load each version from the store.
        cfg.weight_sync.mode = "store" if sglang and layout.colocated else "network"
        cfg.weight_sync.store_every = STORE_EVERY
    ws = cfg.weight_sync
    if ws.mode == "network":
        if ws.backend == "auto":
            ws.backend = "cuda:gloo" if layout.colocated or shared else "nccl"
        if ws.backend == "nccl" and layout.colocated:
            raise ValueError("weight_sync.backend=nccl: the engines share the trainer's GPU and NCCL refuses a group "
                             "whose members share a device; use auto (cuda:gloo there) or give the engines GPUs "
                             "of their own (local.trainer_gpus)")
        ws.master_address = ws.master_address or LOOPBACK
    if layout.engine == "sglang":
        sglang_argv(cfg, layout, 0, "<model>", 0)  # a profile that cannot run on one GPU fails now
    return cfg.validated(), layout


def _cpu_layout(cfg: RunConfig, machine: Machine, num_experts: int, preset: bool, workers: int | None) -> LocalLayout:
    """The CPU layout (module doc); scales a preset's batch with the engines."""
    world = default_world(cfg.trainer.parallel)
    resolve_layout(cfg.trainer.parallel, world, num_experts)
    most = max_cpu_engines(machine.cores)
    if workers is not None and workers > most:
        raise ValueError(f"--workers {workers}: at most {most} on {machine.cores} cores (one engine per core, each "
                         "a process with its own model copy beside its rollout worker; more only time-share the "
                         "cores the trainer needs)")
    engines = workers or cpu_engines(machine.cores)
    trainer_threads = max(1, machine.cores // 2 // world)
    engine_threads = max(1, (machine.cores - world * trainer_threads) // engines)
    if preset:
        _scale_batch(cfg, cfg.trainer.groups_per_step * max(1, engines // 2))
    return LocalLayout(machine=machine, trainer_ranks=world, trainer_gpus=(), shared_gpu=False,
                       engine_devices=("cpu",) * engines, engine="builtin", trainer_threads=trainer_threads,
                       engine_threads=engine_threads)


def _scale_batch(cfg: RunConfig, groups: int) -> None:
    """Set the step's groups to ``groups`` and the back-pressure bound in proportion."""
    t = cfg.trainer
    if groups != t.groups_per_step:
        cfg.buffer.capacity_groups = math.ceil(cfg.buffer.capacity_groups * groups / t.groups_per_step)
        t.groups_per_step = groups


def _check_world(par, world: int, num_experts: int, split: int, machine: Machine, shared: bool) -> None:
    """`resolve_layout` on the trainer's world, its error told in the machine's terms."""
    try:
        resolve_layout(par, world, num_experts)
    except ValueError as e:
        if shared:
            raise ValueError(f"{e} (MOERL_SHARED_GPU=1 starts {world} trainer ranks)") from None
        raise ValueError(
            f"{e}: the trainer has {world} GPU{'s' if world > 1 else ''} here (local.trainer_gpus={split} of "
            f"{machine.gpus}), one rank on each since NCCL refuses two ranks on one GPU; set trainer.parallel to fit, "
            f"local.trainer_gpus, or MOERL_SHARED_GPU=1 to share GPUs over cuda:gloo (tests and debugging only)"
        ) from None


def plan_run(cfg: RunConfig, *, preset: bool, workers: int | None = None,
             machine: Machine | None = None) -> tuple[RunConfig, LocalLayout]:
    """`plan_local` on this machine (`detect_machine`, ``MOERL_SHARED_GPU``) for ``cfg``'s policy.

    Raises:
        ValueError, FileNotFoundError: see `plan_local`; the policy's config unreadable.
    """
    # torch and transformers: only here (module doc); `moerl run` plans before any role starts
    from app.model.config import num_routed_experts
    from app.plan.params import count_params
    from app.trainer.models import policy_config
    from app.trainer.parallel import shared_gpu

    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)) if cfg.model.path else None
    config = policy_config(cfg, path)
    machine = machine or detect_machine()
    return plan_local(cfg, machine, num_routed_experts(config), preset=preset, workers=workers,
                      shared=machine.gpus > 0 and shared_gpu(), params=count_params(config).total)
