"""Deployment config: defaults of the reference deployment and the bad inputs of issue 5 part 9.

No synth here except the app path of one bad input (it fails before any construct is made).
"""

from __future__ import annotations

import json

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


@pytest.mark.parametrize("field,other", [("artifacts_bucket", "checkpoint_bucket"), ("logs_bucket", "checkpoint_bucket"),
                                         ("logs_bucket", "artifacts_bucket")])
def test_one_bucket_name_for_two_buckets_fails(field, other):
    """The storage stack creates every bucket the config names: two of one name fail the deploy."""
    msg = _bad(lambda d: d.update({field: d[other]}))
    assert msg.startswith(f"dev.yaml: {field}: 'moerl-dev-") and f"is also {other}" in msg


@pytest.mark.parametrize("cidr,why", [
    ("10.0.0.0/99", "not an IPv4 network"), ("10.0.0.1/16", "not an IPv4 network"), ("fd00::/48", "not an IPv4"),
    ("8.8.0.0/16", "not inside a private range"), ("10.0.0.0/8", "/8: a VPC's block is /16 to /28"),
    ("10.0.0.0/29", "/29: a VPC's block is /16 to /28"),
    # /17 and /28 are VPCs, but a public /22 and a private /18 per AZ do not fit them (the CDK Vpc threw).
    ("10.0.0.0/17", "control_plane_azs need 49152"), ("192.168.0.0/28", "control_plane_azs need 49152"),
])
def test_vpc_cidr_rules(cidr, why):
    msg = _bad(lambda d: d.update(vpc_cidr=cidr))
    assert msg.startswith("dev.yaml: vpc_cidr: ") and why in msg


def test_vpc_subnets_fit_the_control_plane_azs():
    three = ["us-east-2a", "us-east-2b", "us-east-2c"]
    assert load_config("dev").vpc_cidr == "10.0.0.0/16"
    assert validate_config({**default_config("dev"), "control_plane_azs": three}).vpc_cidr == "10.0.0.0/16"
    msg = _bad(lambda d: d.update(control_plane_azs=[*three, "us-east-2d"]))
    assert "vpc_cidr: 10.0.0.0/16 holds 65536 addresses" in msg and "4 control_plane_azs need 81920" in msg


def test_a_misspelled_pool_names_the_known_pools(tmp_path):
    f = tmp_path / "o.yaml"
    f.write_text("pools:\n  gpu-train:\n    max_size: 4\n")
    with pytest.raises(ConfigError) as e:
        load_config("dev", f)
    assert str(e.value) == (f"{f} (env dev): pools.gpu-train: not a pool; the pools are {list(POOL_NAMES)}")


def test_node_group_size_is_bounded_by_the_eks_quota():
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(max_size=1000000))
    assert msg.startswith("dev.yaml: pools.train-gpu.max_size: 1000000 exceeds 450, EKS's default quota")
    assert validate_config({**default_config("dev"), "pools": {**default_config("dev")["pools"], "rollout-gpu": {
        **default_config("dev")["pools"]["rollout-gpu"], "max_size": 450}}}).pools["rollout-gpu"].max_size == 450


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


# ---------------------------------------------------------------- issue 15


def test_kubernetes_is_the_newest_eks_version_with_graceful_shutdown():
    """EKS standard support lists 1.36 as newest; nodeadm enables graceful node shutdown from 1.34 only."""
    import importlib

    from infra.config import DEFAULT_K8S_VERSION
    assert DEFAULT_K8S_VERSION == "1.36"
    for env in ENVS:
        v = load_config(env).k8s_version
        assert v == DEFAULT_K8S_VERSION and tuple(map(int, v.split("."))) >= (1, 34)
        importlib.import_module(f"aws_cdk.lambda_layer_kubectl_v{v.split('.')[1]}")
    data = default_config("dev")
    data["k8s_version"] = "1.31"  # the floor stays accepted
    assert validate_config(data).k8s_version == "1.31"


def test_a_pool_mixing_efa_card_counts_fails():
    msg = _bad(lambda d: d["pools"]["rollout-gpu"].update(instance_types=["p5en.48xlarge", "p5.48xlarge"]))
    assert "pools.rollout-gpu" in msg and "network-card counts differ" in msg
    rollout = load_config("prod").pools["rollout-gpu"]
    assert {INSTANCE_TABLE[t].efa_interfaces for t in rollout.instance_types} == {32} == {rollout.efa_interfaces}


def test_staging_and_prod_need_an_admin_role_in_their_account():
    for env in ("staging", "prod"):
        cfg = load_config(env)
        assert cfg.admin_role_arns == [f"arn:aws:iam::{cfg.account}:role/moerl-{env}-admin"]
        data = default_config(env)
        data["admin_role_arns"] = []
        with pytest.raises(ConfigError, match=f"admin_role_arns: {env} needs at least one IAM role"):
            validate_config(data)
    assert load_config("dev").admin_role_arns == []


