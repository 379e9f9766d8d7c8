"""Cluster-facing names the runtime (app/) and the manifests (charts8s/) must agree on: ports,
environment variable names, mount paths. One definition each; this module imports nothing, so
charts8s reads them without loading what the roles run on (prometheus_client, httpx, torchx).
"""

# Prometheus /metrics of every moerl process that serves one (trainer rank 0, the rollout workers:
# app/metrics.py, `--metrics-port`); charts8s/monitoring.py scrapes it.
METRICS_PORT = 9464

# The role's Redis password and ACL user (app/buffer/experience.py, app/buffer/acl.py); with no
# user set a role connects as "default".
PASSWORD_ENV = "MOERL_REDIS_PASSWORD"
USER_ENV = "MOERL_REDIS_USER"

# Where a worker or the bench reads an engine's SGLang keys (the pods' Secret references,
# charts8s/rollout.py; app/rollout/engine_client.py sends them).
API_KEY_ENV = "MOERL_ENGINE_API_KEY"
ADMIN_API_KEY_ENV = "MOERL_ENGINE_ADMIN_API_KEY"
# The file holding a worker's own engine's keys (app/rollout/keys.py writes it; SGLang reads the
# same YAML as its --config), and the router's two keys (app/rollout/router.py).
ENGINE_KEYS_FILE_ENV = "MOERL_ENGINE_KEYS_FILE"
ROUTER_API_KEY_ENV = "MOERL_ROUTER_API_KEY"
ROUTER_CONTROL_KEY_ENV = "MOERL_ROUTER_CONTROL_KEY"

# Where every cluster pod finds the run config (the ConfigMap is mounted here: charts8s/cluster.py).
CLUSTER_CONFIG = "/etc/moerl/run.yaml"
