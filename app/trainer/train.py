"""The GRPO / PPO training loop: `moerl train --config run.yaml`, one process per rank under torchrun.

Parallelism (embedded default: ``torchrun --nproc-per-node 2``, ``ep.size = 2``, gloo): the EP
ranks are also the data-parallel ranks. Each step, rank 0 takes ``groups_per_step`` whole GRPO
groups from the experience buffer and scatters them, whole, over the ranks. Every rank divides
its loss by the GLOBAL completion-token count (token-mean; the global sequence count for
seq-mean), so the sum over ranks of their losses is the full-batch loss. Hence:
  * replicated (non-expert) parameters: each rank's gradient is its share of the full-batch
    gradient, and an all-reduce with SUM gives the full-batch gradient;
  * expert parameters: each lives on one EP rank and already receives the gradient of every
    rank's tokens through dispatch/combine autograd, so they are NOT all-reduced.
Every rank runs exactly one forward and one backward per step (an empty rank runs a dummy
row), because the EP all-to-alls are collectives.

Old-policy logprobs: one optimizer step per batch, so "old" is the current policy detached
(ratio 1 at the step); truncated importance sampling weighs each token by
``min(exp(old - rollout), tis_cap)`` against the engine's logprobs (app/trainer/grpo.py).

Policy versions (DESIGN.md §3): version 0 is the initial policy, published before the first
step if the store has none; every ``trainer.publish_every`` steps the next version is
published and announced.

Training state and resume (issue 4; app/trainer/state.py): every ``trainer.save_every`` steps
(and after the last) every rank saves its model shard, optimizer and RNG state, and rank 0 the
`TrainState`, the buffer commit point and the keys of the groups trained on, to
``<run>/train/s{step}/`` in the store; the manifest is written last. Taken groups are committed
(deleted from Redis) only after that save, so a trainer killed between saves re-reads the
groups its lost steps had taken. ``--resume`` loads the newest complete state (or, if none was
saved yet, starts from the initial weights), deletes the groups the saved state had already
taken, and publishes its weights as the version after the newest one in the store, so versions
keep increasing and engines move to the resumed weights. Groups whose (task, attempt) the
lineage already trained on are skipped (counted in ``duplicates``): a group republished after a
Redis failure cannot be trained twice.

Trained-sample record: rank 0 appends one JSON line per step to ``<run_dir>/trained.jsonl``
(fsync'd): ``{"step", "trainer_version", "time", "groups": [{"task_id", "attempt",
"samples": [[sample_id, policy_version], ...]}], "skipped": [[task_id, attempt, reason], ...]}``;
a resume appends ``{"resume_from_step": S, "version": V, "time"}``: lines of steps after S that
precede it were rolled back (their groups are trained again). app/ledger.py audits this file.

PPO (``trainer.algorithm: ppo``, issue 9): a critic (app/trainer/critic.py: a value head on a
copy of the policy trunk, or ``trainer.critic_path``) lives in the same trainer job, EP-sharded
like the policy; `train_step` turns its values into per-token GAE advantages (app/trainer/ppo.py)
for the same clipped loss, staleness bound and TIS, and trains it with the clipped value loss in
the same step. Its weights and optimizer state are saved in each rank's training state
(``extra["critic"]``) and restored by ``--resume``. Both optimizers follow `step_lr` (the
critic to ``trainer.critic_lr``).

Metrics: one JSON line per step in ``<run_dir>/metrics.jsonl`` (rank 0), whole-batch figures:
  step, policy_version, applied (False: non-finite step skipped), bad_steps, time (unix s);
  groups, samples, reward_mean, reward_max, completion_len_mean, staleness_mean, staleness_max;
  loss, pg_loss, tokens, clip_frac, ratio, ratio_max, approx_kl (k3, old||current),
  mismatch_kl (k3, engine||trainer), tis, tis_max, tis_trunc_frac, entropy, kl_ref (kl_coef>0),
  grad_norm (before clipping), lr; PPO: vf_loss, vf_clip_frac, value, return, value_error,
  critic_grad_norm; wait_s (waiting for groups), step_s, publish_s;
  samples_total, overstale_dropped, malformed_groups, error_groups; buffer (ExperienceBuffer.stats()).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import typer
from torch import nn

from app.config import RunConfig
from app.trainer import TrainingError
from app.trainer.batch import TrainBatch, collate_groups, split_groups
from app.trainer.grpo import finish_stats, grpo_loss, token_entropy, token_logprobs

log = logging.getLogger("moerl.train")

cli = typer.Typer(add_completion=False, help="Run a GRPO trainer rank (start with torchrun).")


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
# Process group and model


def init_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Join (or, outside torchrun, create a one-rank) process group: nccl on GPU, gloo on CPU.

    Returns:
        ``(rank, world_size, device)``.
    """
    if "RANK" not in os.environ:  # plain `python -m app.cli train`: a group of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s)
        )
    return dist.get_rank(), dist.get_world_size(), device