def test_an_account_override_moves_bucket_names_and_admin_role(tmp_path):
    f = tmp_path / "prod.yaml"
    f.write_text("account: '777788889999'\n")
    cfg = load_config("prod", f)
    assert cfg.checkpoint_bucket == "moerl-prod-checkpoints-777788889999"
    assert cfg.logs_bucket.endswith("-777788889999") and cfg.artifacts_bucket.endswith("-777788889999")
    assert cfg.admin_role_arns == ["arn:aws:iam::777788889999:role/moerl-prod-admin"]


def test_pipeline_config_needs_real_accounts_and_connection(tmp_path):
    from pathlib import Path

    from infra.config import load_pipeline_config
    good = Path(__file__).parent / "data" / "pipeline.yaml"
    pcfg, cfgs = load_pipeline_config(good)
    assert pcfg.account == "444455556666" and [c.env for c in cfgs] == list(ENVS)
    assert [c.account for c in cfgs] == ["111122223333", "222233334444", "333344445555"]
    assert cfgs[1].admin_role_arns == ["arn:aws:iam::222233334444:role/platform-admin"]
    with pytest.raises(ConfigError, match="-c env=pipeline needs -c config="):
        load_pipeline_config(None)
    text = good.read_text()
    for old, new, match in [
        ('account: "444455556666"', 'account: "111111111111"', "pipeline.account 111111111111 is a placeholder"),
        ("1b2c3d4e-5f60-4718-9a0b-c1d2e3f4a5b6", "00000000-0000-0000-0000-000000000000", "connection_arn is the all-zero"),
        ('    account: "333344445555"\n', "", r"environments.prod.account: 333333333333 is a placeholder"),
        ("  connection_arn:", "  connection:", "pipeline.connection_arn: Field required"),
    ]:
        f = tmp_path / "p.yaml"
        f.write_text(text.replace(old, new))
        with pytest.raises(ConfigError, match=match):
            load_pipeline_config(f)


def test_gpu_pools_are_created_empty_and_scaled_by_command():
    from infra.scale import before_update_commands, scale_up_commands
    cfg = load_config("prod")
    for pool in cfg.pools.values():
        assert pool.initial_sizes == ((0, 0, pool.max_size) if pool.gpu else (pool.min_size, pool.desired_size, pool.max_size))
    cmds = {c[c.index("--nodegroup-name") + 1]: c for c in scale_up_commands(cfg)}
    assert set(cmds) == {"moerl-prod-train-gpu", "moerl-prod-rollout-gpu"}
    assert cmds["moerl-prod-train-gpu"][-1] == "minSize=16,maxSize=16,desiredSize=16"
    assert cmds["moerl-prod-rollout-gpu"][:3] == ["aws", "eks", "update-nodegroup-config"]
    data = default_config("prod")
    data["pools"]["train-gpu"].update(capacity_type="CAPACITY_BLOCK", capacity_reservation_id="cr-0123456789abcdef0",
                                      placement_group=False)
    (cmd,) = before_update_commands(validate_config(data))
    assert cmd[cmd.index("--nodegroup-name") + 1] == "moerl-prod-train-gpu" and cmd[-1] == "minSize=0,maxSize=16,desiredSize=0"


def _before_update_groups(data: dict) -> set[str]:
    from infra.scale import before_update_commands
    return {c[c.index("--nodegroup-name") + 1] for c in before_update_commands(validate_config(data))}


def test_placement_group_and_odcr_pools_scale_to_zero_before_an_update():
    """Issue 27 item 2: an update surges by max(2 x AZs, maxUnavailable) nodes, which an exact
    placement group or ODCR cannot launch; `--before-update` covers them, not only Capacity Blocks."""
    assert _before_update_groups(default_config("prod")) == {"moerl-prod-train-gpu"}  # cluster placement group
    odcr = default_config("prod")
    odcr["pools"]["train-gpu"].update(placement_group=False, capacity_reservation_id="cr-0123456789abcdef0")
    assert _before_update_groups(odcr) == {"moerl-prod-train-gpu"}
    spot = default_config("prod")
    spot["pools"]["train-gpu"].update(placement_group=False)
    assert _before_update_groups(spot) == set()  # plain On-Demand can surge
    cfg = load_config("prod")
    assert cfg.pools["train-gpu"].fixed_capacity and not cfg.pools["rollout-gpu"].fixed_capacity


def test_capacity_block_with_a_placement_group_is_refused():
    """Issue 27 item 3: no AWS source shows a Capacity Block launched into a placement group."""
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(capacity_type="CAPACITY_BLOCK",
                                                         capacity_reservation_id="cr-0123456789abcdef0"))
    assert "pools.train-gpu" in msg and "CAPACITY_BLOCK pool cannot also launch into a placement group" in msg
    msg = _bad(lambda d: d["pools"]["train-gpu"].update(capacity_type="CAPACITY_BLOCK", placement_group_name="pg-1",
                                                         capacity_reservation_id="cr-0123456789abcdef0"))
    assert "placement group" in msg


