"""Read synthesized manifests (dist/*.k8s.yaml) into the objects the replica runs.

Workloads are expanded into pods the way their controllers name and configure them:
- Deployment: ``<name>-<k>`` (k counts every pod the Deployment ever made, so a replacement
  gets a new name, as a ReplicaSet's random suffix does);
- StatefulSet: ``<name>-<ordinal>``, with a persistent claim per (volumeClaimTemplate, pod);
- Volcano Job (batch.volcano.sh/v1alpha1): ``<job>-<task>-<index>``, the env plugin's
  ``VK_TASK_INDEX`` / ``VC_TASK_INDEX``, job policies (``RestartJob`` on ``PodFailed``);
- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1): group g's leader ``<name>-<g>`` and workers
  ``<name>-<g>-<w>``, with ``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``
  (the LWS API doc's environment), restarted as a group.
Any other kind that carries pods is an error, so a new workload kind cannot be skipped silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

# Kinds that hold no pods and need nothing from the replica beyond what is read below.
PASSIVE_KINDS = {"Namespace", "ServiceAccount", "PriorityClass", "ResourceQuota", "LimitRange", "StorageClass",
                 "NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor", "PodMonitor", "Role", "RoleBinding"}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "Job", "LeaderWorkerSet", "DaemonSet", "ReplicaSet", "Pod", "CronJob"}


class ManifestError(ValueError):
    """A manifest the replica cannot run; the message names the object and the field."""


@dataclass
class Workload:
    """One pod-owning object.

    Attributes:
        kind, name, namespace: the object.
        groups: pod groups; each group is a list of (pod name, pod template, extra env). A
            Deployment or StatefulSet has one pod per group; a Volcano Job one group holding
            every task's pods (the gang); a LeaderWorkerSet one group per leader.
        restart: "pod" (replace a deleted pod alone), "job" (Volcano: RestartJob restarts the
            gang), "group" (LWS: RecreateGroupOnPodRestart).
        max_retry: Volcano ``maxRetry``.
        policies: Volcano job policies ``{event: action}``.
    """

    kind: str
    name: str
    namespace: str
    groups: list[list[tuple[str, dict, dict]]]
    restart: str = "pod"
    max_retry: int = 0
    policies: dict[str, str] = field(default_factory=dict)
    doc: dict = field(default_factory=dict)  # the object as synthesized


@dataclass
class Manifests:
    """Everything in a dist/ directory the replica acts on."""

    workloads: list[Workload]
    services: list[dict]
    config_maps: dict[str, dict]  # name -> data
    secret_refs: set[str]  # Secret names the pods reference (none is in dist/)
    namespace: str
    other_kinds: list[str]


def load_docs(dist: str | Path) -> list[dict]:
    """Every object of ``dist/*.k8s.yaml``.

    Raises:
        FileNotFoundError: no manifest file in ``dist``.
    """
    files = sorted(Path(dist).glob("*.k8s.yaml"))
    if not files:
        raise FileNotFoundError(f"{dist}: no *.k8s.yaml manifests (synthesize with python -m charts8s.main)")
    docs = []
    for f in files:
        docs += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return docs


def _template(obj: dict, *path: str) -> dict:
    node = obj
    for key in path:
        if not isinstance(node, dict) or key not in node:
            raise ManifestError(f"{obj['kind']}/{obj['metadata']['name']}: no {'.'.join(path)}")
        node = node[key]
    return node


def expand(doc: dict, made: dict[str, int] | None = None) -> Workload | None:
    """The `Workload` of one object, or None for an object without pods.

    Args:
        made: Deployment name -> pods made so far (names the next pods; updated).

    Raises:
        ManifestError: a pod-owning kind the replica does not run (named).
    """
    kind, meta = doc["kind"], doc["metadata"]
    name, ns = meta["name"], meta.get("namespace", "default")
    spec = doc.get("spec", {})
    if kind == "Deployment":
        made = {} if made is None else made
        tpl = _template(doc, "spec", "template")
        groups = []
        for _ in range(int(spec.get("replicas", 1))):
            k = made.get(name, 0)
            made[name] = k + 1
            groups.append([(f"{name}-{k}", tpl, {})])
        return Workload(kind, name, ns, groups)
    if kind == "StatefulSet":
        tpl = _template(doc, "spec", "template")
        return Workload(kind, name, ns, [[(f"{name}-{i}", tpl, {})] for i in range(int(spec.get("replicas", 1)))])
    if kind == "Job" and doc["apiVersion"].startswith("batch.volcano.sh/"):
        gang = []
        for task in _template(doc, "spec", "tasks"):
            for i in range(int(task.get("replicas", 1))):
                env = {"VK_TASK_INDEX": str(i), "VC_TASK_INDEX": str(i)}  # Volcano's env plugin
                gang.append((f"{name}-{task['name']}-{i}", task["template"], env))
        policies = {p["event"]: p["action"] for p in spec.get("policies", []) if "event" in p}
        return Workload(kind, name, ns, [gang], restart="job", max_retry=int(spec.get("maxRetry", 3)),
                        policies=policies)
    if kind == "LeaderWorkerSet":
        lwt = _template(doc, "spec", "leaderWorkerTemplate")
        size = int(lwt.get("size", 1))
        worker = _template(doc, "spec", "leaderWorkerTemplate", "workerTemplate")
        leader = lwt.get("leaderTemplate") or worker
        groups = []
        for g in range(int(spec.get("replicas", 1))):
            lead = f"{name}-{g}"
            base = {"LWS_LEADER_ADDRESS": f"{lead}.{name}.{ns}", "LWS_GROUP_SIZE": str(size)}
            pods = [(lead, leader, {**base, "LWS_WORKER_INDEX": "0"})]
            pods += [(f"{lead}-{w}", worker, {**base, "LWS_WORKER_INDEX": str(w)}) for w in range(1, size)]
            groups.append(pods)
        return Workload(kind, name, ns, groups, restart="group")
    if kind in WORKLOAD_KINDS:
        raise ManifestError(f"{kind}/{name}: the replica does not run this kind of workload")
    return None


def read_manifests(dist: str | Path) -> Manifests:
    """Read dist/ into workloads, Services, ConfigMaps and the Secret names pods need.

    Raises:
        FileNotFoundError: no manifests.
        ManifestError: a workload kind the replica cannot run, or objects in several namespaces.
    """
    docs = load_docs(dist)
    made: dict[str, int] = {}
    workloads, services, cms, others = [], [], {}, []
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in ("Namespace", "PriorityClass", "StorageClass")}
    namespaces.discard(None)
    if len(namespaces) > 1:
        raise ManifestError(f"objects in several namespaces {sorted(namespaces)}: the replica runs one")
    for d in docs:
        w = expand(d, made)
        if w is not None:
            w.doc = d
            workloads.append(w)
        elif d["kind"] == "Service":
            services.append(d)
        elif d["kind"] == "ConfigMap":
            cms[d["metadata"]["name"]] = d.get("data", {})
        elif d["kind"] not in PASSIVE_KINDS:
            others.append(f"{d['kind']}/{d['metadata']['name']}")
    refs: set[str] = set()
    for w in workloads:
        for group in w.groups:
            for _, tpl, _ in group:
                refs |= secret_names(tpl["spec"])
    return Manifests(workloads, services, cms, refs, namespaces.pop() if namespaces else "default", others)


def secret_names(pod: dict) -> set[str]:
    """Secrets a pod spec references (env valueFrom, envFrom, volumes)."""
    out = set()
    for c in pod.get("containers", []) + pod.get("initContainers", []):
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                out.add(ref["name"])
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                out.add(e["secretRef"]["name"])
    for v in pod.get("volumes", []):
        if "secret" in v:
            out.add(v["secret"]["secretName"])
    return out


def secret_keys(manifests: "Manifests") -> dict[str, set[str]]:
    """Secret name -> the keys the pods read from it by ``secretKeyRef`` (what an operator puts in
    the Secrets made outside dist/: the buffer's one password per Redis user)."""
    out: dict[str, set[str]] = {name: set() for name in manifests.secret_refs}
    for w in manifests.workloads:
        for group in w.groups:
            for _, tpl, _ in group:
                for c in tpl["spec"].get("containers", []) + tpl["spec"].get("initContainers", []):
                    for e in c.get("env", []):
                        ref = e.get("valueFrom", {}).get("secretKeyRef")
                        if ref:
                            out.setdefault(ref["name"], set()).add(ref["key"])
    return out


def selects(selector: dict, labels: dict) -> bool:
    """Whether a Service's (equality) selector matches pod labels; an empty selector matches nothing."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())
