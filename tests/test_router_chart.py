"""The router in the rendered manifests (charts8s/router.py, run config ``rollout.router``): its
command parsed by sglang-router's own argument code, the engines it names, and the NetworkPolicies
(tests/netpolicy.py): workers -> router -> engines, and nothing else to or from the router."""

from __future__ import annotations

import os

import pytest
import yaml

from infra.config import load_config
from test_netpol import EXAMPLES, HUB, INTERNET, KUBE_DNS, OUTSIDER, ROOT, S3, _render

launch_router = pytest.importorskip("sglang_router.launch_router")
os.environ.setdefault("JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION", "1")
ROUTED = "\n  router: true\n  pause_mode: abort\n"


def _routed_run(example: str) -> str:
    """An example run config with the router on (its ``rollout:`` section extended)."""
    text = (EXAMPLES / example).read_text()
    assert text.count("\nrollout:\n") + text.startswith("rollout:\n") == 1
    return text.replace("rollout:\n", "rollout:" + ROUTED, 1)


def _routed_render(tmp, name: str):
    """The example ``name`` (its run config and workloads file) rendered with the router on and
    two engines, on the p5en rollout deployment."""
    os.chdir(ROOT)
    wl = yaml.safe_load((EXAMPLES / f"{name}.workloads.yaml").read_text())
    wl.pop("run_config")
    wl["rollout"]["replicas"] = 2
    return _render(tmp, load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"), _routed_run(f"{name}.run.yaml"),
                   yaml.safe_dump(wl))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _routed_render(tmp_path_factory.mktemp("qwen"), "qwen3-30b-a3b-1node-ep")


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    return _routed_render(tmp_path_factory.mktemp("dsv3"), "dsv3-2node-deepep")


def _container(r, kind: str, name: str, container: str) -> dict:
    (d,) = [d for d in r.docs if d["kind"] == kind and d["metadata"]["name"] == name]
    (c,) = [c for c in d["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return c


@pytest.mark.parametrize("which,engines", [
    ("qwen", ["http://moerl-rollout-{i}.moerl-rollout.moerl:30000"]),
    ("dsv3", ["http://moerl-rollout-{i}.moerl-rollout.moerl:30000"]),
])
def test_router_flags_parse_with_sglang_routers_own_code(which, engines, request):
    r = request.getfixturevalue(which)
    c = _container(r, "Deployment", "moerl-router", "router")
    assert c["command"][:3] == ["python3", "-m", "sglang_router.launch_router"]
    args = launch_router.parse_router_args(c["command"][3:])
    ns = r.plan.namespace
    want = [e.format(i=i).replace(".moerl:", f".{ns}:") for e in engines for i in range(2)]
    assert args.worker_urls == want
    assert args.policy == "cache_aware" and args.port == r.plan.wl.rollout.router_port and args.host == "0.0.0.0"
    assert args.balance_abs_threshold == max(1, r.plan.run.rollout.inflight_tasks() // 4)
    assert args.api_key == "$(SGLANG_API_KEY)" and not args.service_discovery
    (env,) = c["env"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": r.plan.wl.rollout.api_key_secret, "key": "api-key"}
    # every engine it names is one the rendered objects give that name: LWS leaders or the StatefulSet's pods
    kinds = {d["kind"] for d in r.docs if d["metadata"]["name"] == "moerl-rollout"}
    assert ("LeaderWorkerSet" in kinds) == (which == "dsv3") and ("StatefulSet" in kinds) == (which == "qwen")


@pytest.mark.parametrize("which", ["qwen", "dsv3"])
def test_workers_send_generation_to_the_router_and_keep_their_engine(which, request):
    r = request.getfixturevalue(which)
    if which == "qwen":
        worker = _container(r, "StatefulSet", "moerl-rollout", "worker")
        engine = _container(r, "StatefulSet", "moerl-rollout", "engine")
        assert "--api-key" in engine["command"] and "--admin-api-key" in engine["command"]
        assert engine["command"][engine["command"].index("--host") + 1] == "0.0.0.0"
    else:
        worker = _container(r, "StatefulSet", "moerl-rollout-worker", "worker")
    cmd = worker["command"]
    assert cmd[cmd.index("--router-url") + 1] == f"http://moerl-router.{r.plan.namespace}:{r.plan.wl.rollout.router_port}"
    names = {e["name"] for e in worker["env"]}
    assert {"MOERL_ENGINE_API_KEY", "MOERL_ENGINE_ADMIN_API_KEY"} <= names


@pytest.mark.parametrize("which", ["qwen", "dsv3"])
def test_workers_reach_the_router_and_the_router_only_the_engines(which, request):
    r = request.getfixturevalue(which)
    (router,) = r.role("moerl-router")
    port, engine_port = r.plan.wl.rollout.router_port, r.plan.wl.rollout.engine_port
    workers = r.role("moerl-rollout-worker") if which == "dsv3" else r.role("moerl-rollout")
    engines = [p for p in r.role("moerl-rollout") if p.labels.get("moerl.dev/engine-role", "leader") == "leader"]
    for w in workers:
        assert r.can(w, router, port) and not r.can(w, router, 22)
    for e in engines:
        assert r.can(router, e, engine_port) and not r.can(router, e, 20000)
    others = [p for p in r.pods if p.labels.get("app.kubernetes.io/name") not in
              ("moerl-router", "moerl-rollout", "moerl-rollout-worker")]
    assert others and not any(r.can(p, router, port) for p in others)
    assert not r.can(OUTSIDER, router, port)
    assert r.can(router, KUBE_DNS, 53, "UDP")
    for closed in (S3, HUB, INTERNET):
        assert not r.can(router, closed, 443)
    assert not any(r.can(router, p, 6379) for p in r.role("moerl-buffer"))


def test_the_router_holds_no_api_token_and_no_aws_role(dsv3):
    (d,) = [d for d in dsv3.docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "moerl-router"]
    spec = d["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "moerl-router"
    assert spec["serviceAccountName"] != dsv3.plan.cfg.rollout_service_account


def test_without_the_router_nothing_changes(tmp_path):
    os.chdir(ROOT)
    wl = yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-1node-ep.workloads.yaml").read_text())
    wl.pop("run_config")
    r = _render(tmp_path, load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"),
                (EXAMPLES / "qwen3-30b-a3b-1node-ep.run.yaml").read_text(), yaml.safe_dump(wl))
    assert not [d for d in r.docs if d["metadata"]["name"] == "moerl-router"]
    assert {d["kind"] for d in r.docs if d["metadata"]["name"] == "moerl-rollout"} >= {"Deployment"}
    engine = _container(r, "Deployment", "moerl-rollout", "engine")
    assert engine["command"][engine["command"].index("--host") + 1] == "127.0.0.1"


def test_the_routers_two_ports_must_differ(tmp_path):
    from charts8s.workloads import WorkloadError

    os.chdir(ROOT)
    wl = yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-1node-ep.workloads.yaml").read_text())
    wl.pop("run_config")
    wl["rollout"]["router_port"] = wl["rollout"]["router_metrics_port"] = 28000
    with pytest.raises(WorkloadError, match="rollout.router_port and rollout.router_metrics_port are both 28000"):
        _render(tmp_path, load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"),
                _routed_run("qwen3-30b-a3b-1node-ep.run.yaml"), yaml.safe_dump(wl))
