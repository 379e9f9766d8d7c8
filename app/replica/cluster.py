"""The replica's control plane: controllers that keep the workloads' pods, Services and their
forwarders, Secrets, ConfigMaps, claims, and the Pod Identity agent.

Controllers act as their Kubernetes counterparts do, on the events the replica produces:
- Deployment: a deleted or failed pod is replaced by a new one (a new name);
- StatefulSet: the pod comes back under the same name, with the same claims;
- Volcano Job: a failed pod fires the job policy (``PodFailed`` -> ``RestartJob``: every pod of
  the gang is terminated and created again, up to ``maxRetry`` times); the job completes when
  every pod has succeeded;
- LeaderWorkerSet: a restarted container or failed pod recreates its whole group
  (RecreateGroupOnPodRestart).
Pods get the labels their controller adds (``volcano.sh/job-name``, ``pod-template-hash``,
``leaderworkerset.sigs.k8s.io/name``), which Services select on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
from pathlib import Path

from app.buffer.redis_server import free_port
from app.replica.aws import MotoS3, PodIdentityAgent
from app.replica.kubelet import Pod, PodError, Substitutions
from app.replica.manifests import Manifests, Workload, selects
from app.replica.network import Addresses, Forwarder, service_names


class Cluster:
    """Runs a `Manifests` set.

    Args:
        manifests: what dist/ holds (`read_manifests`).
        root: the replica's directory (pods/, claims/, logs).
        secrets: Secret name -> {key: value} (the ones made outside dist/, e.g. the Redis password).
        subs: the substitutions (image, engine, GPUs, S3).
        bucket, region: the checkpoint bucket made on moto.
        associations: service accounts with a Pod Identity association.
    """

    def __init__(self, manifests: Manifests, root: Path, secrets: dict[str, dict[str, str]], subs_kw: dict,
                 bucket: str, region: str, associations: set[str]):
        missing = sorted(manifests.secret_refs - set(secrets))
        if missing:
            raise PodError(f"the pods reference Secrets {missing} that neither dist/ nor the replica provides")
        self.m, self.root, self.secrets = manifests, Path(root), secrets
        self.namespace = manifests.namespace
        self.addr = Addresses()
        self.s3 = MotoS3(bucket, region)
        self.agent = PodIdentityAgent(self.addr.service(), associations)
        self.subs = Substitutions(s3_endpoint=self.s3.url, rdzv_port=free_port(), **subs_kw)
        self.pods: dict[str, Pod] = {}  # live (not deleted) pods by name
        self.history: list[Pod] = []  # every pod ever made, in order
        self.owner: dict[str, Workload] = {}
        self.job_state: dict[str, dict] = {}
        self.made = {w.name: len(w.groups) for w in manifests.workloads if w.kind == "Deployment"}
        self.log_lines: list[str] = []
        self._names: dict[str, str] = {}
        self._lock = threading.RLock()
        self._incarnation = itertools.count()
        self.forwarders: list[Forwarder] = []
        self.cluster_ips: dict[str, str] = {}
        for svc in manifests.services:
            if svc["spec"].get("clusterIP") != "None":
                self.cluster_ips[svc["metadata"]["name"]] = self.addr.service()

    # -- what pods read ---------------------------------------------------------------------------------
    def event(self, line: str) -> None:
        self.log_lines.append(line)
        with open(self.root / "events.log", "a") as f:
            f.write(line + "\n")

    def secret(self, name: str) -> dict[str, str]:
        if name not in self.secrets:
            raise PodError(f"Secret {name!r} does not exist")
        return self.secrets[name]

    def config_map(self, name: str) -> dict[str, str]:
        if name not in self.m.config_maps:
            raise PodError(f"ConfigMap {name!r} is not in dist/")
        return self.m.config_maps[name]

    def claim_dir(self, name: str) -> Path:
        d = self.root / "claims" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def claims_of(self, pod: Pod) -> list[str]:
        w = self.owner.get(pod.name)
        if w is None or w.kind != "StatefulSet":
            return []
        return [t["metadata"]["name"] for t in w.doc["spec"].get("volumeClaimTemplates", [])]

    def names(self) -> dict[str, str]:
        """DNS name -> address: Services (cluster IP, or the first pod of a headless one) and
        pods with hostname + subdomain."""
        out: dict[str, str] = {}
        with self._lock:
            for svc in self.m.services:
                name = svc["metadata"]["name"]
                ip = self.cluster_ips.get(name)
                if ip is None:  # headless: the addresses of its pods (the first, for a single name)
                    pods = self._selected(svc, ready_only=not svc["spec"].get("publishNotReadyAddresses"))
                    ip = pods[0].ip if pods else None
                for n in service_names(name, self.namespace):
                    if ip:
                        out[n] = ip
            out.update(self._names)
        return out

    def service_links(self) -> dict[str, str]:
        """The variables Kubernetes gives every container for each Service with a cluster IP."""
        env = {}
        for svc in self.m.services:
            name = svc["metadata"]["name"]
            ip = self.cluster_ips.get(name)
            if ip is None:
                continue
            key = name.upper().replace("-", "_")
            ports = svc["spec"].get("ports", [])
            if ports:
                env[f"{key}_SERVICE_HOST"] = ip
                env[f"{key}_SERVICE_PORT"] = str(ports[0]["port"])
                env[f"{key}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
                for p in ports:
                    proto = p.get("protocol", "TCP")
                    base = f"{key}_PORT_{p['port']}_{proto}"
                    env.update({base: f"{proto.lower()}://{ip}:{p['port']}", f"{base}_PROTO": proto.lower(),
                                f"{base}_PORT": str(p["port"]), f"{base}_ADDR": ip})
        return env

    def _selected(self, svc: dict, ready_only: bool) -> list[Pod]:
        sel = svc["spec"].get("selector", {})
        return [p for p in self.pods.values() if selects(sel, p.labels) and not p.deleting
                and (p.is_ready() or not ready_only)]

    # -- services ----------------------------------------------------------------------------------------
    def start_services(self) -> None:
        """A forwarder per (cluster-IP Service, port) to the ready pods it selects."""
        for svc in self.m.services:
            name = svc["metadata"]["name"]
            ip = self.cluster_ips.get(name)
            if ip is None:
                continue
            for port in svc["spec"].get("ports", []):
                target = port.get("targetPort", port["port"])

                def endpoints(svc=svc, target=target):
                    out = []
                    for pod in self._selected(svc, ready_only=True):
                        for c in pod.spec["containers"]:
                            try:
                                out.append((pod.ip, Pod._port(c, target)))
                                break
                            except ValueError:
                                continue
                    return out

                self.forwarders.append(Forwarder(ip, int(port["port"]), endpoints).start())

    # -- pods ---------------------------------------------------------------------------------------------
    def _labels(self, w: Workload, tpl: dict) -> dict:
        labels = dict(tpl.get("metadata", {}).get("labels", {}))
        if w.kind == "Deployment":
            labels["pod-template-hash"] = hashlib.sha1(json.dumps(tpl, sort_keys=True).encode()).hexdigest()[:10]
        elif w.kind == "Job":
            labels["volcano.sh/job-name"] = w.name
        elif w.kind == "LeaderWorkerSet":
            labels["leaderworkerset.sigs.k8s.io/name"] = w.name
        return labels

    def _make(self, w: Workload, name: str, tpl: dict, env: dict) -> Pod:
        root = self.root / "pods" / f"{name}.{next(self._incarnation)}"
        ip = self.addr.pod()
        pod = Pod(name, tpl, env, self._labels(w, tpl), root, ip, self)
        spec = tpl["spec"]
        if spec.get("hostname") and spec.get("subdomain"):
            fqdn = f"{spec['hostname']}.{spec['subdomain']}.{self.namespace}"
            for n in (f"{fqdn}.svc.cluster.local", f"{fqdn}.svc", fqdn):
                self._names[n] = ip
        if w.kind == "LeaderWorkerSet":
            for n in (f"{name}.{w.name}.{self.namespace}.svc.cluster.local", f"{name}.{w.name}.{self.namespace}"):
                self._names[n] = ip
            pod.on_restart = self._lws_restart
        governing = w.doc.get("spec", {}).get("serviceName") if w.kind == "StatefulSet" else None
        if governing:  # a StatefulSet pod's own name under its headless Service (the router reaches engines so)
            for n in (f"{name}.{governing}.{self.namespace}.svc.cluster.local", f"{name}.{governing}.{self.namespace}"):
                self._names[n] = ip
        with self._lock:
            self.pods[name] = pod
            self.history.append(pod)
            self.owner[name] = w
        return pod

    def start(self) -> None:
        """Start the Services and every pod of every workload (all at once, as a cluster does).
        Pods of a group are made first (names resolvable), then started."""
        self.start_services()
        made = []
        for w in self.m.workloads:
            for group in w.groups:
                made += [self._make(w, name, tpl, env) for name, tpl, env in group]
        for pod in made:
            pod.start()

    def pods_of(self, workload: str) -> list[Pod]:
        return [p for p in list(self.pods.values()) if self.owner[p.name].name == workload]

    def delete_pod(self, name: str) -> None:
        """`kubectl delete pod`: graceful termination; the controller brings a replacement."""
        pod = self.pods[name]
        pod.delete(reason="kubectl delete pod")
        self._replace(pod)

    def _replace(self, pod: Pod) -> None:
        w = self.owner[pod.name]
        with self._lock:
            self.pods.pop(pod.name, None)
        if w.kind == "Deployment":
            k = self.made[w.name]
            self.made[w.name] = k + 1
            self._make(w, f"{w.name}-{k}", w.doc["spec"]["template"], {}).start()
        elif w.kind == "StatefulSet":
            self._make(w, pod.name, w.doc["spec"]["template"], {}).start()

    def _lws_restart(self, pod: Pod, container) -> None:
        w = self.owner[pod.name]
        group = next(g for g in w.groups if any(name == pod.name for name, _, _ in g))
        self.event(f"LeaderWorkerSet {w.name}: {pod.name}/{container.name} restarted; recreating its group")
        threading.Thread(target=self._recreate_group, args=(w, group), daemon=True).start()

    def _recreate_group(self, w: Workload, group: list) -> None:
        old = [self.pods[name] for name, _, _ in group if name in self.pods]
        threads = [threading.Thread(target=p.delete, kwargs={"reason": "group restart"}) for p in old]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        new = [self._make(w, name, tpl, env) for name, tpl, env in group]
        for p in new:
            p.start()

    def reconcile(self) -> None:
        """One controller pass: react to pods that failed or finished (call it often)."""
        for w in self.m.workloads:
            pods = self.pods_of(w.name)
            if w.kind == "Job":
                self._volcano(w, pods)
            elif w.kind in ("Deployment", "StatefulSet"):
                for p in pods:
                    if p.phase == "Failed":
                        self.event(f"{w.kind} {w.name}: pod {p.name} failed; replacing it")
                        p.delete(reason="failed")
                        self._replace(p)

    def _volcano(self, w: Workload, pods: list[Pod]) -> None:
        st = self.job_state.setdefault(w.name, {"phase": "Running", "retries": 0})
        if st["phase"] != "Running":
            return
        if pods and all(p.phase == "Succeeded" for p in pods):
            st["phase"] = "Completed"
            self.event(f"Volcano Job {w.name}: Completed")
            return
        failed = [p for p in pods if p.phase == "Failed"]
        if not failed:
            return
        action = w.policies.get("PodFailed") or w.policies.get("*")
        if action != "RestartJob" or st["retries"] >= w.max_retry:
            st["phase"] = "Failed"
            self.event(f"Volcano Job {w.name}: Failed ({failed[0].name} failed; action {action}, "
                       f"retries {st['retries']}/{w.max_retry})")
            for p in pods:
                p.delete(reason="job failed")
            return
        st["retries"] += 1
        self.event(f"Volcano Job {w.name}: {failed[0].name} failed -> RestartJob ({st['retries']}/{w.max_retry})")
        self._delete_pods(pods, "RestartJob")
        new = [self._make(w, name, tpl, env) for name, tpl, env in w.groups[0]]
        for p in new:
            p.start()

    def _delete_pods(self, pods: list, reason: str) -> None:
        """Delete ``pods`` together (each gracefully, as the kubelet does), then forget them."""
        threads = [threading.Thread(target=p.delete, kwargs={"reason": reason}) for p in pods]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with self._lock:
            for p in pods:
                self.pods.pop(p.name, None)

    def job_phase(self, name: str) -> str:
        return self.job_state.get(name, {}).get("phase", "Running")

    def delete_workloads(self, names: list[str]) -> None:
        """Delete the pods of the named workloads, one workload after the other, each pod
        gracefully; no replacement is made (`kubectl delete -f`)."""
        for wname in names:
            self._delete_pods(self.pods_of(wname), "workload deleted")
            self.m.workloads = [w for w in self.m.workloads if w.name != wname]

    def stop(self) -> None:
        """Delete every pod that is left, then the forwarders, the agent and moto."""
        self.delete_workloads([w.name for w in self.m.workloads])
        for f in self.forwarders:
            f.stop()
        self.agent.stop()
        self.s3.stop()
