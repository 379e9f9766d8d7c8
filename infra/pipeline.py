"""Promotion pipeline (CDK Pipelines): source -> synth -> infra tests -> dev -> staging -> manual
approval -> prod. Each stage deploys into its environment's account (cross-account keys).

The synth job's output is what deploys, so it installs only pinned, hash-checked packages: the
CDK CLI from infra/cdk-cli/package-lock.json (`npm ci`, integrity-checked) and the Python
packages of infra/requirements-synth.txt (`pip install --require-hashes --no-deps`), and runs the
same synth as the operator's (`-c env=pipeline -c config=<file>`), nothing else. The tests run
in a job of their own before the first deploy (`make test-infra`: tests/test_infra_*.py and
tests/test_ops_charts.py, cfn-lint, cdk-nag and checkov included); that job installs the project
with its test dependencies, and nothing it produces is deployed. Both run on a CodeBuild
machine sized for them (PipelineConfig.synth_compute; the default SMALL has 3 GB); torch comes
from the CPU wheel index there, not as a multi-GB CUDA build.

CDK_CLI_VERSION is the CLI of infra/cdk-cli/package.json, also the pipeline's `cli_version`
(self-mutation and asset publishing): CLI 2.1148.1 bundles cloud-assembly-schema >= 55.5.0
(its npm devDependencies), so it reads what aws-cdk-lib 2.275.0 (schema 55.4.0) writes; a CLI
older than the library's schema refuses the cloud assembly.
"""

from __future__ import annotations

from aws_cdk import Duration, Stack
from aws_cdk import aws_codebuild as codebuild
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import pipelines
from constructs import Construct

from infra.config import DeploymentConfig, PipelineConfig
from infra.stage import EnvStage

SYNTH_IMAGE = codebuild.LinuxBuildImage.STANDARD_7_0
# The runtimes every CodeBuild job of the pipeline selects on that image (buildspec
# runtime-versions; standard:7.0 carries Node.js 18 to 24 and Python 3.11 and 3.12,
# aws/aws-codebuild-docker-images ubuntu/standard/7.0/runtimes.yml): Node 22 LTS, the major the
# Makefile's NODE_VERSION installs (jsii and the CDK CLI print an end-of-life notice under 20, the
# image's older default), and the Python of the synth lock's cp311 wheels.
RUNTIMES = {"nodejs": "22", "python": "3.11"}
SYNTH_TIMEOUT = Duration.minutes(90)
_COMPUTE = {"BUILD_GENERAL1_MEDIUM": codebuild.ComputeType.MEDIUM, "BUILD_GENERAL1_LARGE": codebuild.ComputeType.LARGE,
            "BUILD_GENERAL1_XLARGE": codebuild.ComputeType.X_LARGE}


CDK_CLI_VERSION = "2.1148.1"
# The asset-publishing jobs' cdk-assets (npm dist-tag latest when pinned, 2026-12; the library's
# default is an unpinned "latest" install in a job that can write to every target account).
CDK_ASSETS_VERSION = "4.7.3"
CDK_CLI_DIR = "infra/cdk-cli"
SYNTH_REQUIREMENTS = "infra/requirements-synth.txt"
SYNTH_PYTHON = f"python{RUNTIMES['python']}"  # the cp311 wheels of SYNTH_REQUIREMENTS


def synth_commands(config_path: str) -> list[str]:
    """The synth step's commands: the locked CLI and Python packages, then the synth of this same
    pipeline file (cdk.json runs `.venv/bin/python -m infra.app`)."""
    return [
        f"npm ci --prefix {CDK_CLI_DIR} --ignore-scripts",
        f"{SYNTH_PYTHON} -m venv .venv",
        f".venv/bin/pip install --require-hashes --no-deps -r {SYNTH_REQUIREMENTS}",
        f"JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION=1 {CDK_CLI_DIR}/node_modules/.bin/cdk synth "
        f"-c env=pipeline -c config={config_path}",
    ]


def test_commands() -> list[str]:
    """The test job's commands (Makefile `test-infra`: installs the project, runs the infra tests)."""
    return ["make test-infra"]


class PipelineStack(Stack):
    """The CodePipeline that promotes `configs` (dev, staging, prod, in that order).

    Attributes: pipeline (pipelines.CodePipeline), stages (dict env -> EnvStage).
    """

    def __init__(self, scope: Construct, id: str, *, pipeline_cfg: PipelineConfig,
                 configs: list[DeploymentConfig], config_path: str, **kw) -> None:
        super().__init__(scope, id, **kw)
        source = pipelines.CodePipelineSource.connection(
            pipeline_cfg.repository, pipeline_cfg.branch, connection_arn=pipeline_cfg.connection_arn
        )
        self.pipeline = pipelines.CodePipeline(
            self, "Pipeline",
            pipeline_name="moerl-promotion",
            pipeline_type=codepipeline.PipelineType.V2,
            cross_account_keys=True,
            enable_key_rotation=True,
            synth=pipelines.ShellStep("Synth", input=source, commands=synth_commands(config_path),
                                      primary_output_directory="cdk.out"),
            cli_version=CDK_CLI_VERSION,
            cdk_assets_cli_version=CDK_ASSETS_VERSION,
            # every job (synth, tests, self-mutation, asset publishing) on RUNTIMES
            code_build_defaults=pipelines.CodeBuildOptions(partial_build_spec=codebuild.BuildSpec.from_object(
                {"phases": {"install": {"runtime-versions": RUNTIMES}}})),
            synth_code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(
                    build_image=SYNTH_IMAGE,
                    compute_type=_COMPUTE[pipeline_cfg.synth_compute],
                ),
                timeout=SYNTH_TIMEOUT,
            ),
        )
        tests = pipelines.CodeBuildStep(
            "InfraTests", input=source, commands=test_commands(),
            env={"PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu"},
            build_environment=codebuild.BuildEnvironment(build_image=SYNTH_IMAGE,
                                                         compute_type=_COMPUTE[pipeline_cfg.synth_compute]),
            timeout=SYNTH_TIMEOUT)
        self.stages: dict[str, EnvStage] = {}
        for i, cfg in enumerate(configs):
            stage = EnvStage(self, cfg.env.capitalize(), cfg=cfg)
            pre = [pipelines.ManualApprovalStep("PromoteToProd")] if cfg.env == "prod" else []
            if i == 0:
                pre = [tests, *pre]  # no environment deploys before the tests pass
            self.pipeline.add_stage(stage, pre=pre)
            self.stages[cfg.env] = stage
