"""What a foothold in one pod can reach, asked of the rendered NetworkPolicies (issue 28 items 1, 5, 8).

Each check renders dist/ with charts8s and evaluates the policies as Kubernetes defines them
(tests/netpolicy.py) for pods labelled as their controllers label them:

- item 1: rollout pods reach the trainer only at replica 0's pod (the weight-update group's
  source rank), only on the group's rendezvous port and NCCL's declared range, never torchrun's
  c10d port; the pods that join the group keep NCCL's ports in that range (the sysctl), and the
  fixed ports stay out of it; store mode opens nothing between them;
- item 5: every pod is isolated for egress by its role's policy, which allows what the role
  needs and nothing else (DNS at CoreDNS only, Redis for its clients, the env pool and the
  reward model for rollout pods, the Pod Identity agent for the pods that call AWS, HTTPS
  outside the private ranges for the pods that download models or use the store); the buffer
  and the env pool reach nothing; the Services' ports are their pods' (the VPC CNI's rule);
- item 8: engine pods of different LeaderWorkerSet groups cannot reach each other on any port,
  pods of one group can; no pod mounts a Kubernetes API token; the bench fleets' SGLang, on the
  pod network, asks for --api-key on generation and --admin-api-key on weight updates (SGLang's
  own auth decision, read from the wheel), and the bench Job holds only the API key.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from charts8s.main import build
from charts8s.netpol import NCCL_PORTS, WEIGHT_GROUP_PORT
from charts8s.workloads import WorkloadError, load_workloads
from infra.config import load_config
from netpolicy import Address, Pod, allowed, isolated, pods_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "charts8s" / "examples"
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")

S3 = Address("52.216.10.20")  # an S3 address (its public prefixes; through the VPC gateway endpoint)
HUB = Address("18.160.10.5")  # huggingface.co's CDN, through the NAT gateway
POD_IDENTITY = Address("169.254.170.23")
IMDS = Address("169.254.169.254")
NODE = Address("10.0.12.7")  # another node of the VPC (its kubelet listens on 10250; a pod's own node is always open)
ENDPOINT = Address("10.0.40.9")  # an interface endpoint in the VPC (STS, ECR: 443)
INTERNET = Address("203.0.113.9")
KUBE_DNS = Pod("coredns-0", "kube-system", {"k8s-app": "kube-dns"})
OUTSIDER = Pod("prometheus-0", "monitoring", {"app.kubernetes.io/name": "prometheus"})


class Rendered:
    def __init__(self, cfg, workloads: Path, outdir: Path):
        self.plan = load_workloads(cfg, workloads)
        build(self.plan, outdir)
        self.docs = [d for f in sorted(outdir.glob("*.k8s.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
        self.policies = [d for d in self.docs if d["kind"] == "NetworkPolicy"]
        self.pods = pods_of(self.docs)

    def pod(self, name: str) -> Pod:
        (p,) = [p for p in self.pods if p.name == name]
        return p

    def role(self, component: str) -> list[Pod]:
        found = [p for p in self.pods if p.labels.get("app.kubernetes.io/name") == component]
        assert found, component
        return found

    def can(self, src, dst, port: int, protocol: str = "TCP") -> bool:
        return allowed(self.policies, src, dst, port, protocol)


def _render(tmp_path: Path, cfg, run: str, workloads: str) -> Rendered:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "run.yaml").write_text(run)
    (tmp_path / "workloads.yaml").write_text(workloads + f"\nrun_config: {tmp_path / 'run.yaml'}\n")
    return Rendered(cfg, tmp_path / "workloads.yaml", tmp_path / "dist")


@pytest.fixture(scope="module")
def dev(tmp_path_factory) -> Rendered:
    """dev: 2 trainer nodes, one one-node engine, a reward model, network weight sync."""
    run = ("model: {path: /models/tiny}\nweight_sync: {mode: network}\ntask: {reward_model: org/reward}\n"
           "env: {name: calculator}\n")
    return _render(tmp_path_factory.mktemp("dev"), load_config("dev"), run, "trainer: {nodes: 2}\nrollout: {replicas: 1}")


@pytest.fixture(scope="module")
def multinode(tmp_path_factory) -> Rendered:
    """DeepSeek-V3 over two p5en nodes per engine (LeaderWorkerSet groups), network weight sync,
    and the all-to-all vs DeepEP bench fleets."""
    os.chdir(ROOT)
    run = (EXAMPLES / "dsv3-2node-deepep.run.yaml").read_text() + "weight_sync: {mode: network}\n"
    ab = yaml.safe_load((EXAMPLES / "dsv3-ab.workloads.yaml").read_text())
    ab.pop("run_config")
    ab["rollout"]["replicas"] = 2
    return _render(tmp_path_factory.mktemp("multinode"), load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"),
                   run, yaml.safe_dump(ab))


def _inside(port: int) -> bool:
    return NCCL_PORTS[0] <= port <= NCCL_PORTS[1]


# -- item 1: the rollout -> trainer opening --------------------------------------------------------------


@pytest.mark.parametrize("which", ["dev", "multinode"])
def test_engines_reach_only_the_source_ranks_weight_update_ports(which, request):
    r: Rendered = request.getfixturevalue(which)
    trainers = r.role("moerl-trainer")
    source = r.pod("moerl-trainer-trainer-0")
    others = [p for p in trainers if p is not source]
    assert others, "the check needs a second trainer pod"
    rdzv, port = r.plan.wl.trainer.rdzv_port, WEIGHT_GROUP_PORT
    lo, hi = NCCL_PORTS
    for engine in r.role("moerl-rollout"):
        assert r.can(engine, source, port) and r.can(engine, source, lo) and r.can(engine, source, hi), engine
        for closed in (rdzv, lo - 1, hi + 1, 22, 9464, 29501):
            assert not r.can(engine, source, closed), (engine.name, closed)
        for other in others:
            assert not any(r.can(engine, other, p) for p in (port, lo, hi, rdzv)), (engine.name, other.name)
        # the source rank connects to the engine ranks' NCCL listeners, and to nothing else of theirs
        assert r.can(source, engine, lo) and r.can(source, engine, hi)
        assert not r.can(source, engine, r.plan.wl.rollout.engine_port) and not r.can(source, engine, lo - 1)
        assert not any(r.can(other, engine, lo) for other in others)
    # the trainer ranks still meet each other on every port (c10d rendezvous, NCCL)
    assert r.can(others[0], source, rdzv) and r.can(source, others[0], 40000)


def test_ncclS_ports_are_pinned_where_the_group_meets_and_fixed_ports_stay_out(dev):
    range_sysctl = {"name": "net.ipv4.ip_local_port_range", "value": f"{NCCL_PORTS[0]} {NCCL_PORTS[1]}"}
    templates = []
    for d in dev.docs:
        if d["kind"] == "Job" and d["apiVersion"].startswith("batch.volcano.sh/"):
            templates += [t["template"] for t in d["spec"]["tasks"]]
        elif d["kind"] == "Deployment" and d["metadata"]["name"] == "moerl-rollout":
            templates.append(d["spec"]["template"])
    assert len(templates) == 3
    for tpl in templates:
        assert range_sysctl in tpl["spec"]["securityContext"]["sysctls"]
    (cm,) = [d for d in dev.docs if d["kind"] == "ConfigMap"]
    run = yaml.safe_load(cm["data"]["run.yaml"])
    assert run["weight_sync"]["master_port"] == WEIGHT_GROUP_PORT and not _inside(WEIGHT_GROUP_PORT)
    assert run["weight_sync"]["trainer_host"] == "trainer-0.moerl-trainer.moerl.svc.cluster.local"
    for port in (dev.plan.wl.trainer.rdzv_port, dev.plan.wl.rollout.engine_port, dev.plan.wl.env.port, 6379, 9121, 9464):
        assert not _inside(port), port


@pytest.mark.parametrize("text,message", [
    ("trainer: {rdzv_port: 50000}", "trainer.rdzv_port=50000 is inside NCCL's port range"),
    ("env: {port: 57343}", "env.port=57343 is inside NCCL's port range"),
])
def test_a_fixed_port_inside_nccls_range_fails_before_synth(tmp_path, text, message):
    (tmp_path / "w.yaml").write_text(text)
    with pytest.raises(WorkloadError, match=message):
        load_workloads(load_config("dev"), tmp_path / "w.yaml")


def test_store_mode_opens_nothing_between_trainer_and_engines(tmp_path):
    r = _render(tmp_path, load_config("dev"), "model: {path: /models/tiny}\n", "trainer: {nodes: 2}")
    for engine in r.role("moerl-rollout"):
        for trainer in r.role("moerl-trainer"):
            assert not any(r.can(engine, trainer, p) for p in (WEIGHT_GROUP_PORT, NCCL_PORTS[0], 29500))
            assert not any(r.can(trainer, engine, p) for p in (NCCL_PORTS[0], 30000))


# -- item 5: default-deny egress per role ---------------------------------------------------------------


@pytest.mark.parametrize("which", ["dev", "multinode"])
def test_every_pod_is_isolated_both_ways(which, request):
    r: Rendered = request.getfixturevalue(which)
    for pod in r.pods:
        assert isolated(r.policies, pod, "Egress"), pod.name
        assert isolated(r.policies, pod, "Ingress"), pod.name


def test_each_role_reaches_what_it_needs_and_nothing_else(dev):
    r = dev
    buffer, env = r.role("moerl-buffer")[0], r.role("moerl-env")[0]
    feed, reward = r.role("moerl-feed")[0], r.role("moerl-reward-model")[0]
    trainer, engine = r.pod("moerl-trainer-trainer-1"), r.role("moerl-rollout")[0]
    everyone = [buffer, env, feed, reward, trainer, engine]
    for pod in everyone:  # names resolve at CoreDNS only, and nothing leaves the namespace but that
        assert r.can(pod, KUBE_DNS, 53, "UDP") == (pod is not buffer) and r.can(pod, KUBE_DNS, 53, "TCP") == (pod is not buffer)
        assert not r.can(pod, Address("8.8.8.8"), 53, "UDP") and not r.can(pod, OUTSIDER, 9090)
        for closed in (IMDS, NODE, ENDPOINT):
            assert not any(r.can(pod, closed, p) for p in (80, 443, 10250)), (pod.name, closed)
        assert not r.can(pod, INTERNET, 22) and not r.can(pod, INTERNET, 80)
    # Redis: its three clients only
    assert {p.name for p in everyone if r.can(p, buffer, 6379)} == {feed.name, trainer.name, engine.name}
    # AWS credentials and HTTPS (S3, the Hub): the pods that use them
    aws = {feed.name, trainer.name, engine.name}
    assert {p.name for p in everyone if r.can(p, POD_IDENTITY, 80)} == aws
    assert {p.name for p in everyone if r.can(p, S3, 443) and r.can(p, HUB, 443)} == aws | {reward.name}
    # the env pool and the reward model: rollout pods only, on their own ports
    assert r.can(engine, env, r.plan.wl.env.port) and r.can(engine, reward, r.plan.wl.reward_model.port)
    assert not r.can(engine, env, 22) and not r.can(feed, env, r.plan.wl.env.port)
    assert not r.can(env, engine, 30000) and not r.can(env, trainer, 29500) and not r.can(env, S3, 443)
    # nothing calls into the feed or the rollout pods but the weight-update group
    assert not any(r.can(p, feed, port) for p in everyone for port in (30000, 9464))
    assert not r.can(engine, trainer, 29500) and not r.can(feed, trainer, 29500)


def test_services_keep_their_pods_ports_and_the_run_config_uses_them(dev):
    """The VPC CNI enforces a policy on traffic to a Service only when the Service's port is the
    container's (EKS user guide, network policy considerations)."""
    for svc in (d for d in dev.docs if d["kind"] == "Service"):
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) == p["port"], (svc["metadata"]["name"], p)
    (cm,) = [d for d in dev.docs if d["kind"] == "ConfigMap"]
    run = yaml.safe_load(cm["data"]["run.yaml"])
    assert run["env"]["url"].endswith(f":{dev.plan.wl.env.port}")
    assert run["rollout"]["reward_url"].endswith(f":{dev.plan.wl.reward_model.port}")


