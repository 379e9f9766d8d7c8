"""The router in the rendered manifests (charts8s/router.py, run config ``rollout.router``): its
command parsed by sglang-router's own argument code, the engines it names, and the NetworkPolicies
(tests/netpolicy.py): workers -> router -> engines, and nothing else to or from the router."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import yaml

from app.rollout.router import CONTROL_KEY_ID

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


@pytest.mark.parametrize("which", ["qwen", "dsv3"])
def test_router_flags_parse_with_sglang_routers_own_code(which, request):
    """No engines at start (the workers register theirs), its API key and its control-plane key
    from the Secret, and no engine key: what the router needs and nothing more."""
    r = request.getfixturevalue(which)
    c = _container(r, "Deployment", "moerl-router", "router")
    assert c["command"][:3] == ["python3", "-m", "sglang_router.launch_router"]
    args = launch_router.parse_router_args(c["command"][3:])
    assert args.worker_urls == [] and "--worker-startup-timeout-secs" not in c["command"]
    assert args.policy == "cache_aware" and args.port == r.plan.wl.rollout.router_port and args.host == "0.0.0.0"
    assert args.balance_abs_threshold == max(1, r.plan.run.rollout.inflight_tasks() // 4)
    assert args.api_key == "$(SGLANG_API_KEY)" and not args.service_discovery
    assert args.control_plane_api_keys == [(CONTROL_KEY_ID, "rollout-workers", "$(SGLANG_ROUTER_CONTROL_KEY)", "admin")]
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    secret = r.plan.wl.rollout.api_key_secret
    assert refs == {"SGLANG_API_KEY": {"name": secret, "key": "api-key"},
                    "SGLANG_ROUTER_CONTROL_KEY": {"name": secret, "key": "control-plane-api-key"}}


@pytest.mark.parametrize("which", ["qwen", "dsv3"])
def test_workers_send_generation_to_the_router_and_keep_their_engine(which, request):
    r = request.getfixturevalue(which)
    ns, port = r.plan.namespace, r.plan.wl.rollout.engine_port
    if which == "qwen":
        worker = _container(r, "StatefulSet", "moerl-rollout", "worker")
        engine = _container(r, "StatefulSet", "moerl-rollout", "engine")
        assert not {"--api-key", "--admin-api-key"} & set(engine["command"])
        assert engine["command"][engine["command"].index("--config") + 1] == "/run/moerl/keys/engine.yaml"
        assert engine["command"][engine["command"].index("--host") + 1] == "0.0.0.0"
        cmd = worker["command"]
        # it registers its engine by the name the router reaches: the StatefulSet pod's, through the headless Service
        assert cmd[cmd.index("--router-engine-url") + 1] == f"http://$(POD_NAME).moerl-rollout.{ns}:{port}"
        (svc,) = [d for d in r.docs if d["kind"] == "Service" and d["metadata"]["name"] == "moerl-rollout"]
        assert svc["spec"]["clusterIP"] == "None"
    else:
        worker = _container(r, "StatefulSet", "moerl-rollout-worker", "worker")
        cmd = worker["command"]
        assert "--router-engine-url" not in cmd  # its --engine-url, the group leader's address, is the router's too
    assert cmd[cmd.index("--router-url") + 1] == f"http://moerl-router.{ns}:{r.plan.wl.rollout.router_port}"
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in worker["env"]
            if "secretKeyRef" in e.get("valueFrom", {})}
    assert refs == {"MOERL_ROUTER_API_KEY": "api-key", "MOERL_ROUTER_CONTROL_KEY": "control-plane-api-key",
                    **{k: v for k, v in refs.items() if k.startswith("MOERL_REDIS")}}
    assert {"name": "MOERL_ENGINE_KEYS_FILE", "value": "/run/moerl/keys/engine.yaml"} in worker["env"]


def _pod_specs(r):
    """(object name, pod spec) of every pod template of the render."""
    for d in r.docs:
        spec = d.get("spec", {})
        if d["kind"] == "LeaderWorkerSet":
            t = spec["leaderWorkerTemplate"]
            yield d["metadata"]["name"] + "/leader", t["leaderTemplate"]["spec"]
            yield d["metadata"]["name"] + "/worker", t["workerTemplate"]["spec"]
        elif "template" in spec:
            yield d["metadata"]["name"], spec["template"]["spec"]


@pytest.mark.parametrize("which", ["qwen", "dsv3"])
def test_a_workers_keys_open_its_own_engine_only(which, request, tmp_path):
    """The attack of issue 39 item 6-7 on the rendered fleet (two engines): each engine's keys file
    and each worker's, made by running the pods' own keys init containers, read by SGLang's own
    argument code (--config merged as SGLang merges it); then SGLang's own decision on every admin
    route the worker uses: worker i's key opens engine i and is refused by engine j; no key opens
    another engine's /server_info secrets (SGLang's build_server_info through the plugin's hook);
    only the init containers hold the Secret's admin master, and the router holds no engine key."""
    from app.engine.auth import ADMIN_ROUTES, read_config_keys
    from app.rollout.keys import redact_server_info
    from helpers import keys_files
    from sglang_oracle import parse_launch_server, wheel_function, wheel_module

    r = request.getfixturevalue(which)
    secrets = {"api-key": "s-api", "admin-api-key": "s-master", "control-plane-api-key": "s-control"}
    sgl_auth = wheel_module("srt/utils/auth.py")
    lws_env = {"LWS_WORKER_INDEX": "0", "LWS_LEADER_ADDRESS": "leader", "LWS_GROUP_SIZE": "2"}
    if which == "qwen":
        (d,) = [d for d in r.docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "moerl-rollout"]
        engine_pod = worker_pod = d["spec"]["template"]["spec"]
    else:
        (d,) = [d for d in r.docs if d["kind"] == "LeaderWorkerSet" and d["metadata"]["name"] == "moerl-rollout"]
        engine_pod = d["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
        (w,) = [w for w in r.docs if w["kind"] == "StatefulSet" and w["metadata"]["name"] == "moerl-rollout-worker"]
        worker_pod = w["spec"]["template"]["spec"]
    (engine,) = [c for c in engine_pod["containers"] if c["name"] == "engine"]
    engines, worker_keys = [], []
    for i in range(2):
        files = keys_files(engine_pod, {"POD_NAME": f"moerl-rollout-{i}"}, secrets, tmp_path)
        engines.append(parse_launch_server(engine["command"], lws_env, files))
        if which == "qwen":  # the worker shares its engine's pod and its keys file
            (path,) = files.values()
        else:
            (path,) = keys_files(worker_pod, {"POD_INDEX": str(i)}, secrets, tmp_path).values()
        worker_keys.append(read_config_keys(path))
    assert len({e.admin_api_key for e in engines}) == 2 and all(e.admin_api_key for e in engines)
    assert all(e.api_key is None for e in engines)  # the router sends none on
    for i, (_, admin) in enumerate(worker_keys):
        for j, e in enumerate(engines):
            for path in sorted(ADMIN_ROUTES):
                ok = sgl_auth.decide_request_auth(method="POST", path=path, authorization_header=f"Bearer {admin}",
                                                  api_key=e.api_key, admin_api_key=e.admin_api_key,
                                                  auth_level=sgl_auth.AuthLevel.ADMIN_OPTIONAL).allowed
                assert ok == (i == j), (i, j, path)
    build = wheel_function("srt/utils/common.py", "build_server_info",
                           {"describe_kv_events_publisher": lambda args: None, "Dict": dict, "Any": object})
    for e in engines:  # /server_info is a normal route: open to anyone who reaches the engine
        args = SimpleNamespace(resolved_dict=lambda e=e: dict(vars(e)),
                               launch_command=f"python3 -m sglang.launch_server --admin-api-key {e.admin_api_key}")
        assert e.admin_api_key in json.dumps(build(args, {}))
        assert e.admin_api_key not in json.dumps(redact_server_info(build(args, {}), args, {}))
    # Who holds the master: the keys init containers, nobody else; the router no engine key at all.
    for name, spec in _pod_specs(r):
        for c in spec.get("initContainers", []) + spec["containers"]:
            keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            if "admin-api-key" in keys:
                assert c["name"] == "keys", (name, c["name"])
            if name == "moerl-router":
                assert keys == {"api-key", "control-plane-api-key"}


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


def test_routing_replay_behind_the_router_is_refused_at_synth(tmp_path):
    """sglang-router 0.3.2 drops return_routed_experts (tests/test_engine_router.py measures it on
    the binary): the combination is one line at synth, naming both fields, before any manifest."""
    from charts8s.workloads import WorkloadError

    os.chdir(ROOT)
    wl = yaml.safe_load((EXAMPLES / "qwen3-30b-a3b-1node-ep.workloads.yaml").read_text())
    wl.pop("run_config")
    run = _routed_run("qwen3-30b-a3b-1node-ep.run.yaml").replace(ROUTED, ROUTED + "  routing_replay: true\n", 1)
    with pytest.raises(WorkloadError, match="rollout.routing_replay: not supported with rollout.router") as e:
        _render(tmp_path, load_config("prod", EXAMPLES / "p5en-rollout.deploy.yaml"), run, yaml.safe_dump(wl))
    assert "\n" not in str(e.value) and not (tmp_path / "dist").exists()
