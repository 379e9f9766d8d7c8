"""A rollout batch's optimizer steps: mini-batches and epochs, each step micro-batched forward and
backward, gradient clipping, AdamW. Collective.

Mini-batches and epochs (verl's ``ppo_mini_batch_size`` and ``ppo_epochs``, whose loop this is:
``verl/workers/actor/dp_actor.py`` ``update_policy``; TRL's ``steps_per_generation`` and
``num_iterations``): a step's groups are cut, in the order taken, into mini-batches of
``trainer.ppo_mini_batch_size`` groups (app/trainer/batch.py `split_mini_batches`, the rows'
`TrainBatch.mini_batch`), and ``trainer.ppo_epochs`` passes over them, in the same order each time,
make one optimizer step per mini-batch. The default, one mini-batch and one epoch, is one optimizer
step per batch, as TRL's default.

The clip's old policy (`TrainBatch.old_logprobs`): with one optimizer step per batch it is the
current policy, detached, so the ratio is 1 and neither the clip (``clip_eps_low/high``, GSPO's
sequence clip) nor ``dual_clip`` changes the gradient; with more steps, the trainer's own logprobs
of the whole batch, computed once in a gradient-free pass before the first step, so every later
step is off-policy and the clip bounds it (verl's ``old_log_probs``, TRL's
``old_per_token_logps``). With ``trainer.use_rollout_log_probs`` it is the engine's logprobs (the
behaviour policy; verl's ``use_rollout_log_probs``), so the clip binds from the first step.
Truncated importance sampling weighs each token by ``min(exp(old - rollout), tis_cap)`` against
the engine's logprobs (app/trainer/grpo.py): with the trainer's old logprobs that is AReaL's
decoupled PPO (the clip against the proximal policy, the weight for the behaviour policy).

Normalisation (a step equals the one-shot full-mini-batch step for any micro-batch split and any
layout): every micro-batch's loss is its token sum divided by the GLOBAL count of its mini-batch,
summed over every rank (completion tokens for token-mean, sequences with completion tokens for
seq-mean, every sequence, times the constant, for Dr. GRPO's ``seq-mean-token-sum-norm``), so the
sum of all micro-batch gradients over all ranks is the full-mini-batch gradient; FSDP's
reduce-scatter SUMs (app/trainer/parallel.py turns its division off) and accumulates the sharded
fp32 gradient over micro-batches.

Every rank runs the same number of micro-batches (the group's maximum; a rank with fewer runs
one-row dummy micro-batches whose loss is 0 but whose forward and backward take part in the
all-gathers, reduce-scatters and EP all-to-alls), and every rank agrees, before each backward,
whether the loss is finite: a rank that skipped a backward would strand the others in a
collective.

PPO: a first, gradient-free pass of the critic over every micro-batch gives the values, then
GAE and whitening over the whole batch (app/trainer/ppo.py), then each optimizer step trains the
policy and the critic per micro-batch (their parameters are disjoint, so one backward serves
both); the value clip, like the ratio clip, binds from the batch's second step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from app.config import RunConfig
from app.model.parallel import collective_device
from app.model.policy import moe_blocks, real_tokens, routing_replay
from app.model.router import expert_counts
from app.trainer.batch import TrainBatch, plan_micro_batches, select_rows
from app.trainer.grpo import finish_stats, grpo_loss
from app.trainer.ppo import PPOTargets, ppo_policy_loss, ppo_targets, value_loss


def build_optimizer(params, lr: float, betas: tuple[float, float], weight_decay: float,
                    device: torch.device) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) over the fp32 master weights (FSDP2 shards: DTensors).

    On CUDA the fused implementation (torch.optim.AdamW(fused=True), DTensor-aware): on the
    fp32 state at Qwen3-30B-A3B width its kernels took 37 ms a step against about 77 ms for the
    multi-tensor "foreach" default (bench/results/train-step.md, `bench train-step --profile`). Elsewhere
    "foreach". One parameter group per device mesh: a fused step
    runs one kernel over a group, and its DTensor op refuses parameters of different meshes
    (experts live on the EP x expert-data-parallel mesh, the rest on the data-parallel mesh;
    pytorch/pytorch#149396).

    Args:
        params: the parameters (an iterable of tensors or DTensors, fp32).
        lr, betas, weight_decay: as torch.optim.AdamW (trainer.lr, trainer.adam_betas,
            trainer.weight_decay).
        device: where the parameters live.
    """
    groups: dict[object, list] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return torch.optim.AdamW([{"params": g} for g in groups.values()], lr=lr, betas=tuple(betas),
                             weight_decay=weight_decay, fused=device.type == "cuda" or None)


