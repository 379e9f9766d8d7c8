"""The recipe matrix (issue 37, deliver 2): every file under recipes/ and charts8s/examples/, each
with the options users combine (router, network weight sync, groups spanning engines, partial
rollout, routing replay, FSx, PPO), rendered as `charts8s.main` and `charts8s.ops` render them; each
render is either refused at synth in one line, or checked whole:

- reachability against the contract (charts8s/contract.py TABLE, docs/ARCHITECTURE.md "Who talks
  to whom"): for every pair of pods (a few of each role) and outside peers, on every port the
  render names and a few it does not, tests/netpolicy.py's Kubernetes semantics allow exactly what
  a row of the table names. Which process a pod runs is read from its containers' commands, not
  from the selectors the policies are made with; a worker's engine from its --engine-url. The
  node's DCGM host engine (its hostPort) with infra/'s policies of the same deployment config;
- identity against use: the S3 keys the code writes and reads (app.storage.policy, app.trainer.
  state, app.storage.done, app.metrics, run through a file store), the base model and the dataset
  are allowed by the synthesized role policies (moto's IAM evaluation), and neither the bucket's
  policy nor the gateway endpoint's refuses them from inside the VPC;
- commands: every engine's by SGLang 0.5.23's own argument parser, the router's by
  sglang-router 0.3.2's, every ``moerl`` command by its own click command.

Renders and synths are cached for the module; the matrix's time is reported with the issue.
"""

from __future__ import annotations

import copy
import json
import os
import re
from functools import cache
from pathlib import Path

import pytest
import yaml

from app.cli import command
from app.names import CLUSTER_CONFIG
from app.metrics import upload_run_metrics
from app.storage import open_store
from app.storage.done import mark_done
from app.storage.policy import publish_policy
from app.trainer.state import step_prefix
from charts8s import ops
from charts8s.cluster import RUN_CONFIG_KEY, RUN_CONFIG_MAP
from charts8s.contract import (BENCH_ENGINE, BENCH_JOB, BUFFER, COMPONENT, DNS, ENGINE, ENGINE_HTTP, ENV, FEED_POD,
                               FETCHER, HEALTH, HTTPS, POD_IDENTITY, PROMETHEUS, REWARD, ROUTER_POD, SOURCE,
                               TRAINER_RANKS, WORKER, markdown, ports, rows)
from charts8s.main import build
from charts8s.workloads import DEV_RECIPE, WorkloadError, load_workloads
from infra.config import ConfigError, load_config
from netpolicy import LWS_GROUP, LWS_NAME, LWS_WORKER, POD_INDEX, Address, Pod, Reach, pods_of, reach_host_port
from helpers import keys_files
from sglang_oracle import parse_launch_server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = "charts8s/examples"
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
APP = "app.kubernetes.io/name"

# name -> (env, deployment override, workloads file): every file of recipes/ and charts8s/examples/.
BASES = {
    "dev-tiny-grpo": ("dev", None, None),
    "qwen3-30b-a3b-grpo": ("dev", "recipes/qwen3-30b-a3b-grpo.deploy.yaml", "recipes/qwen3-30b-a3b-grpo.workloads.yaml"),
    "deepseek-v3-grpo": ("prod", "recipes/deepseek-v3-grpo.deploy.yaml", "recipes/deepseek-v3-grpo.workloads.yaml"),
    "qwen3-1node-deepep": ("prod", f"{EXAMPLES}/p5en-rollout.deploy.yaml", f"{EXAMPLES}/qwen3-30b-a3b-1node-deepep.workloads.yaml"),
    "qwen3-1node-ep": ("prod", f"{EXAMPLES}/p5en-rollout.deploy.yaml", f"{EXAMPLES}/qwen3-30b-a3b-1node-ep.workloads.yaml"),
    "dsv3-2node": ("prod", f"{EXAMPLES}/p5en-rollout.deploy.yaml", f"{EXAMPLES}/dsv3-2node-deepep.workloads.yaml"),
    "dsv3-ab": ("prod", f"{EXAMPLES}/p5en-rollout.deploy.yaml", f"{EXAMPLES}/dsv3-ab.workloads.yaml"),
}
# option -> what it adds to the run config ("run") or the deployment config ("deploy").
OPTIONS = {
    "router": {"run": {"rollout": {"router": True, "pause_mode": "abort"}}},
    "network": {"run": {"weight_sync": {"mode": "network"}}},
    "span": {"run": {"weight_sync": {"mode": "network", "engines_per_group": 0}}},
    "partial": {"run": {"rollout": {"partial_rollout": True}}},
    "replay": {"run": {"rollout": {"routing_replay": True}}},
    "ppo": {"run": {"trainer": {"algorithm": "ppo"}}},
    "fsx": {"deploy": {"fsx": {"enabled": True, "file_system_id": "fs-0123456789abcdef0", "mount_name": "abcdefgh"}}},
}
COMBOS = [(), *((o,) for o in OPTIONS), ("router", "span", "ppo", "fsx"), ("router", "replay", "network"), ("router", "partial")]
CASES = [(b, c) for b in BASES for c in COMBOS]
IDS = [f"{b}-{'+'.join(c) or 'as-shipped'}" for b, c in CASES]

