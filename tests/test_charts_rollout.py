"""The rollout engines as charts8s renders each engine profile (issue 14): the example workloads in
charts8s/examples (Qwen3-30B-A3B on one p5en node per engine with DeepEP and with SGLang's
all-to-all, DeepSeek-V3 in bf16 on two nodes with DeepEP, and the all-to-all vs DeepEP bench
pair), synthesized for prod with the
p5en rollout override, then checked against

- the LeaderWorkerSet CRD schema of the LWS version infra/ installs (tests/data) and, strictly,
  the Kubernetes schema for every other object and every pod template;
- SGLang 0.5.23's own server arguments (tests/sglang_oracle.py) for every engine command;
- the layout rules: group size, node ranks, probes and worker on the leader only, DeepEP pod
  resources, the model volume against the node's NVMe.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import os
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.torchx_component import EFA_RESOURCE, HUGEPAGES_RESOURCE, NVSHMEM_EFA_ENV
from charts8s.benchrollout import engine_urls
from charts8s.main import build
from charts8s.workloads import MODEL_COPIES, WorkloadError, load_workloads
from infra.config import load_config
from helpers import keys_files
from sglang_oracle import ArgumentRejected, deprecated_flags, parse_launch_server

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts8s" / "examples"
CRD = Path(__file__).parent / "data" / "lws-v0.10.0-leaderworkersets.crd.json.gz"
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
# What the LWS controller and the kubelet put in for $(VAR) in a group's second pod.
LWS_ENV = {"LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "moerl-rollout-0.moerl-rollout.moerl", "LWS_GROUP_SIZE": "2"}


class Example:
    def __init__(self, name: str, outdir: Path):
        os.chdir(ROOT)  # the workload files name their run config relative to the repository root
        self.cfg = load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml")
        self.plan = load_workloads(self.cfg, EXAMPLES / f"{name}.workloads.yaml")
        build(self.plan, outdir)
        self.outdir = outdir
        self.docs = [d for f in sorted(outdir.glob("*.k8s.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]

    def kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]


@pytest.fixture(scope="module", params=["qwen3-30b-a3b-1node-deepep", "dsv3-2node-deepep", "qwen3-30b-a3b-1node-ep", "dsv3-ab"])
def example(request, tmp_path_factory) -> Example:
    return Example(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def lws_validator() -> jsonschema.Validator:
    crd = json.loads(gzip.decompress(CRD.read_bytes()))
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return jsonschema.Draft7Validator(v1["schema"]["openAPIV3Schema"])


def engine_pods(ex: Example) -> list[tuple[str, str, dict]]:
    """(object name, role, pod spec) of every engine pod template."""
    out = []
    for d in ex.kind("Deployment"):
        if d["metadata"]["name"] == "moerl-rollout":
            out.append((d["metadata"]["name"], "leader", d["spec"]["template"]["spec"]))
    for d in ex.kind("LeaderWorkerSet"):
        t = d["spec"]["leaderWorkerTemplate"]
        out += [(d["metadata"]["name"], "leader", t["leaderTemplate"]["spec"]),
                (d["metadata"]["name"], "worker", t["workerTemplate"]["spec"])]
    return out


def engine_of(pod: dict) -> dict:
    return next(c for c in pod["containers"] if c["name"] == "engine")


def test_every_object_validates(example, lws_validator):
    lws = example.kind("LeaderWorkerSet")
    assert (len(lws) > 0) == (example.plan.engine.nodes > 1 or example.plan.wl.bench_rollout is not None)
    for d in example.docs:
        if d["kind"] == "LeaderWorkerSet":
            lws_validator.validate(d)
            for role in ("leaderTemplate", "workerTemplate"):  # the CRD does not refuse unknown pod fields
                tpl = d["spec"]["leaderWorkerTemplate"][role]
                pod = {"apiVersion": "v1", "kind": "Pod", "metadata": tpl["metadata"], "spec": tpl["spec"]}
                kubernetes_validate.validate(pod, example.cfg.k8s_version, strict=True)
        elif not d["apiVersion"].startswith("batch.volcano.sh/"):
            kubernetes_validate.validate(d, example.cfg.k8s_version, strict=True)


def test_the_crd_schema_refuses_a_broken_group(lws_validator, tmp_path):
    ex = Example("dsv3-2node-deepep", tmp_path / "out")
    (lws,) = ex.kind("LeaderWorkerSet")
    for path, value in ((("leaderWorkerTemplate", "restartPolicy"), "RestartAll"),
                        (("startupPolicy",), "WhenReady"), (("leaderWorkerTemplate", "size"), "two")):
        bad = copy.deepcopy(lws)
        node = bad["spec"]
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            lws_validator.validate(bad)


def test_every_engine_command_parses_with_sglang_arguments(example, tmp_path):
    """Every engine command through SGLang's own flags, its keys file (written by running the pod's
    keys init container) merged as SGLang merges ``--config``: an engine on the pod network that
    serves HTTP has its own admin key, derived from the Secret's master and its leader pod's name;
    a bench leader also asks for the Secret's API key; nobody's keys are in argv."""
    from app.rollout.keys import engine_admin_key

    pods = engine_pods(example)
    assert pods
    layouts = {"moerl-rollout": example.plan.engine}
    layouts.update({f"moerl-bench-{n}": lay for n, lay in example.plan.bench_layouts().items()})
    secrets = {"api-key": "value-of-api-key", "admin-api-key": "value-of-admin-api-key"}
    for name, role, pod in pods:
        c = engine_of(pod)
        cmd = c["command"]
        assert not set(cmd) & deprecated_flags(), cmd
        assert not any("api-key" in a or "API_KEY" in a for a in cmd), cmd
        assert not [e for e in c["env"] if "secretKeyRef" in e.get("valueFrom", {})], name  # no Secret in the engine
        leader_pod = f"{name}-0"
        ns = parse_launch_server(cmd, LWS_ENV, keys_files(pod, {"POD_NAME": leader_pod}, secrets, tmp_path))
        served = cmd[cmd.index("--host") + 1]
        bench = name.startswith("moerl-bench-")
        if served == "127.0.0.1" or role != "leader":  # on loopback, or a node rank that serves no HTTP
            assert (ns.api_key, ns.admin_api_key) == (None, None), name
        else:
            assert ns.admin_api_key == engine_admin_key("value-of-admin-api-key", leader_pod), name
            assert ns.api_key == ("value-of-api-key" if bench else None), name
        lay = layouts[name]
        assert ns.tp_size == lay.tp_size and ns.ep_size == lay.ep_size
        assert ns.moe_a2a_backend == (lay.a2a_backend or "none")
        assert ns.attn_dp_size == lay.profile.attn_dp_size and ns.weight_version == "0"
        assert ns.nnodes == lay.nodes
        if lay.nodes > 1:
            assert ns.node_rank == 1 and ns.dist_init_addr == f"{LWS_ENV['LWS_LEADER_ADDRESS']}:20000"
        if lay.profile.kind == "ep-deepep":
            assert ns.deepep_mode == lay.profile.deepep_mode and ns.ep_size == ns.tp_size


def test_the_oracle_refuses_a_misspelt_or_bad_flag(example, tmp_path):
    _, _, pod = engine_pods(example)[0]
    cmd = engine_of(pod)["command"]
    files = keys_files(pod, {"POD_NAME": "p-0"}, {"api-key": "k", "admin-api-key": "a"}, tmp_path)
    for bad in (["--moe-a2a-backends", "deepep"], ["--deepep-mode", "fastest"], ["--attn-dp-size", "many"]):
        with pytest.raises(ArgumentRejected):
            parse_launch_server(cmd + bad, LWS_ENV, files)
    if files:  # a keys file that is not there is refused, as SGLang refuses it
        with pytest.raises(ArgumentRejected, match="Config file not found"):
            parse_launch_server(cmd, LWS_ENV)


def test_multi_node_engines_are_leader_worker_groups(example):
    lay = example.plan.engine
    if lay.nodes == 1:
        (dep,) = [d for d in example.kind("Deployment") if d["metadata"]["name"] == "moerl-rollout"]
        assert dep["spec"]["replicas"] == example.plan.rollout_replicas
        return
    (lws,) = [d for d in example.kind("LeaderWorkerSet") if d["metadata"]["name"] == "moerl-rollout"]
    spec = lws["spec"]
    t = spec["leaderWorkerTemplate"]
    assert spec["replicas"] == example.plan.rollout_replicas and t["size"] == lay.nodes
    assert t["restartPolicy"] == "RecreateGroupAfterStart"  # the LWS v0.10 CRD's enum has it (validated above)
    assert spec["startupPolicy"] == "LeaderCreated"  # the leader is ready only once every rank joined
    leader, worker = t["leaderTemplate"]["spec"], t["workerTemplate"]["spec"]
    # nothing that restarts on its own in a group's pods: LWS recreates the group on any container
    # restart; the rollout worker is a StatefulSet of its own
    assert [c["name"] for c in leader["containers"]] == ["engine", "fetcher"]
    assert [c["name"] for c in worker["containers"]] == ["engine", "fetcher"]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(engine_of(leader))
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(engine_of(worker))  # rank >= 1: no HTTP
    cmd = engine_of(worker)["command"]
    assert cmd[cmd.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert cmd[cmd.index("--dist-init-addr") + 1].startswith("$(LWS_LEADER_ADDRESS):")
    (sts,) = [d for d in example.kind("StatefulSet") if d["metadata"]["name"] == "moerl-rollout-worker"]
    assert sts["spec"]["replicas"] == example.plan.rollout_replicas
    (wc,) = sts["spec"]["template"]["spec"]["containers"]
    # worker pod i drives group i: its engine URL and group name are LWS's leader address of group i
    env = {"POD_INDEX": "3"}
    expand = [a.replace("$(POD_INDEX)", env["POD_INDEX"]) for a in wc["command"]]
    addr = f"moerl-rollout-3.moerl-rollout.{example.cfg.namespace}"
    assert expand[expand.index("--engine-group") + 1] == addr
    assert expand[expand.index("--engine-url") + 1] == f"http://{addr}:{example.plan.wl.rollout.engine_port}"
    assert {"name": "POD_INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}} in wc["env"]
    for pod in (leader, worker):
        (fetcher,) = [c for c in pod["containers"] if c["name"] == "fetcher"]
        f = fetcher["command"]
        assert f[f.index("--engine") + 1] == "$(LWS_LEADER_ADDRESS)" and f[f.index("--index") + 1] == "$(LWS_WORKER_INDEX)"
        assert ("--marker" in f) == (pod is leader)
    # group peers reach each other (rendezvous, NCCL bootstrap), one policy per group; worker pod i
    # reaches engine i's leader on the engine port, nobody else gets in (issue 39 item 6;
    # tests/test_recipe_matrix.py asks it of every pair of pods)
    (np,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == "moerl-rollout"]
    wsel = sts["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["ingress"] == []
    port = [{"protocol": "TCP", "port": example.plan.wl.rollout.engine_port}]
    for g in range(spec["replicas"]):
        (group,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == f"moerl-rollout-group-{g}"]
        sel = group["spec"]["podSelector"]["matchLabels"]
        assert sel["leaderworkerset.sigs.k8s.io/group-index"] == str(g)
        assert group["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": sel}}]}]
        worker = {**wsel, "apps.kubernetes.io/pod-index": str(g)}
        (leader,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == f"moerl-rollout-leader-{g}"]
        assert leader["spec"]["podSelector"]["matchLabels"] == {**lws["metadata"]["labels"], "moerl.dev/engine-role": "leader",
                                                                "leaderworkerset.sigs.k8s.io/group-index": str(g)}
        assert leader["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": worker}}], "ports": port}]
        (own,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == f"moerl-rollout-worker-{g}"]
        assert own["spec"]["podSelector"]["matchLabels"] == worker
        assert own["spec"]["egress"] == [{"to": [{"podSelector": {"matchLabels": leader["spec"]["podSelector"]["matchLabels"]}}],
                                          "ports": port}]
    (wnp,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == "moerl-rollout-worker"]
    assert wnp["spec"]["ingress"] == [] and {"podSelector": {"matchLabels": lws["metadata"]["labels"]}} not in [
        t for rule in wnp["spec"]["egress"] for t in rule.get("to", [])]

def test_the_startup_probe_allows_for_the_models_load_and_download(example):
    """The leader's startup budget covers the checkpoint read from the node's disk, kernel JIT and
    graph capture, and a Hub model's own download (30 minutes was less than a DeepSeek-V3 first boot)."""
    wl = example.plan.wl.rollout
    need = wl.boot_s + wl.model_gib / wl.load_gib_per_s
    if not (wl.model_path or "").startswith(("s3://", "/")):
        need += wl.model_gib / wl.download_gib_per_s
    leaders = [pod for name, role, pod in engine_pods(example) if role == "leader" and name == "moerl-rollout"]
    for pod in leaders:
        probe = engine_of(pod)["startupProbe"]
        allowed = probe["periodSeconds"] * probe["failureThreshold"]
        assert need <= allowed < need + probe["periodSeconds"]
    if wl.model_gib >= 600:
        assert all(engine_of(p)["startupProbe"]["periodSeconds"] * engine_of(p)["startupProbe"]["failureThreshold"]
                   > 1800 for p in leaders)


