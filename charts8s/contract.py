"""Who talks to whom in the cluster, on which port: the ONE table (docs/ARCHITECTURE.md, "Who talks
to whom", is printed from it by ``python -m charts8s.contract``).

Every NetworkPolicy of dist/ is made from `TABLE` (charts8s/netpol.py `contract_policies`), and
tests/test_recipe_matrix.py asks the rendered policies of every shipped recipe, with every option
combination, whether each pair of pods may connect on each port: a pair the table names must be
allowed, any other denied (tests/netpolicy.py evaluates Kubernetes' semantics). The same table
names what the ops manifests (charts8s/monitoring.py) and infra/ (the DCGM host engine's policy)
open from outside the namespace.

A party is a process of the run, wherever it lives; `selector` says which pods carry it, once:

- ``worker``: the rollout worker (``moerl rollout``). Beside its engine in the engine's pod for
  one-node engines, a pod of the ``moerl-rollout-worker`` StatefulSet for multi-node engines;
- ``engine``: every SGLang node rank of the run's engines; ``engine-http`` the ranks that serve
  HTTP (a multi-node engine's leader); ``fetcher``: a multi-node engine's pods (each puts the
  policy versions on its node's disk and reads the buffer);
- ``trainer`` every trainer rank's pod, ``trainer-0`` replica 0 (global rank 0, the source rank
  of the weight-update groups);
- ``bench-engine:<profile>`` and ``bench-job:<profile>``: a `moerl bench rollout` fleet and its Job;
- outside the namespace: ``dns`` (CoreDNS), ``pod-identity`` (the node's EKS Pod Identity agent),
  ``https`` (TCP 443 outside the private ranges: S3 through the gateway endpoint, the Hub through
  the NAT gateway; a NetworkPolicy can name neither an AWS prefix list nor a host name, so S3 and
  the Hub are one party here), ``prometheus`` (the monitoring namespace), ``health`` (the
  moerl-health namespace: the DCGM diagnostics and node-health pods), ``dcgm`` (the node's DCGM
  host engine, port 5555 through its hostPort).

`pair` ties a row to one peer: ``same-group`` (the pods of one LeaderWorkerSet group, i.e. one
multi-node engine), ``own-engine`` (worker pod i and engine i's leader).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from app.names import METRICS_PORT
from charts8s.cluster import (BUFFER_SERVICE, ENV_SERVICE, FEED, REDIS_EXPORTER_PORT, REDIS_PORT, REWARD_MODEL_SERVICE,
                              ROLLOUT, ROLLOUT_WORKER, ROUTER, TRAINER, WEIGHT_SOURCE_LABEL, weight_group_port)
from charts8s.fsx import fsx_model_path
from charts8s.lws import ROLE_LABEL
from charts8s.netpol import NCCL_PORTS, dns, pod_identity, policy, public_https
from charts8s.placement import APP_LABEL, labels
from charts8s.workloads import Plan
from infra.addons import DCGM_HOSTENGINE_PORT
from infra.charts import HEALTH_NAMESPACE, MONITORING_NAMESPACE
# Parties (module doc).
WORKER, ENGINE, ENGINE_HTTP, FETCHER = "worker", "engine", "engine-http", "fetcher"
TRAINER_RANKS, SOURCE = "trainer", "trainer-0"
BUFFER, ENV, REWARD, FEED_POD, ROUTER_POD = "buffer", "env", "reward-model", "feed", "router"
BENCH_ENGINE, BENCH_JOB = "bench-engine:{p}", "bench-job:{p}"
DNS, POD_IDENTITY, HTTPS, PROMETHEUS, HEALTH, DCGM = "dns", "pod-identity", "https", "prometheus", "health", "dcgm"
OUTSIDE = (DNS, POD_IDENTITY, HTTPS, PROMETHEUS, HEALTH, DCGM)
# The pods of a component, by its label (the scrape targets: a pod that serves no metrics refuses).
COMPONENT = "component:"

LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # set on every pod of a group by the LWS controller
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"  # (kubernetes-sigs/lws api/leaderworkerset/v1)
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # a StatefulSet pod's ordinal (the controller's label)


@dataclass(frozen=True)
class Row:
    """``src`` may open connections to ``dst`` on ``ports`` when ``when`` holds (keys of `PORTS`
    and `WHEN`), tied to one peer by ``pair``; ``why`` says what uses it."""

    src: str
    dst: str
    ports: str
    when: str = "always"
    pair: str | None = None
    why: str = ""


TABLE: tuple[Row, ...] = (
    Row(TRAINER_RANKS, TRAINER_RANKS, "all", why="torchrun's c10d rendezvous, NCCL and gloo between ranks"),
    Row(TRAINER_RANKS, BUFFER, "redis", why="samples, stats, the weight-update board"),
    Row(TRAINER_RANKS, DNS, "dns"),
    Row(TRAINER_RANKS, POD_IDENTITY, "pod-identity", why="S3 credentials"),
    Row(TRAINER_RANKS, HTTPS, "https", why="training state and policy versions (S3); a Hub base model"),
    Row(SOURCE, ENGINE, "nccl", "network", why="the weight-update groups: NCCL's ring and transport"),
    Row(ENGINE, SOURCE, "weight-group", "network", why="the groups' rendezvous and NCCL's ring and transport"),
    Row(ENGINE, ENGINE, "nccl", "groups-span-engines",
        why="a group of several engines (weight_sync.engines_per_group 0 or > 1): NCCL connects consecutive ranks"),
    Row(ENGINE, ENGINE, "all", "multi-node", "same-group", why="one engine's node ranks: torch.distributed, NCCL"),
    Row(ENGINE, DNS, "dns"),
    Row(ENGINE, POD_IDENTITY, "pod-identity", "engine-downloads", why="the base model's copy from S3"),
    Row(ENGINE, HTTPS, "https", "engine-downloads", why="the base model (S3 copy, or SGLang's Hub download)"),
    Row(FETCHER, BUFFER, "redis", "multi-node", why="the version to fetch, the pause to mirror"),
    Row(FETCHER, POD_IDENTITY, "pod-identity", "multi-node"),
    Row(FETCHER, HTTPS, "https", "multi-node", why="policy versions from S3"),
    Row(FETCHER, DNS, "dns", "multi-node"),
    Row(WORKER, BUFFER, "redis", why="task leases, samples, the weight-update board"),
    Row(WORKER, ENV, "env", "env-pool", why="environment episodes or the verifier"),
    Row(WORKER, REWARD, "reward", "reward-model", why="learned rewards"),
    Row(WORKER, ROUTER_POD, "router", "router", why="/generate through the router"),
    Row(WORKER, ENGINE_HTTP, "engine", "multi-node", "own-engine", why="its own engine's control and weight routes"),
    Row(WORKER, DNS, "dns"),
    Row(WORKER, POD_IDENTITY, "pod-identity", why="S3 credentials"),
    Row(WORKER, HTTPS, "https", why="policy versions (S3); a Hub tokenizer"),
    Row(ROUTER_POD, ENGINE_HTTP, "engine", "router", why="the engines behind the router"),
    Row(ROUTER_POD, DNS, "dns", "router"),
    Row(FEED_POD, BUFFER, "redis", why="tasks, the done marker"),
    Row(FEED_POD, DNS, "dns"),
    Row(FEED_POD, POD_IDENTITY, "pod-identity", why="S3 credentials"),
    Row(FEED_POD, HTTPS, "https", why="the dataset, policy versions, the model of its evaluation engine"),
    Row(ENV, DNS, "dns", "env-pool"),
    Row(REWARD, DNS, "dns", "reward-model"),
    Row(REWARD, HTTPS, "https", "reward-model-download", why="the reward model from the Hub"),
    Row(BENCH_JOB, BENCH_ENGINE, "engine", "bench", why="`moerl bench rollout` drives its fleet"),
    Row(BENCH_JOB, DNS, "dns", "bench"),
    Row(BENCH_JOB, HTTPS, "https", "bench", why="the run's tokenizer"),
    Row(BENCH_ENGINE, BENCH_ENGINE, "all", "bench-multi-node", "same-group", why="one engine's node ranks"),
    Row(BENCH_ENGINE, DNS, "dns", "bench"),
    Row(BENCH_ENGINE, POD_IDENTITY, "pod-identity", "bench"),
    Row(BENCH_ENGINE, HTTPS, "https", "bench", why="the base model"),
    # From outside the namespace: the ops manifests (charts8s/monitoring.py) and infra/ render these.
    Row(PROMETHEUS, COMPONENT + TRAINER, "metrics", why="trainer rank 0's figures"),
    Row(PROMETHEUS, COMPONENT + ROLLOUT, "metrics", why="the workers beside one-node engines"),
    Row(PROMETHEUS, COMPONENT + ROLLOUT_WORKER, "metrics", why="the workers of multi-node engines"),
    Row(PROMETHEUS, COMPONENT + BUFFER_SERVICE, "exporter", why="the Redis exporter"),
    Row(PROMETHEUS, COMPONENT + ROUTER, "router-metrics", "router", why="the router's figures"),
    Row(PROMETHEUS, DCGM, "dcgm", why="the DCGM exporter reads the node's host engine"),
    Row(HEALTH, DCGM, "dcgm", why="DCGM diagnostics (the health-check Job, the node-health agent)"),
)

# Port keys: what each opens (docs: the legend under the table).
PORT_DOC = {
    "all": "every port", "dns": "UDP and TCP 53", "redis": f"{REDIS_PORT}", "https": "443", "pod-identity": "80",
    "env": "workloads env.port", "reward": "workloads reward_model.port", "engine": "workloads rollout.engine_port",
    "router": "workloads rollout.router_port", "router-metrics": "workloads rollout.router_metrics_port",
    "metrics": f"{METRICS_PORT}", "exporter": f"{REDIS_EXPORTER_PORT}", "dcgm": f"{DCGM_HOSTENGINE_PORT}",
    "nccl": f"NCCL's range {NCCL_PORTS[0]}-{NCCL_PORTS[1]} (the pods' ip_local_port_range)",
    "weight-group": "weight_sync.master_port and NCCL's range",
}
WHEN_DOC = {
    "always": "every render",
    "network": "weight_sync.mode network",
    "groups-span-engines": "network, and weight_sync.engines_per_group 0 or > 1 with more than one engine",
    "multi-node": "rollout.engine.nodes_per_engine > 1",
    "engine-downloads": "the base model is an s3:// copy (no FSx) or a Hub id",
    "env-pool": "the env pool is rendered (no env.url of the user's)",
    "reward-model": "task.reward_model is set",
    "reward-model-download": "task.reward_model is a Hub id",
    "router": "rollout.router",
    "bench": "workloads bench_rollout",
    "bench-multi-node": "a bench profile of more than one node per engine",
}


def _hub_id(path: str | None) -> bool:
    return bool(path) and not path.startswith(("s3://", "/", "."))


def applies(plan: Plan, when: str, profile: str | None = None) -> bool:
    """Whether condition ``when`` (a `WHEN_DOC` key) holds for the render of ``plan``."""
    run, wl = plan.run, plan.wl
    model = wl.rollout.model_path or run.model.path
    if when == "always":
        return True
    if when == "network":
        return run.weight_sync.mode == "network"
    if when == "groups-span-engines":
        return run.weight_sync.mode == "network" and run.weight_sync.engines_per_group != 1 and plan.rollout_replicas > 1
    if when == "multi-node":
        return plan.engine.nodes > 1
    if when == "engine-downloads":
        return _hub_id(model) or (model.startswith("s3://") and not fsx_model_path(plan, model))
    if when == "env-pool":
        return not (run.env.name and run.env.url)
    if when == "reward-model":
        return bool(run.task.reward_model)
    if when == "reward-model-download":
        return _hub_id(run.task.reward_model)
    if when == "router":
        return run.rollout.router
    if when == "bench":
        return wl.bench_rollout is not None
    if when == "bench-multi-node":
        return profile is not None and plan.bench_layouts()[profile].nodes > 1
    raise KeyError(when)


def _tcp(port: int) -> list[dict]:
    return [{"protocol": "TCP", "port": port}]


NCCL = [{"protocol": "TCP", "port": NCCL_PORTS[0], "endPort": NCCL_PORTS[1]}]
FIXED_PORTS = {  # the port keys that no setting moves
    "dns": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}], "redis": _tcp(REDIS_PORT),
    "https": _tcp(443), "pod-identity": _tcp(80), "metrics": _tcp(METRICS_PORT), "exporter": _tcp(REDIS_EXPORTER_PORT),
    "dcgm": _tcp(DCGM_HOSTENGINE_PORT), "nccl": NCCL,
}


def ports(plan: Plan | None, key: str) -> list[dict] | None:
    """The NetworkPolicy ports of port key ``key`` (None: every port); ``plan`` may be None for
    the keys of `FIXED_PORTS`."""
    if key == "all":
        return None
    if key in FIXED_PORTS:
        return FIXED_PORTS[key]
    wl = plan.wl
    return {"env": _tcp(wl.env.port), "reward": _tcp(wl.reward_model.port), "engine": _tcp(wl.rollout.engine_port),
            "router": _tcp(wl.rollout.router_port), "router-metrics": _tcp(wl.rollout.router_metrics_port),
            "weight-group": _tcp(weight_group_port(plan.run)) + NCCL}[key]


def rows(plan: Plan) -> list[Row]:
    """The rows that hold for the render of ``plan``, bench rows once per profile (``{p}`` filled in)."""
    out = []
    profiles = list(plan.bench_layouts())
    for r in TABLE:
        if "{p}" in r.src + r.dst:
            out += [Row(r.src.format(p=p), r.dst.format(p=p), r.ports, r.when, r.pair, r.why)
                    for p in profiles if applies(plan, r.when, p)]
        elif applies(plan, r.when):
            out.append(r)
    return out


def bench_fleet(profile: str) -> str:
    return f"moerl-bench-{profile}"


def selector(plan: Plan, party: str) -> dict[str, str]:
    """The labels of the pods that carry ``party`` in the render of ``plan`` (the one definition)."""
    multi = plan.engine.nodes > 1
    if party.startswith(COMPONENT):
        return labels(party.removeprefix(COMPONENT))
    if party.startswith("bench-engine:"):
        return labels(bench_fleet(party.split(":", 1)[1]))
    if party.startswith("bench-job:"):
        return labels(f"{bench_fleet(party.split(':', 1)[1])}-job")
    return {
        TRAINER_RANKS: labels(TRAINER),
        SOURCE: {**labels(TRAINER), WEIGHT_SOURCE_LABEL: "true"},
        ENGINE: labels(ROLLOUT),
        FETCHER: labels(ROLLOUT),
        ENGINE_HTTP: {**labels(ROLLOUT), ROLE_LABEL: "leader"} if multi else labels(ROLLOUT),
        WORKER: labels(ROLLOUT_WORKER) if multi else labels(ROLLOUT),
        BUFFER: labels(BUFFER_SERVICE),
        ENV: labels(ENV_SERVICE),
        REWARD: labels(REWARD_MODEL_SERVICE),
        FEED_POD: labels(FEED),
        ROUTER_POD: labels(ROUTER),
    }[party]


NS_LABEL = "kubernetes.io/metadata.name"  # every namespace carries its name as a label (Kubernetes 1.22+)


def peers(plan: Plan, party: str) -> list[dict]:
    """The NetworkPolicy peers of ``party`` (``to`` or ``from`` entries)."""
    if party == DNS:
        return dns()["to"]
    if party == POD_IDENTITY:
        return pod_identity()["to"]
    if party == HTTPS:
        return public_https(plan.cfg.vpc_cidr)["to"]
    if party in (PROMETHEUS, HEALTH):
        ns = MONITORING_NAMESPACE if party == PROMETHEUS else HEALTH_NAMESPACE
        return [{"namespaceSelector": {"matchLabels": {NS_LABEL: ns}}}]
    return [{"podSelector": {"matchLabels": selector(plan, party)}}]


def _rule(direction: str, to: list[dict], port_list: list[dict] | None) -> dict:
    return {direction: to, **({"ports": port_list} if port_list else {})}


def policy_name(sel: dict[str, str]) -> str:
    """A policy's name from the selector it selects by: the component, then what narrows it."""
    name = sel[APP_LABEL]
    if sel.get(WEIGHT_SOURCE_LABEL):
        name += "-weight-source"
    if ROLE_LABEL in sel:
        name += f"-{sel[ROLE_LABEL]}"
    return name