# Peers outside the namespace (as tests/test_netpol.py places them).
S3 = Address("52.216.10.20")
HUB = Address("18.160.10.5")
POD_ID = Address("169.254.170.23")
CLOSED = (Address("169.254.169.254"), Address("10.0.12.7"), Address("10.0.40.9"))  # IMDS, another node, an endpoint
KUBE_DNS = Pod("coredns-0", "kube-system", {"k8s-app": "kube-dns"})
PROMETHEUS_POD = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})
HEALTH_POD = Pod("gpu-dcgm-diag-0", "moerl-health", {"app.kubernetes.io/name": "gpu-dcgm-diag"})
DCGM_SERVER = Pod("dcgm-server-0", "kube-system", {"k8s-app": "dcgm-server", "version": "v1"},
                  ((None, 5555, "TCP", 5555),))  # aws/eks-node-monitoring-agent dcgm-daemonset.yaml
OFF_PORTS = (22, 80, 443, 53, 1234, 5555, 8080, 9090, 10250, 20000, 29500, 49151, 57344)


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def _yaml(path: str | None) -> dict:
    return yaml.safe_load((ROOT / path).read_text()) or {} if path else {}


class Render:
    """One render of the matrix: its plan, dist/ and dist-ops/ documents, pods and policies; or
    the one-line message that refused it (``refused``)."""

    def __init__(self, base: str, combo: tuple, tmp: Path):
        env, deploy, workloads = BASES[base]
        over = [OPTIONS[o] for o in combo]
        wl = _yaml(workloads)
        run = _yaml(wl.get("run_config") or str(DEV_RECIPE.relative_to(ROOT)))
        for o in over:
            run = _merge(run, o.get("run", {}))
        dep = _yaml(deploy)
        for o in over:
            dep = _merge(dep, o.get("deploy", {}))
        tmp.mkdir(parents=True)
        (tmp / "run.yaml").write_text(yaml.safe_dump(run))
        (tmp / "workloads.yaml").write_text(yaml.safe_dump({**wl, "run_config": str(tmp / "run.yaml")}))
        (tmp / "deploy.yaml").write_text(yaml.safe_dump(dep) if dep else "{}\n")
        self.refused = None
        self.deploy = tmp / "deploy.yaml"
        try:
            self.cfg = load_config(env, tmp / "deploy.yaml")
            self.plan = load_workloads(self.cfg, tmp / "workloads.yaml")
        except (ConfigError, WorkloadError) as e:
            self.refused = str(e)
            return
        self.docs = _docs(build(self.plan, tmp / "dist")) + _ops(base, "router" in combo, self.plan, tmp)
        self.policies = [d for d in self.docs if d["kind"] == "NetworkPolicy"]
        self.pods = [p for p in pods_of(self.docs) if p.namespace == self.plan.namespace]


def _docs(files: list[Path]) -> list[dict]:
    return [d for f in files for d in yaml.safe_load_all(f.read_text()) if d]


_OPS: dict = {}


def _ops(base: str, router: bool, plan, tmp: Path) -> list[dict]:
    """dist-ops/ of a render: its policies differ only with the router (its PodMonitor), so one
    render per recipe and router setting."""
    if (base, router) not in _OPS:
        _OPS[base, router] = _docs(ops.build(plan, tmp / "ops"))
    return _OPS[base, router]


