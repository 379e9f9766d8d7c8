"""Continuous GPU and EFA health of one node, with quarantine, and the node's EFA counters for
Prometheus (charts8s/nodehealth.py runs it as a DaemonSet on every GPU pool).

    python -m app.nodehealth --node $(NODE_NAME) --expected-gpus 8 --expected-efa 16 [--port 9465]

Every `--interval` seconds (default 300) the agent checks, as the AWS GPU health-check recipe
does (aws-samples/awsome-distributed-training 4.validation_and_observability/
2.gpu-cluster-healthcheck: nvidia-smi, EFA enumeration, DCGM level 2 on idle nodes):

- gpu: `nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total
  --format=csv,noheader,nounits` answers, lists `--expected-gpus` GPUs and no uncorrected ECC
  error (a GPU fallen off the bus or one with a double-bit error fails);
- efa: /sys/class/infiniband holds `--expected-efa` devices (one per EFA interface of the
  instance type; infra/instances.py), each with a port whose `state` reads ACTIVE;
- dcgm: every `--dcgm-every` seconds (default 6 h), only while no other pod on the node holds
  a GPU, `dcgmi diag -r 2` through the DCGM sidecar of the same pod (it runs dcgmi against the
  node's host engine and leaves the result in the shared directory). The node carries the
  DIAG_TAINT (NoSchedule) while the diagnostics run, so no pod is placed on GPUs under test.

A failed check quarantines the node: the UNHEALTHY_TAINT (NoSchedule, value = the failed
checks) keeps the gang scheduler and every moerl pod off it (they tolerate their pool taints
only), and HEALTH_LABEL reads "fail" with the details in HEALTH_ANNOTATION. Running pods stay
(NoSchedule evicts nothing); a trainer gang on a failed node restarts elsewhere when it fails.
Quarantine is sticky: an operator clears it (`kubectl taint node <node> moerl.dev/unhealthy-`)
after node auto repair or a look; a node that passes again is labelled "pass" but stays tainted.

Node updates are JSON merge patches (RFC 7386) carrying the node's resourceVersion, so a
concurrent change to the node makes the API server refuse it (409 Conflict, Kubernetes API
conventions, "Concurrency Control and Consistency") and the agent re-reads and retries; taints
are one list in a merge patch, so the agent writes the whole list it read with its own entries
changed. Errors: `KubeError` names the request and the status.

The EFA counters (hw_counters/* of each device and port, as the EFA node exporter of the same
repository reads them) are served on `--port` as `moerl_efa_hw_counter_total{device,port,counter}`,
with `moerl_node_health_check{check}` (1 pass, 0 fail) for the alert rules (charts8s/alerts.py).
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import REGISTRY, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from infra.config import DIAG_TAINT_KEY, HEALTH_ANNOTATION, HEALTH_LABEL, UNHEALTHY_TAINT_KEY

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total",
              "--format=csv,noheader,nounits"]
GPU_RESOURCE = "nvidia.com/gpu"
DIAG_REQUEST, DIAG_RESULT, DIAG_RC = "diag.request", "diag.json", "diag.rc"


class KubeError(RuntimeError):
    """A Kubernetes API request failed; the message names the method, the path and the status."""

    def __init__(self, method: str, path: str, status: int, body: str):
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")
        self.status = status


@dataclass
class CheckResult:
    """One check: name ('gpu', 'efa', 'dcgm'), ok, and what it found (one line)."""

    name: str
    ok: bool
    detail: str


# ---------------------------------------------------------------- checks


def gpu_check(run=subprocess.run, expected: int = 8) -> CheckResult:
    """nvidia-smi answers with `expected` GPUs and no uncorrected volatile ECC error.

    `run` is subprocess.run (a test passes its own); a missing binary, a non-zero exit or a
    timeout is a failure, never a pass.
    """
    try:
        proc = run(NVIDIA_SMI, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return CheckResult("gpu", False, f"nvidia-smi did not run: {e}")
    if proc.returncode != 0:
        return CheckResult("gpu", False, f"nvidia-smi exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}")
    rows = [[c.strip() for c in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]
    bad = [r[1] for r in rows if len(r) < 3 or (r[2] not in ("0", "[N/A]", "N/A"))]
    if len(rows) != expected:
        return CheckResult("gpu", False, f"{len(rows)} GPUs, expected {expected}")
    if bad:
        return CheckResult("gpu", False, f"uncorrected ECC errors on {', '.join(bad)}")
    return CheckResult("gpu", True, f"{len(rows)} GPUs")


def efa_devices(sys_root: str | Path = "/sys") -> dict[str, dict[str, dict]]:
    """device -> port -> {"state": str, "counters": {name: int}} under <sys_root>/class/infiniband.

    Counter files that hold no integer (e.g. "N/A (no PMA)") are skipped. No such directory: {}.
    """
    root = Path(sys_root) / "class" / "infiniband"
    out: dict[str, dict[str, dict]] = {}
    if not root.is_dir():
        return out
    for dev in sorted(root.iterdir()):
        ports = {}
        for port in sorted((dev / "ports").glob("*")):
            counters = {}
            hw = port / "hw_counters"
            for f in sorted(hw.iterdir()) if hw.is_dir() else ():
                try:
                    counters[f.name] = int(f.read_text().strip(), 0)
                except (OSError, ValueError):
                    continue
            state = (port / "state").read_text().strip() if (port / "state").is_file() else ""
            ports[port.name] = {"state": state, "counters": counters}
        out[dev.name] = ports
    return out


def efa_check(devices: dict, expected: int) -> CheckResult:
    """`expected` EFA devices, each with an ACTIVE port (state files read '4: ACTIVE')."""
    if len(devices) != expected:
        return CheckResult("efa", False, f"{len(devices)} EFA devices, expected {expected}")
    down = [d for d, ports in devices.items() if not any("ACTIVE" in p["state"] for p in ports.values())]
    if down:
        return CheckResult("efa", False, f"no ACTIVE port on {', '.join(down)}")
    return CheckResult("efa", True, f"{len(devices)} EFA devices")


def dcgm_result(shared: Path) -> CheckResult | None:
    """The DCGM sidecar's last result (diag.rc and diag.json in `shared`), or None if it has none."""
    rc_file = shared / DIAG_RC
    if not rc_file.is_file():
        return None
    rc = rc_file.read_text().strip()
    text = (shared / DIAG_RESULT).read_text() if (shared / DIAG_RESULT).is_file() else ""
    failed = []
    try:
        doc = json.loads(text[text.find("{"):]) if "{" in text else {}
    except json.JSONDecodeError:
        doc = {}
    # `dcgmi diag -j` nests tests under "DCGM GPU Diagnostic".test_categories (DCGM 3-4) or
    # "categories"; each result carries a status, "Fail" on a failure (any case).
    categories = doc.get("DCGM GPU Diagnostic", {}).get("test_categories") or doc.get("categories") or []
    for cat in categories:
        for test in cat.get("tests", []):
            if any(str(r.get("status", "")).upper() == "FAIL" for r in test.get("results", [])):
                failed.append(test.get("name", "?"))
    if rc != "0" or failed:
        return CheckResult("dcgm", False, f"dcgmi diag exit {rc}" + (f"; failed: {', '.join(sorted(set(failed)))}" if failed else ""))
    return CheckResult("dcgm", True, "dcgmi diag -r 2 passed")


