"""One pod of the replica: its containers as local processes, and the kubelet's part.

What the kubelet does and this module does the same way (Kubernetes docs: "Pod Lifecycle",
"Configure Liveness, Readiness and Startup Probes", "Container Lifecycle Hooks"):
- volumes: every emptyDir and claim is a directory of the pod; ConfigMap and Secret keys are
  files where the pod mounts them; the containers share the pod's directories;
- env: ``value``, ``valueFrom`` (secretKeyRef, configMapKeyRef, fieldRef), ``$(VAR)`` expansion
  in command, args and env (``$$`` escapes), Service links (``<SVC>_SERVICE_HOST`` ...);
- probes: startup (liveness and readiness wait for it; ``failureThreshold`` failures restart
  the container), liveness (``failureThreshold`` failures in a row restart it), readiness
  (``successThreshold`` / ``failureThreshold``; a not-ready pod leaves its Services), each every
  ``periodSeconds`` after ``initialDelaySeconds``, cut at ``timeoutSeconds``; exec, httpGet
  and tcpSocket;
- restarts by ``restartPolicy`` (Always, OnFailure, Never) with the crash-loop back-off (10 s,
  doubling, at most 300 s);
- termination: every container's preStop hook (exec, httpGet, sleep), then SIGTERM, then
  SIGKILL to every process of the container once ``terminationGracePeriodSeconds`` have passed
  since termination began; a liveness restart does the same for one container.

What is substituted (`Substitutions`): the image (the local venv and repository on PATH and
PYTHONPATH), the engine (SGLang's command becomes `moerl engine` with its model, host and port),
GPU counts (torchrun's ``--nproc-per-node`` of a GPU container becomes the replica's processes
per node), torchrun's rendezvous port (a port free on this host: its c10d store listens on every
address of the host, so another torchrun on the same port would take the gang into its own
rendezvous), the S3 endpoint (moto). Not run (`NOT_RUN`): the buffer pod's Redis exporter sidecar
(oliver006/redis_exporter), a Go binary outside this venv that only Prometheus reads; the pod's
other containers run and its readiness is theirs. Not reproduced: cgroup CPU and memory limits (each container
gets ``OMP_NUM_THREADS=1`` instead), a read-only root filesystem, user ids, network policies.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from app.local.procs import descendants
from app.replica.aws import TOKEN_PATH
from app.replica.network import Rewriter

BACKOFF_S, BACKOFF_MAX_S = 10.0, 300.0
# Containers not run, by the program their command starts, and why (recorded as a substitution).
NOT_RUN = {"redis_exporter": "not run: the Prometheus Redis exporter is a Go binary outside this venv, "
                             "and only Prometheus (not replicated) reads it"}
PROBE_DEFAULTS = {"initialDelaySeconds": 0, "periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1,
                  "failureThreshold": 3}


class PodError(RuntimeError):
    """A pod cannot be started as its manifest says (a missing Secret key, an unknown volume type)."""


@dataclass
class Substitutions:
    """What the replica puts in place of the cluster's image, engine, GPUs and S3.

    Attributes:
        bin_dir: the venv's bin directory (first on PATH: `moerl`, `torchrun`, `python3`).
        repo: the repository root (PYTHONPATH; the image installs it).
        procs_per_gpu_node: torchrun ``--nproc-per-node`` for a container that asks for GPUs.
        s3_endpoint: moto's URL (``AWS_ENDPOINT_URL_S3``).
        rdzv_port: the port torchrun's ``--rdzv-endpoint`` gets instead of the manifest's (the
            same for every pod of the run); 0: the manifest's.
        log: list of (pod, container, what was substituted), filled as containers start.
    """

    bin_dir: str
    repo: str
    procs_per_gpu_node: int
    s3_endpoint: str
    rdzv_port: int = 0
    log: list[tuple[str, str, str]] = field(default_factory=list)

    @staticmethod
    def not_run(container: dict) -> str | None:
        """Why ``container`` is not run here (its command's program is in NOT_RUN), or None."""
        cmd = container.get("command") or []
        return NOT_RUN.get(Path(str(cmd[0])).name) if cmd else None

    @staticmethod
    def probe_command(cmd: list[str], pod_ip: str) -> list[str]:
        """redis-cli's default host is the pod's own loopback: point it at the pod's address."""
        return [re.sub(r"\bredis-cli\b(?! -h)", f"redis-cli -h {pod_ip}", a) for a in cmd]

    @staticmethod
    def metrics_addr(argv: list[str], pod_ip: str) -> tuple[list[str], str | None]:
        """moerl's /metrics (``--metrics-port``) listens on every address of its pod; here the pods
        share the host's addresses, so it gets ``--metrics-addr <pod address>``, as a word of
        its own or inside a ``bash -c`` line (torchrun's trainer). Returns (argv, note or None)."""
        if any("--metrics-addr" in a for a in argv):
            return argv, None
        if "--metrics-port" in argv[:-1]:
            i = argv.index("--metrics-port") + 2
            out = [*argv[:i], "--metrics-addr", pod_ip, *argv[i:]]
        else:
            out = [re.sub(r"(--metrics-port[ =]\d+)", rf"\1 --metrics-addr {pod_ip}", a) for a in argv]
        if out == argv:
            return argv, None
        return out, f"network: --metrics-addr {pod_ip} (its pod's address)"

    def argv(self, argv: list[str], container: dict, pod_ip: str) -> tuple[list[str], str | None]:
        """``argv`` with the engine, GPU and listen-address substitutions applied; returns
        (argv, note or None)."""
        argv, metrics_note = self.metrics_addr(argv, pod_ip)
        argv, note = self._substituted(argv, container, pod_ip)
        return argv, "; ".join(n for n in (metrics_note, note) if n) or None

    def _substituted(self, argv: list[str], container: dict, pod_ip: str) -> tuple[list[str], str | None]:
        if Path(argv[0]).name == "redis-server" and "--bind" not in argv:
            # It listens on every address of its pod; here the pods share the host's addresses.
            return [*argv, "--bind", pod_ip], f"network: redis-server --bind {pod_ip} (its pod's address)"
        if argv[:3] == ["python3", "-m", "sglang.launch_server"] or argv[:2] == ["sglang", "serve"]:
            keep = {"--model-path": None, "--host": "127.0.0.1", "--port": "30000"}
            # The SGLang flags the built-in engine shares (app/engine/server.py `serve`); --config
            # holds the engine's keys (charts8s/keys.py `keyed_engine`).
            shared = {"--weight-version", "--max-running-requests", "--enable-return-routed-experts", "--config",
                      "--api-key", "--admin-api-key"}
            carried: list[str] = []
            dropped, i = [], 2 if argv[0] == "sglang" else 3
            while i < len(argv):
                flag, _, inline = argv[i].partition("=")
                takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                value = inline or (argv[i + 1] if takes_value and not inline else None)
                if flag in keep:
                    keep[flag] = value
                elif flag in shared:
                    carried += [flag] + ([value] if value is not None else [])
                else:
                    dropped.append(flag)
                i += 1 if inline or not takes_value else 2
            if not keep["--model-path"]:
                raise PodError(f"SGLang command without --model-path: {shlex.join(argv)}")
            new = ["moerl", "engine", "--model-path", keep["--model-path"], "--host", keep["--host"],
                   "--port", keep["--port"], "--threads", "1", *carried]
            return new, f"engine: SGLang -> moerl engine (dropped {' '.join(dropped) or 'nothing'})"
        notes = []
        gpus = int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
        if gpus:
            n = str(self.procs_per_gpu_node)
            pattern = re.compile(r"--nproc[-_]per[-_]node(=| )" + str(gpus) + r"\b")
            out = [pattern.sub(lambda m: f"--nproc-per-node{m.group(1)}{n}", a) for a in argv]
            if out != argv:
                argv, notes = out, [f"GPUs: {gpus} per pod -> torchrun --nproc-per-node {n}"]
        if self.rdzv_port:
            # HOST:PORT, HOST maybe a shell default with a colon of its own (${TORCHX_RANK0_HOST:=ip})
            pattern = re.compile(r"(--rdzv[-_]endpoint[= ]\S*?:)(\d+)(?!\d)")
            ports = sorted({m.group(2) for a in argv for m in pattern.finditer(a)})
            if ports:
                argv = [pattern.sub(lambda m: f"{m.group(1)}{self.rdzv_port}", a) for a in argv]
                notes.append(f"network: rendezvous port {', '.join(ports)} -> one free on the host (torchrun's c10d "
                             "store listens on every address)")
        return argv, "; ".join(notes) or None


def expand_vars(text: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables are replaced, ``$$`` is a literal ``$``,
    undefined references are left as written."""
    def sub(m: re.Match) -> str:
        if m.group(0).startswith("$$"):
            return m.group(0)[1:]
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m.group(0) == "$$" else sub(m), text)


@dataclass
class Probe:
    """One probe of one container and its counters."""

    kind: str  # startup | liveness | readiness
    spec: dict
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    running: bool = False

    def setting(self, key: str) -> int:
        return int(self.spec.get(key, PROBE_DEFAULTS[key]))


class Container:
    """One container's process, restarts and probes."""

    def __init__(self, pod: "Pod", spec: dict):
        self.pod, self.spec, self.name = pod, spec, spec["name"]
        self.proc: subprocess.Popen | None = None
        self.restarts = 0
        self.restarts_in_row = 0  # for the crash-loop back-off
        self.exit_codes: list[int] = []
        self.started = False  # the startup probe has succeeded (or there is none)
        self.ready = False
        self.terminated = False  # will not run again (restartPolicy or pod termination)
        self.stopping = False  # a probe-triggered stop is under way (no second one, no probes)
        self.restart_at: float | None = None
        self.run_since = 0.0
        self.probes: dict[str, Probe] = {}
        self.tree: set[tuple[int, str]] = set()  # (pid, start time) of every process seen in it
        self.lock = threading.Lock()

    # -- process ---------------------------------------------------------------------------------
    def start(self) -> None:
        env, argv = self.pod.container_env(self.spec), self.pod.container_argv(self.spec)
        log = open(self.pod.log_dir / f"{self.name}.log", "ab")
        log.write(f"--- replica: start {time.strftime('%H:%M:%S')} (restart {self.restarts}): {shlex.join(argv)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(argv, env=env, cwd=self.pod.workdir, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        self.run_since = time.monotonic()
        self.started = "startupProbe" not in self.spec
        self.ready = False
        now = time.monotonic()
        self.probes = {k: Probe(k, self.spec[f"{k}Probe"], now + int(self.spec[f"{k}Probe"].get("initialDelaySeconds", 0)))
                       for k in ("startup", "liveness", "readiness") if f"{k}Probe" in self.spec}

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def remember_tree(self) -> None:
        """Note every process of the container (a SIGKILL must reach ranks that left its group)."""
        if self.alive():
            for pid in [self.proc.pid, *descendants(self.proc.pid)]:
                st = _start_time(pid)
                if st:
                    self.tree.add((pid, st))

    def signal(self, sig: int) -> None:
        """SIGTERM to the container's process group; SIGKILL to every process it ever had."""
        if sig == signal.SIGKILL:
            self.remember_tree()
            for pid, st in sorted(self.tree):
                if _start_time(pid) == st:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float, reason: str) -> None:
        """preStop hook, SIGTERM, SIGKILL after ``grace_s`` (counted from now); blocks until gone."""
        deadline = time.monotonic() + grace_s
        self.pod.event(f"{self.name}: stopping ({reason}), grace {grace_s:.0f}s")
        hook = self.spec.get("lifecycle", {}).get("preStop")
        if hook and self.alive():
            self.pod.run_handler(self.spec, hook, max(0.0, deadline - time.monotonic()))
        self.signal(signal.SIGTERM)
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.alive():
            self.pod.event(f"{self.name}: SIGKILL after the {grace_s:.0f}s grace period")
        self.signal(signal.SIGKILL)  # also whatever the main process left behind
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class Pod:
    """A pod: directories, containers, the kubelet loop (a thread) and termination.

    Args:
        name: pod name. template: the pod template (metadata + spec). extra_env: the controller's
            variables (Volcano, LWS). root: the pod's directory. ip: its address.
        cluster: the `app.replica.cluster.Cluster` (Secrets, ConfigMaps, names, substitutions).
    """

    def __init__(self, name: str, template: dict, extra_env: dict, labels: dict, root: Path, ip: str, cluster):
        self.name, self.template, self.spec = name, template, template["spec"]
        self.labels = labels
        self.extra_env, self.root, self.ip, self.cluster = extra_env, Path(root), ip, cluster
        self.workdir = self.root / "workdir"
        self.log_dir = self.root / "logs"
        self.restart_policy = self.spec.get("restartPolicy", "Always")
        self.grace_s = float(self.spec.get("terminationGracePeriodSeconds", 30))
        self.phase = "Pending"
        self.deleting = False
        self.events: list[str] = []
        self.mounts: dict[str, str] = {}
        self.containers: list[Container] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rewrite: Rewriter | None = None
        self.on_restart: Callable[["Pod", Container], None] | None = None  # LWS: recreate the group

    def event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {self.name}: {text}"
        self.events.append(line)
        self.cluster.event(line)

    # -- set up ------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Make the pod's directories, volumes and mounted files; raises PodError on a bad volume."""
        for d in (self.workdir, self.log_dir, self.root / "rootfs" / "home" / "moerl", self.root / "rootfs" / "tmp"):
            d.mkdir(parents=True, exist_ok=True)
        vols: dict[str, Path] = {}
        for v in self.spec.get("volumes", []):
            d = self.root / "volumes" / v["name"]
            if "persistentVolumeClaim" in v:
                d = self.cluster.claim_dir(v["persistentVolumeClaim"]["claimName"])
            elif not ({"emptyDir", "configMap", "secret"} & set(v)):
                raise PodError(f"{self.name}: volume {v['name']!r}: only emptyDir, configMap, secret and claims are replicated")
            d.mkdir(parents=True, exist_ok=True)
            vols[v["name"]] = d
        for claim in self.cluster.claims_of(self):  # StatefulSet volumeClaimTemplates
            vols[claim] = self.cluster.claim_dir(f"{claim}-{self.name}")
        mounts: dict[str, str] = {"/tmp": str(self.root / "rootfs" / "tmp"),
                                  "/home/moerl": str(self.root / "rootfs" / "home" / "moerl")}
        token = self.cluster.agent.token_for(self.spec.get("serviceAccountName", "default"))
        if token is not None:
            d = self.root / "volumes" / "eks-pod-identity-token"
            d.mkdir(parents=True, exist_ok=True)
            (d / "eks-pod-identity-token").write_text(token)

            mounts[str(Path(TOKEN_PATH).parent)] = str(d)
        self.pod_identity = token is not None
        for c in self.spec.get("initContainers", []) + self.spec["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] not in vols:
                    raise PodError(f"{self.name}/{c['name']}: volumeMount {m['name']!r} names no volume")
                target = str(vols[m["name"]] / m.get("subPath", ""))
                if mounts.get(m["mountPath"], target) != target and m["mountPath"] not in ("/tmp", "/home/moerl"):
                    raise PodError(f"{self.name}: {m['mountPath']} is mounted from two volumes; the replica maps "
                                   "mount paths per pod")
                mounts[m["mountPath"]] = target
        self.mounts = mounts
        self.rewrite = Rewriter(mounts, self.ip, self.cluster.names())
        for v in self.spec.get("volumes", []):
            if "configMap" in v or "secret" in v:
                data = (self.cluster.config_map(v["configMap"]["name"]) if "configMap" in v
                        else self.cluster.secret(v["secret"]["secretName"]))
                for key, text in data.items():
                    (vols[v["name"]] / key).write_text(self.rewrite(text))

    # -- what a container sees ------------------------------------------------------------------------
    def container_env(self, c: dict) -> dict[str, str]:
        """The process environment of container ``c`` (module docstring)."""
        s = self.cluster.subs
        env = {"PATH": f"{s.bin_dir}:/usr/local/bin:/usr/bin:/bin", "HOME": "/home/moerl", "HOSTNAME": self.hostname,
               "PYTHONPATH": s.repo, "PYTHONUNBUFFERED": "1", "TMPDIR": "/tmp", "OMP_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "LANG": "C.UTF-8",
               # The replica's S3 is moto; the node's instance metadata is out of a pod's reach on EKS.
               "AWS_ENDPOINT_URL_S3": s.s3_endpoint, "AWS_EC2_METADATA_DISABLED": "true"}
        if self.pod_identity:
            env["AWS_CONTAINER_CREDENTIALS_FULL_URI"] = self.cluster.agent.url
            env["AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE"] = self.rewrite(TOKEN_PATH)  # the mounted token
        env.update(self.cluster.service_links())
        env.update(self.extra_env)
        for e in c.get("env", []):  # the manifest's own, as the pod would see them
            if "value" in e:
                env[e["name"]] = self.rewrite(expand_vars(str(e["value"]), env))
            elif "valueFrom" in e:
                env[e["name"]] = self.rewrite(self._value_from(c, e))
        for k in ("HOME", "TMPDIR"):
            env[k] = self.rewrite(env[k])
        return env

    def _value_from(self, c: dict, e: dict) -> str:
        src = e["valueFrom"]
        where = f"{self.name}/{c['name']} env {e['name']}"
        for field, kind, read in (("secretKeyRef", "Secret", self.cluster.secret),
                                  ("configMapKeyRef", "ConfigMap", self.cluster.config_map)):
            if field in src:
                ref = src[field]
                data = read(ref["name"])
                if ref["key"] not in data:
                    raise PodError(f"{where}: {kind} {ref['name']!r} has no key {ref['key']!r}")
                return data[ref["key"]]
        if "fieldRef" in src:
            fields = {"metadata.name": self.name, "metadata.namespace": self.cluster.namespace, "status.podIP": self.ip,
                      "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
                      "spec.nodeName": f"node-{self.name}"}
            path = src["fieldRef"]["fieldPath"]
            if path not in fields:
                raise PodError(f"{where}: fieldRef {path} is not replicated")
            return fields[path]
        raise PodError(f"{where}: valueFrom {sorted(src)} is not replicated")

    @property
    def hostname(self) -> str:
        return self.spec.get("hostname", self.name)

    def container_argv(self, c: dict) -> list[str]:
        """command + args, ``$(VAR)``-expanded, rewritten, with the substitutions applied."""
        env = self.container_env(c)
        argv = [expand_vars(str(a), env) for a in c.get("command", []) + c.get("args", [])]
        if not argv:
            raise PodError(f"{self.name}/{c['name']}: no command (the image's entrypoint is not replicated)")
        argv, note = self.cluster.subs.argv(argv, c, self.ip)
        if note:
            self.cluster.subs.log.append((self.name, c["name"], note))
        return [self.rewrite(a) for a in argv]

    # -- handlers and probes -------------------------------------------------------------------------
    def run_handler(self, c: dict, handler: dict, timeout_s: float) -> bool:
        """Run a probe or hook handler (exec, httpGet, tcpSocket, sleep); True on success."""
        try:
            if "exec" in handler:
                cmd = [self.rewrite(expand_vars(str(a), {})) for a in handler["exec"]["command"]]
                cmd = self.cluster.subs.probe_command(cmd, self.ip)
                r = subprocess.run(cmd, env=self.container_env(c), cwd=self.workdir, timeout=timeout_s,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                return r.returncode == 0
            if "httpGet" in handler:
                h = handler["httpGet"]
                host = h.get("host") or self.ip
                url = f"http://{host}:{self._port(c, h['port'])}{h.get('path', '/')}"
                with urllib.request.urlopen(url, timeout=timeout_s) as r:
                    return 200 <= r.status < 400
            if "tcpSocket" in handler:
                t = handler["tcpSocket"]
                socket.create_connection((t.get("host") or self.ip, self._port(c, t["port"])), timeout=timeout_s).close()
                return True
            if "sleep" in handler:
                time.sleep(min(float(handler["sleep"]["seconds"]), timeout_s))
                return True
        except (OSError, subprocess.TimeoutExpired, ValueError):
            return False
        raise PodError(f"{self.name}/{c['name']}: handler {sorted(handler)} is not replicated")

    @staticmethod
    def _port(c: dict, port) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.get("ports", []):
            if p.get("name") == port:
                return int(p["containerPort"])
        raise ValueError(f"no container port named {port!r}")

    def _probe(self, ctr: Container, p: Probe) -> None:
        ok = self.run_handler(ctr.spec, p.spec, p.setting("timeoutSeconds"))
        with ctr.lock:
            p.running = False
            if not ctr.alive() or self.deleting:
                return
            if ok:
                p.successes, p.failures = p.successes + 1, 0
            else:
                p.failures, p.successes = p.failures + 1, 0
            if p.kind == "startup":
                if ok:
                    ctr.started = True
                    self.event(f"{ctr.name}: startup probe succeeded")
                elif p.failures >= p.setting("failureThreshold"):
                    self.event(f"{ctr.name}: startup probe failed {p.failures} times; restarting")
                    threading.Thread(target=self._restart, args=(ctr, "startup probe"), daemon=True).start()
            elif p.kind == "liveness" and not ok and p.failures >= p.setting("failureThreshold"):
                self.event(f"{ctr.name}: liveness probe failed {p.failures} times in a row; restarting")
                p.failures = 0
                threading.Thread(target=self._restart, args=(ctr, "liveness probe"), daemon=True).start()
            elif p.kind == "readiness":
                if ok and p.successes >= p.setting("successThreshold"):
                    ctr.ready = True
                elif not ok and p.failures >= p.setting("failureThreshold"):
                    ctr.ready = False

    def _restart(self, ctr: Container, reason: str) -> None:
        """Kill a container as the kubelet does for a failed probe; the loop restarts it."""
        if ctr.stopping:
            return
        ctr.stopping = True
        try:
            grace = float(ctr.probes.get("liveness", Probe("", {})).spec.get("terminationGracePeriodSeconds", self.grace_s))
            ctr.stop(grace, reason)
        finally:
            ctr.stopping = False

    # -- the kubelet loop ------------------------------------------------------------------------------
    def start(self) -> "Pod":
        """Prepare, start every container (those in NOT_RUN aside), and run the kubelet loop in a thread."""
        self.prepare()
        for spec in self.spec.get("initContainers", []):
            init = Container(self, spec)
            init.start()
            if init.proc.wait() != 0:
                self.phase = "Failed"
                self.event(f"init container {spec['name']} failed with {init.proc.returncode}")
                return self
        self.containers = []
        for spec in self.spec["containers"]:
            why = self.cluster.subs.not_run(spec)
            if why:
                self.cluster.subs.log.append((self.name, spec["name"], why))
                continue
            self.containers.append(Container(self, spec))
        for c in self.containers:
            c.start()
        self.phase = "Running"
        self.event(f"started at {self.ip} ({', '.join(c.name for c in self.containers)})")
        self._thread = threading.Thread(target=self._loop, name=f"kubelet-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        last_tree = 0.0
        while not self._stop.wait(0.2):
            now = time.monotonic()
            if now - last_tree > 1.0:
                for c in self.containers:
                    c.remember_tree()
                last_tree = now
            for c in self.containers:
                with c.lock:
                    self._watch(c, now)
            if self.restart_policy != "Always" and all(c.terminated for c in self.containers) and not self.deleting:
                codes = [c.exit_codes[-1] for c in self.containers]
                self.phase = "Succeeded" if all(x == 0 for x in codes) else "Failed"
                self.event(f"{self.phase} (exit codes {codes})")
                return

    def _watch(self, c: Container, now: float) -> None:
        if c.terminated or self.deleting:
            return
        if c.proc is not None and not c.alive() and c.restart_at is None:
            code = c.proc.returncode
            c.exit_codes.append(code)
            c.ready = False
            c.signal(signal.SIGKILL)  # processes the main one left behind go with the container
            again = self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0)
            if not again:
                c.terminated = True
                self.event(f"{c.name}: exited with {code}")
                return
            # Crash-loop back-off, reset after 10 minutes of running.
            if now - c.run_since > 600:
                c.restarts_in_row = 0
            delay = min(BACKOFF_S * 2 ** c.restarts_in_row, BACKOFF_MAX_S)
            c.restarts_in_row += 1
            c.restart_at = now + delay
            self.event(f"{c.name}: exited with {code}; restart in {delay:.0f}s")
            return
        if c.restart_at is not None:
            if now >= c.restart_at:
                c.restart_at = None
                c.restarts += 1
                if self.on_restart is not None:
                    self.on_restart(self, c)
                    return
                c.start()
            return
        for p in c.probes.values():
            if p.running or now < p.next_at or c.stopping:
                continue
            if p.kind != "startup" and not c.started:
                continue
            if p.kind == "startup" and c.started:
                continue
            p.running, p.next_at = True, now + p.setting("periodSeconds")
            threading.Thread(target=self._probe, args=(c, p), daemon=True).start()
        if "readiness" not in c.probes and c.started:
            c.ready = c.alive()

    def is_ready(self) -> bool:
        return self.phase == "Running" and not self.deleting and all(c.ready for c in self.containers)

    def delete(self, grace_s: float | None = None, reason: str = "deleted") -> None:
        """Terminate the pod: every container at once (preStop, SIGTERM, SIGKILL after grace)."""
        if self.deleting:
            return
        self.deleting = True
        grace = self.grace_s if grace_s is None else grace_s
        self.event(f"terminating ({reason}), terminationGracePeriodSeconds {grace:.0f}")
        threads = [threading.Thread(target=c.stop, args=(grace, reason)) for c in self.containers if c.alive()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._stop.set()
        for c in self.containers:
            c.signal(signal.SIGKILL)
        self.phase = "Deleted"

    def kill(self) -> None:
        """SIGKILL every container (a lost node); the loop then sees them exit."""
        self.event("every container SIGKILLed (node lost)")
        for c in self.containers:
            c.signal(signal.SIGKILL)