def step_lr(t, step: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up over
    ``trainer.lr_warmup_steps`` steps to ``trainer.lr``, then constant. A function of the step
    alone, so a resumed run continues the same schedule."""
    if t.lr_warmup_steps <= 0:
        return t.lr
    return t.lr * min(1.0, (step + 1) / t.lr_warmup_steps)


def dummy_batch(pad_id: int) -> TrainBatch:
    """A one-row batch with an empty completion mask: lets a rank with no work join the step's
    collectives while adding nothing to the loss."""
    z = torch.zeros((1, 2))
    return TrainBatch(
        input_ids=torch.full((1, 2), pad_id, dtype=torch.int64),
        attention_mask=torch.ones((1, 2), dtype=torch.int64),
        completion_mask=z.clone(), rollout_logprobs=z.clone(), advantages=torch.zeros(1),
        rewards=torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.int64),
        policy_versions=torch.zeros(1, dtype=torch.int64), sample_ids=[],
    )


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_reduce(t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
    """``t`` all-reduced over the world; the result lives on the group's collective device (a
    copy when ``t`` is elsewhere: NCCL, like the cuda:gloo test layout, refuses CPU tensors).
    Use the returned tensor."""
    if _world() > 1:
        t = t.to(collective_device())
        dist.all_reduce(t, op=op)
    return t


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Clip by the global gradient norm of the whole sharded model; returns the norm (before).

    Gradients are DTensors on two meshes (dense FSDP; experts over efsdp x ep) or plain tensors:
    each mesh's norm is reduced over its own mesh (``DTensor.full_tensor``) and the squares are
    summed, as torchtitan's ``_clip_grad_norm_with_ep`` does. Equals
    ``torch.nn.utils.clip_grad_norm_`` of the unsharded model.
    """
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            by_mesh.setdefault(key, []).append(p)
    if not by_mesh:
        return 0.0
    squares = []
    for group in by_mesh.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group])
        squares.append((n.full_tensor() if isinstance(n, DTensor) else n).float().square())
    total = torch.stack(squares).sum().sqrt()
    norm = float(total)
    if math.isfinite(norm):
        for group in by_mesh.values():  # DTensor ops need one mesh at a time
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return norm


def _micro_batches(batch: TrainBatch, max_tokens: int | None, pad_id: int, device) -> list[tuple]:
    """This rank's micro-batches as ``(rows or None, sub-batch on device)``, padded with dummies to
    the group's maximum count (an all-reduce)."""
    plan = plan_micro_batches(batch, max_tokens)
    count = _all_reduce(torch.tensor([len(plan)], dtype=torch.int64), dist.ReduceOp.MAX)
    out = [(rows, select_rows(batch, rows, length).to(device)) for rows, length in plan]
    dummy = dummy_batch(pad_id).to(device)
    out += [(None, dummy)] * (int(count) - len(plan))
    return out


