"""`moerl warmup`: make the tiny base policy by a short supervised fit on the task's training examples.

No pretrained weights can be downloaded here, so the embedded default starts RL from a policy
that has seen the task's own TRAINING prompts with their reference answers (prompt + answer +
``<eos>``, loss on the answer and ``<eos>`` tokens only). The warm-up is deliberately short
(``task.warmup_steps``): it leaves the held-out sampled reward well below the ceiling, so RL has
something to gain, and the gain is measured from this checkpoint on held-out prompts.

For an environment task (``env.name``), the examples are whole episodes that a scripted policy
plays against the environment itself (`app.envs.episodes_local.demonstration`): the loss is on
the turns the policy should learn, never on the environment's observations.

The result is a Hugging Face checkpoint (app/model/checkpoint.py) plus the tokenizer files,
loadable by stock transformers like any published policy version.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch
import typer

from app.config import RunConfig
from app.envs import episodes_remote
from app.envs.env_client import EnvError
from app.envs.evaluate import evaluate_run_policy, evaluation_key, evaluation_size
from app.envs.tasks import Prompt, make_splits
from app.envs.wire import fetch_wire_format
from app.model.checkpoint import load_policy, save_policy
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.model.source import resolve_model_path
from app.model.tokenizer import PAD_ID, build_tokenizer, load_tokenizer, save_tokenizer


def sft_batch(prompts: list[Prompt], tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded supervised batch.

    Returns:
        ``input_ids [B, L] int64`` (``<bos> prompt answer <eos>``, then ``<pad>``),
        ``attention_mask [B, L] int64``, ``loss_mask [B, L] float32`` (1 on answer and
        ``<eos>`` tokens: the positions whose prediction is trained).
    """
    seqs, masks = [], []
    for p in prompts:
        prompt_ids = tokenizer(p.text)["input_ids"]
        answer_ids = tokenizer(p.answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt_ids + answer_ids)
        masks.append([0.0] * len(prompt_ids) + [1.0] * len(answer_ids))
    width = max(map(len, seqs))
    pad = PAD_ID if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), width)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        loss_mask[i, : len(s)] = torch.tensor(m)
    return ids, attn, loss_mask


