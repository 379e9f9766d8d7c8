"""app/nodehealth.py (issue 27 items 13 and 14): the checks on a sysfs tree laid out as the EFA
driver lays it out, nvidia-smi's CSV, the DCGM result files, and the quarantine written to a Node
over real HTTP with JSON merge-patch semantics (RFC 7386) and resourceVersion conflicts (409), as
the API server applies them (Kubernetes API conventions, "Concurrency Control and Consistency").
The stand-in API server below is ours; it models those two rules and nothing else."""

from __future__ import annotations

import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from app.nodehealth import (DIAG_RC, DIAG_RESULT, Agent, CheckResult, Kube, KubeError, dcgm_result, efa_check,
                            efa_collector, efa_devices, gpu_check, node_patch, record)
from infra.config import DIAG_TAINT_KEY, HEALTH_ANNOTATION, HEALTH_LABEL, UNHEALTHY_TAINT_KEY

POOL_TAINTS = [{"key": "moerl.dev/pool", "value": "train-gpu", "effect": "NoSchedule"},
               {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]


def _sysfs(root: Path, devices: int, active: bool = True, counters: dict | None = None) -> Path:
    """/sys/class/infiniband/rdmapNs0/ports/1/{state,hw_counters/*} as the EFA driver exposes them."""
    for i in range(devices):
        port = root / "class" / "infiniband" / f"rdmap{i}s0" / "ports" / "1"
        (port / "hw_counters").mkdir(parents=True)
        (port / "state").write_text("4: ACTIVE\n" if active else "1: DOWN\n")
        for name, value in (counters or {"tx_bytes": 1000 + i, "rx_bytes": 2000, "rdma_read_wr_err": 0}).items():
            (port / "hw_counters" / name).write_text(f"{value}\n")
        (port / "hw_counters" / "lifespan").write_text("N/A (no PMA)\n")  # skipped, not an error
    return root


def _smi(stdout: str, rc: int = 0):
    def run(cmd, **kw):
        assert cmd[0] == "nvidia-smi"
        return subprocess.CompletedProcess(cmd, rc, stdout, "")
    return run


GOOD_SMI = "".join(f"{i}, 00000000:{0x53 + i:02X}:00.0, 0\n" for i in range(8))


def test_gpu_check_counts_gpus_and_ecc_errors():
    assert gpu_check(_smi(GOOD_SMI), 8).ok
    assert "7 GPUs, expected 8" in gpu_check(_smi("".join(GOOD_SMI.splitlines(True)[:7])), 8).detail
    ecc = GOOD_SMI.replace("00000000:55:00.0, 0", "00000000:55:00.0, 3")
    assert not gpu_check(_smi(ecc), 8).ok and "00000000:55:00.0" in gpu_check(_smi(ecc), 8).detail
    assert not gpu_check(_smi("", rc=15), 8).ok

    def missing(cmd, **kw):
        raise FileNotFoundError("nvidia-smi")
    assert not gpu_check(missing, 8).ok


def test_efa_devices_counters_and_check(tmp_path):
    root = _sysfs(tmp_path, 16)
    devs = efa_devices(root)
    assert len(devs) == 16 and devs["rdmap3s0"]["1"]["counters"] == {"rdma_read_wr_err": 0, "rx_bytes": 2000, "tx_bytes": 1003}
    assert efa_check(devs, 16).ok
    assert efa_check(devs, 32).detail == "16 EFA devices, expected 32"
    down = efa_devices(_sysfs(tmp_path / "down", 16, active=False))
    assert not efa_check(down, 16).ok and "no ACTIVE port" in efa_check(down, 16).detail
    assert efa_devices(tmp_path / "none") == {}


def test_efa_counters_are_served_for_prometheus(tmp_path):
    reg = CollectorRegistry()
    reg.register(efa_collector(_sysfs(tmp_path, 2)))
    text = generate_latest(reg).decode()
    assert 'moerl_efa_hw_counter_total{counter="tx_bytes",device="rdmap1s0",port="1"} 1001.0' in text
    assert "moerl_efa_devices 2.0" in text and "lifespan" not in text


def test_dcgm_result_files(tmp_path):
    assert dcgm_result(tmp_path) is None
    (tmp_path / DIAG_RC).write_text("0\n")
    (tmp_path / DIAG_RESULT).write_text(json.dumps({"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Hardware", "tests": [{"name": "memory", "results": [{"gpu_id": "0", "status": "Pass"}]}]}]}}))
    assert dcgm_result(tmp_path).ok
    (tmp_path / DIAG_RESULT).write_text("Successfully ran diagnostic\n" + json.dumps({"DCGM GPU Diagnostic": {"test_categories": [
        {"category": "Stress", "tests": [{"name": "targeted_stress", "results": [{"gpu_id": "3", "status": "Fail"}]}]}]}}))
    r = dcgm_result(tmp_path)
    assert not r.ok and "targeted_stress" in r.detail
    (tmp_path / DIAG_RC).write_text("226\n")
    (tmp_path / DIAG_RESULT).write_text("not json")
    assert not dcgm_result(tmp_path).ok


def _node(taints=None, rv="7") -> dict:
    return {"metadata": {"name": "ip-10-0-0-1", "resourceVersion": rv, "labels": {"moerl.dev/pool": "train-gpu"}},
            "spec": {"taints": list(taints or POOL_TAINTS)}}


