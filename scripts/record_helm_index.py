"""Refresh tests/data/helm-index/: the chart repository index entries the pins in infra/charts.py
are checked against (tests/test_infra_charts.py).

    .venv/bin/python scripts/record_helm_index.py        # needs internet; rewrites the files

For each classic repository it downloads <repository>/index.yaml and keeps, for the pinned chart,
every entry's name, version, appVersion, kubeVersion, created, digest and urls. For an OCI
repository (oci://host/path/chart) it reads the registry's tag list (OCI distribution API,
GET /v2/<path>/tags/list, anonymous token when the registry asks for one). Each file records the
date and the URL it came from. Review the diff, then move a pin in infra/charts.py.
"""

from __future__ import annotations

import datetime
import json
import sys
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from infra.charts import HELM_CHARTS  # noqa: E402

OUT = ROOT / "tests" / "data" / "helm-index"
FIELDS = ("name", "version", "appVersion", "kubeVersion", "created", "digest", "urls")


def _get(url: str, headers: dict | None = None) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "moerl-record-helm-index", **(headers or {})})
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def classic(repository: str, chart: str) -> dict:
    url = repository.rstrip("/") + "/index.yaml"
    index = yaml.safe_load(_get(url))
    entries = [{k: e[k] for k in FIELDS if k in e} for e in index["entries"][chart]]
    return {"source": url, "generated": str(index.get("generated", "")), "entries": {chart: entries}}


def oci(repository: str, chart: str) -> dict:
    host, _, path = repository.removeprefix("oci://").partition("/")
    url = f"https://{host}/v2/{path}/tags/list"
    try:
        body = _get(url)
    except urllib.error.HTTPError as e:  # token flow: WWW-Authenticate: Bearer realm=...,service=...,scope=...
        if e.code != 401:
            raise
        params = dict(p.split("=", 1) for p in e.headers["WWW-Authenticate"].removeprefix("Bearer ").split(","))
        params = {k: v.strip('"') for k, v in params.items()}
        token = json.loads(_get(f"{params['realm']}?service={params['service']}&scope={params['scope']}"))["token"]
        body = _get(url, {"Authorization": f"Bearer {token}"})
    tags = json.loads(body)["tags"]
    return {"source": url, "entries": {chart: [{"name": chart, "version": t} for t in tags]}}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    today = datetime.date.today().isoformat()
    for repository, chart, _ in HELM_CHARTS:
        data = oci(repository, chart) if repository.startswith("oci://") else classic(repository, chart)
        data = {"recorded": today, "repository": repository, **data}
        (OUT / f"{chart}.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        print(f"{chart}: {len(data['entries'][chart])} entries from {data['source']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
