"""Synth checks of charts8s/: schemas, placement, resources, probes, security, agreement with the
TorchX component, checkov on dist/, and the bad-input rules (issue 6, parts 1, 2, 4, 5).

Manifests are synthesized once per environment (module-scoped fixtures) and read back from disk,
so each assertion checks what `kubectl apply -f dist/` would receive.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

from app.config import RunConfig
from app.names import CLUSTER_CONFIG
from app.torchx_component import EFA_RESOURCE, engine_command, trainer_command
from charts8s.main import build, main
from charts8s.volcano import JOB_SCHEMA
from charts8s.workloads import WorkloadError, load_workloads
from infra.config import POOL_LABEL, load_config
from infra.instances import INSTANCE_TABLE

ROOT = Path(__file__).resolve().parents[1]
CHECKOV = ROOT / ".venv" / "checkov" / "bin" / "checkov"
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")


def _load(outdir: Path) -> list[dict]:
    docs = []
    for f in sorted(outdir.glob("*.k8s.yaml")):
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


class Synth:
    """One environment's synthesized objects plus its config and plan."""

    def __init__(self, env: str, outdir: Path):
        self.cfg = load_config(env)
        self.plan = load_workloads(self.cfg)
        self.files = build(self.plan, outdir)
        self.outdir = outdir
        self.docs = _load(outdir)

    def get(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} objects"
        return found[0]

    def kinds(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def pod_templates(self) -> dict[str, dict]:
        """name -> pod template of every workload (Volcano tasks named job/task)."""
        out = {}
        for d in self.docs:
            if d["kind"] in ("Deployment", "StatefulSet"):
                out[d["metadata"]["name"]] = d["spec"]["template"]
            elif d["apiVersion"].startswith("batch.volcano.sh/"):
                for t in d["spec"]["tasks"]:
                    out[f"{d['metadata']['name']}/{t['name']}"] = t["template"]
        return out

    def trainer_tasks(self) -> list[dict]:
        return self.get("Job", "moerl-trainer")["spec"]["tasks"]


@pytest.fixture(scope="module", params=["dev", "prod"])
def synth(request, tmp_path_factory) -> Synth:
    return Synth(request.param, tmp_path_factory.mktemp(f"dist-{request.param}"))


@pytest.fixture(scope="module")
def prod(tmp_path_factory) -> Synth:
    return Synth("prod", tmp_path_factory.mktemp("dist-prod-only"))


# -- schemas -------------------------------------------------------------------------------------


def test_core_objects_validate_against_the_configured_kubernetes_schema(synth):
    core = [d for d in synth.docs if not d["apiVersion"].startswith("batch.volcano.sh/")]
    assert len(core) >= 20
    for d in core:
        # strict: unknown fields are errors (a typo would otherwise be dropped by the API server)
        kubernetes_validate.validate(d, synth.cfg.k8s_version, strict=True)


def _volcano_validator(version: str) -> jsonschema.Validator:
    defs_dir = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}.0-local-strict"
    defs = json.loads((defs_dir / "_definitions.json").read_text())
    registry = Registry().with_resources([(defs["$id"], Resource.from_contents(defs))])
    return jsonschema.Draft202012Validator(JOB_SCHEMA, registry=registry)


def test_volcano_job_validates_against_its_crd_schema(synth):
    jobs = [d for d in synth.docs if d["apiVersion"].startswith("batch.volcano.sh/")]
    assert len(jobs) == 1
    _volcano_validator(synth.cfg.k8s_version).validate(jobs[0])


@pytest.mark.parametrize("path,value", [
    (("spec", "minAvaliable"), 2),                                   # misspelt Job field
    (("spec", "tasks", 0, "template", "spec", "nodeSelecter"), {}),  # misspelt pod field
    (("spec", "policies", 0, "action"), "RestartAll"),               # unknown action
])
def test_volcano_schema_rejects_broken_jobs(prod, path, value):
    job = json.loads(json.dumps(prod.get("Job", "moerl-trainer")))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        _volcano_validator(prod.cfg.k8s_version).validate(job)


# -- placement -----------------------------------------------------------------------------------


def _tolerated(pod: dict) -> set[tuple[str, str]]:
    return {(t["key"], t.get("value", "")) for t in pod.get("tolerations", [])}