@pytest.fixture(scope="module")
def renders(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    done: dict = {}

    def get(base: str, combo: tuple) -> Render:
        if (base, combo) not in done:
            done[base, combo] = Render(base, combo, root / f"{base}-{len(done)}")
        return done[base, combo]
    return get


def test_every_recipe_file_is_in_the_matrix():
    used = {p for b in BASES.values() for p in b[1:] if p} | {str(DEV_RECIPE.relative_to(ROOT))}
    used |= {_yaml(w)["run_config"] for _, _, w in BASES.values() if w}
    shipped = {str(p.relative_to(ROOT)) for d in ("recipes", EXAMPLES) for p in (ROOT / d).glob("*.yaml")}
    assert shipped == used


# -- who each pod is: read from what it runs ----------------------------------------------------------------


def parties(pod: Pod) -> set[str]:
    """The contract's parties ``pod`` carries, from its containers' commands (and, for the scrape
    targets, its component label)."""
    app = pod.labels.get(APP, "")
    out = {COMPONENT + app}
    for cmd in pod.commands:
        text = " ".join(cmd)
        moerl = cmd[1:2] if cmd[:1] == ("moerl",) else cmd[3:4] if cmd[1:3] == ("-m", "app.cli") else ()
        if "sglang.launch_server" in text:
            fleet = ENGINE if app == "moerl-rollout" else BENCH_ENGINE.format(p=app.removeprefix("moerl-bench-"))
            if app != "moerl-feed":  # the feed's evaluation engine serves on loopback
                out.add(fleet)
            if fleet == ENGINE and cmd[cmd.index("--host") + 1] == "0.0.0.0" and pod.labels.get(LWS_WORKER, "0") == "0":
                out.add(ENGINE_HTTP)
        elif "app.rollout.group" in text:
            out.add(FETCHER)
        elif "redis-server" in text:
            out.add(BUFFER)
        elif "sglang_router.launch_router" in text:
            out.add(ROUTER_POD)
        elif "moerl train" in text or " app.cli train" in text:
            out.add(TRAINER_RANKS)
            if pod.name.endswith("-0"):
                out.add(SOURCE)
        elif moerl == ("rollout",):
            out.add(WORKER)
        elif moerl == ("feed",):
            out.add(FEED_POD)
        elif moerl == ("env",) or (moerl == ("reward",) and "verifier" in cmd):
            out.add(ENV)
        elif moerl == ("reward",):
            out.add(REWARD)
        elif moerl == ("bench",):
            out.add(BENCH_JOB.format(p=app.removeprefix("moerl-bench-").removesuffix("-job")))
    return out


def own_engine(worker: Pod) -> tuple[str, str] | None:
    """(LeaderWorkerSet, group) of the engine a worker pod drives: its --engine-url's host, the
    LWS leader address <lws>-<group>.<lws>.<namespace>, with the pod's ordinal put in."""
    for cmd in worker.commands:
        if "--engine-url" in cmd:
            url = cmd[cmd.index("--engine-url") + 1].replace("$(POD_INDEX)", worker.labels.get(POD_INDEX, "?"))
            m = re.match(r"http://(?P<lws>[a-z0-9-]+)-(?P<g>\d+)\.(?P=lws)\.", url)
            return (m["lws"], m["g"]) if m else None
    return None


def sample(pods: list[Pod]) -> list[Pod]:
    """A few pods of each component: groups (or ordinals) 0, 1 and the last, every pod of those groups."""
    by: dict[str, list[Pod]] = {}
    for p in pods:
        by.setdefault(p.labels.get(APP, p.name), []).append(p)
    out = []
    for group in by.values():
        keys = sorted({int(p.labels.get(LWS_GROUP, i)) for i, p in enumerate(group)})
        keep = {keys[0], keys[-1], *keys[1:2]}
        out += [p for i, p in enumerate(group) if int(p.labels.get(LWS_GROUP, i)) in keep]
    return out


def expected(plan, table, src, dst, port: int, protocol: str) -> bool:
    """Whether a row of the contract lets ``src`` open ``port`` on ``dst``."""
    def of(x) -> set[str]:
        if isinstance(x, Address):
            return {HTTPS} if x in (S3, HUB) and port == 443 else {POD_IDENTITY} if x == POD_ID else set()
        return {DNS} if x is KUBE_DNS else {PROMETHEUS} if x is PROMETHEUS_POD else {HEALTH} if x is HEALTH_POD else parties(x)
    mine, theirs = of(src), of(dst)
    for r in table:
        if r.src not in mine or r.dst not in theirs:
            continue
        opened = ports(plan, r.ports)
        if opened is not None and not any(p.get("protocol", "TCP") == protocol and p["port"] <= port <= p.get("endPort", p["port"])
                                          for p in opened):
            continue
        if r.pair == "same-group" and not (src.labels.get(LWS_NAME) == dst.labels.get(LWS_NAME)
                                           and src.labels.get(LWS_GROUP) == dst.labels.get(LWS_GROUP)):
            continue
        if r.pair == "own-engine" and own_engine(src) != (dst.labels.get(LWS_NAME), dst.labels.get(LWS_GROUP)):
            continue
        return True
    return False


def _probe_ports(plan, table) -> list[tuple[int, str]]:
    named = set()
    for r in table:
        for p in ports(plan, r.ports) or []:
            named |= {(p["port"], p["protocol"]), (p.get("endPort", p["port"]), p["protocol"])}
            if "endPort" in p:
                named.add(((p["port"] + p["endPort"]) // 2, p["protocol"]))
    return sorted(named | {(p, "TCP") for p in OFF_PORTS} | {(53, "UDP")})


@pytest.mark.parametrize("base,combo", CASES, ids=IDS)
def test_reachability_is_the_contract(renders, base, combo):
    r = renders(base, combo)
    if r.refused:
        pytest.skip("refused at synth (test_refusals_are_one_line)")
    table = rows(r.plan)
    reach = Reach(r.policies)
    pods = sample(r.pods)
    outside = [KUBE_DNS, PROMETHEUS_POD, HEALTH_POD, S3, HUB, POD_ID, *CLOSED]
    wrong = []
    for port, proto in _probe_ports(r.plan, table):
        for src in pods + [PROMETHEUS_POD, HEALTH_POD]:
            for dst in pods + outside:
                if src is dst or (not isinstance(src, Pod) or src.namespace != r.plan.namespace) and not isinstance(dst, Pod):
                    continue
                if dst in (PROMETHEUS_POD, HEALTH_POD, KUBE_DNS) and src in (PROMETHEUS_POD, HEALTH_POD):
                    continue
                want, got = expected(r.plan, table, src, dst, port, proto), reach.allowed(src, dst, port, proto)
                if want != got:
                    wrong.append(f"{getattr(src, 'name', src)} -> {getattr(dst, 'name', getattr(dst, 'ip', dst))}:"
                                 f"{port}/{proto} {'denied, the contract names it' if want else 'allowed, the contract does not name it'}")
    assert not wrong, f"{len(wrong)} pairs differ from the contract, e.g.\n" + "\n".join(sorted(wrong)[:25])
    # every pod is isolated both ways: nothing is open by default
    for pod in pods:
        assert reach._matching(pod, KUBE_DNS, "Egress") is not None and reach._matching(pod, KUBE_DNS, "Ingress") is not None, pod.name


# -- refused in one line ------------------------------------------------------------------------------------

# Combinations a rule refuses, and the field its one line names.
REFUSED = {("router", "partial"): "rollout.partial_rollout"}
# What a refusal of a combination with each option names (the conflict).
NAMES = {"router": "rollout.router", "network": "weight_sync", "span": "engines_per_group", "partial": "partial_rollout",
         "replay": "routing_replay", "ppo": "algorithm", "fsx": "fsx"}


@pytest.mark.parametrize("base,combo", CASES, ids=IDS)
def test_a_render_is_refused_only_in_one_line_naming_the_conflict(renders, base, combo):
    r = renders(base, combo)
    if combo == ():
        assert r.refused is None, r.refused  # every shipped recipe renders as shipped
    if combo in REFUSED:
        assert r.refused and REFUSED[combo] in r.refused, r.refused
    if r.refused:
        assert "\n" not in r.refused and "Traceback" not in r.refused, r.refused
        assert any(NAMES[o] in r.refused for o in combo), r.refused


def test_a_run_the_trainer_may_not_publish_is_refused_at_render(tmp_path):
    """Issue 37 item 9: run_id outside trainer_runs (dev's default: dev) is one line at render."""
    (tmp_path / "run.yaml").write_text("run_id: someone-else\nmodel: {path: /models/tiny}\n")
    (tmp_path / "w.yaml").write_text(f"run_config: {tmp_path / 'run.yaml'}\n")
    with pytest.raises(WorkloadError) as e:
        load_workloads(load_config("dev"), tmp_path / "w.yaml")
    assert "run_id 'someone-else' is not covered by the deployment config's trainer_runs ['dev']" in str(e.value)
    assert "\n" not in str(e.value)
    (tmp_path / "d.yaml").write_text("trainer_runs: [someone-*]\n")
    assert load_workloads(load_config("dev", tmp_path / "d.yaml"), tmp_path / "w.yaml").run.run_id == "someone-else"


@pytest.mark.parametrize("field,value,says", [
    ("model", "{path: s3://moerl-dev-checkpoints-111111111111/elsewhere/tiny}", "run config model.path: s3://moerl-dev-"),
    ("model", "{path: s3://another-bucket/models/tiny}", "run config model.path: s3://another-bucket/models/tiny is not"),
    ("task", "{source: jsonl, jsonl_path: 's3://{checkpoint_bucket}/elsewhere/d.jsonl'}", "run config task.jsonl_path"),
    ("model", "{path: 's3://{bucket}/models/tiny'}", "only {checkpoint_bucket}, {models_prefix}, {data_prefix}"),
])
def test_store_paths_outside_the_storage_layout_are_refused(tmp_path, field, value, says):
    """Issue 37 item 9: a base model or dataset must be where the roles read them and FSx links them."""
    (tmp_path / "run.yaml").write_text(f"{field}: {value}\n" + ("model: {path: /models/tiny}\n" if field != "model" else ""))
    (tmp_path / "w.yaml").write_text(f"run_config: {tmp_path / 'run.yaml'}\n")
    with pytest.raises(WorkloadError, match=re.escape(says)) as e:
        load_workloads(load_config("dev"), tmp_path / "w.yaml")
    assert "\n" not in str(e.value)


# -- commands: parsed by their own argument code ----------------------------------------------------------


def _containers(docs: list[dict]):
    """(pod spec, container) of every container and init container of the rendered pods."""
    for d in docs:
        spec = d.get("spec", {})
        templates = []
        if d["kind"] in ("Deployment", "StatefulSet") or (d["kind"] == "Job" and "template" in spec):
            templates = [spec["template"]]
        elif d["kind"] == "Job":
            templates = [t["template"] for t in spec["tasks"]]
        elif d["kind"] == "LeaderWorkerSet":
            templates = [spec["leaderWorkerTemplate"]["leaderTemplate"], spec["leaderWorkerTemplate"]["workerTemplate"]]
        for t in templates:
            for c in t["spec"].get("initContainers", []) + t["spec"]["containers"]:
                yield t["spec"], c


def _moerl(cmd: list[str]) -> None:
    """Parse `moerl NAME ...` with the click command behind it (typer's click raises its UsageError)."""
    c = command(cmd[1])
    args = cmd[2:]
    if hasattr(c, "commands"):  # a group (moerl bench ...): its sub-command parses the rest
        c, args = c.commands[args[0]], args[1:]
    c.make_context(f"moerl {cmd[1]}", list(args))


@pytest.mark.parametrize("base,combo", CASES, ids=IDS)
def test_every_command_parses_with_its_own_argument_code(renders, base, combo):
    from sglang_router import launch_router

    r = renders(base, combo)
    if r.refused:
        pytest.skip("refused at synth")
    lws = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": f"moerl-rollout-0.moerl-rollout.{r.plan.namespace}",
           "LWS_GROUP_SIZE": "2"}
    # the run config as the pods mount it (the commands' --config must exist for their parsers)
    (cm,) = [d for d in r.docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == RUN_CONFIG_MAP]
    mounted = r.deploy.parent / "mounted-run.yaml"
    mounted.write_text(cm["data"][RUN_CONFIG_KEY])
    seen = {"engine": 0, "router": 0, "moerl": set()}
    secret_values = {"api-key": "value-of-api-key", "admin-api-key": "value-of-admin-api-key"}
    for pod, c in _containers(r.docs):
        cmd = c.get("command", [])
        secrets = {e["name"]: f"value-of-{e['valueFrom']['secretKeyRef']['key']}" for e in c.get("env", [])
                   if "secretKeyRef" in e.get("valueFrom", {})}
        if "sglang.launch_server" in cmd:
            # an engine on the pod network reads its keys from the file its pod's keys init container writes
            files = keys_files(pod, {"POD_NAME": "moerl-rollout-0"}, secret_values, r.deploy.parent)
            ns = parse_launch_server(cmd, {**lws, **secrets}, files)
            assert ns.model_path and ns.port, cmd
            seen["engine"] += 1
        elif cmd[:3] == ["python3", "-m", "sglang_router.launch_router"]:
            args = launch_router.parse_router_args(cmd[3:])
            # no engines at start (their workers register them) and a control-plane key of its own
            assert not args.worker_urls and args.control_plane_api_keys and args.port == r.plan.wl.rollout.router_port
            seen["router"] += 1
        elif cmd[:1] == ["moerl"]:
            _moerl([str(mounted) if a == CLUSTER_CONFIG else a for a in cmd])
            seen["moerl"].add(cmd[1])
    assert seen["engine"] >= 1 and seen["router"] == (1 if r.plan.run.rollout.router else 0)
    assert {"rollout", "feed"} <= seen["moerl"]


def test_the_moerl_parser_refuses_a_misspelt_option():
    with pytest.raises(Exception, match="No such option: --worker-idd"):
        _moerl(["moerl", "rollout", "--config", "c.yaml", "--worker-idd", "w"])
    with pytest.raises(Exception, match="unable to parse string as a number"):
        _moerl(["moerl", "bench", "rollout", "--seconds", "many"])


# -- identity against use: S3 keys against the synthesized policies ----------------------------------------


_SYNTH: dict = {}


def _synth(r: Render, tmp: Path) -> dict:
    """Role, bucket and gateway-endpoint policies and the DCGM policies of the infra/ synth of the
    render's deployment config (one synth per distinct config)."""
    from aws_cdk import App
    from aws_cdk.assertions import Template

    from infra.app import build_app
    from test_infra_stacks import _resolve, resources, role_policy

    key = r.cfg.model_dump_json()
    if key in _SYNTH:
        return _SYNTH[key]
    out = tmp / f"cdk-{len(_SYNTH)}"
    app = build_app(r.cfg.env, str(r.deploy), app=App(outdir=str(out)))
    t = {k: Template.from_stack(app.node.find_child(k.capitalize())) for k in ("network", "storage", "cluster")}
    cfg = r.cfg
    roles = {res["Properties"]["RoleName"]: k for k, res in resources(t["cluster"], "AWS::IAM::Role").items()
             if "RoleName" in res["Properties"]}
    buckets = {k: res["Properties"]["BucketName"] for k, res in resources(t["storage"], "AWS::S3::Bucket").items()}

    def plain(v):
        v = _resolve(v, cfg)
        if isinstance(v, dict) and "Fn::GetAtt" in v and v["Fn::GetAtt"][0] in buckets:
            return f"arn:aws:s3:::{buckets[v['Fn::GetAtt'][0]]}"
        if isinstance(v, dict) and "Fn::Join" in v:
            sep, parts = v["Fn::Join"]
            return sep.join(str(plain(p)) for p in parts)
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict) and "Fn::ImportValue" not in v:
            return {k: plain(x) for k, x in v.items()}
        return v
    bucket_policy = [plain(s) for res in resources(t["storage"], "AWS::S3::BucketPolicy").values()
                     if buckets[res["Properties"]["Bucket"]["Ref"]] == cfg.checkpoint_bucket
                     for s in res["Properties"]["PolicyDocument"]["Statement"]]
    (endpoint,) = [res["Properties"] for res in resources(t["network"], "AWS::EC2::VPCEndpoint").values()
                   if res["Properties"].get("VpcEndpointType") == "Gateway"]
    (manifest,) = [res for k, res in resources(t["cluster"], "Custom::AWSCDK-EKS-KubernetesResource").items()
                   if "SystemNetworkPolicies" in k]
    _SYNTH[key] = {
        "roles": {name: role_policy(t["cluster"], cfg, logical) for name, logical in roles.items()},
        "bucket": bucket_policy, "endpoint": [plain(s) for s in endpoint["PolicyDocument"]["Statement"]],
        "system": [d for d in json.loads(_resolve(manifest["Properties"]["Manifest"], cfg)) if d["kind"] == "NetworkPolicy"],
    }
    return _SYNTH[key]


def _matches(patterns, value: str) -> bool:
    from fnmatch import fnmatchcase

    patterns = patterns if isinstance(patterns, list) else [patterns]
    return any(isinstance(p, str) and fnmatchcase(value, p.replace("?", "[?]")) for p in patterns)


def _condition_holds(conditions: dict, context: dict) -> bool:
    """IAM condition operators the rendered policies use, on ``context`` (an unknown one fails)."""
    for op, tests in conditions.items():
        for k, want in tests.items():
            want = want if isinstance(want, list) else [want]
            have = context[k]
            if op in ("StringEquals", "ArnEquals", "Bool"):
                ok = any(str(w).lower() == str(have).lower() if op == "Bool" else w == have for w in want)
            elif op in ("StringNotEquals", "ArnNotEquals"):
                ok = all(w != have for w in want)
            elif op in ("StringLike", "ArnLike"):
                ok = _matches(want, have)
            else:
                raise AssertionError(f"condition operator {op} is not evaluated here")
            if not ok:
                return False
    return True


def _statements_allow(statements: list[dict], action: str, arn: str, context: dict) -> tuple[bool, bool]:
    """(some Allow matches, some Deny matches) among resource-policy ``statements`` for a request."""
    allow = deny = False
    for s in statements:
        actions = s["Action"] if isinstance(s["Action"], list) else [s["Action"]]
        if not any(_matches(a, action) for a in actions) or not _matches(s["Resource"], arn):
            continue
        if _condition_holds(s.get("Condition", {}), context):
            allow |= s["Effect"] == "Allow"
            deny |= s["Effect"] == "Deny"
    return allow, deny


def _written_keys(run_id: str, tmp: Path) -> list[str]:
    """The keys the trainer writes for one version, one state, the done marker and its metrics,
    as the code that builds them writes them (into a file store)."""
    store = open_store(f"file://{tmp / 'store'}")
    version = tmp / "v1"
    version.mkdir(parents=True)
    (version / "config.json").write_text("{}")
    (version / "model.safetensors").write_bytes(b"0")
    publish_policy(store, run_id, 1, version)
    mark_done(store, run_id, 1, 1)
    run_dir = tmp / "run"
    (run_dir / "tensorboard").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("{}\n")
    (run_dir / "tensorboard" / "events.out.tfevents.1").write_text("x")
    upload_run_metrics(run_dir, store, run_id)
    return store.list() + [step_prefix(run_id, 1) + "moerl-state.json", step_prefix(run_id, 1) + "dcp/__0_0.distcp"]


# the roles and bucket policies differ by deployment config: each shipped one, and FSx's
IDENTITY = [(b, ()) for b in BASES] + [("deepseek-v3-grpo", ("fsx",))]


@pytest.mark.parametrize("base,combo", IDENTITY, ids=[f"{b}-{'+'.join(c) or 'as-shipped'}" for b, c in IDENTITY])
def test_every_key_the_code_uses_is_allowed_by_the_rendered_identity(renders, base, combo, tmp_path_factory):
    from moto.iam.access_control import IAMPolicy, PermissionResult

    r = renders(base, combo)
    tmp = tmp_path_factory.mktemp("keys")
    s = _synth(r, tmp_path_factory.getbasetemp())
    cfg, run = r.cfg, r.plan.run
    # the run's trainer role (one per trainer_runs entry) and the rollout pods' role
    names = {"trainer": cfg.trainer_identity(cfg.trainer_entry(run.run_id))[0], "rollout": cfg.pod_role_name("rollout")}
    policy = {role: IAMPolicy(json.dumps(s["roles"][name])) for role, name in names.items()}
    obj = f"arn:aws:s3:::{cfg.checkpoint_bucket}/"
    written = [f"{cfg.run_prefix}/{k}" for k in _written_keys(run.run_id, tmp)]
    reads = {"trainer": list(written), "rollout": [k for k in written if "/policy/" in k or "/trainer/" in k]}
    for url in (run.model.path, run.task.jsonl_path):
        if url and url.startswith("s3://"):
            key = url.removeprefix(f"s3://{cfg.checkpoint_bucket}/").rstrip("/")
            key += "/config.json" if url == run.model.path else ""
            reads["rollout"].append(key)
            if url == run.model.path:
                reads["trainer"].append(key)
    requests = [("trainer", "s3:PutObject", k) for k in written]
    requests += [(role, "s3:GetObject", k) for role, keys in reads.items() for k in keys]
    ok = PermissionResult.PERMITTED
    for role, action, key in requests:
        assert policy[role].is_action_permitted(action, obj + key) == ok, (role, action, key)
        context = {"aws:PrincipalArn": f"arn:aws:iam::{cfg.account}:role/{names[role]}",
                   "aws:SourceVpce": "the-gateway-endpoint", "aws:SecureTransport": "true",
                   "aws:ResourceAccount": cfg.account}
        # the bucket's deny fences compare aws:SourceVpce with the endpoint's id: from the endpoint, they hold false
        bucket = [{**st, "Condition": {op: {k: ("the-gateway-endpoint" if k == "aws:SourceVpce" else v) for k, v in t.items()}
                                       for op, t in st.get("Condition", {}).items()}} for st in s["bucket"]]
        assert not _statements_allow(bucket, action, obj + key, context)[1], ("bucket policy denies", role, action, key)
        assert _statements_allow(s["endpoint"], action, obj + key, context) == (True, False), ("endpoint", role, action, key)
    # and a run the deployment does not name stays unwritable
    other = f"{cfg.run_prefix}/not-{run.run_id}/policy/v1/model.safetensors"
    assert policy["trainer"].is_action_permitted("s3:PutObject", obj + other) != ok


@pytest.mark.parametrize("base", ["dev-tiny-grpo", "deepseek-v3-grpo"])
def test_only_the_dcgm_clients_reach_the_nodes_dcgm_host_engine(renders, base, tmp_path_factory):
    """Issue 39 item 9: a pod reaches its node's address whatever its policies say (the VPC CNI),
    so the host engine's own ingress (infra/) keeps moerl's pods out; the DCGM exporter and the
    health checks get in."""
    r = renders(base, ())
    s = _synth(r, tmp_path_factory.getbasetemp())
    policies = s["system"] + r.policies
    assert all(not reach_host_port(policies, p, DCGM_SERVER, 5555) for p in r.pods), "a moerl pod reaches DCGM"
    assert reach_host_port(policies, PROMETHEUS_POD, DCGM_SERVER, 5555)
    assert reach_host_port(policies, HEALTH_POD, DCGM_SERVER, 5555)
    assert not reach_host_port(policies, PROMETHEUS_POD, DCGM_SERVER, 5556)


# -- the contract itself ---------------------------------------------------------------------------------


def test_the_architecture_doc_prints_the_contract():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert markdown() in doc, "docs/ARCHITECTURE.md: paste `python -m charts8s.contract` under 'Who talks to whom'"


def test_the_policy_model_follows_kubernetes_semantics():
    """tests/netpolicy.py on what the Kubernetes documentation states: default deny once any policy
    selects a pod for a direction (and only for that direction), both sides needed, named ports
    resolved on the destination pod, endPort inclusive, ipBlock except, policyTypes defaulting
    from the spec; and hostPort through the node."""
    from netpolicy import allowed

    web = Pod("web", "ns", {"app": "web"}, (("http", 8080, "TCP", None),))
    cli = Pod("cli", "ns", {"app": "cli"})
    meta = lambda n: {"namespace": "ns", "name": n}  # noqa: E731
    deny_in = {"metadata": meta("a"), "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}}
    assert not allowed([deny_in], cli, web, 8080) and allowed([deny_in], web, cli, 8080)  # egress still open
    named = {"metadata": meta("b"), "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [
        {"from": [{"podSelector": {}}], "ports": [{"port": "http"}]}]}}
    assert allowed([named], cli, web, 8080) and not allowed([named], cli, web, 8081)
    assert _types_default_ingress_only(named)
    out = {"metadata": meta("c"), "spec": {"podSelector": {"matchLabels": {"app": "cli"}}, "policyTypes": ["Egress"], "egress": [
        {"to": [{"podSelector": {"matchLabels": {"app": "web"}}}], "ports": [{"port": "http"}]},
        {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}], "ports": [{"port": 1000, "endPort": 1010}]}]}}
    assert allowed([out], cli, web, 8080) and not allowed([out], cli, web, 9090)
    assert not allowed([out], cli, Address("8.8.8.8"), 8080)  # a named port never matches an address
    assert allowed([out], cli, Address("8.8.8.8"), 1010) and not allowed([out], cli, Address("10.1.1.1"), 1000)
    assert not allowed([out, deny_in], cli, web, 8080)  # egress allows, ingress does not: no connection
    assert allowed([out, deny_in, named], cli, web, 8080)
    assert Reach([out, deny_in, named]).allowed(cli, web, 8080) and not Reach([out, deny_in]).allowed(cli, web, 8080)
    host = Pod("agent", "kube-system", {"k8s-app": "agent"}, ((None, 5555, "TCP", 5555),))
    only = {"metadata": {"namespace": "kube-system", "name": "d"}, "spec": {"podSelector": {"matchLabels": {"k8s-app": "agent"}},
            "policyTypes": ["Ingress"], "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "monitoring"}}}], "ports": [{"port": 5555}]}]}}
    assert reach_host_port([], cli, host, 5555) and not reach_host_port([only], cli, host, 5555)
    assert reach_host_port([only], Pod("p", "monitoring", {}), host, 5555) and not reach_host_port([], cli, host, 5556)


def _types_default_ingress_only(policy: dict) -> bool:
    from netpolicy import _types

    return _types(policy["spec"]) == ["Ingress"] and _types({**policy["spec"], "egress": []}) == ["Ingress", "Egress"]


@pytest.mark.parametrize("base", ["qwen3-1node-ep", "dsv3-2node"])
def test_the_routers_metrics_port_has_a_podmonitor(renders, base):
    """Issue 37 item 9: with rollout.router the router's figures are scraped, on the named port its
    container declares (rollout.router_metrics_port); without the router there is no such target."""
    r = renders(base, ("router",))
    (pm,) = [d for d in r.docs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "moerl-router"]
    (router,) = [d for d in r.docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "moerl-router"]
    assert pm["spec"]["selector"] == {"matchLabels": router["spec"]["template"]["metadata"]["labels"]}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    (c,) = router["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in c["ports"] if p["name"] == endpoint["port"]]
    assert port["containerPort"] == r.plan.wl.rollout.router_metrics_port
    assert Reach(r.policies).allowed(PROMETHEUS_POD, [p for p in r.pods if "moerl-router" in p.name][0], port["containerPort"])
    assert not [d for d in renders(base, ()).docs if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "moerl-router"]
