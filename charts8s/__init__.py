"""cdk8s app of the moerl workloads: buffer, rollout workers, trainer gang, env pool, cluster objects.

`python -m charts8s.main --env dev` (or `cdk8s synth` with cdk8s.yaml) writes dist/*.k8s.yaml from
the same typed deployment config as infra/ (infra.config.load_config) and the run config
(app.config.RunConfig).
"""

from charts8s.node_banner import install as _readable_node_warnings

_readable_node_warnings()  # before any cdk8s import starts jsii's Node process