def build_model(cfg: RunConfig, ep, device: torch.device) -> nn.Module:
    """The policy from ``model.path`` (an HF checkpoint) or, without one, the preset's random init.

    Replicated parameters are then broadcast from rank 0 so that every rank starts identical.
    """
    model = policy_from_config(cfg, ep, device)
    broadcast_replicated(model, ep)
    return model


def policy_from_config(cfg: RunConfig, ep, device: torch.device | str) -> nn.Module:
    """This rank's policy of ``cfg.model`` (dtype ``model.dtype``): ``model.path`` loaded, else
    the preset's random init seeded with ``task.seed``.

    Raises:
        ValueError: the preset's MoE layout does not fit ``ep.size`` (`validate_config`).
    """
    from app.model.checkpoint import load_policy
    from app.model.config import tiny_config, validate_config
    from app.model.policy import build_policy

    dtype = getattr(torch, cfg.model.dtype)
    if cfg.model.path:
        return load_policy(cfg.model.path, cfg.router, ep, device=device, dtype=dtype)
    config = tiny_config(cfg.model.preset)
    validate_config(config, ep.size)
    # build_policy's init is EP-invariant: the same seed gives the same global model.
    return build_policy(config, cfg.router, ep, device=device, dtype=dtype, seed=cfg.task.seed)


def broadcast_replicated(model: nn.Module, ep) -> None:
    """Copy rank 0's replicated parameters (all but the EP-sharded experts) to every rank, so
    that all start identical; nothing to do without a process group of several ranks."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        expert = expert_param_ids(model) if ep.size > 1 else set()
        for p in model.parameters():
            if id(p) not in expert:
                dist.broadcast(p.data, src=0)


def expert_param_ids(model: nn.Module) -> set[int]:
    """ids of the routed-expert parameters (sharded over EP ranks; never all-reduced)."""
    from app.model.moe import MoEBlock

    ids: set[int] = set()
    for m in model.modules():
        if isinstance(m, MoEBlock):
            ids.update(id(p) for p in m.experts.parameters())
    return ids


# --------------------------------------------------------------------------------------------
# One step


def reduce_replicated_grads(params: list[nn.Parameter]) -> None:
    """All-reduce (SUM) the gradients of replicated parameters, one flat buffer per dtype
    (router weights stay float32 in a bfloat16 model).

    A parameter that got no gradient on this rank contributes zeros, so every rank sends the
    same layout.
    """
    if dist.get_world_size() == 1 or not params:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        group = by_dtype[dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in group:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n


def clip_grad_norm(replicated: list[nn.Parameter], sharded: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global gradient norm of the whole (EP-sharded) model; returns the norm.

    ``norm^2 = sum(replicated grads^2)`` (identical on every rank after the all-reduce)
    ``+ all_reduce_SUM(sum(local expert grads^2))``. The result equals
    ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
    """
    def sq(params):
        gs = [p.grad.float().square().sum() for p in params if p.grad is not None]
        return torch.stack(gs).sum() if gs else torch.zeros(())

    rep = sq(replicated)
    shard = sq(sharded).to(rep.device)
    if sharded and dist.get_world_size() > 1:  # same on every rank: EP shards all ranks
        dist.all_reduce(shard, op=dist.ReduceOp.SUM)
    norm = float((rep + shard).sqrt())
    if math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for p in replicated + sharded:
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm


