"""CDK app entry (cdk.json runs `python -m infra.app`).

`cdk synth -c env=dev` (or staging, prod) synthesizes that environment's stacks;
`-c env=pipeline -c config=pipeline.yaml` synthesizes the promotion pipeline with all three
stages from that file (infra.config.load_pipeline_config: the tooling account, the connection,
and each environment's overrides). For one environment, `-c config=path.yaml` overrides fields
of its built-in config.
"""

from __future__ import annotations

import os
import sys
from pathlib import PurePosixPath

from aws_cdk import App, Environment

from infra.config import ConfigError, load_config, load_pipeline_config
from infra.nag import acknowledge, add_nag, pipeline_acknowledgements
from infra.pipeline import PipelineStack
from infra.stage import add_env_stacks


# Feature flags this code relies on (also in cdk.json): server access logs are delivered through
# a bucket policy, not the legacy LogDeliveryWrite ACL (ACLs stay disabled on every bucket).
# Cross-stack references stay "strong" (exports protect the producer), said explicitly.
FEATURE_FLAGS = {
    "@aws-cdk/aws-s3:serverAccessLogsUseBucketPolicy": True,
    "@aws-cdk/core:defaultCrossStackReferences": "strong",
}


def build_app(env: str = "dev", overrides: str | None = None, app: App | None = None) -> App:
    """Build (not synth) the app for `env` ("dev" | "staging" | "prod" | "pipeline").

    Raises infra.config.ConfigError before any construct is made when the config is bad.
    """
    app = app or App()
    for flag, value in FEATURE_FLAGS.items():
        app.node.set_context(flag, value)
    if env == "pipeline":
        pcfg, configs = load_pipeline_config(overrides)
        # The pipeline's synth step runs in a fresh clone: the file must be part of the repository.
        rel = PurePosixPath(str(overrides))
        if rel.is_absolute() or ".." in rel.parts:
            raise ConfigError(f"-c config={overrides}: give the pipeline file as a path inside the repository, "
                              "relative to its root (the pipeline's synth step reads it from its clone)")
        stack = PipelineStack(app, "Pipeline", pipeline_cfg=pcfg, configs=configs, config_path=str(rel),
                              stack_name="moerl-pipeline", env=Environment(account=pcfg.account, region=pcfg.region))
        acknowledge(stack, pipeline_acknowledgements(pcfg))
    else:
        add_env_stacks(app, load_config(env, overrides))
    # cdk-nag: every AwsSolutions finding is either fixed or acknowledged with a reason.
    add_nag(app)
    return app


def main() -> None:
    """`cdk synth|deploy` entry (cdk.json): a bad config, or a Kubernetes version this checkout has no
    kubectl layer or add-on pins for, is one line on stderr and exit 2, not a traceback."""
    app = App()
    try:
        build_app(app.node.try_get_context("env") or "dev", app.node.try_get_context("config"), app)
    except (ConfigError, ValueError, RuntimeError) as e:
        if os.environ.get("MOERL_TRACEBACK") == "1":
            raise
        print(f"moerl infra: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    app.synth()


if __name__ == "__main__":
    main()
