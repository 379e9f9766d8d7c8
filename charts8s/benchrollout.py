"""`moerl bench rollout` in the cluster: per profile of ``bench_rollout`` (charts8s.workloads),
a fleet of SGLang engines and a Job that drives them; one file per profile, so each side of the
A/B (e.g. all-to-all vs DeepEP) is applied, read and deleted on its own.

- engines: a LeaderWorkerSet ``moerl-bench-<name>`` of ``engines`` groups of ``nodes_per_engine``
  pods (also for one node: its leader pods get stable DNS names through the controller's
  headless Service, ``moerl-bench-<name>-<i>.moerl-bench-<name>.<namespace>``), the same engine
  container as the rollout pods but serving on the pod network, with no rollout worker;
- the Job ``moerl-bench-<name>`` (CPU, env-cpu pool): ``moerl bench rollout`` against every
  leader's URL, which waits for them to answer, runs for ``seconds`` and prints aggregate
  tokens/s, tokens/s per GPU and request latency percentiles (``kubectl logs job/...``);
- NetworkPolicies (charts8s/contract.py): the engines accept the Job's requests on the engine
  port, and their own LeaderWorkerSet group's traffic.

The engines serve on the pod network, so SGLang asks for a key on every route but its health
checks (``--api-key``: generation; ``--admin-api-key``: weight updates, profiling, cache control),
read from each leader's keys file (charts8s/keys.py `keyed_engine`): the API key from the
Secret ``bench_rollout.api_key_secret`` made outside dist/ (docs/cluster.md), the admin key
derived per engine from its ``admin-api-key`` (app/rollout/keys.py); the Job holds the API key only.
"""

from __future__ import annotations

import cdk8s
from constructs import Construct

from app.names import API_KEY_ENV, CLUSTER_CONFIG
from app.rollout.engine_args import EngineLayout
from charts8s.cluster import ENV_SERVICE, run_config_volume
from charts8s.kube import api_object, k8s_module
from charts8s.lws import leader_worker_set
from charts8s.contract import BENCH_ENGINE, BENCH_JOB, bench_fleet, contract_policies
from charts8s.placement import checkov_skips, container_security, labels, on_pool, pod_security
from charts8s.keys import API_KEY, keyed_engine, keys_init_container
from charts8s.rollout import NO_PROBE_SKIPS, POD_NAME_ENV, ROLLOUT_SKIPS, UID, engine_container, engine_pod
from charts8s.workloads import Plan

WAIT_S = 3600  # how long the Job waits for the engines to load the model and answer


def engine_urls(plan: Plan, profile: str) -> list[str]:
    """The leader URL of every engine of a bench fleet (LeaderWorkerSet DNS names)."""
    name, bench = bench_fleet(profile), plan.wl.bench_rollout
    return [f"http://{name}-{i}.{name}.{plan.namespace}.svc.cluster.local:{plan.wl.rollout.engine_port}"
            for i in range(bench.engines)]


def bench_command(plan: Plan, profile: str, layout: EngineLayout) -> list[str]:
    """``moerl bench rollout`` against the fleet of `profile` (flags of app/bench/cli.py)."""
    bench = plan.wl.bench_rollout
    cmd = ["moerl", "bench", "rollout", "--config", CLUSTER_CONFIG, "--seconds", str(bench.seconds),
           "--gpus-per-engine", str(layout.gpus), "--wait-s", str(WAIT_S), "--label", profile,
           "--out-dir", "/tmp/bench"]
    if bench.concurrency:
        cmd += ["--concurrency", str(bench.concurrency)]
    for url in engine_urls(plan, profile):
        cmd += ["--url", url]
    return cmd


class BenchRolloutChart(cdk8s.Chart):
    """One profile's engine fleet, its Job and NetworkPolicy (file bench-rollout-<name>.k8s.yaml)."""

    def __init__(self, scope: Construct, plan: Plan, profile: str):
        super().__init__(scope, f"bench-rollout-{profile}")
        k8s, ns = k8s_module(plan.cfg.k8s_version), plan.namespace
        layout = plan.bench_layouts()[profile]
        name = bench_fleet(profile)
        lab = labels(name)
        secret = plan.wl.bench_rollout.api_key_secret
        # The leader serves HTTP: it asks the Job for the API key, and keeps an admin key nobody holds.
        leader = engine_pod(plan, name, [keyed_engine(engine_container(plan, layout, leader=True, host="0.0.0.0"))],
                            keys=keys_init_container(plan, secret, "$(POD_NAME)", [POD_NAME_ENV], api_key=True))
        worker = engine_pod(plan, name, [engine_container(plan, layout, leader=False, host="0.0.0.0")])
        leader_worker_set(self, name, ns, labels=lab, annotations=checkov_skips(**ROLLOUT_SKIPS, **NO_PROBE_SKIPS),
                          replicas=plan.wl.bench_rollout.engines, size=layout.nodes, leader_pod=leader,
                          worker_pod=worker)
        job_lab = labels(f"{name}-job")
        config_vol, config_mount = run_config_volume()
        res = {"cpu": "2", "memory": "4Gi"}
        pod = {
            **on_pool(plan.pool("env-cpu"), spot=True),
            "serviceAccountName": ENV_SERVICE,  # no AWS access needed
            "automountServiceAccountToken": False,
            "securityContext": pod_security(UID),
            "restartPolicy": "Never",
            "containers": [{
                "name": "bench", "image": plan.images["rollout"], "imagePullPolicy": "IfNotPresent",
                "command": bench_command(plan, profile, layout),
                "env": [{"name": API_KEY_ENV, "valueFrom": {"secretKeyRef": {
                    "name": plan.wl.bench_rollout.api_key_secret, "key": API_KEY}}}],
                "resources": {"requests": res, "limits": res},
                "securityContext": container_security(),
                "volumeMounts": [config_mount, {"name": "tmp", "mountPath": "/tmp"}],
            }],
            "volumes": [config_vol, {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
        }
        api_object(self, k8s.KubeJob, name, ns, labels=job_lab, annotations=checkov_skips(
            CKV_K8S_43=ROLLOUT_SKIPS["CKV_K8S_43"], CKV_K8S_15=ROLLOUT_SKIPS["CKV_K8S_15"],
            CKV_K8S_8="a benchmark Job serves no endpoint and runs to completion",
            CKV_K8S_9="a benchmark Job serves no endpoint and runs to completion",
            CKV_K8S_35="the engines' API key is a bearer token read once from the environment at start",
        ), spec={"backoffLimit": 0, "ttlSecondsAfterFinished": 86400,
                 "template": {"metadata": {"labels": job_lab}, "spec": pod}})
        # The engines take the Job's requests and their own group's traffic; out: the model (S3, Hub).
        # The Job only dials out: to the engines, and HTTPS for the run's tokenizer.
        contract_policies(self, k8s, plan, [BENCH_ENGINE.format(p=profile), BENCH_JOB.format(p=profile)])
