"""NetworkPolicy semantics, to ask of rendered manifests whether one connection is allowed.

As the Kubernetes documentation ("Network Policies") and the networking.k8s.io/v1 API reference
define them:

- a pod is isolated for ingress (egress) when some policy of its namespace selects it
  (``podSelector``; ``{}`` selects every pod) and lists Ingress (Egress) in ``policyTypes`` (absent:
  Ingress, plus Egress when the spec has egress rules); an isolated pod allows only what the union
  of the rules of the policies selecting it allows; replies of an allowed connection are allowed;
- a rule allows a peer when its ``from`` / ``to`` is absent or empty, or one of its peers matches:
  ``podSelector`` alone = pods of the policy's namespace, ``namespaceSelector`` (with an optional
  ``podSelector``) = pods of the selected namespaces, ``ipBlock`` = addresses in ``cidr`` and not
  in ``except`` (used here for addresses outside the cluster only); and its ``ports`` are absent
  or empty, or one matches (``protocol`` default TCP, ``port`` up to ``endPort``; a named port
  matches the destination pod's container port of that name and protocol: for ingress the
  selected pod's, for egress the peer pod's, never an address);
- a connection happens when the source's egress allows it and the destination's ingress does.

A pod's traffic to its own node is always allowed (Kubernetes docs: a pod cannot block its
resident node; the VPC CNI's agent adds the node's address to every policy, aws-network-policy-agent
PR 65). So a pod reaches a ``hostPort`` of a pod on its node through the node's address, and only
that pod's ingress decides, the source address being the pod's (`reach_host_port`).
Not modelled (the checks here never ask them): a pod's traffic to itself.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict = field(hash=False)
    # (name, containerPort, protocol, hostPort or None) of its containers' ports
    ports: tuple = field(default=(), hash=False)
    commands: tuple = field(default=(), hash=False)  # each container's command (tuple of str)

    @property
    def namespace_labels(self) -> dict:  # every namespace carries its name as a label (Kubernetes 1.22+)
        return {"kubernetes.io/metadata.name": self.namespace}


@dataclass(frozen=True)
class Address:
    """An address outside the cluster's pods (S3, the Hub, a node, the Pod Identity agent)."""

    ip: str


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; {} selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _types(spec: dict) -> list[str]:
    return spec.get("policyTypes") or (["Ingress"] + (["Egress"] if "egress" in spec else []))


def _peer(peer: dict, policy_ns: str, other) -> bool:
    if "ipBlock" in peer:
        if not isinstance(other, Address):
            return False
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return (ip in ipaddress.ip_network(block["cidr"])
                and not any(ip in ipaddress.ip_network(x) for x in block.get("except", [])))
    if not isinstance(other, Pod):
        return False
    if "namespaceSelector" in peer:
        in_ns = selects(peer["namespaceSelector"], other.namespace_labels)
    else:
        in_ns = other.namespace == policy_ns
    return in_ns and selects(peer.get("podSelector"), other.labels)


def _port(ports: list[dict] | None, port: int, protocol: str, target) -> bool:
    """Whether a rule's ``ports`` admit ``port``/``protocol`` on ``target`` (the destination pod,
    whose container ports a named port refers to; an Address has none)."""
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        if isinstance(p["port"], str):
            if isinstance(target, Pod) and any(n == p["port"] and c == port and proto == protocol
                                               for n, c, proto, _ in target.ports):
                return True
        elif p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _side(policies: list[dict], pod: Pod, other, port: int, protocol: str, kind: str) -> bool:
    key, peers = ("egress", "to") if kind == "Egress" else ("ingress", "from")
    chosen = [p for p in policies if p["metadata"].get("namespace") == pod.namespace
              and selects(p["spec"].get("podSelector"), pod.labels) and kind in _types(p["spec"])]
    if not chosen:
        return True  # not isolated
    target = other if kind == "Egress" else pod
    return any((not rule.get(peers) or any(_peer(x, p["metadata"]["namespace"], other) for x in rule[peers]))
               and _port(rule.get("ports"), port, protocol, target)
               for p in chosen for rule in p["spec"].get(key, []) or [])


def allowed(policies: list[dict], src, dst, port: int, protocol: str = "TCP") -> bool:
    """Whether ``src`` may open a connection to ``dst`` on ``port`` (each a `Pod` or an `Address`)."""
    out = _side(policies, src, dst, port, protocol, "Egress") if isinstance(src, Pod) else True
    into = _side(policies, dst, src, port, protocol, "Ingress") if isinstance(dst, Pod) else True
    return out and into


def reach_host_port(policies: list[dict], src: Pod, host: Pod, host_port: int, protocol: str = "TCP") -> bool:
    """Whether ``src`` reaches ``host_port`` of ``host``, a pod on its node, at the node's address:
    the egress to one's own node is never blocked (module doc), so ``host``'s ingress decides, for
    the container port the hostPort maps to, from ``src``'s address."""
    mapped = [c for _, c, proto, hp in host.ports if hp == host_port and proto == protocol]
    return bool(mapped) and _side(policies, host, src, mapped[0], protocol, "Ingress")


