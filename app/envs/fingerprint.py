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
  new episode at every reset);
* with ``env.demos_from_env``, what the server answers to the demonstrations of the first
  `PLAYED` training specs, rewards included: a user who rescaled the reward (10x) was served the
  old warm-up and its "before RL" figure, and the new reward's range was found only after start.
  A change to how other answers are scored is not seen; a new ``--cache`` folder is the way then.

Demonstrations from ``env.demos_path`` are keyed by the file's bytes (`app.local.run.warmup_dir`);
moerl's own environments by their scripted demonstrations' mix.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from app.config import RunConfig
from app.envs.env_client import EnvSession
from app.envs.episodes_remote import own_demonstration, spec_text
from app.envs.tasks import make_splits
from app.envs.wire import fetch_wire_format

RESETS = 16  # reset observations per split in the fingerprint of a user's environment
PLAYED = 4  # of those, the training specs whose demonstration is played (env.demos_from_env)


def problems_digest(cfg: RunConfig) -> str:
    """sha256 of the task's train and held-out problems (text, answer, spec), in order."""
    h = hashlib.sha256()
    for split in make_splits(cfg.task):
        for p in split:
            h.update(json.dumps([p.text, p.answer, p.spec]).encode())
            h.update(b"\n")
    return h.hexdigest()


async def _resets(url: str, specs: list[str], timeout_s: float, played: int = 0, wire=None) -> list[dict]:
    """The reset observation of each spec; for the first ``played``, also the server's answers
    (observation, reward, done) to the demonstration in the reset's metadata, sent in ``wire``'s
    action field."""
    out = []
    async with EnvSession(url, step_timeout_s=timeout_s) as env:
        for i, spec in enumerate(specs):
            first = await env.reset(spec=spec, episode_id=f"moerl-fingerprint-{i}")
            seen = {"observation": first.observation, "metadata": first.metadata, "done": first.done}
            if i < played:
                seen["answers"] = []
                for text in own_demonstration(first, url):
                    result = await env.step(wire.action(text))
                    seen["answers"].append({"observation": result.observation, "reward": result.reward,
                                            "done": result.done})
                    if result.done:
                        break
            out.append(seen)
    return out


def environment_digest(cfg: RunConfig, url: str) -> str:
    """sha256 of the reset observations the server at ``url`` gives the first `RESETS` training
    and held-out problems and, with ``env.demos_from_env``, its answers to the first `PLAYED`
    demonstrations.

    Raises:
        EnvError: a reset or step failed (the server's own error, named), or a reset held no
            demonstration (``env.demos_from_env``).
        WireError: the server's /schema has no text fields.
    """
    train, heldout = make_splits(cfg.task)
    specs = [spec_text(p.spec) for p in train[:RESETS] + heldout[:RESETS]]
    played, wire = (PLAYED, fetch_wire_format(url)) if cfg.env.demos_from_env else (0, None)
    seen = asyncio.run(_resets(url, specs, cfg.env.step_timeout_s, played, wire))
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
