"""Held-out evaluation: mean reward of the policy over held-out prompts.

Completions are sampled at the rollout temperature (the number RL is judged on) and greedily,
with ``model.generate`` on left-padded prompt batches; each is scored with app/envs/rewards.py.
Works on an in-memory model (ours or stock transformers) or on a checkpoint directory loaded with
stock ``AutoModelForCausalLM`` and ``AutoTokenizer``, so it also checks that a published policy is
loadable by tools other than ours. For an environment task (``env``), each held-out prompt is a
whole episode against the environment, played in process (app/envs/episodes_local.py ``play``),
and its reward is the environment's, as in training.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import typer
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from app.config import RunConfig
from app.envs import episodes_remote
from app.envs.rewards import score_answer_spec
from app.envs.tasks import Prompt, make_splits
from app.envs.wire import fetch_wire_format
from app.model.tokenizer import load_tokenizer


@dataclass
class EvalResult:
    """Mean held-out reward.

    Attributes:
        n: prompts evaluated.
        temperature: sampling temperature used for ``sampled``.
        samples: completions sampled per prompt for ``sampled``.
        sampled: mean reward of the completions sampled at ``temperature``.
        greedy: mean reward of the greedy completion (None if not asked for).
    """

    n: int
    temperature: float
    samples: int
    sampled: float
    greedy: float | None = None


@torch.no_grad()
def generate(model, tokenizer, texts: list[str], temperature: float, max_new_tokens: int) -> list[str]:
    """Complete each prompt text once; temperature 0 means greedy.

    Prompts are tokenized with ``<bos>`` (as the engine does) and left-padded. Returns the decoded
    completions without special tokens; a completion that never produced ``<eos>`` within
    ``max_new_tokens`` is returned as "" (unfinished answers earn no reward, as in rollouts).
    """
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    kwargs = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=None)
    out = model.generate(
        input_ids=batch["input_ids"].to(device),
        attention_mask=batch["attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        **kwargs,
    )
    completions = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        if eos not in row:
            completions.append("")
            continue
        completions.append(tokenizer.decode(row[: row.index(eos)], skip_special_tokens=True))
    return completions


def mean_reward(model, tokenizer, prompts: list[Prompt], temperature: float, max_new_tokens: int,
                samples: int = 1, batch_size: int = 128, progress=None) -> float:
    """Mean reward of ``samples`` completions per prompt at ``temperature`` (0 = greedy);
    ``progress(n)`` after each batch of ``n``."""
    items = [p for p in prompts for _ in range(samples)]
    total = 0.0
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        for p, c in zip(chunk, generate(model, tokenizer, [p.text for p in chunk], temperature, max_new_tokens)):
            total += score_answer_spec(p.spec, c)
        if progress is not None:
            progress(len(chunk))
    return total / len(items)


def mean_episode_reward(model, tokenizer, prompts: list[Prompt], env, temperature: float, max_new_tokens: int,
                        samples: int = 1, overlong_reward: float | None = 0.0, env_url: str | None = None,
                        rollout=None, progress=None) -> float:
    """Mean reward of ``samples`` episodes per prompt of environment ``env`` (an EnvConfig):
    played in process for moerl's environments, against the server at ``env_url`` (default
    ``env.url``) for any other (app/envs/episodes_remote.py), whose rewards must lie in
    ``rollout.reward_range`` (a `RolloutConfig`). ``progress(n)`` as ``n`` episodes end.

    Raises:
        ValueError: a user's environment and no server address.
        EnvError, WireError: the server failed or has no text fields, or a reward broke the rule.
    """
    items = [p for p in prompts for _ in range(samples)]
    if env.builtin():
        # openenv (the env extra, pyproject.toml; environments.py needs it): only for moerl's
        # environments, so a task without one evaluates where it is not installed
        from app.envs.episodes_local import play

        rewards = play(model, tokenizer, items, env, temperature, max_new_tokens, overlong_reward, progress=progress)
    else:
        url = env_url or env.url
        if not url:
            raise ValueError(f"env.url: the held-out episodes of {env.name!r} need its server's address")
        rewards = episodes_remote.play(model, tokenizer, items, env, url, fetch_wire_format(url), temperature,
                                       max_new_tokens, overlong_reward, rollout=rollout, progress=progress)
    return sum(rewards) / len(items)


def evaluation_size(prompts: list, samples: int = 4, greedy: bool = True) -> int:
    """Completions (or episodes) `evaluate` makes: ``samples`` sampled and one greedy per prompt."""
    return len(prompts) * (samples + int(greedy))


def evaluate(model, tokenizer, prompts: list[Prompt], temperature: float = 1.0, max_new_tokens: int = 8,
             greedy: bool = True, seed: int = 0, samples: int = 4, env=None,
             overlong_reward: float | None = 0.0, env_url: str | None = None, rollout=None,
             progress=None) -> EvalResult:
    """Held-out mean reward of ``model`` (sampled at ``temperature``, and greedy if asked).
    ``progress(n)`` is called as ``n`` more of the `evaluation_size` completions are scored;
    ``rollout`` (a `RolloutConfig`) gives the reward range a user environment's rewards must keep.

    ``samples`` completions per prompt (default 4) halve the sampling noise of the sampled figure
    (the part of its standard error that comes from which completions were drawn, ~0.03 with one
    completion on 200 prompts of the tiny recipe), which is the noise in a before/after difference
    on the same prompts. Sampling is seeded (``seed``) without touching the caller's global RNG state. The model is
    put in eval mode and its previous mode restored.

    Raises:
        ValueError: ``prompts`` is empty.
    """
    if not prompts:
        raise ValueError("evaluate: no held-out prompts (task.eval_size must be >= 1)")
    if samples < 1:
        raise ValueError(f"evaluate: samples must be >= 1, got {samples}")
    was_training = model.training
    model.eval()
    try:
        if env is not None:
            def score(temp: float, n: int) -> float:
                return mean_episode_reward(model, tokenizer, prompts, env, temp, max_new_tokens, n, overlong_reward,
                                           env_url, rollout, progress)
        else:
            def score(temp: float, n: int) -> float:
                return mean_reward(model, tokenizer, prompts, temp, max_new_tokens, n, progress=progress)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            sampled = score(temperature, samples)
        best = score(0.0, 1) if greedy else None
    finally:
        model.train(was_training)
    return EvalResult(n=len(prompts), temperature=temperature, samples=samples, sampled=sampled, greedy=best)


def evaluate_checkpoint(path: str | os.PathLike, prompts: list[Prompt], temperature: float = 1.0,
                        max_new_tokens: int = 8, greedy: bool = True, seed: int = 0, samples: int = 4,
                        env=None, overlong_reward: float | None = 0.0, env_url: str | None = None,
                        rollout=None, progress=None) -> EvalResult:
    """`evaluate` a checkpoint directory loaded with stock transformers (model and tokenizer), in
    fp32, on the GPU when there is one.

    Raises:
        FileNotFoundError: ``path`` has no config.json or no tokenizer.json.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face checkpoint directory)")
    tokenizer = load_tokenizer(path)
    # no Hub kernels: app/engine/load.py says why
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, use_kernels=False)
    cuda = torch.cuda.is_available()
    if cuda:  # a GPU-sized policy's generations take minutes on a CPU
        model = model.to("cuda")
    try:
        return evaluate(model, tokenizer, prompts, temperature, max_new_tokens, greedy, seed, samples, env,
                        overlong_reward, env_url, rollout, progress)
    finally:
        del model
        if cuda:  # give the GPU memory back: the caller goes on beside the run's trainer and engines
            torch.cuda.empty_cache()