def train_step(
    cfg: RunConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: TrainBatch,
    *,
    pad_id: int,
    device: torch.device | str = "cpu",
    ref_model: nn.Module | None = None,
    critic=None,
) -> tuple[bool, dict[str, float]]:
    """One rollout batch on this rank's share of it (see the module docstring): ``trainer.ppo_epochs``
    passes over its mini-batches (`TrainBatch.mini_batch`), one optimizer step each. Collective.

    Args:
        cfg: the run config (``trainer``: loss, micro_batch_tokens, logprob_chunk_tokens,
            grad_clip, ppo_epochs, use_rollout_log_probs; ``rollout.temperature`` for the logprobs).
        model: the policy (sharded by app/trainer/parallel.py, or a plain module on one rank);
            it must have ``sequence_logprobs`` (app/model/policy.py).
        optimizer: AdamW over the policy's parameters.
        batch: this rank's rows (`app.trainer.batch.collate_groups`), on the CPU; may be empty.
        pad_id: padding token of dummy micro-batches.
        device: where micro-batches are moved.
        ref_model: frozen reference policy for the k3 KL penalty, or None (``kl_coef`` 0).
        critic: PPO's `app.trainer.critic.CriticParts`, or None for GRPO.

    Returns:
        ``(applied, stats)``: ``applied`` is False (on every rank) when a loss or a gradient norm
        was not finite; that optimizer step is then skipped, its gradients dropped, and so are the
        batch's remaining steps. ``stats`` are whole-batch figures, identical on every rank:
        ``loss`` (full-batch; the mean over the batch's optimizer steps), ``grad_norm`` (before
        clipping; NaN when skipped; the mean over the steps), ``entropy`` (with
        ``trainer.log_entropy``), ``micro_batches`` (over all steps), ``optimizer_steps`` (applied),
        ``routing_replay_mismatch`` (with ``rollout.routing_replay``: the fraction of replayed
        (token, MoE layer) pairs whose experts this router would not have chosen), the per-token
        means of `grpo.finish_stats` over every step's tokens; with a critic also ``vf_loss``,
        ``vf_clip_frac``, ``value``, ``return``, ``value_error`` and ``critic_grad_norm``. With
        more than one optimizer step, ``mini_batch_stats``: one dict per step (``epoch``,
        ``mini_batch`` and its `PER_UPDATE` figures).
    """
    t = cfg.trainer
    kw = dict(temperature=cfg.rollout.temperature, chunk=t.logprob_chunk_tokens)
    rows_total = batch.input_ids.shape[0]
    mini = batch.mini_batch if batch.mini_batch is not None else torch.zeros(rows_total, dtype=torch.int64)
    local = torch.tensor([int(mini.max()) + 1 if rows_total else 1], dtype=torch.int64)
    n_mini = int(_all_reduce(local, dist.ReduceOp.MAX))
    steps = t.ppo_epochs * n_mini

    # The old policy of the clip: the engine's logprobs, or the trainer's own before the batch's
    # first optimizer step (one gradient-free pass; with one step per batch they are the current
    # logprobs, detached, and no pass is needed).
    recompute = steps > 1 and not t.use_rollout_log_probs
    micro = _micro_batches(batch, t.micro_batch_tokens, pad_id, device) if recompute or critic is not None else []
    targets = _ppo_targets(cfg, critic.module, batch, micro, device) if critic is not None else None
    if t.use_rollout_log_probs:
        batch = dataclasses.replace(batch, old_logprobs=batch.rollout_logprobs)
    elif recompute:
        batch = dataclasses.replace(batch, old_logprobs=_old_logprobs(model, batch, micro, kw))
    del micro  # its device copies of the rows

    applied = True
    done: list[tuple[int, int, dict]] = []
    for epoch in range(t.ppo_epochs):
        for j in range(n_mini):
            sub, sub_targets = batch, targets
            if n_mini > 1:
                rows = (mini == j).nonzero().squeeze(1)
                sub = select_rows(batch, rows, batch.input_ids.shape[1])
                sub_targets = None if targets is None else _rows_of_targets(targets, rows)
            ok, stats = _update(cfg, model, optimizer, sub, pad_id, device, ref_model, critic, sub_targets, kw)
            done.append((epoch, j, stats))
            if not ok:
                applied = False  # every rank agrees; the batch's remaining steps are skipped too
                break
        if not applied:
            break
    stats = _combine([s for _, _, s in done])
    stats["optimizer_steps"] = float(len(done) - (0 if applied else 1))
    if steps > 1:
        stats["mini_batch_stats"] = [{"epoch": e, "mini_batch": j, **{k: s[k] for k in PER_UPDATE if k in s}}
                                     for e, j, s in done]
    return applied, stats


