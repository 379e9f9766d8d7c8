"""The training loop: batches from the experience buffer, steps, publishing, state, metrics.

One process per rank under torchrun (`moerl train`, app/trainer/train.py). Each step, rank 0
takes ``groups_per_step`` whole GRPO groups' headers from the buffer and assigns them, whole, to
the ranks (every rank is a data-parallel rank; app/layout.py); each rank reads and decodes its
own groups, and rank 0 takes the next step's during the step (app/trainer/intake.py); each rank
runs its micro-batches
(app/trainer/step.py); then the step may publish a policy version (app/trainer/publish.py: every
rank uploads what it owns) and save the training state (app/trainer/state.py: DCP, each tensor
once).

Policy versions (docs/ARCHITECTURE.md, "Policy version and staleness"): version 0 is the initial policy, published before the first
step if the store has none; every ``trainer.publish_every`` steps the next version is published
and announced. With ``weight_sync.mode: network`` each version is first pushed to the
registered engines (app/trainer/weight_sync.py) and only every ``weight_sync.store_every``-th
one (and the last) is published to the store.

Training state and resume: every ``trainer.save_every`` steps (and after the last) the sharded
model and optimizer state of every module, each rank's RNG state, and rank 0's `TrainState`, the
buffer commit point and the keys of the groups trained on go to ``<run>/train/s{step}/`` in the
store; the manifest is written last. Taken groups are committed (deleted from Redis) only after
that save, so a trainer killed between saves re-reads the groups its lost steps had taken.
``--resume`` loads the newest complete state (or, if none was saved yet, starts from the initial
weights), deletes the groups the saved state had already taken, and publishes its weights as the
version after the newest one in the store, so versions keep increasing and engines move to the
resumed weights. Groups whose (task, attempt) the lineage already trained on are skipped
(counted in ``duplicates``): a group republished after a Redis failure cannot be trained twice.

Trained-sample record: rank 0 appends one JSON line per step to ``<run_dir>/trained.jsonl``
(fsync'd): ``{"step", "trainer_version", "time", "groups": [{"task_id", "attempt",
"samples": [[sample_id, policy_version], ...]}], "skipped": [[task_id, attempt, reason], ...]}``;
a resume appends ``{"resume_from_step": S, "version": V, "time"}``: lines of steps after S that
precede it were rolled back (their groups are trained again). app/ledger.py audits this file.

Metrics: one JSON line per step in ``<run_dir>/metrics.jsonl`` (rank 0), whole-batch figures:
  step, policy_version, applied (False: non-finite step skipped), bad_steps, time (unix s);
  objective (`TrainerConfig.objective`: grpo, gspo, dr_grpo, ppo, and the modifiers that are on);
  groups, samples, reward_mean, reward_max, completion_len_mean, staleness_mean, staleness_max;
  push_s, pushed_engines, push_failed_engines, push_left_out (network weight sync only);
  loss, pg_loss, tokens, clip_frac, ratio, ratio_max, approx_kl (k3, old||current),
  mismatch_kl (k3, engine||trainer), tis, tis_max, tis_trunc_frac, is_masked_frac (tokens whose
  importance weight a *_mask rollout_is mode zeroed), dual_clip_frac (dual_clip), entropy, kl_ref (kl_coef>0),
  no_signal_skipped, no_signal_admitted (dynamic_sampling, app/trainer/sampling.py),
  grad_norm (before clipping), lr, micro_batches; PPO: vf_loss, vf_clip_frac, value, return,
  value_error, critic_grad_norm; wait_s (waiting for groups; in the background while the
  previous step ran), read_s (rank 0 reading, decoding and collating its share), step_s,
  publish_s, save_s;
  samples_total, overstale_dropped, malformed_groups, error_groups; buffer (ExperienceBuffer.stats()).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from app.config import RunConfig
from app.trainer import TrainingError
from app.trainer.intake import BatchIntake

log = logging.getLogger("moerl.train")


@dataclass
class TrainState:
    """What the loop carries from step to step (issue 4 will save and restore it)."""

    step: int = 0  # optimizer steps attempted (skipped ones included)
    version: int = 0  # last published policy version
    bad_steps: int = 0  # skipped (non-finite) steps in total
    bad_in_row: int = 0
    samples: int = 0  # samples trained on
    overstale: int = 0  # groups dropped here for exceeding max_staleness (the buffer should)
    malformed: int = 0  # groups skipped because a sample did not collate
    error_groups: int = 0  # all-"error" groups skipped (tasks the engine refused)
    duplicates: int = 0  # groups skipped because this lineage had trained on them already
    resumed_from: int | None = None  # step of the state this process resumed from
    started: float = field(default_factory=time.time)


# --------------------------------------------------------------------------------------------
# Batches from the buffer (rank 0) and their scatter


class Stop(Exception):
    """Raised on every rank when rank 0 says the run must end (a signal)."""


def take_groups(buffer, cfg: RunConfig, version: int, should_stop, keep) -> tuple[list, float]:
    """Rank 0: block until ``groups_per_step`` whole groups' headers (`GroupHeader`) that pass
    ``keep(group)`` are taken.

    Groups that ``keep`` rejects are consumed from the buffer but not trained on (``keep``
    counts them).

    Returns:
        ``(groups, seconds waited)``.

    Raises:
        TimeoutError: fewer groups than needed arrived within ``trainer.batch_timeout_s``.
        Stop: ``should_stop()`` became true while waiting.
    """
    n = cfg.trainer.groups_per_step
    t0 = time.monotonic()
    groups: list = []
    while len(groups) < n:
        if should_stop():
            raise Stop("stop requested while waiting for a batch")
        waited = time.monotonic() - t0
        if waited > cfg.trainer.batch_timeout_s:
            raise TimeoutError(
                f"only {len(groups)}/{n} GRPO groups arrived within trainer.batch_timeout_s="
                f"{cfg.trainer.batch_timeout_s:g}s from {cfg.buffer.redis_url} "
                f"(run {cfg.run_id!r}): are rollout workers running?"
            )
        got = buffer.take_headers(n - len(groups), trainer_version=version, timeout_s=1.0)
        groups.extend(g for g in got if keep(g))
    return groups, time.monotonic() - t0


def scatter_groups(payload: dict | None, rank: int) -> dict:
    """Broadcast rank 0's step payload ``{"parts": [groups per rank], "error": str|None,
    "stop": bool}`` and return it on every rank. Raises `Stop` / `TrainingError` everywhere if
    rank 0 reported one."""
    box = [payload if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    msg = box[0]
    if msg["error"]:
        raise TrainingError(msg["error"])
    if msg["stop"]:
        raise Stop("stop requested")
    return msg


def on_rank0(fn, rank: int):
    """Run ``fn()`` on rank 0 only and return its result there (None elsewhere).

    If it raises, rank 0 re-raises the original exception and every other rank raises a
    `TrainingError` with the same message, so no rank is left waiting for a dead peer.
    """
    box: list = [None]
    result = error = None
    if rank == 0:
        try:
            result = fn()
        except Exception as e:
            error = e
            box[0] = f"{type(e).__name__}: {e}"
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise TrainingError(f"rank 0 failed: {box[0]}")
    return result


def broadcast_from_rank0(value, rank: int):
    """``value`` of rank 0 on every rank (a pickled broadcast; small objects only)."""
    box = [value if rank == 0 else None]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def append_line(f, record: dict) -> None:
    """Append one JSON line to ``f`` and fsync it (the ledger must survive a SIGKILL)."""
    f.write(json.dumps(record, separators=(",", ":")) + "\n")
    f.flush()
    os.fsync(f.fileno())


def open_trained_log(path: Path):
    """Open trained.jsonl for appending; a line cut short by a kill is closed with a newline
    first, so the next record starts on a line of its own."""
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with open(path, "ab") as f:
                f.write(b"\n")
    return open(path, "a")


def run_training(cfg: RunConfig, run_dir: Path, resume: bool = False) -> TrainState:
    """Train for ``trainer.steps`` steps (this rank's part). Returns the final state.

    Args:
        cfg: the run configuration.
        run_dir: where metrics.jsonl and trained.jsonl go (rank 0), and this rank's scratch
            (``trainer-publish/``) for files on their way to the store.
        resume: continue from the newest complete training state in the store (see the module
            docstring); without one, start from the initial weights. Either way the first
            version published is one after the newest in the store.

    Raises:
        ValueError: ``trainer.parallel`` does not fit the world or the model (app/layout.py);
            ``buffer.capacity_groups`` is smaller than ``trainer.groups_per_step``; the store
            already holds policy versions of this run and ``resume`` is False; ``run_dir`` holds
            metrics.jsonl or trained.jsonl while the store has no version of this run (an
            earlier run's records).
        TrainingError: no batch in time, too many non-finite steps in a row, a failed publish
            or save, Redis unreachable — raised on every rank with the same message (rank 0 may
            raise the original exception instead, e.g. BufferConnectionError naming the URL).
    """
    from app.buffer import ExperienceBuffer
    from app.layout import resolve_layout
    from app.model.config import moe_layer_ids, num_routed_experts
    from app.model.parallel import init_ep
    from app.model.source import resolve_model_path
    from app.storage import mark_done, open_store
    from app.storage.policy import latest_policy_version
    from app.trainer.models import build_critic_parts, build_policy_model, build_reference, policy_config
    from app.trainer.parallel import build_mesh
    from app.trainer.publish import publish_version
    from app.trainer.state import drop_committed, latest_state, load_state, newer_entry, save_state
    from app.trainer.step import build_optimizer, train_step
    from app.trainer.parallel import init_distributed

    # The cross-field rules (capacity vs save_every, PPO's loss aggregation) live in RunConfig;
    # validate again in case fields were set in code after loading.
    cfg = cfg.validated()
    t = cfg.trainer
    rank, world, device = init_distributed(timeout_s=t.batch_timeout_s + 600)
    # A Hub id or an s3:// prefix is downloaded to this host's cache first (one process per host).
    path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)) if cfg.model.path else None
    if t.critic_path:
        t.critic_path = str(resolve_model_path(t.critic_path, cfg.model.cache_dir))
    config = policy_config(cfg, path)
    layout = resolve_layout(t.parallel, world, num_routed_experts(config))
    mesh = build_mesh(layout, device.type)
    ep = mesh.ep_context(init_ep(t.parallel, group=mesh.ep.get_group(), hidden_size=config.hidden_size).backend)
    torch.manual_seed(cfg.task.seed)
    store = open_store(cfg.store_url)

    def connect_and_check():
        # Rank 0 alone talks to Redis and checks the store; its error reaches every rank.
        buf = ExperienceBuffer.from_config(cfg, autocommit=False)
        latest = latest_policy_version(store, cfg.run_id)
        earlier = [n for n in ("metrics.jsonl", "trained.jsonl")
                   if (Path(run_dir) / n).is_file() and (Path(run_dir) / n).stat().st_size]
        if latest is None and earlier:
            # A new run (no version in the store) must not append to another run's records; a
            # resumed one finds its own versions (v0 is published before either file is opened).
            raise ValueError(f"--run-dir {run_dir}: holds {' and '.join(earlier)} of an earlier run, and "
                             f"{cfg.store_url} has no policy of run {cfg.run_id!r}: give a new run a new run "
                             "directory")
        if latest is not None and not resume:
            raise ValueError(
                f"{cfg.store_url}: run {cfg.run_id!r} already has policy v{latest}; use a new "
                "run_id, or --resume to continue it"
            )
        manifest = latest_state(store, cfg.run_id) if resume else None
        if manifest is not None:
            if manifest["world_size"] != world:  # DCP reshards (app/trainer/state.py load_state)
                log.info("resuming step %d, saved by %d ranks, on %d", manifest["step"], manifest["world_size"], world)
            # Finish a commit that a kill interrupted: the saved state has taken these groups.
            drop_committed(buf, manifest.get("commit_point"))
        return buf, latest, manifest

    # Groups leave Redis (commit) only after a saved state includes the steps that trained on
    # them, so a trainer killed at any point loses nothing.
    checked = on_rank0(connect_and_check, rank)
    buffer = checked[0] if rank == 0 else None
    latest, manifest = broadcast_from_rank0(checked[1:] if rank == 0 else None, rank)

    model = build_policy_model(cfg, path, ep, mesh, device)
    ref_model = build_reference(cfg, path, ep, mesh, device) if t.kl_coef > 0 else None
    optimizer = build_optimizer(model.parameters(), t.lr, t.adam_betas, t.weight_decay, device)
    critic = build_critic_parts(cfg, path, ep, mesh, device) if t.algorithm == "ppo" else None
    modules = {"policy": (model, optimizer)}
    if critic is not None:
        modules["critic"] = (critic.module, critic.optimizer)
    pad_id = getattr(config, "pad_token_id", None) or 0
    dtype = getattr(torch, cfg.model.dtype)
    # Routing replay (rollout.routing_replay): samples carry the engine's experts of the MoE layers.
    moe_layers = moe_layer_ids(config) if cfg.rollout.routing_replay else None
    intake = BatchIntake(cfg, buffer, rank, world, pad_id, moe_layers, num_routed_experts(config))

    state = TrainState()
    trained: set[str] = set()  # rank 0: "task_id/attempt" of every group this lineage trained on
    commit_point: str | None = None  # rank 0: newest samples-stream entry taken
    if manifest is not None:
        trained = set(load_state(store, cfg.run_id, manifest, modules))
        state = TrainState(**manifest["train_state"])
        state.resumed_from = manifest["step"]
        commit_point = manifest.get("commit_point")
        if rank == 0:
            log.info("resumed from the training state of step %d (policy v%d)", state.step, state.version)
    elif resume and rank == 0:
        log.info("--resume: no complete training state in the store; starting from step 0")
    if rank != 0:
        trained = set()  # only rank 0 checks groups against the lineage

    stop_requested = False

    def on_signal(signum, frame):
        nonlocal stop_requested
        stop_requested = True

    # SIGTERM / Ctrl-C: finish the current step, then stop on every rank (rank 0 decides).
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    work_dir = run_dir / "trainer-publish"
    metrics_path = run_dir / "metrics.jsonl"

    def publish(version: int) -> tuple[str, float]:
        return publish_version(
            model, mesh, version, store=store, run_id=cfg.run_id, work_dir=work_dir,
            keep=t.keep_versions, dtype=dtype, buffer=buffer, tokenizer_source=path,
        )

    # weight_sync.mode network: every version is also pushed to the engines over the network,
    # and only every store_every-th (and the last) goes to the store (app/trainer/weight_sync.py).
    pusher = None
    if cfg.weight_sync.mode == "network":
        from app.buffer.weight_sync import SyncBoard
        from app.trainer.weight_sync import WeightPusher

        pusher = WeightPusher(cfg.weight_sync, rank, device, board=SyncBoard.of(buffer) if rank == 0 else None)

    def push(version: int) -> dict:
        if pusher is None:
            return {}
        r = pusher.push(model, mesh, version, dtype)
        return {"push_s": r.seconds, "pushed_engines": len(r.pushed), "push_failed_engines": len(r.failed),
                "push_left_out": len(r.left_out)}

    def save() -> float:
        meta = {"train_state": asdict(state), "policy_version": state.version, "commit_point": commit_point}
        try:
            return save_state(store, cfg.run_id, state.step, modules, meta,
                              lineage=sorted(trained) if rank == 0 else None, work_dir=work_dir, keep=t.keep_states)
        except RuntimeError as e:
            raise TrainingError(str(e)) from None

    # The first version is the starting policy: v0 for a new run; for a resumed run the
    # version after the newest in the store (a store with versions was refused above unless
    # resuming: mixing two runs' versions would break the version contract).
    first = 0 if latest is None else latest + 1
    uri, secs = publish(first)
    state.version = first
    if rank == 0:
        log.info("published %s policy v%d -> %s (%.1fs)", "resumed" if resume else "initial", first, uri, secs)

    metrics_file = open(metrics_path, "a") if rank == 0 else None
    trained_file = open_trained_log(run_dir / "trained.jsonl") if rank == 0 else None
    if trained_file is not None and resume:
        append_line(trained_file, {"resume_from_step": state.resumed_from or 0, "version": first,
                                   "time": time.time()})
    try:
        while state.step < t.steps:
            taken = intake.next(state, trained, lambda: stop_requested)
            groups, skipped, wait_s, msg, batch = taken.groups, taken.skipped, taken.wait_s, {"meta": taken.meta}, taken.train
            commit_point = newer_entry(commit_point, taken.commit_point)
            t0 = time.perf_counter()
            lr = step_lr(t, state.step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if critic is not None:
                for group in critic.optimizer.param_groups:
                    group["lr"] = lr * critic.base_lr / t.lr  # same warm-up, its own peak
            applied, stats = train_step(cfg, model, optimizer, batch, pad_id=pad_id, device=device,
                                        ref_model=ref_model, critic=critic)
            trainer_version = state.version
            state.step += 1
            step_s = time.perf_counter() - t0
            if applied:
                state.bad_in_row = 0
                state.samples += int(msg["meta"].get("samples", 0))
            else:
                state.bad_steps += 1
                state.bad_in_row += 1
                log.warning("step %d: non-finite loss or gradient; step skipped (%d in a row)",
                            state.step, state.bad_in_row)
            if rank == 0:
                if applied:
                    trained.update(f"{g.task_id}/{g.attempt}" for g in groups)
                else:
                    skipped += [[g.task_id, g.attempt, "nonfinite"] for g in groups]
                append_line(trained_file, {
                    "step": state.step, "trainer_version": trainer_version, "time": time.time(),
                    "groups": [{"task_id": g.task_id, "attempt": g.attempt,
                                "samples": [[s.sample_id, s.policy_version] for s in g.samples]}
                               for g in (groups if applied else [])],
                    "skipped": skipped,
                })
            give_up = state.bad_in_row >= t.max_bad_steps
            publish_s = save_s = 0.0
            push_meta: dict = {}
            if not give_up and (state.step % t.publish_every == 0 or state.step == t.steps):
                push_meta = push(state.version + 1)
                if pusher is None or (state.version + 1) % cfg.weight_sync.store_every == 0 or state.step == t.steps:
                    uri, publish_s = publish(state.version + 1)
                state.version += 1
            if not give_up and (state.step % t.save_every == 0 or state.step == t.steps):
                save_s = save()
                if rank == 0:
                    buffer.commit(upto=commit_point)  # a skipped (non-finite) step consumes its groups too
            if rank == 0:
                record = {
                    "time": time.time(), "step": state.step, "policy_version": state.version,
                    "objective": t.objective(), "applied": applied, "bad_steps": state.bad_steps, **msg["meta"],
                    **{k: v for k, v in stats.items()}, "lr": lr,
                    "wait_s": wait_s, "step_s": step_s, "publish_s": publish_s, "save_s": save_s, **push_meta,
                    "samples_total": state.samples, "overstale_dropped": state.overstale,
                    "malformed_groups": state.malformed, "error_groups": state.error_groups,
                    "duplicate_groups": state.duplicates, "buffer": buffer.stats(),
                }
                metrics_file.write(json.dumps(record, allow_nan=True) + "\n")
                metrics_file.flush()
                log.info(
                    "step %d v%d loss %.4f reward %.3f grad_norm %.3f clip %.3f tis %.3f "
                    "wait %.1fs step %.2fs",
                    state.step, state.version, stats["loss"], msg["meta"].get("reward_mean", float("nan")),
                    stats["grad_norm"], stats["clip_frac"], stats.get("tis", 1.0), wait_s, step_s,
                )
            if give_up:
                raise TrainingError(
                    f"{state.bad_in_row} steps in a row had a non-finite loss or gradient "
                    f"(trainer.max_bad_steps={t.max_bad_steps}); stopping at step {state.step}, "
                    f"policy v{state.version}. Lower trainer.lr or check the rollout logprobs."
                )
    except Stop:
        log.info("stop requested: ending at step %d, policy v%d", state.step, state.version)
    finally:
        intake.close()
        if pusher is not None:
            pusher.close()
        for f in (metrics_file, trained_file):
            if f is not None:
                f.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rank == 0 and state.step >= t.steps:
        mark_done(store, cfg.run_id, state.step, state.version)  # the feeder (app/feed.py) stops on it
    return state


def step_lr(t, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over
    ``trainer.lr_warmup_steps`` steps to ``trainer.lr``, then constant. A function of the step
    alone, so a resumed run continues the same schedule."""
    if t.lr_warmup_steps <= 0:
        return t.lr
    return t.lr * min(1.0, (step + 1) / t.lr_warmup_steps)


def usable(group, state: TrainState, max_staleness: int, pad_id: int, *,
           trained: set[str] | None = None, skipped: list | None = None, moe_layers: list[int] | None = None) -> bool:
    """Rank 0's check of one group before it is scattered: not trained on before by this
    lineage (``trained`` holds "task_id/attempt" keys), within ``max_staleness`` (the buffer
    enforces it already; this guards the contract), not an all-"error" group, and well-formed
    (its ``check``). A rejected group is counted in ``state``, appended to ``skipped`` as
    ``[task_id, attempt, reason]``, never trained on, and does not take a place in the step's
    ``groups_per_step``. ``group`` is a `GroupHeader` (what rank 0 takes; its payload is checked
    by the rank that decodes it) or a whole `Group`."""
    reason = None
    if trained is not None and f"{group.task_id}/{group.attempt}" in trained:
        state.duplicates += 1
        reason = "duplicate"
    elif state.version - group.policy_version > max_staleness:
        state.overstale += 1
        reason = "overstale"
    elif all(s.finish_reason == "error" for s in group.samples):
        # A task the engine refused (rollout worker): no completion tokens to learn from.
        state.error_groups += 1
        reason = "error"
    else:
        try:
            group.check(moe_layers)
        except ValueError as e:
            state.malformed += 1
            log.warning("skipping malformed group %s/%s: %s", group.task_id, group.attempt, e)
            reason = "malformed"
    if reason is not None and skipped is not None:
        skipped.append([group.task_id, group.attempt, reason])
    return reason is None


def batch_meta(groups: list, version: int) -> dict:
    """Rank 0's summary of a step's groups: rewards and staleness (whole batch)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [float(s.reward) for s in samples]
    stale = [version - int(s.policy_version) for s in samples]
    lengths = [s.completion_len for s in samples]
    n = max(len(samples), 1)
    return {
        "groups": len(groups),
        "samples": len(samples),
        "reward_mean": sum(rewards) / n if samples else float("nan"),
        "reward_max": max(rewards, default=float("nan")),
        "completion_len_mean": sum(lengths) / n,
        "staleness_mean": sum(stale) / n,
        "staleness_max": max(stale, default=0),
    }