def test_models_and_data_prefixes_lie_outside_the_run_prefix():
    """Issue 28 item 6: the trainer writes under run_prefix only, so shared models and data need their own."""
    cfg = load_config("prod")
    assert (cfg.run_prefix, cfg.models_prefix, cfg.data_prefix) == ("runs", "models", "data")
    assert "overlap" in _bad(lambda d: d.update(models_prefix="runs/models"))
    assert "overlap" in _bad(lambda d: d.update(data_prefix="runs"))
    assert "overlap" in _bad(lambda d: d.update(run_prefix="data/runs"))


def test_existing_placement_group_needs_placement_and_gpu_pools_stripe_instance_store():
    assert "placement_group_name needs placement_group=true" in _bad(
        lambda d: d["pools"]["rollout-gpu"].update(placement_group_name="my-odcr-group"))
    cfg = load_config("prod")
    assert {p.name for p in cfg.pools.values() if p.local_storage == "RAID0"} == {"train-gpu", "rollout-gpu"}


def test_preflight_finds_a_missing_admin_role_against_iam_over_http(moto_s3, tmp_path, monkeypatch, capsys):
    """Issue 27 item 1: a role of admin_role_arns the stack does not create must exist before the
    deploy; checked with boto3 against moto's IAM over HTTP, one line naming the ARN."""
    import boto3

    from infra.preflight import main, missing_admin_roles
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    account = "123456789012"  # moto's account
    f = tmp_path / "staging.yaml"
    f.write_text(f"account: '{account}'\nadmin_role_arns: ['arn:aws:iam::{account}:role/platform-admin', "
                 f"'arn:aws:iam::{account}:role/moerl-staging-admin']\n")
    cfg = load_config("staging", f)
    iam = boto3.client("iam", endpoint_url=moto_s3, region_name="us-east-1")
    from infra.execution_policy import boundary_policy
    iam.create_policy(PolicyName="moerl-staging-boundary", PolicyDocument=json.dumps(boundary_policy(cfg)))
    assert missing_admin_roles(cfg, iam) == [f"arn:aws:iam::{account}:role/platform-admin"]  # the default one is created
    assert main(["--env", "staging", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "admin_role_arns: arn:aws:iam::123456789012:role/platform-admin does not exist" in err[0]
    iam.create_role(RoleName="platform-admin", AssumeRolePolicyDocument='{"Version":"2012-10-17","Statement":[]}')
    assert main(["--env", "staging", "--config", str(f)]) == 0
    f.write_text(f.read_text() + "create_admin_role: false\n")  # now the default role must exist too
    assert missing_admin_roles(load_config("staging", f), iam) == [f"arn:aws:iam::{account}:role/moerl-staging-admin"]


def test_pull_through_secrets_must_be_ecr_pullthroughcache_secrets():
    msg = _bad(lambda d: d.update(pull_through_secrets={"ghcr.io": "arn:aws:secretsmanager:us-east-2:111111111111:secret:gh"}))
    assert "pull_through_secrets" in msg and "ecr-pullthroughcache/" in msg
    assert "pull_through_secrets" in _bad(lambda d: d.update(pull_through_secrets={"nvcr.io": "x"}))  # not an ECR upstream


def test_preflight_finds_missing_admin_principals_and_boundary_against_iam_over_http(moto_s3, tmp_path, monkeypatch, capsys):
    """Issue 39 item 8: the admin role's named principals must exist (IAM refuses a trust policy
    naming a missing one), and so must the permissions boundary every role is created with."""
    import boto3

    from infra.execution_policy import boundary_policy
    from infra.preflight import main
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    account = "123456789012"  # moto's account
    f = tmp_path / "prod.yaml"
    f.write_text(f"account: '{account}'\nadmin_principals: ['arn:aws:iam::{account}:role/oncall', "
                 f"'arn:aws:iam::{account}:user/ops/alice']\n")
    iam = boto3.client("iam", endpoint_url=moto_s3, region_name="us-east-1")
    assert main(["--env", "prod", "--config", str(f)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [e.split(": ")[1] for e in err[:2]] == ["admin_principals", "admin_principals"] and len(err) == 3, err
    assert "role/oncall does not exist" in err[0] and "user/ops/alice does not exist" in err[1]
    assert "moerl-prod-boundary does not exist" in err[2] and "infra.execution_policy --env prod --boundary" in err[2]
    iam.create_role(RoleName="oncall", AssumeRolePolicyDocument='{"Version":"2012-10-17","Statement":[]}')
    iam.create_user(UserName="alice", Path="/ops/")
    iam.create_policy(PolicyName="moerl-prod-boundary", PolicyDocument=json.dumps(boundary_policy(load_config("prod", f))))
    assert main(["--env", "prod", "--config", str(f)]) == 0
