"""Evaluate IAM requests against synthesized policies with iam-simulate (cloud-copilot), an IAM
policy simulator that implements AWS's evaluation logic: identity policies, resource policies,
permissions boundaries, VPC endpoint policies, every condition operator, same- and cross-account
requests, and anonymous (unsigned) requests; it also refuses an action, resource ARN or context
key the service does not define. moto's policy engine (moto.iam.access_control) answers neither
conditions on Allow statements nor endpoint policies, so it cannot show these.

tests/iam-simulate/ holds the locked npm package (the Makefile runs `npm ci` there) and
simulate.mjs, which takes a batch of simulations on stdin: one node process per batch.

    decisions = simulate([request("s3:GetObject", "arn:aws:s3:::b/k", account, principal=ANONYMOUS,
                                  endpoint=endpoint_policy, context={"aws:SourceVpce": "vpce-1"})])
    decisions == ["ImplicitlyDenied"]
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

SIM_DIR = Path(__file__).resolve().parent / "iam-simulate"
# iam-simulate's marker of an unsigned request (its anonymousPrincipal).
ANONYMOUS = {"type": "Anonymous"}
ALLOWED = "Allowed"


def request(action: str, resource: str, resource_account: str, *, principal: str | dict,
            identity: list[dict] | tuple = (), resource_policy: dict | None = None,
            endpoint: dict | None = None, boundary: dict | None = None, context: dict | None = None) -> dict:
    """One iam-simulate Simulation: `principal` (an ARN, or ANONYMOUS) asks for `action` on
    `resource` (owned by `resource_account`) under the given policies and context keys."""
    sim = {
        "request": {"principal": principal, "action": action,
                    "resource": {"resource": resource, "accountId": resource_account},
                    "contextVariables": context or {}},
        "identityPolicies": [{"name": f"identity{i}", "policy": p} for i, p in enumerate(identity)],
        "serviceControlPolicies": [], "resourceControlPolicies": [],
    }
    if resource_policy is not None:
        sim["resourcePolicy"] = resource_policy
    if endpoint is not None:
        sim["vpcEndpointPolicies"] = [{"name": "endpoint", "policy": _star_principal(endpoint)}]
    if boundary is not None:
        sim["permissionBoundaryPolicies"] = [{"name": "boundary", "policy": boundary}]
    return sim


def _star_principal(policy: dict) -> dict:
    """`policy` with every {"AWS": "*"} principal written "*": aws-cdk-lib renders AnyPrincipal as
    the former, iam-simulate accepts only the latter in an endpoint policy, and IAM treats the two
    alike (IAM user guide, "AWS JSON policy elements: Principal", all principals)."""
    statements = policy["Statement"] if isinstance(policy["Statement"], list) else [policy["Statement"]]
    return {**policy, "Statement": [{**s, "Principal": "*"} if s.get("Principal") == {"AWS": "*"} else s
                                    for s in statements]}


def simulate(simulations: list[dict]) -> list[str]:
    """The decision of each simulation: "Allowed", "ImplicitlyDenied" or "ExplicitlyDenied".

    Raises AssertionError naming the simulation when iam-simulate refuses its input (so a typo in
    an action or ARN fails the test instead of reading as a denial), or when the package is not
    installed.
    """
    script = SIM_DIR / "simulate.mjs"
    assert (SIM_DIR / "node_modules" / "@cloud-copilot" / "iam-simulate").is_dir(), (
        f"iam-simulate is not installed: run `make test`, or `npm ci --prefix {SIM_DIR} --ignore-scripts`")
    node = shutil.which("node")
    assert node, "node is not on PATH (the Makefile's system-deps installs it)"
    proc = subprocess.run([node, str(script)], input=json.dumps(simulations), capture_output=True, text=True,
                          cwd=SIM_DIR, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    for sim, got in zip(simulations, out):
        assert "error" not in got, f"iam-simulate refused {json.dumps(sim['request'])}: {json.dumps(got['error'])[:2000]}"
    return [got["result"] for got in out]