# The figures of each optimizer step that train_step lists under mini_batch_stats.
PER_UPDATE = ("loss", "grad_norm", "tokens", "clip_frac", "dual_clip_frac", "approx_kl", "ratio", "ratio_max",
              "tis", "vf_clip_frac")
# Figures of one optimizer step that are not per-token means (`_combine`).
_STEP_MEANS = ("loss", "grad_norm", "critic_grad_norm", "routing_replay_mismatch")


def _combine(steps: list[dict]) -> dict:
    """The batch's figures from its optimizer steps' (one step: its own): ``_max`` keys the maximum,
    ``tokens`` and ``micro_batches`` the sum, `_STEP_MEANS` the mean over steps, and every other
    (per-token) mean weighted by the step's tokens."""
    if len(steps) == 1:
        return dict(steps[0])
    tokens = sum(s["tokens"] for s in steps)
    out = {}
    for k in steps[0]:
        values = [s[k] for s in steps]
        if k.endswith("_max"):
            out[k] = max(values)
        elif k in ("tokens", "micro_batches"):
            out[k] = float(sum(values))
        elif k in _STEP_MEANS:
            out[k] = sum(values) / len(values)
        else:
            out[k] = sum(v * s["tokens"] for v, s in zip(values, steps)) / max(tokens, 1.0)
    return out


def _update(cfg: RunConfig, model: nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch, pad_id: int,
            device, ref_model, critic, targets, kw: dict) -> tuple[bool, dict[str, float]]:
    """One optimizer step on this rank's share of one mini-batch (micro-batched; see the module
    docstring). Collective. Returns ``(applied, stats)`` as `train_step` does for one step."""
    t = cfg.trainer
    mask = batch.completion_mask
    # [completion tokens, sequences with completion tokens, real sequences] of the mini-batch (every rank).
    counts = _all_reduce(torch.stack([mask.sum(), (mask.sum(-1) > 0).float().sum(),
                                      (batch.attention_mask.sum(-1) > 0).float().sum()]).float())
    # Dr. GRPO's constant normaliser counts every sequence, a masked one (overlong_filter) too, as
    # TRL (its batch size) and verl (seq-mean-token-sum-norm) do.
    denominator = {"token-mean": counts[0], "seq-mean": counts[1], "seq-mean-token-sum-norm": counts[2]}[t.loss_agg]
    micro = _micro_batches(batch, t.micro_batch_tokens, pad_id, device)

    model.train()
    if critic is not None:
        critic.module.train()
    sums: dict[str, Tensor] = {}
    maxima: dict[str, Tensor] = {}
    applied = True
    replay_counts = torch.zeros(2)
    # Aux-loss-free balancing: each MoE layer's expert loads of the step's real tokens.
    blocks = [b for _, b in moe_blocks(model)] if cfg.router.bias_update_rate > 0 else []
    loads = 0
    for rows, mb in micro:
        # Routing replay: the MoE layers route by the engine's experts for this micro-batch, in
        # the forward and in any recompute of its backward. Padding and dummy rows are no tokens
        # of the aux loss or the loads.
        replay = (routing_replay(model, mb.routed_experts.unbind(2)) if mb.routed_experts is not None
                  else contextlib.nullcontext())
        tokens = mb.attention_mask.bool() if rows is not None else torch.zeros_like(mb.attention_mask, dtype=torch.bool)
        with replay, real_tokens(model, tokens):
            ok, step_sums, out_maxima, load = _micro_step(cfg, model, mb, rows, denominator, counts, kw, ref_model,
                                                          critic, targets, blocks, tokens)
            if mb.routed_experts is not None:
                replay_counts += sum(m.last_replay_mismatch.cpu() for m in model.modules()
                                     if getattr(m, "last_replay_mismatch", None) is not None)
        loads = loads + load if blocks else 0
        for k, v in step_sums.items():
            sums[k] = sums.get(k, 0) + v
        for k, v in out_maxima.items():
            maxima[k] = torch.maximum(maxima[k], v) if k in maxima else v
        if not ok:
            applied = False  # every rank agrees: no backward anywhere, no optimizer step
            break

    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = critic_grad_norm = float("nan")
    if applied:
        grad_norm = clip_grad_norm(params, t.grad_clip)
        if critic is not None:
            critic_grad_norm = clip_grad_norm([p for p in critic.module.parameters() if p.requires_grad],
                                              t.grad_clip)
        applied = math.isfinite(grad_norm) and (critic is None or math.isfinite(critic_grad_norm))
        if applied:
            optimizer.step()
            if critic is not None:
                critic.optimizer.step()
            if blocks:  # loads of every rank: every replica of the bias takes the same update
                total = _all_reduce(loads)
                for block, layer_load in zip(blocks, total):
                    block.update_expert_bias(layer_load)
    optimizer.zero_grad(set_to_none=True)
    if critic is not None:
        critic.optimizer.zero_grad(set_to_none=True)

    keys = sorted(sums)
    vec = _all_reduce(torch.stack([torch.as_tensor(sums[k], device=counts.device).reshape(()) for k in keys]))
    mkeys = sorted(maxima)
    mvec = torch.stack([maxima[k].to(counts.device).reshape(()) for k in mkeys]) if mkeys else torch.zeros(0)
    if mkeys:
        mvec = _all_reduce(mvec, dist.ReduceOp.MAX)
    reduced = dict(zip(keys, vec.cpu()))
    full_loss = float(reduced.pop("loss"))
    stats = finish_stats(reduced, dict(zip(mkeys, mvec.cpu())))
    stats.update(loss=full_loss, grad_norm=grad_norm, micro_batches=float(len(micro)))
    if cfg.rollout.routing_replay:  # how often the trainer's own router would have differed (every rank)
        replay_counts = _all_reduce(replay_counts).cpu()
        stats["routing_replay_mismatch"] = float(replay_counts[0] / replay_counts[1].clamp(min=1))
    if critic is not None:
        stats["critic_grad_norm"] = critic_grad_norm
    return applied, stats