def _groups(plan: Plan, party: str) -> int:
    """The LeaderWorkerSet groups (engines) of the fleet of engine ``party``."""
    return plan.wl.bench_rollout.engines if party.startswith("bench-engine:") else plan.rollout_replicas


def contract_policies(scope, k8s, plan: Plan, parties: list[str]) -> None:
    """The NetworkPolicies that make `TABLE` hold for the pods of ``parties``: one per distinct
    selector (the parties one pod carries share it), isolating its pods both ways and allowing
    the rows' connections out of and into them; for a row tied to one peer, a policy per engine
    (``same-group``: the group's pods to each other; ``own-engine``: worker i out to engine i's
    leader, and that leader in from worker i only). Rows from outside the namespace are the ops
    manifests' and infra/'s. A party of a narrower selector than its component's (``trainer-0``,
    ``engine-http`` of multi-node engines) gets a policy only where rows name it."""
    ns, table = plan.namespace, rows(plan)
    by_selector: dict[tuple, list[str]] = {}
    for party in parties:
        by_selector.setdefault(tuple(sorted(selector(plan, party).items())), []).append(party)
    for key, mine in by_selector.items():
        sel = dict(key)
        egress, ingress = [], []
        for r in table:
            if r.pair:
                continue
            if r.src in mine:
                egress.append(_rule("to", peers(plan, r.dst), ports(plan, r.ports)))
            if r.dst in mine and r.src not in OUTSIDE:
                ingress.append(_rule("from", peers(plan, r.src), ports(plan, r.ports)))
        # A component's policy isolates its pods both ways even with no rule; a narrower selector
        # (trainer-0, a group's leaders) only adds what its rows allow.
        if ingress or egress or sel == labels(sel[APP_LABEL]):
            policy(scope, k8s, policy_name(sel), ns, sel, ingress=_unique(ingress), egress=_unique(egress))
    for r in table:
        if r.pair == "same-group" and r.src in parties:
            sel = selector(plan, r.src)
            fleet = sel[APP_LABEL]
            for g in range(_groups(plan, r.src)):
                group = {**sel, LWS_NAME_LABEL: fleet, LWS_GROUP_LABEL: str(g)}
                policy(scope, k8s, f"{fleet}-group-{g}", ns, group, labels=sel,
                       ingress=[_rule("from", [{"podSelector": {"matchLabels": group}}], ports(plan, r.ports))],
                       egress=[_rule("to", [{"podSelector": {"matchLabels": group}}], ports(plan, r.ports))])
        elif r.pair == "own-engine":
            src, dst = selector(plan, r.src), selector(plan, r.dst)
            for i in range(plan.rollout_replicas):
                worker = {**src, POD_INDEX_LABEL: str(i)}
                leader = {**dst, LWS_GROUP_LABEL: str(i)}
                if r.src in parties:
                    policy(scope, k8s, f"{policy_name(src)}-{i}", ns, worker, labels=src,
                           egress=[_rule("to", [{"podSelector": {"matchLabels": leader}}], ports(plan, r.ports))])
                if r.dst in parties:
                    policy(scope, k8s, f"{policy_name(dst)}-{i}", ns, leader, labels=dst,
                           ingress=[_rule("from", [{"podSelector": {"matchLabels": worker}}], ports(plan, r.ports))])


def _unique(rules: list[dict]) -> list[dict]:
    """``rules`` with the peers of rules on the same ports in one rule, each peer once."""
    out: list[dict] = []
    for rule in rules:
        (direction,) = [k for k in rule if k != "ports"]
        same = next((o for o in out if o.get("ports") == rule.get("ports")), None)
        if same is None:
            out.append({direction: list(rule[direction]), **({"ports": rule["ports"]} if "ports" in rule else {})})
        else:
            same[direction] += [p for p in rule[direction] if p not in same[direction]]
    return out


def markdown() -> str:
    """The table as docs/ARCHITECTURE.md prints it, with the legends of its port and condition keys."""
    lines = ["| from | to | ports | when | peer | what for |", "| --- | --- | --- | --- | --- | --- |"]
    for r in TABLE:
        lines.append(f"| {r.src} | {r.dst} | {r.ports} | {r.when} | {r.pair or ''} | {r.why} |")
    lines += ["", "| port key | opens |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in PORT_DOC.items()]
    lines += ["", "| condition | holds when |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in WHEN_DOC.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