# -- item 8: engine groups, API tokens, the bench fleets' keys -------------------------------------------


def test_engine_groups_reach_their_own_group_only(multinode):
    r = multinode
    for fleet in ["moerl-rollout", *(f"moerl-bench-{n}" for n in r.plan.wl.bench_rollout.profiles)]:
        pods = r.role(fleet)
        groups = sorted({p.labels["leaderworkerset.sigs.k8s.io/group-index"] for p in pods})
        assert len(groups) >= 2, fleet
        for a in pods:
            for b in pods:
                if a is b:
                    continue
                same = a.labels["leaderworkerset.sigs.k8s.io/group-index"] == b.labels["leaderworkerset.sigs.k8s.io/group-index"]
                for port in (20000, 30000, NCCL_PORTS[0], 12345):
                    assert r.can(a, b, port) == same, (a.name, b.name, port)
    # and never across fleets
    assert not r.can(r.role("moerl-rollout")[0], r.role("moerl-bench-a2a")[0], 20000)


@pytest.mark.parametrize("which", ["dev", "multinode"])
def test_no_pod_mounts_a_kubernetes_api_token(which, request):
    """No moerl pod calls the Kubernetes API; Pod Identity's webhook adds its own projected token."""
    r: Rendered = request.getfixturevalue(which)
    for d in r.docs:
        if d["kind"] == "ServiceAccount":
            assert d["automountServiceAccountToken"] is False, d["metadata"]["name"]
    for pod_spec in _pod_specs(r.docs):
        assert pod_spec.get("automountServiceAccountToken") is False


