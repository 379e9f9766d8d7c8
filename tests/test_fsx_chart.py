"""The shared FSx for Lustre file system in the rendered manifests (issue 27 item 12): the static
PersistentVolume and its claim, which pods mount it (read-only, only on the pools whose nodes the
file system admits), where the engines and the trainer read the base model from, and the
mirror lookup of app/model/source.py behind model.path. Off (the default) renders nothing new.
"""

from __future__ import annotations

import os
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from app.model import source
from charts8s.fsx import CLAIM, DRIVER, MOUNT
from charts8s.main import build
from charts8s.workloads import WorkloadError, load_workloads
from infra.cluster import FSX_POOLS
from infra.config import POOL_LABEL, ConfigError, config_from_mapping, load_config
from test_charts import _checkov

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
FS_ID, MOUNT_NAME = "fs-0123456789abcdef0", "abcdefgh"


def _cfg(**fsx):
    return config_from_mapping("prod", {"fsx": {"enabled": True, "file_system_id": FS_ID, "mount_name": MOUNT_NAME, **fsx}},
                               "test (env prod)")


def _render(tmp_path: Path, cfg, model: str) -> list[dict]:
    wl = tmp_path / "workloads.yaml"
    wl.write_text(yaml.safe_dump({"rollout": {"model_path": model}}))
    files = build(load_workloads(cfg, wl), tmp_path / "dist")
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


def _pods(docs: list[dict]) -> dict[str, dict]:
    out = {}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            out[d["metadata"]["name"]] = d["spec"]["template"]["spec"]
        elif d["kind"] == "LeaderWorkerSet":
            out[d["metadata"]["name"]] = d["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
        elif d["apiVersion"].startswith("batch.volcano.sh/"):
            for t in d["spec"]["tasks"]:
                out[f"{d['metadata']['name']}/{t['name']}"] = t["template"]["spec"]
    return out


def _pool(pod: dict) -> str:
    return pod["nodeSelector"][POOL_LABEL]


def test_engines_and_trainer_read_the_base_model_from_the_mount(tmp_path):
    cfg = _cfg()
    model = f"s3://{cfg.checkpoint_bucket}/{cfg.models_prefix}/Qwen3-30B-A3B"
    docs = _render(tmp_path, cfg, model)
    (pv,) = [d for d in docs if d["kind"] == "PersistentVolume"]
    (pvc,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == CLAIM]
    csi = pv["spec"]["csi"]
    assert csi == {"driver": DRIVER, "volumeHandle": FS_ID, "readOnly": True,
                   "volumeAttributes": {"dnsname": f"{FS_ID}.fsx.{cfg.region}.amazonaws.com", "mountname": MOUNT_NAME}}
    assert pv["spec"]["claimRef"] == {"namespace": cfg.namespace, "name": CLAIM} and pv["spec"]["storageClassName"] == ""
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"] and pvc["metadata"]["namespace"] == cfg.namespace
    for d in (pv, pvc):
        kubernetes_validate.validate(d, cfg.k8s_version, strict=True)
    pods = _pods(docs)
    mounting = {n: p for n, p in pods.items() if any(v.get("persistentVolumeClaim", {}).get("claimName") == CLAIM
                                                     for v in p.get("volumes", []))}
    # every mounting pod sits on a pool whose nodes the file system admits, and mounts it read-only
    assert mounting and all(_pool(p) in FSX_POOLS for p in mounting.values())
    assert {_pool(p) for p in mounting.values()} == set(FSX_POOLS)
    for name, pod in mounting.items():
        (vol,) = [v for v in pod["volumes"] if v["name"] == "fsx"]
        assert vol["persistentVolumeClaim"]["readOnly"] is True
        for ctr in [*pod.get("initContainers", []), *pod["containers"]]:
            assert {"name": "fsx", "mountPath": MOUNT, "readOnly": True} in ctr["volumeMounts"], (name, ctr["name"])
            assert {"name": source.MIRROR_ENV, "value": f"s3://{cfg.checkpoint_bucket}/models/={MOUNT}/models/"} in ctr["env"]
    # the engines load the mounted copy: no init container copies the model onto the node
    engine_pods = [p for p in mounting.values() if any(c["name"] == "engine" for c in p["containers"])]
    assert engine_pods
    for pod in engine_pods:
        (engine,) = [c for c in pod["containers"] if c["name"] == "engine"]
        cmd = engine["command"]
        assert cmd[cmd.index("--model-path") + 1] == f"{MOUNT}/models/Qwen3-30B-A3B"
        assert not [c for c in pod.get("initContainers", []) if c["name"] == "model"]
    assert any(n.startswith("moerl-trainer/") for n in mounting)
    # pods elsewhere (buffer, env pool, the feed without an engine) do not mount it
    assert all(_pool(p) not in FSX_POOLS for n, p in pods.items() if n not in mounting)
    report = _checkov(tmp_path / "dist", "kubernetes")
    assert [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]] == []


