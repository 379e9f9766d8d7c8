"""A fingerprint of what a warm-up sees: its problems and, for an environment of the user's, the
environment's own answers. `moerl run` keys its warm-up cache on it (app/local/run.py
`warmup_dir`), so that a changed environment is never served a stale warm-up.

The run config alone is not enough: an environment served at ``env.url`` (or an import path
whose code changed) can give other problems under the same config. A user changed the letters
of a sorting environment from a..j to a..z; the cache, keyed on the config, said "warm-up:
reusing ..." and RL started from a held-out reward of 0.049 instead of 0.424.

What goes in:

* the task's problems, train and held-out (`app.envs.tasks.make_splits`: each prompt's text,
  reference answer and spec), which also catches a dataset whose generator changed;
* with an environment of the user's, its reset observations, whole (the text the policy reads
  and OpenEnv's metadata, where ``env.demos_from_env`` takes its demonstrations), for the first
  `RESETS` training and held-out specs, played on one session of its server (OpenEnv starts a
  new episode at every reset).

Demonstrations from ``env.demos_path`` are keyed by the file's bytes (`app.local.run.warmup_dir`);
moerl's own environments by their scripted demonstrations' mix.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from app.config import RunConfig
from app.envs.env_client import EnvSession
from app.envs.episodes_remote import spec_text
from app.envs.tasks import make_splits

RESETS = 16  # reset observations per split in the fingerprint of a user's environment


def problems_digest(cfg: RunConfig) -> str:
    """sha256 of the task's train and held-out problems (text, answer, spec), in order."""
    h = hashlib.sha256()
    for split in make_splits(cfg.task):
        for p in split:
            h.update(json.dumps([p.text, p.answer, p.spec]).encode())
            h.update(b"\n")
    return h.hexdigest()


async def _resets(url: str, specs: list[str], timeout_s: float) -> list[dict]:
    out = []
    async with EnvSession(url, step_timeout_s=timeout_s) as env:
        for i, spec in enumerate(specs):
            first = await env.reset(spec=spec, episode_id=f"moerl-fingerprint-{i}")
            out.append({"observation": first.observation, "metadata": first.metadata, "done": first.done})
    return out


def environment_digest(cfg: RunConfig, url: str) -> str:
    """sha256 of the reset observations the server at ``url`` gives the first `RESETS` training
    and held-out problems.

    Raises:
        EnvError: a reset failed (the server's own error, named).
    """
    train, heldout = make_splits(cfg.task)
    specs = [spec_text(p.spec) for p in train[:RESETS] + heldout[:RESETS]]
    seen = asyncio.run(_resets(url, specs, cfg.env.step_timeout_s))
    return hashlib.sha256(json.dumps(seen, sort_keys=True, default=str).encode()).hexdigest()


def warmup_fingerprint(cfg: RunConfig, env_url: str | None = None) -> dict[str, str]:
    """``{"problems": digest}`` and, with an environment of the user's, ``{"environment": digest}``
    of its server at ``env_url`` (default ``env.url``).

    Raises:
        ValueError: an environment of the user's and no server address.
        EnvError: a reset failed.
    """
    out = {"problems": problems_digest(cfg)}
    if cfg.env.name and not cfg.env.builtin():
        url = env_url or cfg.env.url
        if not url:
            raise ValueError(f"env.url: the warm-up of {cfg.env.name!r} is keyed on its server's answers; "
                             "no server address")
        out["environment"] = environment_digest(cfg, url)
    return out