def test_trainer_pods_select_train_gpu_and_never_spot(synth):
    pool = synth.cfg.pools["train-gpu"]
    assert pool.capacity_type != "SPOT"
    tasks = synth.trainer_tasks()
    assert len(tasks) == synth.plan.trainer_nodes
    spot_pools = [p for p in synth.cfg.pools.values() if p.capacity_type == "SPOT"]
    for t in tasks:
        pod = t["template"]["spec"]
        assert pod["nodeSelector"] == {POOL_LABEL: "train-gpu"}
        assert _tolerated(pod) == {(x.key, x.value) for x in pool.taints}
        for sp in spot_pools:  # no toleration of a Spot pool's own taint
            assert not any(x.value == sp.name and (x.key, x.value) in _tolerated(pod) for x in sp.taints)
        (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert {"key": "eks.amazonaws.com/capacityType", "operator": "NotIn", "values": ["SPOT"]} in term["matchExpressions"]
        assert pod["serviceAccountName"] == synth.cfg.trainer_service_account_of(synth.plan.run.run_id)
        assert pod["priorityClassName"] == "moerl-trainer"


def test_rollout_pods_tolerate_spot_pool_and_drain_before_kill(synth):
    pool = synth.cfg.pools["rollout-gpu"]
    assert pool.capacity_type == "SPOT"
    dep = synth.get("Deployment", "moerl-rollout")
    assert dep["spec"]["replicas"] == synth.plan.rollout_replicas
    pod = dep["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {POOL_LABEL: "rollout-gpu"}
    assert _tolerated(pod) == {(x.key, x.value) for x in pool.taints}
    drain = synth.plan.run.rollout.drain_grace_s
    assert pod["terminationGracePeriodSeconds"] == math.ceil(drain) + synth.plan.wl.rollout.drain_margin_s
    assert pod["terminationGracePeriodSeconds"] > drain
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    # the engine outlives the worker's drain, inside the grace period
    assert drain <= engine["lifecycle"]["preStop"]["sleep"]["seconds"] < pod["terminationGracePeriodSeconds"]
    assert pod["serviceAccountName"] == synth.cfg.rollout_service_account
    keys = {c["topologyKey"] for c in pod["topologySpreadConstraints"]}
    assert {"kubernetes.io/hostname", "node.kubernetes.io/instance-type"} <= keys
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]


def test_buffer_and_env_pods_land_on_their_pools(synth):
    buf = synth.get("StatefulSet", "moerl-buffer")["spec"]["template"]["spec"]
    assert buf["nodeSelector"] == {POOL_LABEL: "buffer-mem"}
    env = synth.get("Deployment", "moerl-env")["spec"]["template"]["spec"]
    assert env["nodeSelector"] == {POOL_LABEL: "env-cpu"}
    assert _tolerated(env) == {(x.key, x.value) for x in synth.cfg.pools["env-cpu"].taints}


# -- resources -----------------------------------------------------------------------------------


def test_gpu_and_efa_counts_match_the_instance_table(synth):
    train, roll = synth.cfg.pools["train-gpu"], synth.cfg.pools["rollout-gpu"]
    gpus = min(INSTANCE_TABLE[t].gpus for t in train.instance_types)
    efa = min(INSTANCE_TABLE[t].efa_interfaces for t in train.instance_types) if train.efa else 0
    assert gpus > 0
    for t in synth.trainer_tasks():
        (c,) = t["template"]["spec"]["containers"]
        lim = c["resources"]["limits"]
        assert int(lim["nvidia.com/gpu"]) == gpus
        assert int(lim.get(EFA_RESOURCE, 0)) == efa
        assert int(lim["hugepages-2Mi"]) == synth.cfg.pools["train-gpu"].hugepages_2mi * 2**20
        assert f"--nproc-per-node={gpus}" in c["command"][-1]
    engine = next(c for c in synth.get("Deployment", "moerl-rollout")["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "engine")
    assert int(engine["resources"]["limits"]["nvidia.com/gpu"]) == min(INSTANCE_TABLE[t].gpus for t in roll.instance_types)
    roll_efa = min(INSTANCE_TABLE[t].efa_interfaces for t in roll.instance_types) if roll.efa else 0
    assert int(engine["resources"]["limits"].get(EFA_RESOURCE, 0)) == roll_efa
    quota = synth.get("ResourceQuota", "moerl-accelerators")["spec"]["hard"]
    feed = synth.get("Deployment", "moerl-feed")["spec"]["template"]["spec"]["containers"]
    feed_gpus = sum(int(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in feed)
    assert feed_gpus == synth.plan.feed_gpus  # the held-out evaluation engine
    assert int(quota["requests.nvidia.com/gpu"]) == synth.plan.trainer_nodes * gpus + synth.plan.rollout_replicas * int(
        engine["resources"]["limits"]["nvidia.com/gpu"]) + feed_gpus


def test_trainer_gang_restarts_whole_and_resumes(prod):
    job = prod.get("Job", "moerl-trainer")
    spec = job["spec"]
    assert spec["schedulerName"] == "volcano" and spec["minAvailable"] == prod.plan.trainer_nodes
    assert {"event": "PodFailed", "action": "RestartJob"} in spec["policies"]
    assert {"event": "PodEvicted", "action": "RestartJob"} in spec["policies"]
    svc = prod.get("Service", "moerl-trainer")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    for t in spec["tasks"]:
        pod = t["template"]["spec"]
        assert pod["subdomain"] == "moerl-trainer" and pod["hostname"] == t["name"]
        (c,) = pod["containers"]
        cmd = c["command"][-1]
        assert "--resume" in cmd and "--max-restarts=0" in cmd and "--rdzv-backend=c10d" in cmd
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["VC_TRAINER_0_HOSTS"].startswith("trainer-0.moerl-trainer.")
        for key in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT", "NCCL_SOCKET_IFNAME", "FI_PROVIDER"):
            assert env[key], key
    # replica 0 hosts the c10d store; the others reach it through the headless Service name
    assert "TORCHX_RANK0_HOST" in spec["tasks"][0]["template"]["spec"]["containers"][0]["command"][-1]
    assert "VC_TRAINER_0_HOSTS" in spec["tasks"][1]["template"]["spec"]["containers"][0]["command"][-1]


# -- probes, PDBs, security ------------------------------------------------------------------------


def test_probes_and_disruption_budgets_exist(synth):
    pod = synth.get("Deployment", "moerl-rollout")["spec"]["template"]["spec"]
    engine = next(c for c in pod["containers"] if c["name"] == "engine")
    worker = next(c for c in pod["containers"] if c["name"] == "worker")
    marker = worker["command"][worker["command"].index("--pause-marker") + 1]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        # the pause-aware probe (app/rollout/probe.py): /health_generate unless the worker's marker says paused
        cmd = engine[probe]["exec"]["command"]
        assert cmd[:3] == ["python3", "-m", "app.rollout.probe"], probe
        assert cmd[cmd.index("--marker") + 1] == marker, probe
        # the probe outwaits SGLang's own 20 s /health_generate wait, and the kubelet outwaits the probe
        assert float(cmd[cmd.index("--timeout") + 1]) > 20 and engine[probe]["timeoutSeconds"] > float(cmd[cmd.index("--timeout") + 1])
    for name in ("moerl-buffer",):
        containers = synth.get("StatefulSet", name)["spec"]["template"]["spec"]["containers"]
        assert [c["name"] for c in containers] == ["redis", "redis-exporter"]
        for c in containers:
            assert c["readinessProbe"] and c["livenessProbe"], c["name"]
    (c,) = synth.get("Deployment", "moerl-env")["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"] and c["livenessProbe"]
    pdbs = {d["metadata"]["name"]: d["spec"]["selector"]["matchLabels"] for d in synth.kinds("PodDisruptionBudget")}
    for name in ("moerl-rollout", "moerl-env", "moerl-feed"):
        dep = synth.get("Deployment", name)
        assert pdbs[name] == dep["spec"]["template"]["metadata"]["labels"]


def test_no_pod_runs_privileged_or_as_root(synth):
    templates = synth.pod_templates()
    assert len(templates) == 4 + synth.plan.trainer_nodes  # buffer, env pool, rollout, feed, trainer tasks
    for name, tpl in templates.items():
        pod = tpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] >= 10000, name
        assert not pod.get("hostNetwork") and not pod.get("hostPID") and not pod.get("hostIPC"), name
        assert not any("hostPath" in v for v in pod.get("volumes", [])), name
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc.get("privileged") is False and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), (name, c["name"])
    ns = synth.get("Namespace", synth.cfg.namespace)
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# -- buffer, config map, service accounts -----------------------------------------------------------


def test_redis_buffer_is_persistent_password_protected_and_fenced(synth):
    sts = synth.get("StatefulSet", "moerl-buffer")
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--dir") + 1] == "/data"
    assert {"name": "data", "mountPath": "/data"} in c["volumeMounts"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    secret_var = args[args.index("--requirepass") + 1].strip("$()")
    (env,) = [e for e in c["env"] if e["name"] == secret_var]
    assert env["valueFrom"]["secretKeyRef"]["name"] == synth.plan.wl.buffer.password_secret
    assert "stringData" not in json.dumps(synth.docs) and not synth.kinds("Secret")  # no credential in dist/
    (rule,) = synth.get("NetworkPolicy", "moerl-buffer")["spec"]["ingress"]
    allowed = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in rule["from"]}
    # the roles with a Redis user; the env pool (model output runs there) holds no credential and is not let in
    assert allowed == {"moerl-rollout", "moerl-trainer", "moerl-feed"}
    # one ACL user per role, each password from its own key of the Secret; each role's pods get theirs only
    users = [args[i + 1] for i, a in enumerate(args) if a == "--user"]
    assert users == ["trainer", "rollout", "feed"]
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c["env"]}
    assert keys == {"password", "trainer", "rollout", "feed"}
    for name, tpl in synth.pod_templates().items():
        refs = {(e["name"], e.get("value") or e["valueFrom"]["secretKeyRef"]["key"]) for ctr in tpl["spec"]["containers"]
                for e in ctr.get("env", []) if e["name"] in ("MOERL_REDIS_USER", "MOERL_REDIS_PASSWORD")
                or "secretKeyRef" in e.get("valueFrom", {})}
        role = {"moerl-trainer": "trainer", "moerl-rollout": "rollout", "moerl-feed": "feed"}.get(name.split("/")[0])
        if role is not None:
            assert refs == {("MOERL_REDIS_USER", role), ("MOERL_REDIS_PASSWORD", role)}, name
        elif name != "moerl-buffer":
            assert not refs, name
    # the selectors really match those pods' labels
    for name, tpl in synth.pod_templates().items():
        if name.split("/")[0] in allowed:
            assert tpl["metadata"]["labels"]["app.kubernetes.io/name"] == name.split("/")[0]


def test_redis_is_past_the_cves_published_since_7_4_2_and_pinned_by_digest(synth):
    """The buffer's image is Redis 7.4.11 or later (charts8s/workloads.py BufferSpec lists the
    CVEs fixed after 7.4.2), named by the digest of its index as well as by its tag."""
    sts = synth.get("StatefulSet", "moerl-buffer")
    (c,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "redis"]
    ref, _, digest = c["image"].partition("@")
    assert len(digest) == len("sha256:") + 64 and digest.startswith("sha256:")
    version = tuple(int(x) for x in ref.rsplit(":", 1)[1].split("-")[0].split("."))
    assert version >= (7, 4, 11), c["image"]


def _exporter(synth) -> tuple[dict, dict, dict[str, dict]]:
    """(pod template, exporter container, its env by name) of the buffer StatefulSet."""
    tpl = synth.get("StatefulSet", "moerl-buffer")["spec"]["template"]
    (c,) = [c for c in tpl["spec"]["containers"] if c["name"] == "redis-exporter"]
    return tpl, c, {e["name"]: e for e in c["env"]}


def _checked(value: str) -> list[tuple[int, str]]:
    """(db, key) pairs of a redis_exporter check-*-keys list ("db0=key,db0=key2")."""
    out = []
    for item in value.split(","):
        db, _, key = item.partition("=")
        out.append((int(db.removeprefix("db")), key))
    return out


def test_buffer_pod_runs_the_redis_exporter_on_its_metrics_port(synth):
    """The buffer's Prometheus sidecar: the pinned oliver006/redis_exporter, on the port its
    PodMonitor scrapes, reaching redis-server on the pod's loopback with the buffer's own
    password Secret, the /scrape proxy off, every variable one v1.88.0 reads, restricted like
    every container, and not run by the replica (which says why)."""
    from app.replica.kubelet import Substitutions
    from charts8s.cluster import REDIS_EXPORTER_PORT
    from charts8s.monitoring import SCRAPED, metrics_port
    from charts8s.placement import container_security

    tpl, c, env = _exporter(synth)
    (redis_c,) = [r for r in tpl["spec"]["containers"] if r["name"] == "redis"]
    assert c["image"] == synth.plan.wl.buffer.exporter_image
    repo, tag = c["image"].rsplit(":", 1)
    assert repo.endswith("oliver006/redis_exporter") and tag.startswith("v") and tag != "latest"
    assert c["ports"] == [metrics_port(REDIS_EXPORTER_PORT)] and SCRAPED["moerl-buffer"] == REDIS_EXPORTER_PORT
    assert env["REDIS_EXPORTER_WEB_LISTEN_ADDRESS"]["value"] == f":{REDIS_EXPORTER_PORT}"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    (redis_port,) = redis_c["ports"]
    assert env["REDIS_ADDR"]["value"] == f"redis://localhost:{redis_port['containerPort']}"
    (secret,) = [e for e in redis_c["env"] if e["name"] == "REDISCLI_AUTH"]  # the default user's password
    assert env["REDIS_PASSWORD"]["valueFrom"] == secret["valueFrom"]
    assert env["REDIS_EXPORTER_DISABLE_SCRAPE_ENDPOINT"]["value"] == "true"
    known = {line for line in (ROOT / "tests/data/redis_exporter-v1.88.0-env.txt").read_text().splitlines()
             if line and not line.startswith("#")}
    assert set(env) <= known, set(env) - known
    assert c["securityContext"] == container_security()
    res = c["resources"]
    assert res["requests"] == res["limits"] and set(res["limits"]) == {"cpu", "memory"}
    assert Substitutions.not_run(c).startswith("not run: ")
    assert Substitutions.not_run(redis_c) is None


def test_the_exporter_checks_the_keys_the_buffer_writes(synth, redis_server):
    """The keys the exporter measures are the ones an ExperienceBuffer of the mounted run config
    writes (its own key table, and after a task is queued and leased, the streams and sets
    as they are in Redis), in the database of buffer.redis_url."""
    from urllib.parse import urlsplit

    import redis

    from app.buffer import ExperienceBuffer, Sample, Task
    from app.buffer.experience import ROLLOUT_GROUP
    from app.buffer.keys import SET_KEYS, STREAM_KEYS

    (cm,) = synth.kinds("ConfigMap")
    run = RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"]))
    _, _, env = _exporter(synth)
    keys = _checked(env["REDIS_EXPORTER_CHECK_SINGLE_KEYS"]["value"])
    streams = _checked(env["REDIS_EXPORTER_CHECK_SINGLE_STREAMS"]["value"])
    db = int(urlsplit(run.buffer.redis_url).path.strip("/"))
    assert {d for d, _ in keys + streams} == {db}
    with ExperienceBuffer(redis_server, run.run_id, prefix=run.buffer.run_prefix) as buf:
        assert [k for _, k in keys] == [buf.keys[n] for n in STREAM_KEYS + SET_KEYS]
        assert [k for _, k in streams] == [buf.keys[n] for n in STREAM_KEYS]
        buf.put_tasks([Task(f"train-00000{i}", [1, i], "p", "{}", 2) for i in range(3)])
        done, _ = buf.lease("w", count=2)  # the second stays leased
        assert buf.publish(done, [Sample(done.sample_id(run.run_id, i), done.task_id, i, done.attempt, done.prompt_ids,
                                         [7, 8], [-0.5, -0.25], 1.0, 0, "stop") for i in range(2)])
        k = buf.keys
    r = redis.Redis.from_url(redis_server, decode_responses=True)
    # dead (dead letters) and dropped: none yet
    assert [r.type(key) for _, key in streams] == ["stream", "stream", "none"]
    assert [r.type(key) for _, key in keys] == ["stream", "stream", "none", "set", "set", "none"]
    # what the exporter reads for its metrics: XLEN and SCARD (redis_key_size), the group's PEL
    # (redis_stream_group_messages_pending: the leased task)
    assert (r.xlen(k["tasks"]), r.xlen(k["samples"]), r.scard(k["issued"]), r.scard(k["seen"])) == (2, 1, 3, 2)
    (group,) = r.xinfo_groups(k["tasks"])
    assert group["name"] == ROLLOUT_GROUP and group["pending"] == 1


def test_one_config_map_read_by_every_pod(synth):
    (cm,) = synth.kinds("ConfigMap")
    run = RunConfig.model_validate(yaml.safe_load(cm["data"]["run.yaml"]))
    assert run.buffer.redis_url.startswith(f"redis://moerl-buffer.{synth.cfg.namespace}.svc")
    assert run.store_url == f"s3://{synth.cfg.checkpoint_bucket}/{synth.cfg.run_prefix}"
    assert run.rollout.engine_url == "http://127.0.0.1:30000"
    for name, tpl in synth.pod_templates().items():
        if name == "moerl-buffer":
            continue
        vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        assert vols["run-config"]["configMap"]["name"] == cm["metadata"]["name"], name
        mounts = [m for c in tpl["spec"]["containers"] for m in c.get("volumeMounts", []) if m["name"] == "run-config"]
        assert mounts and all(m["mountPath"] == os.path.dirname(CLUSTER_CONFIG) for m in mounts), name


def test_service_accounts_match_pod_identity_names(synth):
    sas = {d["metadata"]["name"]: d for d in synth.kinds("ServiceAccount")}
    # the trainer's is its run's (issue 39 item 9: one Pod Identity role per trainer_runs entry)
    trainer_sa = synth.cfg.trainer_service_account_of(synth.plan.run.run_id)
    assert trainer_sa in sas and synth.cfg.rollout_service_account in sas
    for name, tpl in synth.pod_templates().items():
        assert tpl["spec"]["serviceAccountName"] in sas, name
    prio = {d["metadata"]["name"]: d["value"] for d in synth.kinds("PriorityClass")}
    assert prio["moerl-trainer"] > prio["moerl-rollout"]


# -- agreement with the TorchX component -------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::UserWarning:torchx.schedulers.kubernetes_scheduler")  # TorchX's note on Volcano < 1.4 task retries
def test_charts_and_torchx_component_agree(prod):
    """`torchx run -s kubernetes` (dry run) of the component yields the chart's image, command, resources."""
    from torchx.runner import get_runner

    plan, spec = prod.plan, prod.get("Job", "moerl-trainer")["spec"]
    train = min(prod.cfg.pools["train-gpu"].specs, key=lambda s: s.gpus)
    with get_runner() as runner:
        info = runner.dryrun_component(
            str(ROOT / "app" / "torchx_component.py") + ":trainer",
            ["--image", plan.images["trainer"], "--nnodes", str(plan.trainer_nodes),
             "--nproc_per_node", str(plan.gpus_per_trainer), "--gpus", str(plan.gpus_per_trainer),
             "--efa", str(plan.efa_per_trainer), "--hugepages_mib", str(prod.cfg.pools["train-gpu"].hugepages_2mi),
             "--cpu", str(train.vcpus - 8), "--mem_mb",
             str(int(train.memory_gib * 1024 * 0.9) - prod.cfg.pools["train-gpu"].hugepages_2mi),
             "--run_dir", "/tmp/moerl-run", "--metrics_port", "9464"],
            scheduler="kubernetes", cfg={"queue": "default", "namespace": prod.cfg.namespace,
                                         "service_account": prod.cfg.trainer_service_account_of(plan.run.run_id)},
        )
    tx = info.request.resource["spec"]["tasks"]
    assert len(tx) == len(spec["tasks"])
    for ours, theirs in zip(spec["tasks"], tx):
        (c,) = ours["template"]["spec"]["containers"]
        t = theirs["template"].spec.containers[0]
        assert c["image"] == t.image
        # same command up to the rendezvous id, which TorchX makes unique per submission
        strip = lambda s: s.split("--rdzv-id=")[0] + s.split("--max-restarts")[1]
        assert strip(c["command"][-1]) == strip(t.command[-1])
        assert c["resources"]["limits"] == t.resources.limits
    dep = prod.get("Deployment", "moerl-rollout")["spec"]["template"]["spec"]
    engine = next(c for c in dep["containers"] if c["name"] == "engine")
    assert engine["image"] == plan.images["rollout"]
    from charts8s.rollout import served_model_path

    # the charts serve an s3:// base model from its local copy (tests/test_model_paths.py)
    assert engine["command"] == engine_command("sglang", served_model_path(plan), 30000, plan.gpus_per_rollout)
    assert trainer_command(CLUSTER_CONFIG, 1, 8, 29500, True).startswith("torchrun ")


# -- checkov -------------------------------------------------------------------------------------------


def _checkov(target: Path, framework: str) -> dict:
    assert CHECKOV.exists(), f"{CHECKOV} missing: run `make test` (its install step creates .venv/checkov)"
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CKV_NO_TELEMETRY": "1", "LOG_LEVEL": "ERROR"}
    proc = subprocess.run([str(CHECKOV), "-d", str(target), "--framework", framework, "--output", "json",
                           "--skip-download", "--quiet"], capture_output=True, text=True, env=env, timeout=600)
    report = json.loads(proc.stdout)
    return report if isinstance(report, dict) else {"results": {"failed_checks": [], "skipped_checks": []}, "summary": {}}


def test_checkov_passes_on_dist_with_every_skip_justified(prod):
    report = _checkov(prod.outdir, "kubernetes")
    failed = [(f["check_id"], f["resource"]) for f in report["results"]["failed_checks"]]
    assert failed == []
    assert report["summary"]["passed"] > 100
    for d in prod.docs:
        for key, value in (d["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert check.startswith("CKV") and len(reason.split()) >= 5, (d["metadata"]["name"], value)


# -- bad input -----------------------------------------------------------------------------------------


def _workloads(tmp_path: Path, text: str, run: str | None = None) -> Path:
    if run is not None:
        (tmp_path / "run.yaml").write_text(run)
        text += f"\nrun_config: {tmp_path / 'run.yaml'}\n"
    p = tmp_path / "workloads.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,run,message", [
    ("trainer: {nodes: 3}", None, "trainer.nodes=3 exceeds pools.train-gpu.max_size=2"),
    ("rollout: {replicas: 5}", None, "rollout.replicas=5 exceeds pools.rollout-gpu.max_size=2"),
    ("env: {replicas: 100, cpu: 4}", None, "env.replicas=100 exceeds the env-cpu pool's capacity"),
    ("trainer: {nodes: 1}", "trainer: {parallel: {ep: 3}}", "trainer.parallel.ep=3 must divide trainer.parallel.dp_shard=8"),
    ("images: {rollout: '1.dkr.ecr.us-east-2.amazonaws.com/moerl/rollout'}", None, "images.rollout: image"),
    ("images: {env: 'registry:5000/moerl/env'}", None, "has no tag"),
    ("images: {trainer: 'moerl/trainer:latest'}", None, "mutable tag 'latest'"),
    ("trainer: {nodez: 1}", None, "trainer.nodez: Extra inputs are not permitted"),
    ("images: {trainer: 'my repo/TRAINER:1.0 extra'}", None, "images.trainer: 'my repo/TRAINER:1.0 extra' is not a valid"),
    ("buffer: {password_secret: 'Not_A_Valid Name!'}", None, "buffer.password_secret"),
    ("buffer: {exporter_image: 'oliver006/redis_exporter:latest'}", None, "buffer.exporter_image: image"),
    # A trailing newline (a YAML block scalar, a pasted line) matched the patterns' "$" and was rendered.
    ('buffer: {exporter_image: "oliver006/redis_exporter:v1.88.0\\n"}', None, "buffer.exporter_image: 'oliver006"),
    ('buffer: {password_secret: "moerl-redis\\n"}', None, "buffer.password_secret"),
    ("buffer: {image: 'public.ecr.aws/docker/library/redis:7.4.11-alpine'}", None, "buffer.image: 'public.ecr.aws/docker/library/redis:7.4.11-alpine' has no @sha256 digest"),
    ("bench_rollout: {profiles: {a2a: {kind: ep}}, api_key_secret: 'Bad Key'}", None, "bench_rollout.api_key_secret"),
    # profiles are what a bench renders: an empty map rendered no fleet and no Job.
    ("bench_rollout: {profiles: {}}", None, "bench_rollout.profiles: no profile"),
])
def test_bad_input_fails_before_synth_with_one_message(tmp_path, text, run, message):
    cfg = load_config("dev")
    with pytest.raises(WorkloadError) as e:
        load_workloads(cfg, _workloads(tmp_path, text, run))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("mode", ["store", "network"])
def test_network_weight_sync_opens_the_trainer_and_the_engines_to_each_other_only(tmp_path, mode):
    """weight_sync.mode network: the trainer's source rank and the engines form one NCCL group
    (app/trainer/weight_sync.py), so replica 0's pod admits the rollout pods on the group's
    rendezvous port and NCCL's range only, and the rollout pods admit replica 0 on NCCL's range
    only (tests/test_netpol.py asks every connection of it); the trainer pods know their address
    (POD_IP, what master_address falls back to). Store mode keeps both closed to each other."""
    from charts8s.cluster import WEIGHT_SOURCE_LABEL
    from charts8s.netpol import NCCL_PORTS, WEIGHT_GROUP_PORT
    from charts8s.placement import labels

    cfg = load_config("dev")
    out = tmp_path / "dist"
    run = f"model: {{path: /models/tiny}}\nweight_sync: {{mode: {mode}}}\n"
    build(load_workloads(cfg, _workloads(tmp_path, "", run)), out)
    docs = _load(out)
    policy = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    source = {**labels("moerl-trainer"), WEIGHT_SOURCE_LABEL: "true"}
    nccl = {"protocol": "TCP", "port": NCCL_PORTS[0], "endPort": NCCL_PORTS[1]}
    assert policy["moerl-trainer"]["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": labels("moerl-trainer")}}]}]
    if mode == "network":
        ws = policy["moerl-trainer-weight-source"]["spec"]
        assert ws["podSelector"]["matchLabels"] == source
        assert ws["ingress"] == [{"from": [{"podSelector": {"matchLabels": labels("moerl-rollout")}}],
                                  "ports": [{"protocol": "TCP", "port": WEIGHT_GROUP_PORT}, nccl]}]
        assert policy["moerl-rollout"]["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": source}}],
                                                                "ports": [nccl]}]
    else:
        assert "moerl-trainer-weight-source" not in policy and policy["moerl-rollout"]["spec"]["ingress"] == []
    (job,) = [d for d in docs if d["kind"] == "Job"]
    for task in job["spec"]["tasks"]:
        (ctr,) = task["template"]["spec"]["containers"]
        env = {e["name"]: e for e in ctr["env"]}
        assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}, task["name"]
        assert (task["template"]["metadata"]["labels"].get(WEIGHT_SOURCE_LABEL) == "true") == task["name"].endswith("-0")
    for d in docs:
        if not d["apiVersion"].startswith("batch.volcano.sh/"):
            kubernetes_validate.validate(d, cfg.k8s_version, strict=True)