def test_a_model_outside_the_linked_prefix_is_still_copied_from_s3(tmp_path):
    cfg = _cfg()
    # a run's published version (under run_prefix, which both roles read; elsewhere is refused at render)
    docs = _render(tmp_path, cfg, f"s3://{cfg.checkpoint_bucket}/{cfg.run_prefix}/base-run/policy/v3")
    engine_pods = [p for p in _pods(docs).values() if any(c["name"] == "engine" for c in p["containers"])]
    assert engine_pods and all([c for c in p["initContainers"] if c["name"] == "model"] for p in engine_pods)


def test_fsx_on_needs_the_stack_outputs(tmp_path):
    """The error names the deployment config, where the fields live, not the workloads file
    (it read ``recipes/...workloads.yaml: fsx.file_system_id``); one output without the other
    is refused by the deployment config itself."""
    cfg = config_from_mapping("prod", {"fsx": {"enabled": True}}, "test")
    with pytest.raises(WorkloadError) as e:
        load_workloads(cfg, ROOT / "recipes/qwen3-30b-a3b-grpo.workloads.yaml")
    assert str(e.value).startswith("deployment config (env prod): fsx.file_system_id and fsx.mount_name:"), e.value
    assert "FsxFileSystemId" in str(e.value) and "workloads.yaml" not in str(e.value)
    with pytest.raises(ConfigError, match=r"fsx.file_system_id is set but fsx.mount_name is not"):
        config_from_mapping("prod", {"fsx": {"enabled": True, "file_system_id": FS_ID}}, "test")
    with pytest.raises(ConfigError, match=r"fsx.mount_name is set but fsx.file_system_id is not"):
        config_from_mapping("prod", {"fsx": {"mount_name": MOUNT_NAME}}, "test")


def test_fsx_off_renders_no_volume(tmp_path):
    cfg = load_config("prod")
    docs = _render(tmp_path, cfg, f"s3://{cfg.checkpoint_bucket}/models/Qwen3-30B-A3B")
    assert not [d for d in docs if d["kind"] in ("PersistentVolume",)]
    assert "fsx" not in yaml.safe_dump_all(docs).replace("fsx.", "")


def test_model_path_resolves_to_the_mirror_and_falls_back_to_the_store(tmp_path, monkeypatch):
    mount = tmp_path / "fsx"
    (mount / "models" / "m").mkdir(parents=True)
    monkeypatch.setenv(source.MIRROR_ENV, f"s3://b/models/={mount}/models/")
    assert source.mirrored("s3://b/models/m") is None  # not imported yet: the store is read
    (mount / "models" / "m" / "config.json").write_text("{}")
    assert source.mirrored("s3://b/models/m/") == mount / "models" / "m"
    assert source.resolve_model_path("s3://b/models/m", tmp_path / "cache") == mount / "models" / "m"
    assert source.config_source("s3://b/models/m", tmp_path / "cache") == str(mount / "models" / "m")
    assert source.mirrored("s3://b/modelsx/m") is None and source.mirrored("s3://other/models/m") is None
    monkeypatch.setenv(source.MIRROR_ENV, "/fsx/models")
    with pytest.raises(ValueError, match=source.MIRROR_ENV):
        source.mirrored("s3://b/models/m")