def evaluation_key(cfg) -> dict:
    """What a run's held-out figure depends on besides the checkpoint and the task's problems
    (the warm-up cache's key holds those): a figure recorded with an equal key is the same
    measurement (`moerl run` reuses the warm-up's own instead of measuring it twice)."""
    r = cfg.rollout
    return {"temperature": r.temperature, "max_new_tokens": r.max_new_tokens, "overlong_reward": r.overlong_reward,
            "reward_range": list(r.reward_range), "samples": 4, "eval_size": cfg.task.eval_size,
            "seed": cfg.task.seed, "env": cfg.env.model_dump(exclude={"url"}) if cfg.env.name else None}


def evaluate_run_policy(cfg, model_dir: str | os.PathLike, env_url: str | None = None, progress=None) -> EvalResult:
    """The held-out figure of a run (a `RunConfig`): the checkpoint in ``model_dir`` loaded with
    stock transformers, the task's held-out problems (episodes of ``env.name``, its server at
    ``env_url`` for a user's), sampled at ``rollout.temperature`` (4 per problem) and greedy.
    The warm-up and `moerl run` (before and after RL) measure it alike."""
    hf_logging.disable_progress_bar()  # no "Loading weights" bar in logs and between the run's own lines
    _, heldout = make_splits(cfg.task)
    return evaluate_checkpoint(model_dir, heldout, temperature=cfg.rollout.temperature,
                               max_new_tokens=cfg.rollout.max_new_tokens, seed=cfg.task.seed,
                               env=cfg.env if cfg.env.name else None, overlong_reward=cfg.rollout.overlong_reward,
                               env_url=env_url, rollout=cfg.rollout, progress=progress)


cli = typer.Typer(add_completion=False, help="Held-out mean reward of a checkpoint.")


@cli.command()
def main(
    checkpoint: Path = typer.Option(..., "--checkpoint", help="HF checkpoint dir with tokenizer files."),
    config: Path | None = typer.Option(None, "--config", help="Run config YAML (task section)."),
    temperature: float | None = typer.Option(None, help="Default: rollout.temperature."),
) -> None:
    """Print the held-out mean reward (sampled and greedy) of CHECKPOINT as one JSON line."""
    cfg = RunConfig.load(config) if config else RunConfig()
    _, heldout = make_splits(cfg.task)
    temp = cfg.rollout.temperature if temperature is None else temperature
    res = evaluate_checkpoint(checkpoint, heldout, temp, cfg.rollout.max_new_tokens, seed=cfg.task.seed,
                              env=cfg.env if cfg.env.name else None, overlong_reward=cfg.rollout.overlong_reward)
    typer.echo(json.dumps(asdict(res)))


if __name__ == "__main__":  # python -m app.envs.evaluate --checkpoint DIR [--config run.yaml]
    cli()