def test_deepep_pods_get_efa_hugepages_and_nvshmem(example):
    pool = example.cfg.pools["rollout-gpu"]
    for name, role, pod in engine_pods(example):
        c = engine_of(pod)
        kind = (example.plan.engine if name == "moerl-rollout" else example.plan.bench_layouts()[name[len("moerl-bench-"):]]).profile.kind
        lim, env = c["resources"]["limits"], {e["name"]: e["value"] for e in c["env"] if "value" in e}
        assert int(lim[EFA_RESOURCE]) == pool.efa_interfaces > 0
        assert lim[HUGEPAGES_RESOURCE] == f"{pool.hugepages_2mi}Mi" and pool.hugepages_2mi > 0
        assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
        if kind == "ep-deepep":
            assert {k: env[k] for k in NVSHMEM_EFA_ENV} == NVSHMEM_EFA_ENV
        else:
            assert not set(NVSHMEM_EFA_ENV) & set(env)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # Pod Security "restricted"


def test_model_volume_is_sized_from_the_model_and_fits_the_nvme(example):
    store = min(s.instance_store_gib for s in example.cfg.pools["rollout-gpu"].specs)
    for _, _, pod in engine_pods(example):
        vols = {v["name"]: v for v in pod["volumes"]}
        size = int(vols["models"]["emptyDir"]["sizeLimit"].removesuffix("Gi"))
        assert size == math.ceil(MODEL_COPIES * example.plan.wl.rollout.model_gib) <= store


