"""docs/your-own-environment.md's skeleton runs as written (issue 44, item 12): its Python block is
an OpenEnv environment that `moerl env` accepts and OpenEnv's own server serves; moerl's probe
passes it, its demonstrations and episodes play, and the page's run config is valid."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from app.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "your-own-environment.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE.read_text(), flags=re.M | re.S)


@pytest.fixture
def sort_env(tmp_path, monkeypatch):
    """The page's first Python block as the module ``sort_env``."""
    (tmp_path / "sort_env.py").write_text(blocks("python")[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("sort_env")


def test_the_skeleton_is_short():
    assert len(blocks("python")[0].splitlines()) <= 30


def test_the_skeleton_trains_as_the_page_says(sort_env, tmp_path):
    from openenv.core.env_server import create_fastapi_app

    from app.envs.contract import check_reset
    from app.envs.env_client import EnvSession
    from app.envs.openenv_server import user_environment
    from app.envs.tasks import make_splits
    from app.envs.warmup import user_env_examples
    from app.envs.wire import fetch_wire_format
    from app.model.tokenizer import build_tokenizer
    from helpers import EnvServer

    (tmp_path / "sort.yaml").write_text(blocks("yaml")[0])
    cfg = RunConfig.load(tmp_path / "sort.yaml")
    assert user_environment(cfg.env.name)[0] is sort_env.SortLetters  # `moerl env` serves it
    # OpenEnv's own server, as the page's line makes it, at env.url.
    app = create_fastapi_app(sort_env.SortLetters, sort_env.SortAction, sort_env.SortObservation,
                             max_concurrent_envs=256)
    server = EnvServer(app=app)
    try:
        cfg.env.url = server.url
        cfg.task.train_size, cfg.task.eval_size = 16, 4
        wire = fetch_wire_format(server.url)
        train, heldout = make_splits(cfg.task)
        check_reset(server.url, wire, spec=train[0].spec, max_sessions=cfg.env.max_sessions)
        tok = build_tokenizer()
        examples = user_env_examples(cfg, tok, server.url, log=lambda *_: None)
        assert len(examples) == 16 and all(sum(mask) > 0 for _, mask in examples)

        async def episode(spec: str, answers: list[str]) -> tuple[list[str], float]:
            seen = []
            async with EnvSession(server.url) as env:
                r = await env.reset(spec=spec, episode_id="doc")
                word = wire.message(r.observation, reset=True)["content"].rstrip("=")
                for a in answers:
                    r = await env.step(wire.action(a if a else "".join(sorted(word))))
                    if r.done:
                        return seen, r.reward
                    seen.append(wire.message(r.observation)["content"])
            return seen, -1.0

        right = asyncio.run(episode(heldout[0].spec, [""]))
        assert right == ([], 1.0)
        hinted, reward = asyncio.run(episode(heldout[1].spec, ["zzz", ""]))
        assert hinted and hinted[0].startswith("wrong at 0 1 2") and reward == 1.0
        assert 0.0 <= asyncio.run(episode(heldout[2].spec, ["zzz", "zzz"]))[1] < 1.0
        assert all(json.loads(p.spec)["split"] == "heldout" for p in heldout)
    finally:
        server.stop()