def pad_examples(examples: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``(ids, mask)`` examples: ``input_ids [B, L] int64``, ``attention_mask [B, L]
    int64``, ``loss_mask [B, L] float32``."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    attn = torch.zeros(len(examples), width, dtype=torch.long)
    loss_mask = torch.zeros(len(examples), width)
    for i, (s, m) in enumerate(examples):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        loss_mask[i, : len(s)] = torch.tensor(m, dtype=torch.float32)
    return ids, attn, loss_mask


def env_batch(prompts: list[Prompt], tokenizer, env_cfg, rng: random.Random):
    """Like `sft_batch`, from environment demonstrations (`app.envs.episodes_local`)."""
    # openenv (the env extra, pyproject.toml; environments.py needs it): only for moerl's
    # environments, so a task without one warms up where it is not installed
    from app.envs.episodes_local import demonstration

    pad = PAD_ID if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    return pad_examples([demonstration(env_cfg, p, tokenizer, rng) for p in prompts], pad)


def sft_loss(model, ids: torch.Tensor, attn: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions where ``loss_mask`` is 1 (scalar fp32)."""
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = loss_mask[:, 1:]
    return -(logp * mask).sum() / mask.sum()


def lr_at(step: int, total: int, peak: float, warmup: int = 20) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay from ``peak`` to ``peak / 10``."""
    ramp = min(1.0, (step + 1) / warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * step / max(1, total)))
    return peak * ramp * (0.1 + 0.9 * cosine)


def warm_up(model, tokenizer, train: list[Prompt], steps: int, lr: float, batch_size: int, seed: int = 0,
            log=None, env_cfg=None, examples: list[tuple[list[int], list[int]]] | None = None) -> list[float]:
    """Fit ``model`` in place on random batches of ``train``; returns the loss of every step.

    Batches go to the model's device. AdamW (betas 0.9/0.98, no weight decay), `lr_at`
    schedule, gradient clipping at 1.0. With
    ``examples`` (``(ids, mask)`` pairs: a user environment's played demonstrations) the batches
    are drawn from them; with ``env_cfg`` (an `app.config.EnvConfig` naming one of moerl's
    environments) the examples are its demonstrations (`env_batch`), else prompt + answer
    (`sft_batch`).

    Raises:
        ValueError: ``train`` (or ``examples``, when given) is empty.
    """
    if examples is not None:
        if not examples:
            raise ValueError("warmup: no demonstrations")
        train = examples
    if not train:
        raise ValueError("warmup: no training prompts")
    rng = random.Random(seed)
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        batch = rng.sample(train, min(batch_size, len(train)))
        pad = PAD_ID if tokenizer.pad_token_id is None else tokenizer.pad_token_id
        if examples is not None:
            tensors = pad_examples(batch, pad)
        elif env_cfg is not None and env_cfg.name:
            tensors = env_batch(batch, tokenizer, env_cfg, rng)
        else:
            tensors = sft_batch(batch, tokenizer)
        loss = sft_loss(model, *(t.to(device) for t in tensors))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log and (step % 5 == 0 or step == steps - 1):  # `moerl run` shows them as a bar
            log(f"warmup step {step + 1}/{steps} loss {losses[-1]:.3f}")
    return losses


def build_base_policy(cfg: RunConfig):
    """The untrained policy of ``cfg.model`` (preset built in code, or ``model.path`` loaded), EP 1,
    in fp32 (``model.dtype`` is the trainer's compute dtype over fp32 master weights)."""
    dtype = torch.float32
    if cfg.model.path:
        return load_policy(cfg.model.path, cfg.router, EPContext.local(), dtype=dtype)
    return build_policy(tiny_config(cfg.model.preset), cfg.router, EPContext.local(), dtype=dtype, seed=cfg.task.seed)


def user_env_examples(cfg: RunConfig, tokenizer, env_url: str | None, log=print):
    """The warm-up examples of a user's environment, played against the server at ``env_url``
    (app/envs/episodes_remote.py): its ``env.demos_path`` rows, or with ``env.demos_from_env``
    the training episodes with the turns each reset observation's metadata gives; None without
    demonstrations.

    Raises:
        ValueError, FileNotFoundError: a bad demonstrations file, or no server address.
        EnvError, WireError: the server failed, has no text fields, or (``demos_from_env``) gave
            no demonstration.
    """
    if not cfg.env.demos_path and not cfg.env.demos_from_env:
        log("warmup: env.demos_path unset: the base policy is the untrained preset (no demonstrations)")
        return None
    url = env_url or cfg.env.url
    if not url:
        raise ValueError(f"env.url: the demonstrations of {cfg.env.name!r} are played against its server")
    if cfg.env.demos_from_env:
        train, _ = make_splits(cfg.task)
        rows = episodes_remote.own_demo_rows([p.spec for p in train])
    else:
        rows = episodes_remote.load_demos(cfg.env.demos_path)
    examples = episodes_remote.demonstrations(rows, tokenizer, cfg.env, url, fetch_wire_format(url))
    source = "the environment's own (reset metadata)" if cfg.env.demos_from_env else cfg.env.demos_path
    log(f"warmup: {len(examples)} demonstrations from {source} played against {url}")
    return examples


def run_warmup(cfg: RunConfig, out: Path, threads: int | None = 1, log=print, env_url: str | None = None) -> dict:
    """Warm up the policy of ``cfg`` and save it with its tokenizer as a checkpoint at ``out``.

    Writes ``out/`` (HF checkpoint + tokenizer files) and ``out/warmup.json`` (losses, held-out
    evaluation, wall time). ``threads`` caps torch's CPU threads (None leaves it). An
    environment of the user's (``env.name`` not one of moerl's) is reached at ``env_url``
    (default ``env.url``) for its demonstrations (`user_env_examples`; none: no fitting step)
    and its held-out episodes.

    Returns:
        The summary written to warmup.json.

    Raises:
        ValueError: bad task config (see `make_splits`); ``out`` exists and is not a directory,
            or is a non-empty directory that is not an earlier warm-up checkpoint.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "warmup.json").is_file():
        # Only an earlier warm-up checkpoint may be replaced: anything else is the user's.
        raise ValueError(f"--out: {out} is not empty and holds no earlier warm-up (warmup.json)")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.task.seed)
    train, heldout = make_splits(cfg.task)
    if cfg.model.path:  # a Hub id or an s3:// prefix: downloaded to the cache first
        cfg = cfg.model_copy(deep=True)
        cfg.model.path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir))
    model = build_base_policy(cfg)
    # On a GPU when there is one: the GPU-sized preset's fit takes minutes on a CPU. In fp32 there
    # too: a short fit, and the CPU's code path (bf16 compute is the trainer's, over its fp32 master).
    if torch.cuda.is_available():
        model = model.to("cuda")
    # A loaded checkpoint keeps its own tokenizer if it has one; presets use the character one.
    has_own = cfg.model.path and (Path(cfg.model.path) / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(cfg.model.path) if has_own else build_tokenizer()
    t0 = time.monotonic()
    t = cfg.task
    user_env = bool(cfg.env.name) and not cfg.env.builtin()
    examples = user_env_examples(cfg, tokenizer, env_url, log) if user_env else None
    fitted = not (user_env and examples is None)
    if not fitted:
        losses = [float("nan")]
    else:
        losses = warm_up(model, tokenizer, train, t.warmup_steps, t.warmup_lr, t.warmup_batch_size, t.seed, log,
                         env_cfg=cfg.env, examples=examples)
    wall = time.monotonic() - t0
    # Written beside `out` and renamed once its evaluation is in warmup.json: a warm-up whose
    # evaluation failed (a user environment's null rewards) leaves nothing `moerl run` would reuse.
    staging = out.parent / f".{out.name}.staging"
    try:
        save_policy(model, staging, EPContext.local(), overwrite=True)
        save_tokenizer(staging, tokenizer)
        del model  # the evaluation loads the saved checkpoint: no second copy on a GPU
        # The held-out figure as `moerl run` measures it (from the saved checkpoint), so that it
        # can take this one as its "before RL" instead of measuring the same thing again.
        total, done = evaluation_size(heldout), [0, 0]

        def progress(n: int) -> None:
            done[0] += n
            if done[0] >= done[1] + total / 10 or done[0] == total:
                done[1] = done[0]
                log(f"warmup: held-out evaluation {done[0]}/{total}")

        result = evaluate_run_policy(cfg, staging, env_url, progress=progress)
        summary = dict(task=t.name, steps=t.warmup_steps if fitted else 0, first_loss=losses[0],
                       last_loss=losses[-1], wall_s=round(wall, 2), heldout=asdict(result),
                       evaluation=evaluation_key(cfg), checkpoint=str(out))
        (staging / "warmup.json").write_text(json.dumps(summary, indent=1))
        if out.exists():  # an earlier warm-up (checked above): replaced
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"warmup done in {wall:.1f}s: loss {losses[0]:.3f} -> {losses[-1]:.3f}; held-out mean reward "
        f"sampled(T={result.temperature}) {result.sampled:.3f}, greedy {result.greedy:.3f}; saved {out}")
    return summary


cli = typer.Typer(add_completion=False, help="Make the tiny base policy with a short supervised warm-up.")


@cli.command()
def main(
    config: Path | None = typer.Option(None, "--config", help="Run config YAML (default: built-in defaults)."),
    out: Path = typer.Option(..., "--out", help="Checkpoint directory to write."),
    threads: int = typer.Option(1, help="torch CPU threads (the machine is shared)."),
    env_url: str = typer.Option(None, "--env-url", help="A user environment's server (default: env.url)."),
) -> None:
    """Warm up the policy on the task's training examples and save it as an HF checkpoint."""
    cfg = RunConfig.load(config) if config else RunConfig()
    try:
        run_warmup(cfg, out, threads=threads, env_url=env_url)
    except EnvError as e:  # a user's environment failed its episodes: one line, exit 2 (app/cli.py)
        raise ValueError(str(e)) from None