def test_cdk8s_yaml_app_synthesizes_into_the_cli_outdir(tmp_path):
    """`cdk8s synth` runs cdk8s.yaml's `app` with CDK8S_OUTDIR set; the app must honour both."""
    conf = yaml.safe_load((ROOT / "cdk8s.yaml").read_text())
    assert conf["language"] == "python" and conf["output"] == "dist"
    cmd = conf["app"].split()
    cmd[0] = str(ROOT / cmd[0]) if not Path(cmd[0]).is_absolute() else cmd[0]
    out = tmp_path / "out"
    env = {**os.environ, "CDK8S_OUTDIR": str(out), "MOERL_ENV": "staging"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    names = sorted(p.name for p in out.glob("*.k8s.yaml"))
    assert names == ["buffer.k8s.yaml", "cluster.k8s.yaml", "envpool.k8s.yaml", "feed.k8s.yaml", "rollout.k8s.yaml",
                     "trainer.k8s.yaml"]
    job = next(d for d in _load(out) if d["kind"] == "Job")
    assert len(job["spec"]["tasks"]) == load_config("staging").pools["train-gpu"].max_size
    # reproducible: a second synth (in this process) writes the same bytes, so dist/ diffs are real
    again = build(load_workloads(load_config("staging")), tmp_path / "again")
    assert {p.name: p.read_bytes() for p in again} == {p.name: p.read_bytes() for p in out.glob("*.k8s.yaml")}


def test_cli_bad_input_leaves_existing_output_untouched(tmp_path, capsys):
    out = tmp_path / "dist"
    out.mkdir()
    (out / "old.k8s.yaml").write_text("kept: true\n")
    bad = _workloads(tmp_path, "trainer: {nodes: 99}")
    assert main(["--env", "dev", "--workloads", str(bad), "--outdir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.nodes=99" in err[0]
    assert [p.name for p in out.iterdir()] == ["old.k8s.yaml"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".dist.")]  # no half-written temp dir


# -- the command lines name options the CLI really has ----------------------------------------------


def _options(name: str) -> set[str]:
    from app.cli import command

    cmd = command(name)
    return {opt for p in cmd.params for opt in p.opts}


def _flags(argv: list[str]) -> set[str]:
    return {a for a in argv if a.startswith("--")}


def test_container_commands_use_existing_cli_options(prod):
    from app.torchx_component import engine_command, worker_command

    assert _flags(engine_command("builtin", "/m", 30000, 1)) <= _options("engine")
    assert _flags(worker_command(CLUSTER_CONFIG, "w-0")) <= _options("rollout")
    cmd = prod.trainer_tasks()[0]["template"]["spec"]["containers"][0]["command"][-1]
    train_argv = cmd.split(" moerl train ", 1)[1].split()
    assert _flags(train_argv) <= _options("train")
    (reward,) = prod.get("Deployment", "moerl-env")["spec"]["template"]["spec"]["containers"]
    try:
        options = _options("reward")
    except ModuleNotFoundError:
        pytest.skip("app.envs.reward_server (`moerl reward`) is not in this tree yet")
    assert _flags(reward["command"]) <= options


# -- the TorchX component on its own ----------------------------------------------------------------


def _wrapped_command(role) -> list[str]:
    """The argv a TorchX role runs inside the exit-status wrapper of app/torchx_component.py
    (``bash -c "trap 'true' TERM INT; <argv>; rc=$?; echo ...; exit $rc"``)."""
    import shlex

    assert role.entrypoint == "bash" and role.args[0] == "-c", role.name
    head, body = "trap 'true' TERM INT; ", role.args[1]
    assert body.startswith(head) and "; rc=$?; " in body, body
    return shlex.split(body[len(head):body.rindex("; rc=$?; ")])


def test_local_job_materializes_every_role_without_path():
    """`.venv/bin/torchx run -s local_cwd ...:job` with the venv not on PATH: every role starts
    through the interpreter running torchx, never through `torchrun` / `moerl` looked up on PATH."""
    import sys

    from torchx.runner import get_runner

    with get_runner() as runner:
        info = runner.dryrun_component(str(ROOT / "app" / "torchx_component.py") + ":job",
                                       ["--config", "run.yaml", "--model_path", "/m", "--rollout_replicas", "2"],
                                       scheduler="local_cwd")
    roles = info._app.roles
    assert [r.name for r in roles] == ["trainer", "rollout", "feed"]
    py = sys.executable
    trainer, rollout, feed = (_wrapped_command(r) for r in roles)
    assert trainer[:2] == ["bash", "-c"] and trainer[2].startswith(f"{py} -m torch.distributed.run ")
    assert f"-m app.cli train --config run.yaml --resume" in trainer[2]
    assert f"{py} -m app.cli engine --model-path /m" in rollout[-1] and roles[1].num_replicas == 2
    assert f"{py} -m app.cli rollout --config run.yaml" in rollout[-1]
    assert feed[:5] == [py, "-m", "app.cli", "feed", "--config"]
    for r in roles:
        words = " ".join([r.entrypoint, *r.args]).replace(";", " ").replace("&", " ").split()
        assert "torchrun" not in words and "moerl" not in words, r.name
    # each rollout replica gets its own worker id (task-lease consumer name)
    ids = {r.args[-1].split("--worker-id ")[1].split()[0] for r in info.request.role_params["rollout"]}
    assert len(ids) == 2


@pytest.mark.parametrize("kwargs", [{"nnodes": 0}, {"gpus": 3, "nproc_per_node": 2}])
def test_trainer_component_rejects_bad_counts(kwargs):
    from app.torchx_component import trainer

    with pytest.raises(ValueError):
        trainer(**kwargs)


def test_paired_roles_drain_the_worker_then_stop_the_engine(tmp_path):
    """SIGTERM to the paired role reaches the worker, waits for its drain, returns its status, stops the engine."""
    import signal
    import time

    from app.torchx_component import _pair

    engine = ["bash", "-c", f"echo $$ > {tmp_path}/engine.pid; exec sleep 60"]
    worker = ["bash", "-c", f"trap 'kill $!; echo drained > {tmp_path}/worker.txt; exit 7' TERM; "
                            f"echo $$ > {tmp_path}/worker.pid; sleep 60 & wait $!"]
    proc = subprocess.Popen(["bash", "-c", _pair(engine, worker)], start_new_session=True)
    try:
        for _ in range(200):  # both started (bounded wait, no timing assertion)
            if (tmp_path / "engine.pid").exists() and (tmp_path / "worker.pid").exists():
                break
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "worker.txt").read_text().strip() == "drained"
    engine_pid = int((tmp_path / "engine.pid").read_text())
    for _ in range(100):
        try:
            os.kill(engine_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the engine outlived the paired role")


def test_paired_roles_end_when_the_worker_dies_of_a_signal(tmp_path):
    """A worker killed by a signal (an OOM kill) ends the paired role with its status and stops the
    engine; bash keeps that status > 128, which an earlier loop took for an interrupted wait and
    spun on for ever."""
    import signal

    from app.torchx_component import _pair

    engine = ["bash", "-c", f"echo $$ > {tmp_path}/engine.pid; exec sleep 60"]
    worker = ["bash", "-c", f"for _ in $(seq 1000); do [ -s {tmp_path}/engine.pid ] && break; sleep 0.01; done; "
                            "kill -KILL $$"]  # once the engine runs
    proc = subprocess.Popen(["bash", "-c", _pair(engine, worker)], start_new_session=True)
    try:
        assert proc.wait(timeout=30) == 128 + signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    with pytest.raises(ProcessLookupError):  # killed and reaped before the role exited
        os.kill(int((tmp_path / "engine.pid").read_text()), 0)


def test_synth_refuses_an_outdir_with_other_files(tmp_path, capsys):
    from charts8s.main import main

    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["--env", "dev", "--outdir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "notes.txt" in err[0]
    assert (out / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize("outdir", ["/proc/1/x", "a-file/x"])
def test_synth_names_an_outdir_it_cannot_make(tmp_path, capsys, outdir):
    """/proc/1 holds no new directory; a file is no directory's parent: one line naming --outdir
    (a FileNotFoundError or FileExistsError traceback from tempfile.mkdtemp before)."""
    from charts8s.main import main

    (tmp_path / "a-file").write_text("kept\n")
    path = outdir if outdir.startswith("/") else str(tmp_path / outdir)
    assert main(["--env", "dev", "--outdir", path]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"charts8s: --outdir: {path}: cannot make a directory in "), err
    assert (tmp_path / "a-file").read_text() == "kept\n"
