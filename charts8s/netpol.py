"""The pods' NetworkPolicies: what each role may reach (egress) and who may reach it (ingress).

Every moerl pod is selected by an egress policy of its own role (default deny: a pod selected by a
policy with ``Egress`` among its policyTypes may open only what some rule allows; Kubernetes docs,
"Network Policies"), and by an ingress policy. The rules here are the pieces those policies are
made of, declared once:

- `dns`: CoreDNS in kube-system (UDP and TCP 53); every role resolves the cluster's names.
- `pod_identity`: the EKS Pod Identity agent on the node's link-local 169.254.170.23, port 80
  (AWS_CONTAINER_CREDENTIALS_FULL_URI), for the pods that call AWS (trainer, rollout, feed).
- `public_https`: TCP 443 outside every private range: S3 (through the VPC's gateway endpoint,
  whose addresses are S3's public prefixes) and the Hugging Face Hub (through the NAT gateway),
  for the pods that download models or read and write the store. A NetworkPolicy cannot name an
  AWS prefix list, so this cannot be narrowed to S3 alone here; the bucket policy's endpoint fence
  (infra/) is what keeps credentials from working outside the VPC.
- `pods` / `same_group`: other pods of the namespace by labels, on given ports (or all).

Ports NCCL opens: NCCL binds its listening sockets (bootstrap root and ring, the socket transport)
to port 0 unless NCCL_COMM_ID names the root's (NVIDIA/nccl src/misc/socket.cc ncclSocketListen),
and its documentation restricts them with the kernel's ``net.ipv4.ip_local_port_range`` (NCCL user
guide, "Troubleshooting: IP ports"); torch's TCPStore clients and gloo's pairs take ports the same
way. That sysctl is namespaced per pod and on the kubelet's safe list (enabled by default, allowed
by Pod Security "restricted"), so pods of the weight-update group set it to `NCCL_PORTS` and the
policies open exactly that range, plus the group's rendezvous port (``weight_sync.master_port``,
`WEIGHT_GROUP_PORT`), never torchrun's c10d port. The VPC CNI enforces a Service
only when its port is the container's (EKS user guide, network policy considerations), so every
Service here keeps port == targetPort.
"""

from __future__ import annotations

import ipaddress

from charts8s.kube import api_object

# net.ipv4.ip_local_port_range of the trainer and rollout pods: NCCL's and gloo's listening ports
# and every outbound connection's source port. 8192 ports, above every fixed port moerl listens on
# (6379, 8080, 9121, 9464, 20000, 29500, 29600, 30000); start and end of different parity, as
# the kernel prefers.
NCCL_PORTS = (49152, 57343)
# weight_sync.master_port in the cluster (unless the run config sets one): the rendezvous of the
# weight-update group on the trainer's source rank, fixed so that the policies open it alone.
WEIGHT_GROUP_PORT = 29600
PORT_RANGE_SYSCTL = "net.ipv4.ip_local_port_range"
POD_IDENTITY_AGENT = "169.254.170.23/32"  # EKS Pod Identity agent (IPv4), port 80
PRIVATE = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16", "127.0.0.0/8")
KUBE_DNS = {"k8s-app": "kube-dns"}  # the EKS CoreDNS add-on's pod labels, in kube-system


def port_range_sysctl() -> dict:
    """The pod securityContext sysctl that keeps NCCL's ports (and every ephemeral port) in `NCCL_PORTS`."""
    return {"name": PORT_RANGE_SYSCTL, "value": f"{NCCL_PORTS[0]} {NCCL_PORTS[1]}"}


def tcp(port: int, end: int | None = None) -> dict:
    """A NetworkPolicy port (``endPort``: a range, both ends included)."""
    return {"protocol": "TCP", "port": port, **({"endPort": end} if end is not None and end != port else {})}


def nccl_ports() -> list[dict]:
    return [tcp(*NCCL_PORTS)]


def dns() -> dict:
    """Egress rule: CoreDNS in kube-system, UDP and TCP 53."""
    return {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": KUBE_DNS}}],
            "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def pod_identity() -> dict:
    """Egress rule: the node's EKS Pod Identity agent (credentials for S3)."""
    return {"to": [{"ipBlock": {"cidr": POD_IDENTITY_AGENT}}], "ports": [tcp(80)]}


def public_https(vpc_cidr: str) -> dict:
    """Egress rule: TCP 443 to any address outside the private ranges and the VPC (S3, the Hub)."""
    private = list(PRIVATE)
    vpc = ipaddress.ip_network(vpc_cidr)
    if not any(vpc.subnet_of(ipaddress.ip_network(p)) for p in PRIVATE):
        private.append(vpc_cidr)
    return {"to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": private}}], "ports": [tcp(443)]}


def pods(labels: dict, ports: list[dict] | None = None, *, direction: str) -> dict:
    """An ingress (``direction="from"``) or egress (``"to"``) rule for the namespace's pods with
    ``labels``; every port when ``ports`` is None."""
    rule = {direction: [{"podSelector": {"matchLabels": labels}}]}
    if ports:
        rule["ports"] = ports
    return rule


def policy(scope, k8s, name: str, namespace: str, selects: dict, *, ingress: list[dict] | None = None,
           egress: list[dict] | None = None, labels: dict | None = None) -> None:
    """A NetworkPolicy ``name`` for the pods with labels ``selects``: ingress rules if ``ingress``
    is not None (an empty list: nothing in), egress rules if ``egress`` is not None (an empty
    list: nothing out)."""
    types, spec = [], {"podSelector": {"matchLabels": selects}}
    if ingress is not None:
        types.append("Ingress")
        spec["ingress"] = ingress
    if egress is not None:
        types.append("Egress")
        spec["egress"] = egress
    spec["policyTypes"] = types
    api_object(scope, k8s.KubeNetworkPolicy, name, namespace, labels=labels or selects, spec=spec)
