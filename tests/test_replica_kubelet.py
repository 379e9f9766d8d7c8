"""The replica's own machinery (app/replica/), each piece against what Kubernetes does:

- strings a container reads are rewritten to its pod's directories and addresses, and only at
  path and name boundaries; ``$(VAR)`` expands as the kubelet expands it;
- the substitutions: SGLang's command becomes `moerl engine` with the same model, host and port;
  torchrun's processes of a GPU pod; redis-server bound to its pod's address; the Redis
  exporter sidecar is not run, the reason stated, and its pod is ready on its other containers;
- manifests: Deployments, StatefulSets, Volcano Jobs and LeaderWorkerSets expand into the pods
  their controllers make; a pod-owning kind the replica does not run is an error;
- the kubelet on real processes: a failing liveness probe restarts the container, a startup
  probe holds liveness back, the preStop hook runs before SIGTERM, a container that ignores
  SIGTERM is SIGKILLed when its grace period ends, Secrets and ConfigMaps are where the pod
  mounts them, and a Service forwards to the ready pod only.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from app.replica import kubelet
from app.replica.kubelet import NOT_RUN, PodError, Substitutions, expand_vars
from app.replica.manifests import ManifestError, expand, read_manifests
from app.replica.network import Rewriter


def test_rewriter_maps_mounts_addresses_and_names_at_boundaries():
    r = Rewriter({"/tmp": "/R/tmp", "/models": "/R/models", "/etc/moerl": "/R/cfg"}, "127.10.0.3",
                 {"moerl-buffer.moerl.svc.cluster.local": "127.20.0.1", "moerl-buffer.moerl.svc": "127.20.0.1"})
    assert r("--config /etc/moerl/run.yaml") == "--config /R/cfg/run.yaml"
    assert r("redis://moerl-buffer.moerl.svc.cluster.local:6379/0") == "redis://127.20.0.1:6379/0"
    assert r("http://127.0.0.1:30000 localhost 0.0.0.0") == "http://127.10.0.3:30000 127.10.0.3 127.10.0.3"
    assert r("/modelsX /models/policy-cache /tmp") == "/modelsX /R/models/policy-cache /R/tmp"
    assert r("s3://bucket/tmp/x moerl-buffer.moerl.svc.cluster.localx 127.0.0.10") == \
        "s3://bucket/tmp/x moerl-buffer.moerl.svc.cluster.localx 127.0.0.10"


def test_expand_vars_as_the_kubelet_does():
    env = {"POD_NAME": "moerl-rollout-3"}
    assert expand_vars("--worker-id $(POD_NAME)", env) == "--worker-id moerl-rollout-3"
    assert expand_vars("$$(POD_NAME) $(UNSET)", env) == "$(POD_NAME) $(UNSET)"


def test_substitutions_engine_gpus_and_listen_address():
    s = Substitutions(bin_dir="/venv/bin", repo="/repo", procs_per_gpu_node=2, s3_endpoint="http://x")
    argv, note = s.argv(["python3", "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                         "--port", "30000", "--tp-size", "8", "--enable-dp-lm-head"], {}, "127.10.0.9")
    assert argv == ["moerl", "engine", "--model-path", "/m", "--host", "127.0.0.1", "--port", "30000", "--threads", "1"]
    assert "--tp-size" in note and "--enable-dp-lm-head" in note
    gpu = {"resources": {"limits": {"nvidia.com/gpu": "8"}}}
    argv, note = s.argv(["bash", "-c", "torchrun --nnodes=1 --nproc-per-node=8 x"], gpu, "127.10.0.9")
    assert argv[2] == "torchrun --nnodes=1 --nproc-per-node=2 x" and "8 per pod" in note
    assert s.argv(["bash", "-c", "torchrun --nproc-per-node=8 x"], {}, "ip")[0][2].endswith("=8 x")  # no GPUs asked
    assert s.argv(["redis-server", "--port", "6379"], {}, "127.10.0.2")[0][-2:] == ["--bind", "127.10.0.2"]
    with pytest.raises(PodError, match="--model-path"):
        s.argv(["python3", "-m", "sglang.launch_server", "--port", "1"], {}, "ip")
    # /metrics on the pod's own address: a word of its own, or inside torchrun's bash -c line
    argv, note = s.argv(["moerl", "rollout", "--metrics-port", "9464", "--worker-id", "w"], {}, "127.10.0.4")
    assert argv == ["moerl", "rollout", "--metrics-port", "9464", "--metrics-addr", "127.10.0.4", "--worker-id", "w"]
    assert note == "network: --metrics-addr 127.10.0.4 (its pod's address)"
    argv, note = s.argv(["bash", "-c", "torchrun --nproc-per-node=8 -m app.cli train --metrics-port 9464"], gpu, "127.10.0.5")
    assert argv[2] == "torchrun --nproc-per-node=2 -m app.cli train --metrics-port 9464 --metrics-addr 127.10.0.5"
    assert note.startswith("network: --metrics-addr 127.10.0.5") and "8 per pod" in note
    kept = ["moerl", "rollout", "--metrics-port", "9464", "--metrics-addr", "0.0.0.0"]
    assert s.argv(kept, {}, "127.10.0.4") == (kept, None)
    # torchrun's rendezvous on a port of the run's own (its c10d store listens on every address of the host)
    s.rdzv_port = 41234
    line = "torchrun --rdzv-backend=c10d --rdzv-endpoint=${TORCHX_RANK0_HOST:=127.10.0.5}:29500 --nproc-per-node=8 x"
    argv, note = s.argv(["bash", "-c", line], gpu, "127.10.0.5")
    assert argv[2] == "torchrun --rdzv-backend=c10d --rdzv-endpoint=${TORCHX_RANK0_HOST:=127.10.0.5}:41234 --nproc-per-node=2 x"
    assert note == ("GPUs: 8 per pod -> torchrun --nproc-per-node 2; network: rendezvous port 29500 -> one free on "
                    "the host (torchrun's c10d store listens on every address)")


def _pod(name: str, containers: list[dict], **spec) -> dict:
    return {"metadata": {"labels": {"app": name}}, "spec": {"containers": containers, **spec}}


def test_controllers_name_their_pods():
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "n"},
           "spec": {"replicas": 2, "template": _pod("d", [])}}
    assert [g[0][0] for g in expand(dep, {}).groups] == ["d-0", "d-1"]
    sts = {**dep, "kind": "StatefulSet", "metadata": {"name": "s", "namespace": "n"}}
    assert [g[0][0] for g in expand(sts).groups] == ["s-0", "s-1"]
    job = {"apiVersion": "batch.volcano.sh/v1alpha1", "kind": "Job", "metadata": {"name": "j", "namespace": "n"},
           "spec": {"maxRetry": 4, "policies": [{"event": "PodFailed", "action": "RestartJob"}],
                    "tasks": [{"name": "t0", "replicas": 1, "template": _pod("j", [])},
                              {"name": "t1", "replicas": 2, "template": _pod("j", [])}]}}
    w = expand(job)
    assert [p[0] for p in w.groups[0]] == ["j-t0-0", "j-t1-0", "j-t1-1"]
    assert w.groups[0][2][2]["VC_TASK_INDEX"] == "1" and w.policies == {"PodFailed": "RestartJob"} and w.max_retry == 4
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "e", "namespace": "n"},
           "spec": {"replicas": 2, "leaderWorkerTemplate": {"size": 3, "workerTemplate": _pod("e", [])}}}
    w = expand(lws)
    assert [[p[0] for p in g] for g in w.groups] == [["e-0", "e-0-1", "e-0-2"], ["e-1", "e-1-1", "e-1-2"]]
    assert w.groups[1][2][2] == {"LWS_LEADER_ADDRESS": "e-1.e.n", "LWS_GROUP_SIZE": "3", "LWS_WORKER_INDEX": "2"}
    with pytest.raises(ManifestError, match="DaemonSet/x"):
        expand({"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {"name": "x"}, "spec": {}})


# -- the kubelet on real processes -------------------------------------------------------------------

SERVER = """
import http.server, os, signal, sys, time
started = time.time()
def term(*a):
    open('sigterm', 'w').write(str(time.time()))
    if os.environ.get('IGNORE_TERM'):
        return
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == '/ready' or (self.path == '/live' and time.time() - started < float(os.environ['LIVE_S']))
        self.send_response(200 if ok else 500); self.end_headers()
    def log_message(self, *a): pass
