"""The Helm charts infra/ installs are pinned to versions their repositories publish (issue 15 item 2).

Each pin in infra/charts.py must be an entry of the repository index recorded in
tests/data/helm-index/<chart>.yaml (date and source in each file; scripts/record_helm_index.py
refreshes them), and the entry's kubeVersion constraint must admit every environment's
Kubernetes version. No synth here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from infra.charts import HELM_CHARTS, LWS
from infra.config import ENVS, load_config

ROOT = Path(__file__).resolve().parents[1]
INDEX = ROOT / "tests" / "data" / "helm-index"


def recorded(chart: str) -> dict:
    return yaml.safe_load((INDEX / f"{chart}.yaml").read_text())


def _version(v: str) -> tuple[int, ...]:
    # "1.36", "v1.25.0-0", "1.19.0-0" -> numeric release part
    return tuple(int(x) for x in re.match(r"^v?(\d+(?:\.\d+)*)", v.strip()).group(1).split("."))


def admits(constraint: str, version: str) -> bool:
    """Whether a Helm kubeVersion constraint ('>=1.25.0-0', '>= 1.19.0-0 <1.40') admits `version`.

    Only the comparison operators the recorded charts use (>=, >, <=, <, =); an unknown form
    raises ValueError so a new constraint shape is noticed, not passed.
    """
    want = _version(version)
    for token in re.split(r"[\s,]+", re.sub(r"(>=|<=|>|<|=)\s+", r"\1", constraint.strip())):
        m = re.fullmatch(r"(>=|<=|>|<|=)?(v?\d[\w.+-]*)", token)
        if not m:
            raise ValueError(f"kubeVersion {constraint!r}: {token!r} not handled")
        op, have = m.group(1) or "=", _version(m.group(2))
        n = max(len(have), len(want))
        a, b = want + (0,) * (n - len(want)), have + (0,) * (n - len(have))
        if not {">=": a >= b, ">": a > b, "<=": a <= b, "<": a < b, "=": a == b}[op]:
            return False
    return True


@pytest.mark.parametrize("repository,chart,version", HELM_CHARTS, ids=[c for _, c, _ in HELM_CHARTS])
def test_pinned_chart_version_is_published(repository, chart, version):
    data = recorded(chart)
    assert data["repository"] == repository, f"{chart}: recorded from {data['repository']}, pinned at {repository}"
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", str(data["recorded"])) and data["source"]
    versions = [e["version"] for e in data["entries"][chart]]
    assert version in versions, f"{chart} {version} is not in the recorded index ({versions[:5]} ...)"


@pytest.mark.parametrize("repository,chart,version", HELM_CHARTS, ids=[c for _, c, _ in HELM_CHARTS])
def test_pinned_chart_supports_the_configured_kubernetes(repository, chart, version):
    (entry,) = [e for e in recorded(chart)["entries"][chart] if e["version"] == version]
    constraint = entry.get("kubeVersion")
    for env in ENVS:
        k8s = load_config(env).k8s_version
        assert constraint is None or admits(constraint, k8s), f"{chart} {version} needs kubeVersion {constraint}, env {env} runs {k8s}"


def test_constraint_parser_can_refuse():
    assert admits(">=1.25.0-0", "1.36") and admits(">= 1.19.0-0", "1.31")
    assert not admits(">=1.37.0-0", "1.36") and not admits(">=1.25.0 <1.30", "1.36")
    with pytest.raises(ValueError):
        admits("~1.36", "1.36")


def test_the_pins_the_review_found_missing_or_stale():
    """Volcano 1.15.2 was never published (index: 1.15.0 newest); EFA chart v0.5.7 ran image
    v0.5.4, which predates p6-b200; LWS is an OCI chart at registry.k8s.io."""
    pins = {chart: version for _, chart, version in HELM_CHARTS}
    assert "1.15.2" not in [e["version"] for e in recorded("volcano")["entries"]["volcano"]]
    efa = {e["version"]: e for e in recorded("aws-efa-k8s-device-plugin")["entries"]["aws-efa-k8s-device-plugin"]}
    assert efa["v0.5.7"]["appVersion"] == "v0.5.4" and pins["aws-efa-k8s-device-plugin"] != "v0.5.7"
    assert LWS[0].startswith("oci://registry.k8s.io/")


def test_refresh_is_documented():
    readme = (ROOT / "docs" / "deploy-aws.md").read_text()
    assert "scripts/record_helm_index.py" in readme and "tests/data/helm-index" in readme


def test_volcano_runs_on_a_kubernetes_its_matrix_lists_or_a_recorded_decision():
    """Issue 27 item 9: one place (infra/charts.py) decides which cluster versions run Volcano: the
    pinned line's compatibility matrix, or an entry of VOLCANO_UNLISTED_KUBERNETES that docs/deploy-aws.md's
    real-account list names; the config refuses every other version."""
    from infra.charts import VOLCANO, VOLCANO_KUBERNETES, VOLCANO_UNLISTED_KUBERNETES
    from infra.config import ConfigError, default_config, validate_config

    line, listed = VOLCANO_KUBERNETES
    assert VOLCANO[2].startswith(line + ".") and listed[0] == "1.24" and listed[-1] == "1.35"
    readme = (ROOT / "docs" / "deploy-aws.md").read_text()
    real = readme[readme.index("## Checked only on a real account"):]
    for env in ENVS:
        k8s = load_config(env).k8s_version
        assert k8s in listed or k8s in VOLCANO_UNLISTED_KUBERNETES, (env, k8s)
    for k8s in VOLCANO_UNLISTED_KUBERNETES:
        assert k8s not in listed and f"Volcano {VOLCANO[2]}" in real and f"Kubernetes {k8s}" in real
    data = default_config("dev")
    data["k8s_version"] = "1.37"
    with pytest.raises(ConfigError, match=r"k8s_version: Kubernetes 1.37: Volcano 1.15 .*1.24-1.35"):
        validate_config(data, "dev.yaml")
    data["k8s_version"] = "1.35"
    assert validate_config(data).k8s_version == "1.35"


def test_volcano_is_the_newest_release_of_its_line():
    """Issue 39 item 5: Volcano 1.15.1 (a fix release of the pinned line) was published; 1.15.0 was
    pinned. The entry's provenance is in tests/data/helm-index/volcano.yaml."""
    from infra.charts import VOLCANO
    releases = [e["version"] for e in recorded("volcano")["entries"]["volcano"] if re.fullmatch(r"1\.15\.\d+", e["version"])]
    assert VOLCANO[2] == max(releases, key=_version) == "1.15.1"