def test_bench_jobs_drive_their_own_fleet(example):
    from app.cli import command

    bench = example.plan.wl.bench_rollout
    if bench is None:
        assert not [d for d in example.kind("Job") if d["apiVersion"] == "batch/v1"]
        return
    options = {o for p in command("bench").commands["rollout"].params for o in p.opts}
    jobs = {d["metadata"]["name"]: d for d in example.kind("Job") if d["apiVersion"] == "batch/v1"}
    assert set(jobs) == {f"moerl-bench-{n}" for n in bench.profiles}
    for name in bench.profiles:
        (c,) = jobs[f"moerl-bench-{name}"]["spec"]["template"]["spec"]["containers"]
        cmd = c["command"]
        assert cmd[:3] == ["moerl", "bench", "rollout"] and {a for a in cmd if a.startswith("--")} <= options
        urls = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--url"]
        assert urls == engine_urls(example.plan, name) and len(urls) == bench.engines
        # leader DNS names through the LeaderWorkerSet's headless Service: <lws>-<i>.<lws>.<ns>
        assert all(u.startswith(f"http://moerl-bench-{name}-{i}.moerl-bench-{name}.{example.cfg.namespace}.") for i, u in enumerate(urls))
        (fleet,) = [d for d in example.kind("LeaderWorkerSet") if d["metadata"]["name"] == f"moerl-bench-{name}"]
        assert fleet["spec"]["replicas"] == bench.engines
        cmd = engine_of(fleet["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"])["command"]
        assert cmd[cmd.index("--host") + 1] == "0.0.0.0"  # the Job calls it over the pod network
        (np,) = [d for d in example.kind("NetworkPolicy") if d["metadata"]["name"] == f"moerl-bench-{name}"]
        job_labels = jobs[f"moerl-bench-{name}"]["spec"]["template"]["metadata"]["labels"]
        assert {"from": [{"podSelector": {"matchLabels": job_labels}}],
                "ports": [{"protocol": "TCP", "port": example.plan.wl.rollout.engine_port}]} in np["spec"]["ingress"]
    # each side of the A/B is a file of its own
    assert {p.name for p in example.outdir.glob("bench-rollout-*.k8s.yaml")} == {f"bench-rollout-{n}.k8s.yaml" for n in bench.profiles}
    quota = next(d for d in example.kind("ResourceQuota"))["spec"]["hard"]
    gpus = example.plan.gpus_per_rollout * (example.plan.rollout_nodes + example.plan.bench_nodes) + example.plan.trainer_world_size
    assert int(quota["requests.nvidia.com/gpu"]) == gpus


