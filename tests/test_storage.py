"""Object store (file:// and s3:// on moto's server over HTTP) and the policy-version layout."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

import boto3
import pytest

import app.storage.file as file_mod
from app.storage import (download_policy, latest_policy_version, open_store, policy_versions,
                         prune_policies, publish_policy)
from app.storage.policy import MANIFEST
from app.storage.s3 import MiB, S3Store


def new_bucket(endpoint: str) -> str:
    name = f"moerl-test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return open_store(f"file://{tmp_path / 'store'}")
    endpoint = request.getfixturevalue("moto_s3")
    return open_store(f"s3://{new_bucket(endpoint)}/some/prefix", endpoint_url=endpoint)


def hf_dir(path: Path, seed: int, size: int = 2000) -> Path:
    """A stand-in HF checkpoint directory (contents only need to be distinct per version)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(f'{{"model_type": "qwen3_moe", "seed": {seed}}}')
    (path / "model.safetensors").write_bytes(bytes((seed + i) % 251 for i in range(size)))
    (path / "tokenizer").mkdir(exist_ok=True)
    (path / "tokenizer" / "vocab.json").write_text(f'{{"v{seed}": 0}}')
    return path


def test_store_basic_operations(store, tmp_path):
    store.put_bytes("a/b/one.bin", b"1")
    store.put_bytes("a/bc/two.bin", b"22")
    store.put_bytes("a/b/one.bin", b"111")  # overwrite
    assert store.get_bytes("a/b/one.bin") == b"111"
    assert store.exists("a/b/one.bin") and not store.exists("a/b/none.bin")
    assert store.list("a/b") == ["a/b/one.bin", "a/bc/two.bin"]  # a string prefix, as in S3
    assert store.list("a/b/") == ["a/b/one.bin"]
    assert store.list() == ["a/b/one.bin", "a/bc/two.bin"]

    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3000))
    store.put_file(src, "files/src.bin")
    got = store.get_file("files/src.bin", tmp_path / "out" / "got.bin")
    assert got.read_bytes() == src.read_bytes()

    with pytest.raises(FileNotFoundError, match="none.bin"):
        store.get_bytes("a/none.bin")
    with pytest.raises(FileNotFoundError, match="none.bin"):
        store.get_file("a/none.bin", tmp_path / "missing.bin")
    assert not (tmp_path / "missing.bin").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(file_mod.TMP_MARK)]
    for bad in ["", "/abs", "a/../b", "a//b", "a/./b"]:
        with pytest.raises(ValueError, match="key"):
            store.put_bytes(bad, b"x")

    assert store.delete_prefix("a/b/") == 1
    assert store.list() == ["a/bc/two.bin", "files/src.bin"]
    with pytest.raises(ValueError, match="non-empty"):
        store.delete_prefix("")


def test_file_store_write_is_atomic(tmp_path, monkeypatch):
    store = open_store(f"file://{tmp_path / 'store'}")
    store.put_bytes("k/obj", b"old")
    src = tmp_path / "big.bin"
    src.write_bytes(b"new" * 1000)

    def broken_copy(inp, out, length=0):
        out.write(inp.read(10))
        raise OSError("disk full")

    monkeypatch.setattr(file_mod.shutil, "copyfileobj", broken_copy)
    with pytest.raises(OSError, match="disk full"):
        store.put_file(src, "k/obj")
    assert store.get_bytes("k/obj") == b"old"  # the reader never sees a partial object
    assert os.listdir(tmp_path / "store" / "k") == ["obj"]  # no temporary left behind
    # A temporary of a concurrent writer is never listed.
    (tmp_path / "store" / "k" / (file_mod.TMP_MARK + "obj.x1")).write_bytes(b"partial")
    assert store.list("k/") == ["k/obj"]