# ---------------------------------------------------------------- the node object


def node_patch(node: dict, results: list[CheckResult], now: str, diag_running: bool | None = None) -> dict:
    """The JSON merge patch (RFC 7386) that records `results` on `node` (a Node object as read).

    Sets HEALTH_LABEL to "pass" or "fail" and HEALTH_ANNOTATION to the results; on a failure adds
    (or updates) the UNHEALTHY_TAINT with the failed checks as its value; never removes it
    (quarantine is sticky). diag_running True adds the DIAG_TAINT, False removes it, None leaves
    it. The taint list is written whole (a merge patch replaces lists), with the node's other
    taints as read; metadata.resourceVersion makes the API server refuse a stale patch.
    """
    failed = [r.name for r in results if not r.ok]
    taints = [t for t in node.get("spec", {}).get("taints") or [] if t["key"] not in (UNHEALTHY_TAINT_KEY, DIAG_TAINT_KEY)]
    old = {t["key"]: t for t in node.get("spec", {}).get("taints") or []}
    if failed:
        taints.append({"key": UNHEALTHY_TAINT_KEY, "value": "-".join(failed), "effect": "NoSchedule"})
    elif UNHEALTHY_TAINT_KEY in old:
        taints.append(old[UNHEALTHY_TAINT_KEY])
    if diag_running or (diag_running is None and DIAG_TAINT_KEY in old):
        taints.append({"key": DIAG_TAINT_KEY, "value": "dcgm", "effect": "NoSchedule"})
    summary = {"time": now, "checks": [{"name": r.name, "ok": r.ok, "detail": r.detail} for r in results]}
    return {
        "metadata": {"resourceVersion": node["metadata"]["resourceVersion"],
                     "labels": {HEALTH_LABEL: "fail" if failed else "pass"},
                     "annotations": {HEALTH_ANNOTATION: json.dumps(summary, separators=(",", ":"))}},
        "spec": {"taints": taints},
    }