def isolated(policies: list[dict], pod: Pod, kind: str) -> bool:
    """Whether some policy selects ``pod`` for ``kind`` ("Ingress" or "Egress")."""
    return any(p["metadata"].get("namespace") == pod.namespace and selects(p["spec"].get("podSelector"), pod.labels)
               and kind in _types(p["spec"]) for p in policies)


LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER = "leaderworkerset.sigs.k8s.io/worker-index"


def _ports(spec: dict) -> tuple:
    return tuple((p.get("name"), p["containerPort"], p.get("protocol", "TCP"), p.get("hostPort"))
                 for c in spec.get("containers", []) for p in c.get("ports", []))


def _commands(spec: dict) -> tuple:
    return tuple(tuple(c.get("command", [])) + tuple(c.get("args", [])) for c in spec.get("containers", []))


POD_INDEX = "apps.kubernetes.io/pod-index"


def pods_of(docs: list[dict]) -> list[Pod]:
    """The pods the rendered workloads make, with the labels their controllers give them: the
    template's, for a StatefulSet pod its ordinal (``apps.kubernetes.io/pod-index``, the
    StatefulSet controller's label since Kubernetes 1.28), and for a LeaderWorkerSet the group's
    and worker's index and the set's name (the LWS controller's pod webhook, kubernetes-sigs/lws
    v0.10.0 pkg/webhooks/pod_webhook.go)."""
    out: list[Pod] = []
    for d in docs:
        kind, meta, spec = d["kind"], d["metadata"], d.get("spec", {})
        ns = meta.get("namespace", "default")
        if kind in ("Deployment", "StatefulSet"):
            tpl = spec["template"]
            extra = lambda i: {POD_INDEX: str(i)} if kind == "StatefulSet" else {}  # noqa: E731
            out += [Pod(f"{meta['name']}-{i}", ns, {**tpl["metadata"]["labels"], **extra(i)}, _ports(tpl["spec"]),
                        _commands(tpl["spec"])) for i in range(int(spec.get("replicas", 1)))]
        elif kind == "Job" and d["apiVersion"].startswith("batch.volcano.sh/"):
            out += [Pod(f"{meta['name']}-{t['name']}", ns, dict(t["template"]["metadata"]["labels"]),
                        _ports(t["template"]["spec"]), _commands(t["template"]["spec"])) for t in spec["tasks"]]
        elif kind == "Job":
            tpl = spec["template"]
            out.append(Pod(meta["name"], ns, dict(tpl["metadata"]["labels"]), _ports(tpl["spec"]), _commands(tpl["spec"])))
        elif kind == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            for g in range(int(spec["replicas"])):
                for w in range(int(lwt["size"])):
                    tpl = lwt["leaderTemplate"] if w == 0 else lwt["workerTemplate"]
                    labels = {**tpl["metadata"]["labels"], LWS_NAME: meta["name"], LWS_GROUP: str(g), LWS_WORKER: str(w)}
                    out.append(Pod(f"{meta['name']}-{g}" + (f"-{w}" if w else ""), ns, labels, _ports(tpl["spec"]),
                                   _commands(tpl["spec"])))
    return out


class Reach:
    """`allowed` over one set of policies, for many questions: the policies selecting each pod and
    the rules whose peers match each pair are worked out once (the same semantics)."""

    def __init__(self, policies: list[dict]):
        self.policies = policies
        self._chosen: dict = {}
        self._rules: dict = {}

    def _matching(self, pod: Pod, other, kind: str) -> list[list[dict] | None] | None:
        """The ports of ``pod``'s rules of ``kind`` whose peers match ``other``; None: not isolated."""
        key = (pod.name, pod.namespace, kind)
        if key not in self._chosen:
            self._chosen[key] = [p for p in self.policies if p["metadata"].get("namespace") == pod.namespace
                                 and selects(p["spec"].get("podSelector"), pod.labels) and kind in _types(p["spec"])]
        chosen = self._chosen[key]
        if not chosen:
            return None
        okey = (key, other.name if isinstance(other, Pod) else other.ip, getattr(other, "namespace", None))
        if okey not in self._rules:
            rule_key, peers = ("egress", "to") if kind == "Egress" else ("ingress", "from")
            self._rules[okey] = [rule.get("ports") for p in chosen for rule in p["spec"].get(rule_key, []) or []
                                 if not rule.get(peers) or any(_peer(x, p["metadata"]["namespace"], other) for x in rule[peers])]
        return self._rules[okey]

    def allowed(self, src, dst, port: int, protocol: str = "TCP") -> bool:
        if isinstance(src, Pod):
            out = self._matching(src, dst, "Egress")
            if out is not None and not any(_port(p, port, protocol, dst) for p in out):
                return False
        if isinstance(dst, Pod):
            into = self._matching(dst, src, "Ingress")
            if into is not None and not any(_port(p, port, protocol, dst) for p in into):
                return False
        return True