def test_patch_quarantines_keeps_pool_taints_and_is_sticky():
    bad = [CheckResult("gpu", True, "8 GPUs"), CheckResult("efa", False, "15 EFA devices, expected 16")]
    p = node_patch(_node(), bad, "t")
    assert p["metadata"]["resourceVersion"] == "7" and p["metadata"]["labels"] == {HEALTH_LABEL: "fail"}
    assert p["spec"]["taints"] == [*POOL_TAINTS, {"key": UNHEALTHY_TAINT_KEY, "value": "efa", "effect": "NoSchedule"}]
    assert json.loads(p["metadata"]["annotations"][HEALTH_ANNOTATION])["checks"][1]["detail"] == "15 EFA devices, expected 16"
    quarantined = _node(p["spec"]["taints"])
    again = node_patch(quarantined, [CheckResult("gpu", True, ""), CheckResult("efa", True, "")], "t")
    assert again["metadata"]["labels"] == {HEALTH_LABEL: "pass"}
    assert {"key": UNHEALTHY_TAINT_KEY, "value": "efa", "effect": "NoSchedule"} in again["spec"]["taints"]  # sticky
    diag = node_patch(_node(), [CheckResult("gpu", True, "")], "t", diag_running=True)
    assert {"key": DIAG_TAINT_KEY, "value": "dcgm", "effect": "NoSchedule"} in diag["spec"]["taints"]
    done = node_patch(_node(diag["spec"]["taints"]), [CheckResult("gpu", True, "")], "t", diag_running=False)
    assert done["spec"]["taints"] == POOL_TAINTS


def _merge_patch(target, patch):
    """RFC 7386 JSON Merge Patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge_patch(out.get(k), v)
    return out


class _ApiServer:
    """One Node and a pod list over HTTP: GET, and PATCH with application/merge-patch+json, refused
    with 409 when the patch carries a stale metadata.resourceVersion; the version moves on every write."""

    def __init__(self, node: dict, pods: list[dict]):
        self.node, self.pods, self.patches, self.bump_before_patch = node, pods, [], 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                assert self.headers["Authorization"] == "Bearer t0k"
                if self.path.startswith("/api/v1/nodes/"):
                    return self._send(200, outer.node)
                if self.path.startswith("/api/v1/pods?fieldSelector=spec.nodeName%3D"):
                    return self._send(200, {"items": outer.pods})
                self._send(404, {"reason": "NotFound"})

            def do_PATCH(self):
                assert self.headers["Content-Type"] == "application/merge-patch+json"
                patch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.bump_before_patch:  # someone else wrote the node meanwhile
                    outer.bump_before_patch -= 1
                    outer.node["metadata"]["resourceVersion"] = str(int(outer.node["metadata"]["resourceVersion"]) + 1)
                if patch["metadata"].get("resourceVersion") != outer.node["metadata"]["resourceVersion"]:
                    return self._send(409, {"reason": "Conflict"})
                outer.patches.append(patch)
                outer.node = _merge_patch(outer.node, patch)
                outer.node["metadata"]["resourceVersion"] = str(int(patch["metadata"]["resourceVersion"]) + 1)
                self._send(200, outer.node)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"


def test_record_retries_on_conflict_and_quarantines_over_http():
    api = _ApiServer(_node(), [])
    kube = Kube(api.url, token="t0k")
    api.bump_before_patch = 2  # two concurrent writers: two 409s, then it lands
    record(kube, "ip-10-0-0-1", [CheckResult("gpu", False, "7 GPUs, expected 8")])
    assert len(api.patches) == 1
    assert api.node["metadata"]["labels"] == {"moerl.dev/pool": "train-gpu", HEALTH_LABEL: "fail"}
    assert api.node["spec"]["taints"][-1] == {"key": UNHEALTHY_TAINT_KEY, "value": "gpu", "effect": "NoSchedule"}
    api.bump_before_patch = 9
    with pytest.raises(KubeError, match="409"):
        record(kube, "ip-10-0-0-1", [CheckResult("gpu", True, "")], attempts=3)
    api.httpd.shutdown()


def test_agent_runs_dcgm_only_on_an_idle_node_under_the_diag_taint(tmp_path):
    gpu_pod = {"metadata": {"namespace": "moerl", "name": "moerl-trainer-0"}, "status": {"phase": "Running"},
               "spec": {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "8"}}}]}}
    api = _ApiServer(_node(), [gpu_pod])
    shared = tmp_path / "shared"
    shared.mkdir()
    agent = Agent(Kube(api.url, token="t0k"), "ip-10-0-0-1", 8, 16, shared, _sysfs(tmp_path / "sys", 16),
                  run=_smi(GOOD_SMI), diag_timeout_s=10, poll_s=0.1)
    assert [r.name for r in agent.step(now=0.0)] == ["gpu", "efa"]  # a GPU pod runs: no diagnostics
    assert not (shared / "diag.request").exists()
    api.pods[:] = []

    def sidecar():  # the DCGM container's part (charts8s/nodehealth.py DCGM_LOOP)
        import time
        while not (shared / "diag.request").exists():
            time.sleep(0.05)
        assert any(t["key"] == DIAG_TAINT_KEY for t in api.node["spec"]["taints"])  # tainted while it runs
        (shared / "diag.request").unlink()
        (shared / DIAG_RESULT).write_text(json.dumps({"DCGM GPU Diagnostic": {"test_categories": []}}))
        (shared / DIAG_RC).write_text("0")
    t = threading.Thread(target=sidecar)
    t.start()
    results = agent.step(now=1.0)
    t.join(5)
    assert [r.name for r in results] == ["gpu", "efa", "dcgm"] and all(r.ok for r in results)
    assert api.node["spec"]["taints"] == POOL_TAINTS and api.node["metadata"]["labels"][HEALTH_LABEL] == "pass"
    assert [r.name for r in agent.step(now=2.0)] == ["gpu", "efa", "dcgm"]  # not due again: the last result reported
    api.httpd.shutdown()