def _workloads(tmp_path: Path, run: str, text: str) -> Path:
    # A base model the engine can name (workloads no longer default to a Hub id).
    (tmp_path / "run.yaml").write_text(run + "\nmodel: {path: Qwen/Qwen3-30B-A3B}\n")
    p = tmp_path / "w.yaml"
    p.write_text(text + f"\nrun_config: {tmp_path / 'run.yaml'}\n")
    return p


@pytest.mark.parametrize("deploy,run,text,message", [
    ("p5en", "rollout: {engine: {kind: ep-deepep}}", "rollout: {model_gib: 8000}", "rollout.model_gib=8000"),
    (None, "rollout: {engine: {kind: ep}}", "rollout: {model_gib: 642}", "8 x 80 GiB GPUs"),  # p5 in the pool
    ("p5en", "rollout: {engine: {nodes_per_engine: 2, tp_size: 12}}", "", "tp_size=12"),
    ("p5en", "rollout: {engine: {nodes_per_engine: 4}}", "rollout: {replicas: 20}", "rollout.replicas=20 engines x"),
    ("p5en", "rollout: {engine: {kind: ep-deepep, tp_size: 8, ep_size: 4}}", "", "ep_size=4"),
    ("p5en", "", "bench_rollout: {profiles: {Bad_Name: {kind: ep}}}", "Bad_Name"),
])
def test_bad_engine_layouts_fail_before_synth(tmp_path, deploy, run, text, message):
    cfg = load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml" if deploy else None)
    with pytest.raises(WorkloadError) as e:
        load_workloads(cfg, _workloads(tmp_path, run, text))
    # one message naming the field (a run-config field error keeps the run config's own format)
    assert message in str(e.value)
    assert "\n" not in str(e.value) or "invalid run config" in str(e.value)