class Kube:
    """The few Kubernetes API calls of the agent, over HTTPS with the pod's service-account token.

    base: API server URL (default: in-cluster, KUBERNETES_SERVICE_HOST/PORT); token and ca from
    the mounted service account unless given.
    """

    def __init__(self, base: str | None = None, token: str | None = None, ca: str | None = None):
        self.base = base or f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        self.token = token if token is not None else (SERVICE_ACCOUNT / "token").read_text().strip()
        self.ctx = None
        if self.base.startswith("https"):
            self.ctx = ssl.create_default_context(cafile=ca or str(SERVICE_ACCOUNT / "ca.crt"))

    def request(self, method: str, path: str, body: dict | None = None, content_type: str = "application/json") -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=30, context=self.ctx) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise KubeError(method, path, e.code, e.read().decode(errors="replace")) from None

    def node(self, name: str) -> dict:
        return self.request("GET", f"/api/v1/nodes/{name}")

    def patch_node(self, name: str, patch: dict) -> dict:
        return self.request("PATCH", f"/api/v1/nodes/{name}", patch, "application/merge-patch+json")

    def gpu_pods(self, node: str, exclude_namespace: str) -> list[str]:
        """Names of running or pending pods on `node`, outside `exclude_namespace`, that request GPUs."""
        pods = self.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{node}")
        out = []
        for p in pods.get("items", []):
            if p["metadata"].get("namespace") == exclude_namespace or p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            for c in p["spec"].get("containers", []):
                if int((c.get("resources", {}).get("requests") or {}).get(GPU_RESOURCE, 0)):
                    out.append(f"{p['metadata']['namespace']}/{p['metadata']['name']}")
                    break
        return out


def record(kube: Kube, node: str, results: list[CheckResult], diag_running: bool | None = None, attempts: int = 5) -> dict:
    """Read the node, patch it with `results` (node_patch); on 409 Conflict read again and retry."""
    for attempt in range(attempts):
        current = kube.node(node)
        try:
            return kube.patch_node(node, node_patch(current, results, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                                    diag_running))
        except KubeError as e:
            if e.status != 409 or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


# ---------------------------------------------------------------- metrics


def efa_collector(sys_root: str | Path):
    """A prometheus_client collector of the node's EFA hw_counters (module docstring)."""
    class EfaCollector:
        def collect(self):
            devices = efa_devices(sys_root)
            counters = CounterMetricFamily("moerl_efa_hw_counter", "EFA device hw_counters (sysfs).",
                                           labels=["device", "port", "counter"])
            for dev, ports in devices.items():
                for port, info in ports.items():
                    for name, value in info["counters"].items():
                        counters.add_metric([dev, port, name], value)
            yield counters
            yield GaugeMetricFamily("moerl_efa_devices", "EFA devices under /sys/class/infiniband.", value=len(devices))

    return EfaCollector()


