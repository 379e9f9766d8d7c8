"""A learned reward model for the embedded default, and the reward function that asks `moerl reward`.

Making one (like the warm-up policy, from the task's own labelled examples; nothing downloaded):

    python -m app.envs.reward_model --config run.yaml --base runs/cache/warmup-... --out runs/rm

The model is the warm-up policy's trunk with a fresh one-output score head, as stock
``AutoModelForSequenceClassification`` loads it from the policy checkpoint (the usual RLHF
recipe: the reward model starts from the SFT model). It is fitted by mean squared error on
``(prompt + candidate answer, verifier score)`` pairs built from the TRAINING prompts: the
reference answer (score 1) and corrupted copies of it (a character replaced, dropped, inserted,
two swapped, the answer cut short, the prompt word echoed back), each labelled by the task's own
verifier, so the labels are dense in [0, 1] like the rewards RL sees. The held-out prompts are
kept for the check written beside the checkpoint (``reward_model.json``: MSE and how often the
reference answer outscores a corruption).

Using one: set ``task.reward_model`` to the checkpoint, start ``moerl reward --config run.yaml``
and point ``rollout.reward_url`` at it; `app.rollout.scoring.score_fn_for` then gives rollout workers a
`RemoteReward` instead of the verifier (``rollout.reward_fn``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import httpx
import typer

from app.config import RunConfig
from app.envs.rewards import score_answer_spec
from app.envs.tasks import Prompt, make_splits

# --------------------------------------------------------------------------------------------
# The reward function of rollout workers


class RemoteReward:
    """``score(task, completion) -> float`` answered by a `moerl reward` server.

    Sends ``{"text": [task.prompt + completion]}`` to ``POST {url}/score``. The worker calls it
    from several threads at once (one per completion of a group), so the server batches them.

    Args:
        url: base URL of the server (``rollout.reward_url``).
        timeout_s: per request (the worker also bounds it by ``rollout.reward_timeout_s``).

    Raises (from a call): httpx.HTTPError on a network error or a 4xx/5xx answer; the rollout
    worker fails the group on a raise (it is never trained; the task is retried).
    """

    def __init__(self, url: str, timeout_s: float = 5.0):
        self.url = url.rstrip("/")
        self._client = httpx.Client(timeout=timeout_s)

    def __call__(self, task, completion: str) -> float:
        r = self._client.post(f"{self.url}/score", json={"text": [task.prompt + completion]})
        r.raise_for_status()
        return float(r.json()["rewards"][0])

    def warm(self, task_cfg=None, timeout_s: float = 300.0) -> None:
        """Wait until the server answers ``GET /health`` (its model loaded); the worker calls
        this before its first lease.

        Raises:
            TimeoutError: no healthy answer within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self._client.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"reward server {self.url} not healthy after {timeout_s:.0f} s")
            time.sleep(0.5)

    def close(self) -> None:
        self._client.close()


# --------------------------------------------------------------------------------------------
# Labelled examples and the fit

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def corrupt(answer: str, prompt: str, rng: random.Random) -> str:
    """One corrupted copy of ``answer`` (may equal it by chance; the label says so)."""
    a = list(answer)
    kind = rng.randrange(6)
    if kind == 0 and a:  # replace one character
        a[rng.randrange(len(a))] = rng.choice(_LETTERS)
    elif kind == 1 and len(a) > 1:  # drop one
        del a[rng.randrange(len(a))]
    elif kind == 2:  # insert one
        a.insert(rng.randrange(len(a) + 1), rng.choice(_LETTERS))
    elif kind == 3 and len(a) > 1:  # swap two neighbours
        i = rng.randrange(len(a) - 1)
        a[i], a[i + 1] = a[i + 1], a[i]
    elif kind == 4 and len(a) > 1:  # cut short
        a = a[: rng.randrange(1, len(a))]
    else:  # echo the prompt's word (for spell_backward: the word forwards)
        return prompt.rstrip("=") or answer
    return "".join(a)


def labelled_examples(prompts: list[Prompt], per_prompt: int = 3, seed: int = 0) -> list[tuple[str, float]]:
    """``(prompt text + candidate answer, verifier score)`` pairs: each prompt's reference answer
    and ``per_prompt`` corruptions of it, scored by `app.envs.rewards.score_answer_spec`."""
    rng = random.Random(seed)
    out = []
    for p in prompts:
        for cand in [p.answer] + [corrupt(p.answer, p.text, rng) for _ in range(per_prompt)]:
            out.append((p.text + cand, score_answer_spec(p.spec, cand)))
    return out


def encode(texts: list[str], tokenizer, pad_id: int):
    """Right-padded ``input_ids [B, L] int64`` and ``attention_mask [B, L] int64`` of texts
    (``<bos>`` prepended by the tokenizer)."""
    import torch  # only to fit or check a model: the rollout worker imports RemoteReward without it

    seqs = [tokenizer(t)["input_ids"] for t in texts]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
    return ids, attn


def predict(model, tokenizer, texts: list[str], batch_size: int = 256) -> list[float]:
    """The model's scalar output for each text (eval mode, no gradient)."""
    import torch  # only to fit or check a model: the rollout worker imports RemoteReward without it

    model.eval()
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            ids, attn = encode(texts[i : i + batch_size], tokenizer, model.config.pad_token_id)
            out += model(input_ids=ids, attention_mask=attn).logits[:, 0].float().tolist()
    return out