def _pod_specs(docs: list[dict]) -> list[dict]:
    out = []
    for d in docs:
        spec = d.get("spec", {})
        if d["kind"] in ("Deployment", "StatefulSet") or (d["kind"] == "Job" and "template" in spec):
            out.append(spec["template"]["spec"])
        elif d["kind"] == "Job":
            out += [t["template"]["spec"] for t in spec["tasks"]]
        elif d["kind"] == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            out += [lwt["leaderTemplate"]["spec"], lwt["workerTemplate"]["spec"]]
    assert out
    return out


def _auth_levels() -> dict[str, str]:
    """Function name -> SGLang auth level of the routes in its http_server.py (``@auth_level``)."""
    import ast

    from sglang_oracle import sglang_dir

    tree = ast.parse((sglang_dir() / "srt" / "entrypoints" / "http_server.py").read_text())
    levels = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", "") == "auth_level":
                    levels[node.name] = dec.args[0].attr
    return levels


def test_bench_fleets_on_the_pod_network_ask_for_keys(multinode, tmp_path):
    """SGLang's own decision (sglang/srt/utils/auth.py decide_request_auth, from the wheel) on the
    rendered fleets' leaders, their keys read from the file their keys init container writes:
    /generate needs the API key the Job holds; the weight-update routes need the engine's own
    admin key, which the Job does not hold."""
    from app.rollout.keys import engine_admin_key
    from helpers import keys_files
    from sglang_oracle import parse_launch_server, wheel_module

    auth = wheel_module("srt/utils/auth.py")
    levels = _auth_levels()
    assert levels["update_weights_from_disk"] == levels["init_weights_update_group"] == "ADMIN_OPTIONAL"
    assert "generate_request" not in levels  # generation is a NORMAL route
    r = multinode
    secret_values = {"api-key": "k-api", "admin-api-key": "k-admin"}
    checked = 0
    for d in r.docs:
        if d["kind"] != "LeaderWorkerSet" or not d["metadata"]["name"].startswith("moerl-bench-"):
            continue
        tpl = d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]  # the one that serves HTTP
        for g in range(2):
            (c,) = [c for c in tpl["spec"]["containers"] if c["name"] == "engine"]
            cmd = c["command"]
            leader = f"{d['metadata']['name']}-{g}"
            env = {"LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "leader", "LWS_GROUP_SIZE": "2"}
            args = parse_launch_server(cmd, env, keys_files(tpl["spec"], {"POD_NAME": leader}, secret_values, tmp_path))
            key, admin = args.api_key, args.admin_api_key
            assert (key, admin) == ("k-api", engine_admin_key("k-admin", leader)), leader
            decide = lambda path, header, level: auth.decide_request_auth(  # noqa: E731
                method="POST", path=path, authorization_header=header, api_key=key, admin_api_key=admin,
                auth_level=getattr(auth.AuthLevel, level)).allowed
            assert not decide("/generate", None, "NORMAL") and decide("/generate", "Bearer k-api", "NORMAL")
            assert not decide("/update_weights_from_disk", "Bearer k-api", "ADMIN_OPTIONAL")
            assert not decide("/update_weights_from_disk", "Bearer k-admin", "ADMIN_OPTIONAL")  # the master opens nothing
            assert decide("/update_weights_from_disk", f"Bearer {admin}", "ADMIN_OPTIONAL")
            checked += 1
    assert checked >= 4
    for d in r.docs:
        if d["kind"] == "Job" and d["apiVersion"] == "batch/v1":
            (c,) = d["spec"]["template"]["spec"]["containers"]
            keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            assert keys == {"api-key"}, d["metadata"]["name"]


def test_the_bench_client_sends_the_api_key(monkeypatch):
    import asyncio

    import httpx

    from app.rollout.engine_client import EngineClient

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"status": "ok"})

    async def go():
        async with EngineClient("http://engine:30000", api_key="k-api", transport=httpx.MockTransport(handler)) as c:
            await c._http.get("/health_generate")

    asyncio.run(go())
    assert seen == ["Bearer k-api"]