# ---------------------------------------------------------------- the loop


@dataclass
class Agent:
    """One node's checks on a schedule (module docstring); `step` runs one round."""

    kube: Kube
    node: str
    expected_gpus: int
    expected_efa: int
    shared: Path
    sys_root: Path = Path("/sys")
    namespace: str = "moerl-health"
    dcgm_every_s: float = 6 * 3600
    diag_timeout_s: float = 1800
    poll_s: float = 5.0
    run: object = subprocess.run
    last_dcgm: float = field(default=-1e18)
    gauge: object = None

    def step(self, now: float | None = None) -> list[CheckResult]:
        now = time.time() if now is None else now
        results = [gpu_check(self.run, self.expected_gpus), efa_check(efa_devices(self.sys_root), self.expected_efa)]
        if now - self.last_dcgm >= self.dcgm_every_s and all(r.ok for r in results) \
                and not self.kube.gpu_pods(self.node, self.namespace):
            record(self.kube, self.node, results, diag_running=True)
            try:
                diag = self._diagnose()
            finally:
                self.last_dcgm = now
            results.append(diag)
            record(self.kube, self.node, results, diag_running=False)
        else:
            previous = dcgm_result(self.shared)
            results += [previous] if previous else []
            record(self.kube, self.node, results)
        if self.gauge is not None:
            for r in results:
                self.gauge.labels(r.name).set(1 if r.ok else 0)
        return results

    def _diagnose(self) -> CheckResult:
        for name in (DIAG_RC, DIAG_RESULT):
            (self.shared / name).unlink(missing_ok=True)
        (self.shared / DIAG_REQUEST).write_text(str(time.time()))
        deadline = time.monotonic() + self.diag_timeout_s
        while True:
            result = dcgm_result(self.shared)
            if result is not None:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(self.poll_s, left))
        return CheckResult("dcgm", False, f"no diagnostics result within {self.diag_timeout_s:g} s")


def build_parser() -> argparse.ArgumentParser:
    """The CLI's arguments (module docstring; charts8s/nodehealth.py renders them)."""
    p = argparse.ArgumentParser(prog="python -m app.nodehealth", description=__doc__.splitlines()[0])
    p.add_argument("--node", default=os.environ.get("NODE_NAME"))
    p.add_argument("--expected-gpus", type=int, required=True)
    p.add_argument("--expected-efa", type=int, required=True)
    p.add_argument("--shared", default="/shared")
    p.add_argument("--sys-root", default="/sys")
    p.add_argument("--port", type=int, default=9465)
    p.add_argument("--interval", type=float, default=300.0)
    p.add_argument("--dcgm-every", type=float, default=6 * 3600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry (module docstring); exit 2 with one line on stderr for bad arguments."""
    args = build_parser().parse_args(argv)
    if not args.node or args.expected_gpus < 0 or args.expected_efa < 0 or args.interval <= 0:
        print("app.nodehealth: --node (or NODE_NAME), --expected-gpus >= 0, --expected-efa >= 0 and --interval > 0 "
              "are required", file=sys.stderr)
        return 2

    REGISTRY.register(efa_collector(args.sys_root))
    gauge = Gauge("moerl_node_health_check", "Last result of each node health check (1 pass, 0 fail).", ["check"])
    start_http_server(args.port)
    agent = Agent(Kube(), args.node, args.expected_gpus, args.expected_efa, Path(args.shared), Path(args.sys_root),
                  dcgm_every_s=args.dcgm_every, gauge=gauge)
    while True:
        try:
            for r in agent.step():
                print(json.dumps({"check": r.name, "ok": r.ok, "detail": r.detail}), flush=True)
        except (KubeError, OSError) as e:  # the API server or a file away for a while: try again next round
            print(json.dumps({"error": str(e)}), flush=True)
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