def check_reward_model(model, tokenizer, prompts: list[Prompt], seed: int = 1) -> dict:
    """Held-out quality: MSE against the verifier, and the fraction of (reference, corruption)
    pairs of one prompt where the reference answer scores higher (ties in the verifier skipped)."""
    examples = labelled_examples(prompts, per_prompt=3, seed=seed)
    preds = predict(model, tokenizer, [t for t, _ in examples])
    labels = [y for _, y in examples]
    mse = sum((p - y) ** 2 for p, y in zip(preds, labels)) / len(labels)
    wins = pairs = 0
    for k in range(0, len(examples), 4):  # [reference, 3 corruptions] per prompt
        for j in range(1, 4):
            if labels[k + j] < labels[k]:
                pairs += 1
                wins += preds[k] > preds[k + j]
    return {"n": len(labels), "mse": mse, "label_var": _var(labels), "ranking_accuracy": wins / max(pairs, 1)}


def _var(x: list[float]) -> float:
    m = sum(x) / len(x)
    return sum((v - m) ** 2 for v in x) / len(x)


def fit_reward_model(cfg: RunConfig, base: str | os.PathLike, out: str | os.PathLike, steps: int = 400,
                     lr: float = 3e-3, batch_size: int = 64, threads: int | None = 1, log=print) -> dict:
    """Fit a reward model from the policy checkpoint ``base`` and save it at ``out``.

    Writes ``out/`` (HF sequence-classification checkpoint + tokenizer) and
    ``out/reward_model.json`` (losses, held-out check, wall time); the directory is assembled
    under a temporary name and renamed into place, so ``out`` is either complete or absent.

    Args:
        cfg: run config (``task`` gives the prompts and the verifier).
        base: an HF causal-LM checkpoint (the warm-up policy) whose trunk starts the model.
        out: checkpoint directory to write; must not exist yet.
        steps, lr, batch_size: AdamW fit (`app.envs.warmup.lr_at`: linear warm-up over 10% of the
            steps, then cosine to lr / 10).
        threads: torch CPU threads (None leaves torch's default).

    Returns:
        The summary written to reward_model.json.

    Raises:
        FileNotFoundError: ``base`` has no config.json.
        FileExistsError: ``out`` exists.
    """
    # torch and transformers: only to fit a reward model; the rollout worker imports this module
    # (RemoteReward) without them
    import torch
    from transformers import AutoModelForSequenceClassification

    from app.envs.warmup import lr_at
    from app.model.tokenizer import PAD_ID, build_tokenizer, save_tokenizer

    base, out = Path(base), Path(out)
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"--base: {base} has no config.json (expected the warm-up policy checkpoint)")
    if out.exists():
        raise FileExistsError(f"--out: {out} exists; choose a new directory")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(cfg.task.seed)
    train, heldout = make_splits(cfg.task)
    examples = labelled_examples(train, seed=cfg.task.seed)
    tokenizer = build_tokenizer()
    # no Hub kernels: app/engine/load.py says why
    model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, pad_token_id=PAD_ID,
                                                               use_kernels=False)
    model.config.pad_token_id = PAD_ID
    before = check_reward_model(model, tokenizer, heldout)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    rng = random.Random(cfg.task.seed)
    warm = max(1, steps // 10)
    losses = []
    t0 = time.monotonic()
    model.train()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup=warm)
        batch = rng.sample(examples, min(batch_size, len(examples)))
        ids, attn = encode([t for t, _ in batch], tokenizer, PAD_ID)
        target = torch.tensor([y for _, y in batch], dtype=torch.float32)
        pred = model(input_ids=ids, attention_mask=attn).logits[:, 0].float()
        loss = torch.nn.functional.mse_loss(pred, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"reward model step {step + 1}/{steps} mse {losses[-1]:.4f}")
    wall = time.monotonic() - t0
    after = check_reward_model(model, tokenizer, heldout)
    summary = dict(task=cfg.task.name, base=str(base), steps=steps, examples=len(examples), first_loss=losses[0],
                   last_loss=losses[-1], wall_s=round(wall, 2), heldout_before=before, heldout=after,
                   checkpoint=str(out))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    save_tokenizer(tmp, tokenizer)
    (tmp / "reward_model.json").write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out)
    if log:
        log(f"reward model done in {wall:.1f}s: held-out mse {after['mse']:.4f} (labels' variance "
            f"{after['label_var']:.4f}), reference ranked above a corruption {after['ranking_accuracy']:.1%}; saved {out}")
    return summary


cli = typer.Typer(add_completion=False, help="Fit a reward model on the task's labelled examples.")


@cli.command()
def main(
    base: Path = typer.Option(..., "--base", help="Warm-up policy checkpoint (HF) to start from."),
    out: Path = typer.Option(..., "--out", help="Reward-model checkpoint directory to write."),
    config: Path | None = typer.Option(None, "--config", help="Run config YAML (default: built-in defaults)."),
    steps: int = typer.Option(400, "--steps", min=1),
    lr: float = typer.Option(3e-3, "--lr", min=0.0),
    threads: int = typer.Option(1, "--threads", min=1, help="torch CPU threads (the machine is shared)."),
) -> None:
    """Fit and save the reward model; prints its held-out check."""
    cfg = RunConfig.load(config) if config else RunConfig()
    try:
        fit_reward_model(cfg, base, out, steps=steps, lr=lr, threads=threads)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        typer.echo(f"reward model: {e}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