def test_the_worker_client_passes_sglangs_own_auth_on_every_route_it_calls():
    """An EngineClient holding both keys against SGLang's own decision (decide_request_auth and
    each route's @auth_level, from the wheel) on an engine started with both: every call the
    worker makes is allowed; one holding the API key only is refused the weight-update routes,
    and `ADMIN_ROUTES` is exactly the ADMIN_OPTIONAL routes among those it calls."""
    import asyncio

    import httpx

    from app.rollout.engine_client import ADMIN_ROUTES, EngineClient
    from sglang_oracle import route_auth_levels, wheel_module

    auth = wheel_module("srt/utils/auth.py")
    level_of = route_auth_levels()  # path -> level, as http_server.py declares them
    seen: dict[str, bool] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        seen[path] = auth.decide_request_auth(
            method=request.method, path=path, authorization_header=request.headers.get("authorization"),
            api_key="k-api", admin_api_key="k-admin", auth_level=getattr(auth.AuthLevel, level_of[path])).allowed
        if path == "/generate":
            return httpx.Response(200, json={"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}})
        return httpx.Response(200, json={"success": True, "message": "", "weight_version": "1"})

    async def calls(c: EngineClient) -> None:
        await c.generate("p", n=1, max_new_tokens=1, temperature=1.0, top_p=1.0, return_logprob=False)
        await c.update_weights_from_disk("/m", weight_version=1)
        await c.init_weights_update_group("a", 1, 0, 2, "g", "nccl")
        await c.begin_weight_update()
        await c.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], "g")
        await c.end_weight_update()
        await c.destroy_weights_update_group("g")
        await c.pause_generation()
        await c.abort_request(abort_all=True)
        await c.flush_cache()
        await c.continue_generation()
        await c.server_info()
        await c.weight_version()
        await c.health_generate()

    async def go(**keys) -> dict[str, bool]:
        seen.clear()
        async with EngineClient("http://engine:30000", retries=0, transport=httpx.MockTransport(handler), **keys) as c:
            try:
                await calls(c)
            except Exception:
                pass  # a refused call: `seen` records the decision
        return dict(seen)

    both = asyncio.run(go(api_key="k-api", admin_api_key="k-admin"))
    assert len(both) >= 12 and all(both.values()), both
    assert ADMIN_ROUTES == {p for p in both if level_of[p] == "ADMIN_OPTIONAL"}
    api_only = asyncio.run(go(api_key="k-api"))
    assert api_only["/generate"] and not api_only["/update_weights_from_disk"]


