"""TRL's own GRPO loss, ``GRPOTrainer._compute_loss`` (TRL 1.16, a test dependency), run on our tensors,
and its reuse of one generation batch over several optimizer steps (``_prepare_inputs``).

`trl_loss` builds a real ``GRPOConfig`` (so TRL's own checks of the options run), gives a stand-in
trainer the attributes that ``GRPOTrainer.__init__`` copies from it (``trl/trainer/grpo_trainer.py``:
``max_completion_length``, ``loss_type``, ``importance_sampling_level``, ``epsilon_low/high``,
``beta``, the vLLM importance-sampling switches, the entropy bonus, ...), and calls the unbound
``GRPOTrainer._compute_loss(stand_in, model, inputs)``. The stand-in's
``_get_per_token_logps_and_entropies`` returns the caller's per-token logprobs and entropies (with
gradient), so TRL's loss arithmetic runs unchanged and its gradient can be compared with ours. The
accelerator is one process (gather/reduce are the identity) and there is no gradient accumulation.
`trl_generation_steps` runs ``steps_per_generation x num_iterations`` optimizer steps on one
generation batch the same way, through TRL's ``_prepare_inputs``.

Layout: TRL's tensors are completion-aligned, ``[B, C]`` (``completion_mask``), where ours are
aligned with the whole row (app/trainer/grpo.py); `to_completion` moves ours there. `full_logprobs`
and `groups_near` make the inputs: the model's logprobs from its full logits, and groups whose
engine logprobs lie near the model's.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from types import SimpleNamespace

import torch
from torch import Tensor

from app.trainer.batch import collate_groups
from helpers import fake_groups

# GRPOTrainer.__init__ copies these GRPOConfig fields to attributes of the same name.
_SAME_NAME = ("max_completion_length", "num_generations", "use_vllm", "vllm_importance_sampling_correction",
              "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_max",
              "vllm_importance_sampling_clip_min", "loss_type", "scale_rewards", "importance_sampling_level",
              "off_policy_mask_threshold", "mask_truncated_completions", "top_entropy_quantile", "entropy_coef",
              "use_adaptive_entropy", "beta")


def grpo_config(**kw):
    """A real ``trl.GRPOConfig`` for CPU with ``kw`` (TRL's ``__post_init__`` validates it)."""
    from trl import GRPOConfig

    base = dict(output_dir=tempfile.mkdtemp(prefix="trl-oracle-"), per_device_train_batch_size=8,
                num_generations=4, use_cpu=True, report_to="none", save_strategy="no", beta=0.0,
                epsilon=0.2, epsilon_high=0.28, loss_type="bnpo", router_aux_loss_coef=0.0)
    return GRPOConfig(**(base | kw))


class _Accelerator:
    num_processes = 1
    is_main_process = True
    sync_gradients = True  # one micro-batch per optimizer step

    def gather(self, t):
        return t

    gather_for_metrics = gather

    def reduce(self, t, reduction="sum"):
        return t


def trl_loss(args, logps: Tensor, inputs: dict, entropies: Tensor | None = None) -> Tensor:
    """``GRPOTrainer._compute_loss`` of TRL with ``args`` (a `grpo_config`) on completion-aligned
    ``logps [B, C]`` (with gradient) and ``inputs`` (``prompt_ids``, ``prompt_mask``,
    ``completion_ids``, ``completion_mask``, ``advantages`` and, as TRL's generation step makes
    them, ``old_per_token_logps``, ``ref_per_token_logps``, ``importance_sampling_ratio``)."""
    from trl import GRPOTrainer

    return GRPOTrainer._compute_loss(_stand_in(args, logps, entropies), None, inputs)


def trl_generation_steps(args, generation: dict, logps_of_rows, optimizer) -> list[float]:
    """TRL's reuse of one generation batch, run by TRL's own code: ``GRPOTrainer._prepare_inputs``
    (the batch cut into ``steps_per_generation`` slices, buffered, handed out ``num_iterations``
    times: slice ``step % steps_per_generation`` at step ``step``) and ``_compute_loss``, then one
    optimizer step per slice, as TRL's loop does with ``gradient_accumulation_steps=1``
    (``GRPOTrainer.training_step`` counts ``_step``).

    Args:
        args: a `grpo_config` with ``steps_per_generation`` and ``num_iterations``.
        generation: what TRL's ``_generate_and_score_completions`` returns for the batch (`inputs_of`
            with ``old_per_token_logps`` and, for TIS, ``importance_sampling_ratio``), plus ``rows``:
            ``[B]`` row indices, so `logps_of_rows` knows a slice's rows.
        logps_of_rows: ``rows [b] -> [b, C]`` completion-aligned logprobs of the model (with gradient).
        optimizer: over the model's parameters.

    Returns:
        The loss of every optimizer step.
    """
    from trl import GRPOTrainer

    stand_in = _stand_in(args, None, None)
    stand_in._step, stand_in._buffered_inputs, stand_in.num_iterations = 0, None, args.num_iterations
    stand_in._generate_and_score_completions = lambda batch: dict(generation)
    losses = []
    for _ in range(args.steps_per_generation * args.num_iterations):
        inputs = GRPOTrainer._prepare_inputs(stand_in, None)
        logps = logps_of_rows(inputs["rows"])
        stand_in._get_per_token_logps_and_entropies = lambda *a, logps=logps, **k: (logps, torch.zeros_like(logps), None)
        loss = GRPOTrainer._compute_loss(stand_in, None, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stand_in._step += 1
        losses.append(loss.item())
    return losses


def _stand_in(args, logps: Tensor | None, entropies: Tensor | None) -> SimpleNamespace:
    """The attributes of a ``GRPOTrainer`` that ``_compute_loss`` and ``_prepare_inputs`` read."""
    from trl import GRPOTrainer

    stand_in = SimpleNamespace(**{k: getattr(args, k) for k in _SAME_NAME})
    stand_in.args = args
    stand_in.epsilon_low = args.epsilon
    stand_in.epsilon_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    stand_in.aux_loss_enabled = False
    stand_in._entropy_bonus_enabled = args.entropy_coef != 0.0 or args.use_adaptive_entropy
    stand_in._last_world_entropy = float("inf")
    stand_in._entropy_window_stats = None
    stand_in.model = SimpleNamespace(training=True)
    stand_in.current_gradient_accumulation_steps = 1
    stand_in.accelerator = _Accelerator()
    stand_in._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    stand_in.get_off_policy_mask = GRPOTrainer.get_off_policy_mask
    if logps is not None:
        ent = entropies if entropies is not None else torch.zeros_like(logps)
        stand_in._get_per_token_logps_and_entropies = lambda *a, **k: (logps, ent, None)
    return stand_in


def to_completion(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Our row-aligned ``x [B, L]`` (values where ``mask > 0``) as TRL's ``[B, C]`` completion tensor,
    left-aligned (C = the longest row's completion), and the ``[B, C]`` completion mask. Differentiable.

    Completion tokens must be contiguous in each row (prompt, completion, padding)."""
    B = mask.shape[0]
    n = mask.sum(-1).long()
    C = max(int(n.max()), 1) if B else 1
    start = torch.where(mask > 0, torch.arange(mask.shape[1]).expand_as(mask), mask.shape[1]).min(-1).values
    rows, cols = [], []
    for b in range(B):
        rows += [b] * int(n[b])
        cols += list(range(int(start[b]), int(start[b]) + int(n[b])))
    out = torch.zeros(B, C, dtype=x.dtype)
    cmask = torch.zeros(B, C)
    pos = [j for b in range(B) for j in range(int(n[b]))]
    out = out.index_put((torch.tensor(rows, dtype=torch.long), torch.tensor(pos, dtype=torch.long)),
                        x[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)])
    cmask[torch.tensor(rows, dtype=torch.long), torch.tensor(pos, dtype=torch.long)] = 1.0
    return out, cmask


def inputs_of(mask_c: Tensor, advantages: Tensor, **more) -> dict:
    """TRL's ``inputs`` for a ``[B, C]`` completion mask (token ids are not read: the stand-in
    supplies the logprobs)."""
    B, C = mask_c.shape
    return {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1, dtype=torch.long),
            "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": mask_c.long(),
            "advantages": advantages, **more}


def full_logprobs(model, batch, temperature: float):
    """Per-token logprobs and entropies from the full logits (no chunking), row-aligned, with grad."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits / temperature, -1)
    picked = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    pad = torch.nn.functional.pad
    return pad(picked, (1, 0)) * batch.completion_mask, pad(ent, (1, 0)) * batch.completion_mask


def groups_near(model, n_groups: int, seed: int, temperature: float, truncated: tuple[int, ...] = ()):
    """fake_groups with partial-credit rewards whose engine logprobs are the model's own plus noise
    (ratios near 1, so the band of a mask mode keeps some tokens and sequences and drops others); the
    rows ``truncated`` end at max_new_tokens (finish_reason "length")."""
    groups = fake_groups(n_groups, seed=seed, binary_reward=False)
    batch = collate_groups(groups)
    with torch.no_grad():
        logp, _ = full_logprobs(model, batch, temperature)
    g = torch.Generator().manual_seed(seed + 1)
    row = 0
    for group in groups:
        for s in group.samples:
            p = len(s.prompt_ids)
            true = logp[row, p : p + len(s.completion_ids)]
            s.logprobs = (true + 0.15 * torch.randn(true.shape, generator=g)).tolist()
            if row in truncated:
                s.finish_reason = "length"
            row += 1
    return groups