def test_open_store_urls(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rel = open_store("file://runs/store")
    assert rel.root == tmp_path / "runs" / "store" and rel.url == f"file://{tmp_path}/runs/store"
    monkeypatch.chdir("/")
    rel.put_bytes("x", b"1")  # the root was made absolute when opened
    assert (tmp_path / "runs" / "store" / "x").read_bytes() == b"1"
    with pytest.raises(ValueError, match="scheme"):
        open_store("gs://bucket/x")
    with pytest.raises(ValueError, match="no bucket"):
        open_store("s3:///x")


def test_s3_multipart_sse_and_endpoint_from_env(moto_s3, tmp_path, monkeypatch):
    bucket = new_bucket(moto_s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)
    store = open_store(f"s3://{bucket}/ckpt", sse="AES256",
                       multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    assert isinstance(store, S3Store) and store.endpoint_url == moto_s3
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(11 * MiB))
    store.put_file(big, "v1/model.safetensors")
    head = boto3.client("s3", endpoint_url=moto_s3).head_object(Bucket=bucket, Key="ckpt/v1/model.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # uploaded in 3 parts
    assert head["ServerSideEncryption"] == "AES256"
    out = store.get_file("v1/model.safetensors", tmp_path / "back.bin")
    assert hashlib.sha256(out.read_bytes()).digest() == hashlib.sha256(big.read_bytes()).digest()

    small = open_store(f"s3://{bucket}/ckpt", multipart_threshold=5 * MiB)
    small.put_bytes("small", b"x")
    head = boto3.client("s3", endpoint_url=moto_s3).head_object(Bucket=bucket, Key="ckpt/small")
    assert "-" not in head["ETag"].strip('"')


def test_s3_sse_kms(moto_s3, tmp_path):
    bucket = new_bucket(moto_s3)
    key_id = boto3.client("kms", endpoint_url=moto_s3).create_key()["KeyMetadata"]["KeyId"]
    store = open_store(f"s3://{bucket}", endpoint_url=moto_s3, sse="aws:kms", kms_key_id=key_id)
    store.put_bytes("run1/policy/latest", b"3")
    (tmp_path / "f").write_bytes(b"abc")
    store.put_file(tmp_path / "f", "run1/f")
    s3 = boto3.client("s3", endpoint_url=moto_s3)
    for key in ["run1/policy/latest", "run1/f"]:
        head = s3.head_object(Bucket=bucket, Key=key)
        assert (head["ServerSideEncryption"], head["SSEKMSKeyId"]) == ("aws:kms", key_id)


def test_s3_errors(moto_s3):
    with pytest.raises(FileNotFoundError, match="no-such-bucket-x1"):
        open_store("s3://no-such-bucket-x1/p", endpoint_url=moto_s3)
    with pytest.raises(ValueError, match="sse"):
        S3Store("b", sse="aws:kms:dsse", check=False, endpoint_url=moto_s3)
    with pytest.raises(ValueError, match="kms_key_id"):
        S3Store("b", kms_key_id="k", check=False, endpoint_url=moto_s3)


class Recorder:
    """Wraps a store and records the order of writes."""

    def __init__(self, inner):
        self.inner, self.writes = inner, []

    def put_file(self, local_path, key):
        self.writes.append(key)
        self.inner.put_file(local_path, key)

    def put_bytes(self, key, data):
        self.writes.append(key)
        self.inner.put_bytes(key, data)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_publish_writes_latest_last_and_download(store, tmp_path):
    rec = Recorder(store)
    assert latest_policy_version(store, "run1") is None
    uri = publish_policy(rec, "run1", 1, hf_dir(tmp_path / "ck1", seed=1))
    assert uri == store.uri("run1/policy/v1")
    assert rec.writes[-1] == "run1/policy/latest"
    assert rec.writes[-2] == f"run1/policy/v1/{MANIFEST}"
    assert sorted(rec.writes[:-2]) == ["run1/policy/v1/config.json", "run1/policy/v1/model.safetensors",
                                       "run1/policy/v1/tokenizer/vocab.json"]
    publish_policy(store, "run1", 2, hf_dir(tmp_path / "ck2", seed=2))
    assert latest_policy_version(store, "run1") == 2

    dest = tmp_path / "cache" / "v2"
    assert download_policy(store, "run1", 2, dest) == dest
    for rel in ["config.json", "model.safetensors", "tokenizer/vocab.json"]:
        assert (dest / rel).read_bytes() == (tmp_path / "ck2" / rel).read_bytes()
    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    download_policy(store, "run1", 2, dest)  # same version again: harmless, nothing rewritten
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime
    (dest / "model.safetensors").write_bytes(b"torn")  # a damaged local copy is replaced
    download_policy(store, "run1", 2, dest)
    assert (dest / "model.safetensors").read_bytes() == (tmp_path / "ck2" / "model.safetensors").read_bytes()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["v2"]  # no temporaries left


def test_publish_and_download_errors(store, tmp_path):
    (tmp_path / "nocfg").mkdir()
    (tmp_path / "nocfg" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="config.json"):
        publish_policy(store, "run1", 1, tmp_path / "nocfg")
    with pytest.raises(ValueError, match="version"):
        publish_policy(store, "run1", -1, hf_dir(tmp_path / "ck", 0))
    assert store.list() == []  # nothing written
    # An upload that died before its manifest is never downloaded.
    store.put_file(tmp_path / "ck" / "config.json", "run1/policy/v7/config.json")
    with pytest.raises(FileNotFoundError, match="v7.*incomplete"):
        download_policy(store, "run1", 7, tmp_path / "cache" / "v7")
    assert not (tmp_path / "cache" / "v7").exists()
    store.put_bytes("run1/policy/latest", b"garbage")
    with pytest.raises(ValueError, match="latest"):
        latest_policy_version(store, "run1")


def test_prune_keeps_newest_and_latest(store, tmp_path):
    for v in range(1, 6):
        publish_policy(store, "run1", v, hf_dir(tmp_path / f"ck{v}", seed=v))
    assert policy_versions(store, "run1") == [1, 2, 3, 4, 5]
    assert prune_policies(store, "run1", keep=2) == [1, 2, 3]
    assert policy_versions(store, "run1", complete_only=False) == [4, 5]
    assert prune_policies(store, "run1", keep=2) == []

    # v6 and v7 are being uploaded (no manifest yet, latest still 5): keep=1 deletes 4, never
    # latest (5) nor the newer uploads. Once v11 is latest, v6 and v7 are dead partial uploads.
    for v in (6, 7):
        store.put_file(tmp_path / "ck1" / "config.json", f"run1/policy/v{v}/config.json")
    assert prune_policies(store, "run1", keep=1) == [4]
    assert policy_versions(store, "run1", complete_only=False) == [5, 6, 7]
    publish_policy(store, "run1", 11, hf_dir(tmp_path / "ck11", seed=11))
    assert prune_policies(store, "run1", keep=2) == [6, 7]
    assert policy_versions(store, "run1", complete_only=False) == [5, 11]
    assert download_policy(store, "run1", 11, tmp_path / "v11").is_dir()
    with pytest.raises(ValueError, match="keep"):
        prune_policies(store, "run1", keep=0)