def test_the_policy_model_follows_the_documented_semantics():
    """tests/netpolicy.py on the cases the Kubernetes documentation spells out: a peer with both
    namespaceSelector and podSelector is AND, two peers are OR; ipBlock except; endPort; a pod no
    policy selects is open; policies add up."""
    from netpolicy import allowed as ok

    a = Pod("a", "ns1", {"app": "a"})
    b = Pod("b", "ns2", {"app": "b"})
    c = Pod("c", "ns1", {"app": "b"})
    meta = {"namespace": "ns2", "name": "p"}
    both = {"metadata": meta, "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns1"}}, "podSelector": {"matchLabels": {"app": "b"}}}]}]}}
    either = {"metadata": meta, "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ns1"}}}, {"podSelector": {"matchLabels": {"app": "b"}}}]}]}}
    assert not ok([both], a, b, 80) and ok([both], c, b, 80)
    assert ok([either], a, b, 80) and ok([either], c, b, 80)
    out = {"metadata": {"namespace": "ns1", "name": "q"}, "spec": {"podSelector": {"matchLabels": {"app": "a"}},
           "policyTypes": ["Egress"], "egress": [{"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.0.0.0/8"]}}],
                                                  "ports": [{"protocol": "TCP", "port": 1000, "endPort": 1010}]}]}}
    assert ok([out], a, Address("8.8.8.8"), 1005) and not ok([out], a, Address("8.8.8.8"), 1011)
    assert not ok([out], a, Address("10.1.2.3"), 1005) and not ok([out], a, Address("8.8.8.8"), 1005, "UDP")
    assert not ok([out], a, c, 1005)  # pods are not matched by ipBlock here
    assert ok([out], c, a, 22)  # c is selected by no policy: open both ways
    more = {"metadata": {"namespace": "ns1", "name": "r"}, "spec": {"podSelector": {"matchLabels": {"app": "a"}},
            "policyTypes": ["Egress"], "egress": [{"to": [{"podSelector": {}}]}]}}
    assert ok([out, more], a, c, 22) and not ok([out, more], a, b, 22)