http.server.HTTPServer(('127.0.0.1', 8000), H).serve_forever()
"""


def _deployment(name: str, env: dict, grace: int, **ctr) -> dict:
    c = {"name": "app", "command": ["python3", "-c", SERVER], "ports": [{"name": "http", "containerPort": 8000}],
         "env": [{"name": k, "value": v} for k, v in env.items()]
         + [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "s", "key": "password"}}}],
         "volumeMounts": [{"name": "cfg", "mountPath": "/etc/app"}], **ctr}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": "t"},
            "spec": {"replicas": 1, "template": {"metadata": {"labels": {"app": name}}, "spec": {
                "terminationGracePeriodSeconds": grace, "containers": [c],
                "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}]}}}}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A replica Cluster on hand-written manifests: 'live' fails liveness after 2 s (period 1 s,
    2 failures), 'stubborn' ignores SIGTERM (grace 2 s) and has a Redis exporter sidecar, one
    Service with a named target port."""
    from app.replica.cluster import Cluster

    monkeypatch.setattr(kubelet, "BACKOFF_S", 0.5)  # the kubelet's 10 s back-off, shortened for the test
    probe = lambda path: {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 1, "failureThreshold": 2}  # noqa: E731
    docs = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg", "namespace": "t"},
         "data": {"app.yaml": "url: http://svc.t.svc.cluster.local:80\ndir: /tmp/x\n"}},
        _deployment("live", {"LIVE_S": "2"}, 5, livenessProbe=probe("/live"), readinessProbe=probe("/ready"),
                    startupProbe={"tcpSocket": {"port": 8000}, "periodSeconds": 1, "failureThreshold": 30},
                    lifecycle={"preStop": {"exec": {"command": ["sh", "-c", "date +%s.%N > prestop"]}}}),
        _deployment("stubborn", {"LIVE_S": "1e9", "IGNORE_TERM": "1"}, 2),
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "svc", "namespace": "t"},
         "spec": {"selector": {"app": "stubborn"}, "ports": [{"port": 80, "targetPort": "http"}]}},
    ]
    docs[2]["spec"]["template"]["spec"]["containers"].append(
        {"name": "exporter", "command": ["/redis_exporter"], "ports": [{"name": "metrics", "containerPort": 9121}],
         "readinessProbe": {"httpGet": {"path": "/health", "port": "metrics"}}})
    dist = tmp_path / "dist"
    dist.mkdir()
    (dist / "t.k8s.yaml").write_text(yaml.safe_dump_all(docs))
    import sys

    c = Cluster(read_manifests(dist), tmp_path / "run", {"s": {"password": "pw"}},
                dict(bin_dir=str(Path(sys.executable).parent), repo=str(Path(__file__).resolve().parents[1]),
                     procs_per_gpu_node=1), bucket="replica-test", region="us-east-1", associations=set())
    (tmp_path / "run").mkdir(exist_ok=True)
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _wait(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_kubelet_probes_hooks_and_grace(cluster):
    live, stubborn = cluster.pods["live-0"], cluster.pods["stubborn-0"]
    # mounted ConfigMap, rewritten to this pod's address for the Service and its own /tmp
    text = (live.root / "volumes" / "cfg" / "app.yaml").read_text()
    svc_ip = cluster.cluster_ips["svc"]
    assert text == f"url: http://{svc_ip}:80\ndir: {live.root}/rootfs/tmp/x\n"
    assert stubborn.ip != live.ip
    # the Service forwards to the ready pod it selects, through the named target port
    assert _wait(stubborn.is_ready)
    with urllib.request.urlopen(f"http://{svc_ip}:80/ready", timeout=5) as r:
        assert r.status == 200
    # liveness fails after 2 s: the container is stopped (preStop, SIGTERM) and started again
    (app,) = live.containers
    assert _wait(lambda: app.restarts >= 1, 30), cluster.log_lines
    assert (live.workdir / "prestop").exists() and (live.workdir / "sigterm").exists()
    assert float((live.workdir / "prestop").read_text()) <= float((live.workdir / "sigterm").read_text())
    assert app.exit_codes[0] == 0  # its SIGTERM handler exits 0
    assert any("liveness probe failed 2 times" in line for line in cluster.log_lines)
    # a container that ignores SIGTERM is SIGKILLed when the grace period (2 s) ends
    t0 = time.monotonic()
    cluster.delete_pod("stubborn-0")
    took = time.monotonic() - t0
    assert 1.8 <= took < 6, took
    assert (stubborn.workdir / "sigterm").exists() and stubborn.containers[0].proc.returncode == -9
    assert "stubborn-1" in cluster.pods  # the Deployment made a replacement with a new name
    with pytest.raises(OSError):  # the old pod's address answers no more
        socket.create_connection((stubborn.ip, 8000), timeout=1)


def test_a_missing_secret_key_stops_the_pod_with_its_name(cluster):
    pod = cluster.pods["live-0"]
    c = dict(pod.spec["containers"][0], env=[{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}])
    with pytest.raises(PodError, match="live-0/app env X: Secret 's' has no key 'nope'"):
        pod.container_env(c)


def test_the_redis_exporter_is_not_run_and_says_why(cluster):
    """A container whose program is in NOT_RUN is left out, the reason among the substitutions;
    the pod runs and is ready (its Service forwards) on its other container."""
    pod = cluster.pods["stubborn-0"]
    assert [c.name for c in pod.containers] == ["app"]
    assert ("stubborn-0", "exporter", NOT_RUN["redis_exporter"]) in cluster.subs.log
    assert NOT_RUN["redis_exporter"].startswith("not run: ")
    assert _wait(pod.is_ready)
    assert not (pod.log_dir / "exporter.log").exists() and (pod.log_dir / "app.log").exists()
    assert Substitutions.not_run({"command": ["redis-server"]}) is None and Substitutions.not_run({}) is None
