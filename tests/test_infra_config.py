"""Deployment config: defaults of the reference deployment and the bad inputs of issue 5 part 9.

No synth here except the app path of one bad input (it fails before any construct is made).
"""

from __future__ import annotations

import pytest

from infra.config import (ENVS, GPU_TAINT_KEY, POOL_LABEL, POOL_NAMES, ConfigError, default_config,
                          load_config, validate_config)
from infra.instances import INSTANCE_TABLE


def test_prod_is_the_reference_deployment():
    cfg = load_config("prod")
    train, rollout = cfg.pools["train-gpu"], cfg.pools["rollout-gpu"]
    assert train.instance_types == ["p5en.48xlarge"] and train.desired_size == 16
    assert train.capacity_type in ("ON_DEMAND", "CAPACITY_BLOCK")
    assert rollout.capacity_type == "SPOT" and rollout.desired_size == 32 and len(rollout.instance_types) >= 2
    assert len(cfg.pools["env-cpu"].instance_types) >= 5 and cfg.pools["env-cpu"].capacity_type == "SPOT"
    assert cfg.pools["buffer-mem"].capacity_type == "ON_DEMAND"
    assert cfg.region and cfg.az.startswith(cfg.region) and len(cfg.control_plane_azs) >= 2


@pytest.mark.parametrize("env", ENVS)
def test_every_env_loads_with_labels_and_taints(env):
    cfg = load_config(env)
    assert set(cfg.pools) == set(POOL_NAMES)
    for name, pool in cfg.pools.items():
        assert pool.labels[POOL_LABEL] == name
        assert (GPU_TAINT_KEY in {t.key for t in pool.taints}) == pool.gpu
    assert cfg.retain_data == (env != "dev")


def test_mixed_pool_uses_the_common_efa_count():
    cfg = load_config("prod")
    rollout = cfg.pools["rollout-gpu"]
    assert rollout.efa_interfaces == min(INSTANCE_TABLE[t].efa_interfaces for t in rollout.instance_types)
    assert cfg.pools["train-gpu"].efa_interfaces == 16  # p5en: 16 network cards
    assert cfg.pools["env-cpu"].efa_interfaces == 0


def test_yaml_overrides_merge_and_validate(tmp_path):
    f = tmp_path / "o.yaml"
    f.write_text("pools:\n  train-gpu:\n    instance_types: [p5.48xlarge]\nk8s_version: '1.34'\n")
    cfg = load_config("staging", f)
    assert cfg.pools["train-gpu"].instance_types == ["p5.48xlarge"]
    assert cfg.pools["train-gpu"].efa_interfaces == 32
    assert cfg.pools["rollout-gpu"].capacity_type == "SPOT"  # untouched defaults stay
    assert cfg.k8s_version == "1.34"


def _bad(mutate) -> str:
    data = default_config("dev")
    mutate(data)
    with pytest.raises(ConfigError) as e:
        validate_config(data, "dev.yaml")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dev.yaml: ")
    return msg


def test_instance_type_without_efa_entry_fails():
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(instance_types=["p9.96xlarge"]))
    assert "pools.train-gpu.instance_types" in msg and "'p9.96xlarge'" in msg and "INSTANCE_TABLE" in msg


def test_node_groups_in_two_azs_fail():
    msg = _bad(lambda d: d["pools"]["rollout-gpu"].update(az="us-east-2b"))
    assert "pools.rollout-gpu" in msg and "one AZ" in msg


def test_kubernetes_below_1_31_fails():
    msg = _bad(lambda d: d.update(k8s_version="1.30"))
    assert msg.startswith("dev.yaml: k8s_version:") and "1.31" in msg


def test_spot_training_pool_fails():
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(capacity_type="SPOT"))
    assert "pools.train-gpu" in msg and "SPOT" in msg


@pytest.mark.parametrize("name", ["Moerl_Checkpoints", "ab", "moerl..ckpt", "192.168.1.1", "xn--moerl", "moerl-", "a" * 64])
def test_bucket_name_breaking_s3_rules_fails(name):
    msg = _bad(lambda d: d.update(checkpoint_bucket=name))
    assert msg.startswith("dev.yaml: checkpoint_bucket:") and "S3 naming rules" in msg


def test_other_rules():
    assert "CAPACITY_BLOCK needs capacity_reservation_id" in _bad(
        lambda d: d["pools"]["train-gpu"].update(capacity_type="CAPACITY_BLOCK"))
    assert "min_size <= desired_size <= max_size" in _bad(lambda d: d["pools"]["system"].update(desired_size=9))
    assert "efa=true" in _bad(lambda d: d["pools"]["env-cpu"].update(efa=True))
    assert "unknown" not in _bad(lambda d: d.update(image_tag="latest"))
    assert "Extra inputs" in _bad(lambda d: d.update(nodegroups={}))  # typo'd key
    assert "not a CIDR block" in _bad(lambda d: d.update(public_endpoint_cidrs=["10.0.0.300/8"]))
    assert "not an IAM role ARN" in _bad(lambda d: d.update(admin_role_arns=["platform-admin"]))
    prod = default_config("prod")
    prod["public_endpoint_cidrs"] = ["0.0.0.0/0"]
    with pytest.raises(ConfigError, match="open API endpoint"):
        validate_config(prod)


def test_hugepages_rules():
    assert load_config("prod").pools["train-gpu"].hugepages_2mi > 0
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(hugepages_2mi=5121))
    assert "pools.train-gpu" in msg and "whole number of 2 MiB pages" in msg
    msg = _bad(lambda d: d["pools"]["system"].update(hugepages_2mi=10 * 2**20))
    assert "pools.system" in msg and "exceeds half the memory" in msg


def test_app_refuses_bad_override_before_building(tmp_path):
    from infra.app import build_app

    f = tmp_path / "bad.yaml"
    f.write_text("pools:\n  train-gpu:\n    capacity_type: SPOT\n")
    with pytest.raises(ConfigError, match=r"bad.yaml \(env dev\): pools.train-gpu: capacity_type SPOT"):
        build_app("dev", str(f))
    with pytest.raises(ConfigError, match="env 'qa'"):
        build_app("qa")