@pytest.mark.parametrize("per_group", [1, 0, 2])
def test_weight_update_groups_spanning_engines_open_nccls_range_between_their_engines(tmp_path, per_group):
    """Issue 37 item 2: a group of several engines (weight_sync.engines_per_group 0 or > 1) holds
    trainer-0 and every member engine's ranks; NCCL's bootstrap ring and transport connect
    consecutive ranks, engine g to engine g + 1, and which engines share a group changes with
    each push (the ready ones, sorted: app/trainer/weight_sync.py partition). So every engine rank
    reaches every other on NCCL's range, and on nothing else beyond its own group; with a group
    per engine (1, the default) engines of different groups reach each other on no port."""
    os.chdir(ROOT)
    run = ((EXAMPLES / "dsv3-2node-deepep.run.yaml").read_text()
           + f"weight_sync: {{mode: network, engines_per_group: {per_group}}}\n")
    w = yaml.safe_load((EXAMPLES / "dsv3-2node-deepep.workloads.yaml").read_text())
    w.pop("run_config")
    w["rollout"]["replicas"] = 3
    r = _render(tmp_path, load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"), run, yaml.safe_dump(w))
    engines = r.role("moerl-rollout")
    lo, hi = NCCL_PORTS
    spans = per_group != 1
    group = lambda p: p.labels["leaderworkerset.sigs.k8s.io/group-index"]  # noqa: E731
    pairs = [(a, b) for a in engines for b in engines if group(a) != group(b)]
    assert len(pairs) >= 12
    for a, b in pairs:
        assert r.can(a, b, lo) == r.can(a, b, hi) == r.can(a, b, (lo + hi) // 2) == spans, (a.name, b.name)
        assert not any(r.can(a, b, p) for p in (lo - 1, hi + 1, 20000, 30000, WEIGHT_GROUP_PORT)), (a.name, b.name)
    source = r.pod("moerl-trainer-trainer-0")
    assert all(r.can(e, source, WEIGHT_GROUP_PORT) and r.can(source, e, lo) for e in engines)
    assert not any(r.can(w_, e, lo) for w_ in r.role("moerl-rollout-worker") for e in engines)
