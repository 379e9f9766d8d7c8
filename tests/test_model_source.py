"""app.model.source: model.path as a local directory, an s3:// prefix (moto's server over real
HTTP, two processes racing for one cache dir) and a Hugging Face Hub id (huggingface_hub's own
offline cache: HF_HUB_OFFLINE=1 and a pre-populated cache, so the library's code path runs)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import boto3
import pytest
import torch
from filelock import FileLock

from app.config import RouterConfig
from app.model.checkpoint import load_policy, save_policy
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.policy import build_policy
from app.model.source import lock_path, resolve_model_path

LOCAL = EPContext.local()
ROOT = Path(__file__).resolve().parents[1]
# Files of a Hub-style repository that are not part of a model directory moerl reads.
NOT_DOWNLOADED = {"README.md": b"# readme", "original/consolidated.00.pth": b"x" * 100,
                  "onnx/model.safetensors": b"not ours"}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    """A tiny saved policy plus tokenizer files, as a Hub repository holds them."""
    torch.set_num_threads(1)
    out = save_policy(build_policy(tiny_config("tiny-qwen3-moe"), RouterConfig(), LOCAL, seed=4),
                      tmp_path_factory.mktemp("src") / "model", LOCAL, max_shard_bytes=60_000)
    (out / "tokenizer.json").write_text('{"version": "1.0"}')
    (out / "tokenizer_config.json").write_text("{}")
    return out


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


# ---------------------------------------------------------------- local


def test_local_directory_is_used_as_is(hf_dir, tmp_path):
    assert resolve_model_path(str(hf_dir), tmp_path / "cache") == hf_dir
    assert not (tmp_path / "cache").exists()  # nothing copied
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"model\.path '.*empty': .* has no config\.json"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match=r"model\.path '/no/such/dir': not a local directory, an s3://"):
        resolve_model_path("/no/such/dir", tmp_path / "cache")


# ---------------------------------------------------------------- s3


@pytest.fixture
def s3_model(moto_s3, hf_dir, monkeypatch) -> str:
    """hf_dir (and some files a model directory does not need) under s3://<new bucket>/models/tiny."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)  # S3Store's endpoint, inherited by children
    bucket = f"moerl-test-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=moto_s3)
    client.create_bucket(Bucket=bucket)
    for name, data in {**_files(hf_dir), **NOT_DOWNLOADED}.items():
        client.put_object(Bucket=bucket, Key=f"models/tiny/{name}", Body=data)
    client.put_object(Bucket=bucket, Key="models/tiny-other/config.json", Body=b"{}")  # a sibling prefix
    return f"s3://{bucket}/models/tiny"


def test_s3_prefix_downloads_the_model_files_once(s3_model, hf_dir, tmp_path, caplog):
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="app.model.source"):
        got = resolve_model_path(s3_model + "/", cache)
    assert got.parent == cache / "s3" and _files(got) == _files(hf_dir)  # README, original/, onnx/ left out
    assert sorted(p.name for p in got.parent.iterdir()) == [got.name]  # no temporary directory left
    assert sum(bool(re.search(r"downloading \d+ files", r.message)) for r in caplog.records) == 1
    model = load_policy(got, RouterConfig(), LOCAL)
    assert model.config.model_type == "qwen3_moe"

    caplog.clear()
    mtimes = {p: p.stat().st_mtime_ns for p in got.iterdir()}
    with caplog.at_level(logging.INFO, logger="app.model.source"):
        assert resolve_model_path(s3_model, cache) == got
    assert not any(re.search(r"downloading \d+ files", r.message) for r in caplog.records)
    assert {p: p.stat().st_mtime_ns for p in got.iterdir()} == mtimes