def _micro_step(cfg: RunConfig, model: nn.Module, mb: TrainBatch, rows, denominator: Tensor, counts: Tensor,
                kw: dict, ref_model, critic, targets, blocks: list, tokens: Tensor) -> tuple[bool, dict, dict, Tensor | None]:
    """Forward, loss and backward of one micro-batch (collective). Returns (finite on every rank,
    detached fp32 sums, maxima, ``[len(blocks), E]`` expert loads of the real ``tokens`` [B, S]
    in each of ``blocks`` or None without blocks); when a loss is not finite on some rank, no
    rank runs backward."""
    t = cfg.trainer
    # The entropy bonus back-propagates through the entropy; logging alone does not.
    logp, ent, _ = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.completion_mask,
                                           with_entropy=t.log_entropy or t.entropy_coef > 0,
                                           entropy_grad=t.entropy_coef > 0, **kw)
    # Read the routing now: a recompute in backward writes last_topk_idx again.
    load = (torch.stack([expert_counts(b.last_topk_idx, b.num_experts, tokens) for b in blocks])
            if blocks else None)
    ref_logp = None
    if ref_model is not None:
        with torch.no_grad():
            ref_logp = ref_model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.completion_mask, **kw)[0]
    policy_kw = dict(
        clip_eps_low=t.clip_eps_low, clip_eps_high=t.clip_eps_high, loss_agg=t.loss_agg,
        denominator=denominator, rollout_logprobs=mb.rollout_logprobs, tis_cap=t.tis_cap,
        ref_logprobs=ref_logp, kl_coef=t.kl_coef, ratio_level=t.ratio_level, rollout_is=t.rollout_is,
        rollout_is_min=t.rollout_is_min, dual_clip=t.dual_clip, entropy=ent, entropy_coef=t.entropy_coef,
        token_denominator=counts[0], norm_tokens=cfg.max_policy_tokens(),
    )
    vout = None
    old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs
    if critic is None:
        out = grpo_loss(logp, old, mb.advantages, mb.completion_mask, **policy_kw)
    else:
        tg = _slice_targets(targets, rows, mb)
        values = critic.module(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
        out = ppo_policy_loss(logp, old, tg.advantages, mb.completion_mask, **policy_kw)
        vout = value_loss(values, tg.values, tg.returns, mb.completion_mask, t.value_clip, denominator=counts[0])
    loss = out.loss
    aux = [m.last_aux_loss for m in model.modules() if getattr(m, "last_aux_loss", None) is not None]
    if aux and cfg.router.aux_loss_coef > 0:
        # Each layer's aux loss is summed over this micro-batch's sequences (app/model/router.py):
        # divided by the step's real sequences, the ranks' and micro-batches' sum is the mean over
        # sequences, whatever the split.
        loss = loss + torch.stack(aux).sum() / counts[2].clamp(min=1.0)
    step_sums = dict(out.sums)
    if ent is not None:
        step_sums["entropy"] = (ent * mb.completion_mask).sum()
    step_sums["loss"] = loss.detach()
    if vout is not None:
        step_sums.update({k: v for k, v in vout.sums.items() if k != "tokens"})
        loss = loss + vout.loss
    sums = {k: v.detach().float() for k, v in step_sums.items()}
    maxima = {k: v.detach().float() for k, v in out.maxima.items()}
    bad = _all_reduce(torch.tensor([0.0 if torch.isfinite(loss) else 1.0], device=loss.device), dist.ReduceOp.MAX)
    if bad.item() > 0:
        return False, sums, maxima, load
    loss.backward()
    return True, sums, maxima, load


@torch.no_grad()
def _old_logprobs(model: nn.Module, batch: TrainBatch, micro: list[tuple], kw: dict) -> Tensor:
    """The policy's logprobs of every row before the batch's first optimizer step, ``[B, L]`` on the
    CPU, 0 off the completion mask: one gradient-free pass over the micro-batches (collective,
    dummies included), with routing replay as in training."""
    out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
    model.train()  # the training forwards' mode: the first step's ratio is 1
    for rows, mb in micro:
        replay = (routing_replay(model, mb.routed_experts.unbind(2)) if mb.routed_experts is not None
                  else contextlib.nullcontext())
        with replay:
            logp = model.sequence_logprobs(mb.input_ids, mb.attention_mask, mb.completion_mask, **kw)[0]
        if rows is not None:
            out[rows, : logp.shape[1]] = logp.float().cpu()
    return out * batch.completion_mask


def _ppo_targets(cfg: RunConfig, critic: nn.Module, batch: TrainBatch, micro: list[tuple], device):
    """Critic values of every row (gradient-free pass over the micro-batches), then GAE and the
    whole-batch whitening (a collective, on ``device``) on this rank's full ``[B, L]`` batch."""
    t = cfg.trainer
    values = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
    critic.eval()
    with torch.no_grad():
        for rows, mb in micro:
            v = critic(input_ids=mb.input_ids, attention_mask=mb.attention_mask).float().cpu()
            if rows is not None:
                values[rows, : v.shape[1]] = v
    return ppo_targets(batch.rewards, values, batch.completion_mask, t.gamma, t.gae_lambda, t.whiten_advantages,
                       device=device)


def _rows_of_targets(targets, rows: Tensor):
    """The PPO targets of the batch's ``rows`` (a mini-batch)."""
    return PPOTargets(values=targets.values[rows], returns=targets.returns[rows], advantages=targets.advantages[rows])


def _slice_targets(targets, rows: Tensor | None, mb: TrainBatch):
    """The targets of one micro-batch's rows (zeros for a dummy micro-batch)."""
    shape = mb.completion_mask.shape
    device = mb.completion_mask.device
    if rows is None:
        z = torch.zeros(shape, device=device)
        return PPOTargets(values=z, returns=z, advantages=z)
    cut = lambda x: x[rows, : shape[1]].to(device)  # noqa: E731
    return PPOTargets(values=cut(targets.values), returns=cut(targets.returns), advantages=cut(targets.advantages))