def test_checkov_passes_on_the_multi_node_and_bench_manifests(tmp_path):
    from test_charts import _checkov

    ex = Example("dsv3-ab", tmp_path / "ab")
    report = _checkov(ex.outdir, "kubernetes")
    assert [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]] == []


@pytest.mark.parametrize("env", ["dev", "staging", "prod"])
def test_the_default_rollout_engine_command_parses_with_sglang_arguments(env):
    from app.model.source import store_copy_dir
    from charts8s.rollout import BASE_MODEL_DIR, engine_container

    plan = load_workloads(load_config(env))
    cmd = engine_container(plan, plan.engine, leader=True)["command"]
    ns = parse_launch_server(cmd)
    assert ns.tp_size == plan.gpus_per_rollout and ns.moe_a2a_backend == "none" and ns.nnodes == 1
    base = plan.wl.rollout.model_path or plan.run.model.path
    # an s3:// base model is served from the copy the pod's init container fetched (tests/test_model_paths.py)
    local = str(store_copy_dir(base, BASE_MODEL_DIR)) if base.startswith("s3://") else base
    assert ns.model_path == local and ns.port == plan.wl.rollout.engine_port


def test_the_worker_serves_the_port_its_podmonitor_scrapes(example):
    """The leader's worker container runs `moerl rollout --metrics-port` on the named port the
    moerl-rollout PodMonitor (charts8s/monitoring.py) scrapes, in a pod its selector matches."""
    from app.names import METRICS_PORT
    from charts8s.monitoring import SCRAPED, metrics_port
    from charts8s.placement import labels

    assert "moerl-rollout" in SCRAPED
    # The run's engines (the bench pair's engines are driven by the bench Jobs, without a worker);
    # multi-node engines' workers are the moerl-rollout-worker StatefulSet, scraped as a role of its own.
    leaders = [pod for name, role, pod in engine_pods(example) if name == "moerl-rollout" and role == "leader"]
    assert leaders
    if example.plan.engine.nodes > 1:
        assert "moerl-rollout-worker" in SCRAPED
        leaders = [d["spec"]["template"]["spec"] for d in example.kind("StatefulSet")
                   if d["metadata"]["name"] == "moerl-rollout-worker"]
    for pod in leaders:
        (worker,) = [c for c in pod["containers"] if c["name"] == "worker"]
        assert worker["ports"] == [metrics_port()]
        cmd = worker["command"]
        assert cmd[cmd.index("--metrics-port") + 1] == str(METRICS_PORT)
    templates = [d["spec"]["template"] for d in example.kind("Deployment") if d["metadata"]["name"] == "moerl-rollout"]
    for t in templates:
        assert labels("moerl-rollout").items() <= t["metadata"]["labels"].items()
    for d in example.kind("StatefulSet"):
        if d["metadata"]["name"] == "moerl-rollout-worker":
            assert labels("moerl-rollout-worker").items() <= d["spec"]["template"]["metadata"]["labels"].items()


def test_engines_outlive_a_weight_group_error_and_trainers_end_on_a_hang(example):
    """Issue 37 item 7 as rendered: every engine container runs under CleanUpOnly NCCL error
    handling (a failed weight-update group answers a failure, the worker reloads from the store;
    torch's default would tear the scheduler down), every trainer container under TearDown (a hung
    training collective ends the process and Volcano restarts the gang); the weight-update group
    itself is made with its own handling either way (app/weight_group.py)."""
    engines = [engine_of(pod) for _, _, pod in engine_pods(example)]
    assert engines
    for c in engines:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", c["name"]
    trainers = [c for d in example.docs if d["kind"] == "Job" and d["apiVersion"].startswith("batch.volcano.sh/")
                for t in d["spec"]["tasks"] for c in t["template"]["spec"]["containers"]]
    assert trainers
    for c in trainers:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