def test_s3_bad_prefix_or_bucket_names_model_path(s3_model, tmp_path):
    bucket = s3_model.split("/")[2]
    with pytest.raises(FileNotFoundError, match=rf"model\.path 's3://{bucket}/models/none': no config\.json in that prefix"):
        resolve_model_path(f"s3://{bucket}/models/none", tmp_path)
    with pytest.raises(FileNotFoundError, match=rf"model\.path 's3://{bucket}/models/tiny-other': no model\.safetensors"):
        resolve_model_path(f"s3://{bucket}/models/tiny-other", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model\.path 's3://no-such-bucket-moerl/x': s3 bucket 'no-such-bucket-moerl' .* does not exist"):
        resolve_model_path("s3://no-such-bucket-moerl/x", tmp_path)
    assert not (tmp_path / "s3").exists() or not any((tmp_path / "s3").iterdir())  # nothing half-written


_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from app.model.source import resolve_model_path
print(resolve_model_path(sys.argv[1], sys.argv[2]))
"""


def _child(path: str, cache: Path, err: Path, env: dict | None = None, cwd: Path = ROOT) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _CHILD, path, str(cache)], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=err.open("w"),
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_two_processes_racing_for_one_cache_dir(s3_model, hf_dir, tmp_path):
    """The test holds the host lock until both processes wait on it, so they race for certain:
    one downloads, the other waits and then uses the same directory."""
    cache = tmp_path / "cache"
    lock_file = lock_path(s3_model, cache)
    lock_file.parent.mkdir(parents=True)
    errs = [tmp_path / f"child{i}.err" for i in range(2)]
    with FileLock(str(lock_file)):
        children = [_child(s3_model, cache, err) for err in errs]
        deadline = time.monotonic() + 60
        while not all("waiting" in e.read_text() for e in errs):
            assert time.monotonic() < deadline, [e.read_text() for e in errs]
            assert all(c.poll() is None for c in children), [e.read_text() for e in errs]
            time.sleep(0.1)
        assert not (cache / "s3").exists()
    outs = [c.communicate(timeout=120)[0] for c in children]
    logs = [e.read_text() for e in errs]
    assert [c.returncode for c in children] == [0, 0], logs
    paths = {Path(o.strip()) for o in outs}
    assert len(paths) == 1, outs
    assert sum(len(re.findall(r"downloading \d+ files", text)) for text in logs) == 1, logs
    assert _files(paths.pop()) == _files(hf_dir)


# ---------------------------------------------------------------- Hugging Face Hub (offline cache)


def test_hub_id_resolves_from_the_offline_hub_cache(hf_dir, tmp_path):
    """The Hub cache layout (huggingface_hub docs, "Understand caching"): models--owner--name/
    refs/main holds the commit, snapshots/<commit>/ the files. With HF_HUB_OFFLINE=1 the library
    answers from it; a repository it does not hold is an error naming model.path."""
    cache = tmp_path / "cache"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "hub" / "models--acme--tiny-moe"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for name, data in _files(hf_dir).items():
        (snapshot / name).write_bytes(data)
    (tmp_path / "acme").mkdir()  # the children run in tmp_path: a local acme/ without tiny-moe/

    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    child = _child("acme/tiny-moe", cache, tmp_path / "ok.err", env=offline, cwd=tmp_path)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0, (tmp_path / "ok.err").read_text()
    assert Path(out.strip()) == snapshot
    assert load_policy(Path(out.strip()), RouterConfig(), LOCAL).config.model_type == "qwen3_moe"

    child = _child("acme/not-cached", cache, tmp_path / "missing.err", env=offline, cwd=tmp_path)
    child.communicate(timeout=120)
    err = (tmp_path / "missing.err").read_text()
    assert child.returncode != 0
    assert "FileNotFoundError: model.path 'acme/not-cached': no local directory of that name" in err
    assert "HF_HUB_OFFLINE" in err  # huggingface_hub's own reason



def test_the_trainer_starts_from_an_s3_model_path(s3_model, hf_dir, tmp_path, redis_server, monkeypatch):
    """`moerl train` with model.path an s3:// prefix (the cluster recipes' form): the checkpoint is
    downloaded to model.cache_dir, and the sharded trainer's first published version is it."""
    import threading

    import torch.distributed as dist
    from safetensors.torch import load_file

    from app.config import RunConfig
    from app.storage import open_store
    from app.storage.policy import download_policy
    from app.trainer.trainer import Trainer
    from helpers import fake_producer, single_rank_env

    cfg = RunConfig.model_validate({
        "run_id": "s3-start", "store_url": f"file://{tmp_path}/store",
        "model": {"path": s3_model, "cache_dir": str(tmp_path / "cache")},
        "buffer": {"redis_url": redis_server}, "rollout": {"group_size": 2},
        "trainer": {"steps": 1, "groups_per_step": 1, "batch_timeout_s": 60},
    })
    single_rank_env(monkeypatch)
    stop = threading.Event()
    producer = threading.Thread(target=fake_producer, args=(redis_server, "s3-start", stop, 2), daemon=True)
    producer.start()
    try:
        Trainer(cfg, tmp_path / "run").train()
    finally:
        stop.set()
        producer.join(10)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert any((tmp_path / "cache").rglob("config.json"))  # downloaded to the node-local cache
    v0 = download_policy(open_store(cfg.store_url), "s3-start", 0, tmp_path / "v0")
    got = {k: v for f in v0.glob("*.safetensors") for k, v in load_file(f).items()}
    want = {k: v for f in hf_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_init_container_command_fetches_into_the_path_sglang_is_given(s3_model, hf_dir, tmp_path):
    """`python3 -m app.model.source PATH --cache-dir DIR` (the engine pods' init container)
    downloads into `store_copy_dir` (the --model-path charts8s renders) and prints it; a prefix
    that holds no model ends in one error line on stderr and exit 2."""
    from app.model.source import store_copy_dir

    cache = tmp_path / "base"
    run = [sys.executable, "-m", "app.model.source", s3_model, "--cache-dir", str(cache)]
    got = subprocess.run(run, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert got.returncode == 0, got.stderr
    assert Path(got.stdout.strip()) == store_copy_dir(s3_model, cache)
    assert _files(store_copy_dir(s3_model, cache)) == _files(hf_dir)
    bad = subprocess.run(run[:3] + [s3_model + "-none", "--cache-dir", str(cache)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith("app.model.source: model.path")