def dummy_batch(pad_id: int) -> TrainBatch:
    """A one-row batch with an empty completion mask: lets a rank with no groups join the
    step's collectives while adding nothing to the loss."""
    z = torch.zeros((1, 2))
    return TrainBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
        attention_mask=torch.ones((1, 2), dtype=torch.int64),
        completion_mask=z.clone(), rollout_logprobs=z.clone(), advantages=torch.zeros(1),
        rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.int64),
        policy_versions=torch.zeros(1, dtype=torch.int64), sample_ids=[],
    )


def train_step(
    cfg: RunConfig,
    model: nn.Module,
    ref_model: nn.Module | None,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    replicated: list[nn.Parameter],
    sharded: list[nn.Parameter],
    critic=None,
) -> tuple[bool, dict[str, float]]:
    """Forward, loss, backward, gradient all-reduce and clipping, optimizer step. Collective.

    GRPO (``critic`` None): the clipped loss on the batch's group-relative advantages. PPO
    (``critic`` an `app.trainer.critic.CriticParts`): the critic's values give per-token GAE
    advantages, whitened over the whole batch (app/trainer/ppo.py), for the same clipped loss
    (with TIS and the k3 KL); the clipped value loss trains the critic in the same backward, and
    each model's gradient is all-reduced and clipped on its own before both optimizers step.

    Args:
        cfg: the run config (``trainer`` section; ``rollout.temperature`` for the logprobs).
        model: the policy, this rank's experts only.
        ref_model: frozen reference policy for the k3 KL penalty, or None (``kl_coef`` 0).
        optimizer: over ``replicated + sharded``.
        batch: this rank's groups (`collate_groups`) or `dummy_batch`, on the model's device.
        replicated: parameters every rank holds a copy of (gradients all-reduced with SUM).
        sharded: this rank's expert parameters (gradients complete already; not reduced).
        critic: PPO's critic, or None for GRPO.

    Returns:
        ``(applied, stats)``: ``applied`` is False (on every rank) when the loss or the gradient
        norm was not finite; the optimizer step is then skipped and the gradients dropped.
        ``stats`` are whole-batch figures, identical on every rank: ``loss`` (full-batch),
        ``grad_norm`` (global, before clipping; NaN when skipped), ``entropy`` and the
        per-token means of `grpo.finish_stats`; with a critic also ``vf_loss``,
        ``vf_clip_frac``, ``value``, ``return``, ``value_error`` (per-token means) and
        ``critic_grad_norm``.
    """
    t = cfg.trainer
    temp = cfg.rollout.temperature
    mask = batch.completion_mask
    counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).float().sum()])
    if dist.get_world_size() > 1:
        dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    denominator = counts[0] if t.loss_agg == "token-mean" else counts[1]

    model.train()
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids, temp)
    ref_logp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logits = ref_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            ref_logp = token_logprobs(ref_logits, batch.input_ids, temp)
    policy_kw = dict(
        clip_eps_low=t.clip_eps_low, clip_eps_high=t.clip_eps_high, loss_agg=t.loss_agg,
        denominator=denominator, rollout_logprobs=batch.rollout_logprobs, tis_cap=t.tis_cap,
        ref_logprobs=ref_logp, kl_coef=t.kl_coef,
    )
    vout = None
    if critic is None:
        out = grpo_loss(logp, logp.detach(), batch.advantages, batch.completion_mask, **policy_kw)
    else:
        from app.trainer.ppo import ppo_policy_loss, ppo_targets, value_loss

        critic.module.train()
        values = critic.module(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        # One update per batch: the values the targets are built from are the critic's now.
        targets = ppo_targets(batch.rewards, values, mask, t.gamma, t.gae_lambda, t.whiten_advantages)
        out = ppo_policy_loss(logp, logp.detach(), targets.advantages, mask, **policy_kw)
        vout = value_loss(values, targets.values, targets.returns, mask, t.value_clip, denominator=counts[0])
    loss = out.loss
    aux = [m.last_aux_loss for m in model.modules() if getattr(m, "last_aux_loss", None) is not None]
    if aux and cfg.router.aux_loss_coef > 0:
        # Each rank's aux loss covers its own tokens; /world makes the rank sum their average.
        loss = loss + cfg.router.aux_loss_coef * torch.stack(aux).sum() / dist.get_world_size()
    sums = dict(out.sums)
    if t.log_entropy:
        sums["entropy"] = (token_entropy(logits.detach(), temp) * batch.completion_mask).sum()
    # Each rank's loss is its share of the full-batch loss (global denominator): SUM them.
    sums["loss"] = loss.detach()
    if vout is not None:
        sums.update({k: v for k, v in vout.sums.items() if k != "tokens"})
        loss = loss + vout.loss  # disjoint parameters: one backward gives each model its gradient

    # Every rank must agree before backward: a rank skipping it would strand the others in
    # the combine/dispatch all-to-alls of the backward pass.
    bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=loss.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    grad_norm = critic_grad_norm = float("nan")
    applied = False
    if bad.item() == 0:
        loss.backward()
        reduce_replicated_grads(replicated)
        grad_norm = clip_grad_norm(replicated, sharded, t.grad_clip)
        if critic is not None:
            reduce_replicated_grads(critic.replicated)
            critic_grad_norm = clip_grad_norm(critic.replicated, critic.sharded, t.grad_clip)
        if math.isfinite(grad_norm) and (critic is None or math.isfinite(critic_grad_norm)):
            optimizer.step()
            if critic is not None:
                critic.optimizer.step()
            applied = True
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.optimizer.zero_grad(set_to_none=True)

    keys = sorted(sums)
    vec = torch.stack([sums[k].float().reshape(()) for k in keys]).to(counts.device)
    mkeys = sorted(out.maxima)
    mvec = torch.stack([out.maxima[k].float().reshape(()) for k in mkeys]).to(counts.device)
    if dist.get_world_size() > 1:
        dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        dist.all_reduce(mvec, op=dist.ReduceOp.MAX)
    reduced = dict(zip(keys, vec.cpu()))
    full_loss = float(reduced.pop("loss"))
    stats = finish_stats(reduced, dict(zip(mkeys, mvec.cpu())))
    stats["loss"] = full_loss
    stats["grad_norm"] = grad_norm
    if critic is not None:
        stats["critic_grad_norm"] = critic_grad_norm
    return applied, stats


# --------------------------------------------------------------------------------------------
# Batches from the buffer (rank 0) and their scatter


class Stop(Exception):
    """Raised on every rank when rank 0 says the run must end (a signal)."""


def take_groups(buffer, cfg: RunConfig, version: int, should_stop, keep) -> tuple[list, float]:
    """Rank 0: block until ``groups_per_step`` whole groups that pass ``keep(group)`` are taken.

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
        got = buffer.take_batch(n - len(groups), trainer_version=version, timeout_s=1.0)
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


# --------------------------------------------------------------------------------------------
# The loop


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
        run_dir: where metrics.jsonl and trained.jsonl go (rank 0).
        resume: continue from the newest complete training state in the store (see the module
            docstring); without one, start from the initial weights. Either way the first
            version published is one after the newest in the store.

    Raises:
        ValueError: ``ep.size`` is neither 1 nor the world size; ``buffer.capacity_groups`` is
            smaller than ``(trainer.save_every + 1) * trainer.groups_per_step`` (the workers
            would stop before the trainer could fill a step); the store already holds policy
            versions of this run and ``resume`` is False; the state to resume was saved by a
            different number of ranks.
        TrainingError: no batch in time, too many non-finite steps in a row, a failed publish
            or save, Redis unreachable — raised on every rank with the same message (rank 0 may
            raise the original exception instead, e.g. BufferConnectionError naming the URL).
    """
    from app.buffer import ExperienceBuffer
    from app.model.parallel import init_ep
    from app.storage import mark_done, open_store
    from app.storage.policy import latest_policy_version
    from app.trainer.publish import publish_version
    from app.trainer.state import (drop_committed, latest_state, load_rank_payload, newer_entry,
                                   rank_payload, restore, save_state)

    # The cross-field rules (capacity vs save_every, PPO's loss aggregation) live in RunConfig;
    # validate again in case fields were set in code after loading.
    cfg = cfg.validated()
    t = cfg.trainer
    rank, world, device = init_distributed(timeout_s=t.batch_timeout_s + 600)
    if cfg.trainer.parallel.ep not in (1, world):
        raise ValueError(
            f"trainer.parallel.ep={cfg.trainer.parallel.ep} must be 1 or the number of trainer ranks ({world}): EP ranks "
            "are the data-parallel ranks"
        )
    torch.manual_seed(cfg.task.seed)
    ep = init_ep(cfg.trainer.parallel)
    store = open_store(cfg.store_url)

    def connect_and_check():
        # Rank 0 alone talks to Redis and checks the store; its error reaches every rank.
        buf = ExperienceBuffer.from_config(cfg, autocommit=False)
        latest = latest_policy_version(store, cfg.run_id)
        if latest is not None and not resume:
            raise ValueError(
                f"{cfg.store_url}: run {cfg.run_id!r} already has policy v{latest}; use a new "
                "run_id, or --resume to continue it"
            )
        manifest = latest_state(store, cfg.run_id) if resume else None
        if manifest is not None:
            if manifest["world_size"] != world:
                raise ValueError(
                    f"training state of step {manifest['step']} was saved by {manifest['world_size']} "
                    f"ranks; this run has {world} (keep ep.size and --nproc-per-node)")
            # Finish a commit that a kill interrupted: the saved state has taken these groups.
            drop_committed(buf, manifest.get("commit_point"))
        return buf, latest, manifest

    # Groups leave Redis (commit) only after a saved state includes the steps that trained on
    # them, so a trainer killed at any point loses nothing.
    checked = on_rank0(connect_and_check, rank)
    buffer = checked[0] if rank == 0 else None
    latest, manifest = broadcast_from_rank0(checked[1:] if rank == 0 else None, rank)

    model = build_model(cfg, ep, device)
    ref_model = None
    if t.kl_coef > 0:
        ref_model = build_model(cfg, ep, device).eval().requires_grad_(False)
    sharded_ids = expert_param_ids(model) if ep.size > 1 else set()
    params = [p for p in model.parameters() if p.requires_grad]
    replicated = [p for p in params if id(p) not in sharded_ids]
    sharded = [p for p in params if id(p) in sharded_ids]
    optimizer = torch.optim.AdamW(params, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    pad_id = getattr(model.config, "pad_token_id", None) or 0
    critic = None
    if t.algorithm == "ppo":
        from app.trainer.critic import make_critic_parts, restore_critic, critic_payload

        critic = make_critic_parts(cfg, ep, device)

    state = TrainState()
    trained: set[str] = set()  # rank 0: "task_id/attempt" of every group this lineage trained on
    commit_point: str | None = None  # rank 0: newest samples-stream entry taken
    if manifest is not None:
        extra = restore(model, optimizer, load_rank_payload(store, cfg.run_id, manifest))
        if critic is not None:
            restore_critic(critic.module, critic.optimizer, extra.get("critic"))
        state = TrainState(**manifest["train_state"])
        state.resumed_from = manifest["step"]
        trained = set(extra.get("trained", []))
        commit_point = manifest.get("commit_point")
        if rank == 0:
            log.info("resumed from the training state of step %d (policy v%d)", state.step, state.version)
    elif resume and rank == 0:
        log.info("--resume: no complete training state in the store; starting from step 0")

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
            model, ep, version, store=store, run_id=cfg.run_id, work_dir=work_dir,
            keep=t.keep_versions, buffer=buffer, tokenizer_source=cfg.model.path,
        )

    def save() -> float:
        meta = {"train_state": asdict(state), "policy_version": state.version, "commit_point": commit_point}
        extra = {"trained": sorted(trained)} if rank == 0 else {}
        if critic is not None:
            extra["critic"] = critic_payload(critic.module, critic.optimizer)
        try:
            return save_state(store, cfg.run_id, state.step, rank_payload(model, optimizer, extra), meta,
                              work_dir=work_dir, keep=t.keep_states)
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
            payload = None
            wait_s = 0.0
            groups: list = []
            skipped: list = []
            if rank == 0:
                payload = {"parts": None, "error": None, "stop": False, "meta": {}}

                def keep(g) -> bool:
                    nonlocal commit_point
                    commit_point = newer_entry(commit_point, g.entry_id)
                    return usable(g, state, cfg.buffer.max_staleness, pad_id, trained=trained, skipped=skipped)

                try:
                    groups, wait_s = take_groups(buffer, cfg, state.version, lambda: stop_requested, keep)
                    payload["parts"] = split_groups(groups, world)
                    payload["meta"] = batch_meta(groups, state.version)
                except Stop:
                    payload["stop"] = True
                except Exception as e:
                    payload["error"] = f"rank 0 could not take a batch: {e}"
            if stop_requested and rank == 0:
                payload["stop"] = True
            msg = scatter_groups(payload, rank)
            t0 = time.perf_counter()
            my_groups = msg["parts"][rank]
            batch = collate_groups(my_groups, pad_id=pad_id, scale_by_std=t.scale_by_std)
            if batch.input_ids.shape[0] == 0:
                batch = dummy_batch(pad_id)
            batch = batch.to(device)
            lr = step_lr(t, state.step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if critic is not None:
                for group in critic.optimizer.param_groups:
                    group["lr"] = lr * critic.base_lr / t.lr  # same warm-up, its own peak
            applied, stats = train_step(cfg, model, ref_model, optimizer, batch, replicated, sharded, critic)
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
            if not give_up and (state.step % t.publish_every == 0 or state.step == t.steps):
                uri, publish_s = publish(state.version + 1)
                state.version += 1
            if not give_up and (state.step % t.save_every == 0 or state.step == t.steps):
                save_s = save()
                if rank == 0:
                    buffer.commit()  # a skipped (non-finite) step consumes its groups too
            if rank == 0:
                record = {
                    "time": time.time(), "step": state.step, "policy_version": state.version,
                    "applied": applied, "bad_steps": state.bad_steps, **msg["meta"],
                    **{k: v for k, v in stats.items()}, "lr": lr,
                    "wait_s": wait_s, "step_s": step_s, "publish_s": publish_s, "save_s": save_s,
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
        for f in (metrics_file, trained_file):
            if f is not None:
                f.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if rank == 0 and state.step >= t.steps: mark_done(store, cfg.run_id, state.step, state.version)  # feeder stops
    return state


def step_lr(t, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over
    ``trainer.lr_warmup_steps`` steps to ``trainer.lr``, then constant. A function of the step
    alone, so a resumed run continues the same schedule."""
    if t.lr_warmup_steps <= 0:
        return t.lr
    return t.lr * min(1.0, (step + 1) / t.lr_warmup_steps)


def usable(group, state: TrainState, max_staleness: int, pad_id: int, *,
           trained: set[str] | None = None, skipped: list | None = None) -> bool:
    """Rank 0's check of one group before it is scattered: not trained on before by this
    lineage (``trained`` holds "task_id/attempt" keys), within ``max_staleness`` (the buffer
    enforces it already; this guards the contract), not an all-"error" group, and well-formed
    (it collates). A rejected group is counted in ``state``, appended to ``skipped`` as
    ``[task_id, attempt, reason]``, never trained on, and does not take a place in the step's
    ``groups_per_step``."""
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
            collate_groups([group], pad_id=pad_id)
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
    lengths = [len(s.completion_ids) for s in samples]
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


@cli.command()
def train(
    config: Path = typer.Option(..., "--config", exists=True, dir_okay=False, help="Run config YAML."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest training state."),
    run_dir: Path = typer.Option(None, "--run-dir", help="Where metrics.jsonl goes; default runs/<run_id>."),
) -> None:
    """Run one trainer rank. Start every rank with torchrun (``--nproc-per-node = ep.size``)."""
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s rank{os.environ.get('RANK', '0')} %(message)s"
    )
    state = None
    try:
        cfg = RunConfig.load(config)
        state = run_training(cfg, run_dir or Path("runs") / cfg.run_id, resume=resume)
    except (TrainingError, ValueError, ConnectionError, TimeoutError, FileNotFoundError) as e:
        # Bad input or a run-ending condition: one clear line, no traceback.
        typer.echo(f"moerl train (rank {os.environ.get('RANK', '0')}): {e}", err=True)
        raise SystemExit(1) from None  # (typer.Exit escapes app.cli's click group)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if state is not None and int(os.environ.get("RANK", "0")) == 0:
        typer.echo(json.dumps({"done": True, **asdict(state)}))
