"""Promotion pipeline (CDK Pipelines): source -> synth (runs the test suite) -> dev -> staging ->
manual approval -> prod. Each stage deploys into its environment's account (cross-account keys).

The synth step runs `make test` (the whole suite, ~15 min on 2 cores) and then the same synth as
the operator's (`-c env=pipeline -c config=<file>`), on a CodeBuild machine sized for it
(PipelineConfig.synth_compute; the default SMALL has 3 GB of memory). torch comes from the CPU
wheel index there, not as a multi-GB CUDA build.
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
SYNTH_TIMEOUT = Duration.minutes(90)
_COMPUTE = {"BUILD_GENERAL1_MEDIUM": codebuild.ComputeType.MEDIUM, "BUILD_GENERAL1_LARGE": codebuild.ComputeType.LARGE,
            "BUILD_GENERAL1_XLARGE": codebuild.ComputeType.X_LARGE}


def synth_commands(config_path: str) -> list[str]:
    """The synth step's commands: the test suite, then the synth of this same pipeline file."""
    return [
        "npm install -g aws-cdk@2",
        "make test",  # creates .venv, installs the project, runs the whole suite
        f"JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION=1 cdk synth -c env=pipeline -c config={config_path}",
    ]


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
                                      env={"PIP_EXTRA_INDEX_URL": "https://download.pytorch.org/whl/cpu"},
                                      primary_output_directory="cdk.out"),
            synth_code_build_defaults=pipelines.CodeBuildOptions(
                build_environment=codebuild.BuildEnvironment(
                    build_image=SYNTH_IMAGE,
                    compute_type=_COMPUTE[pipeline_cfg.synth_compute],
                ),
                timeout=SYNTH_TIMEOUT,
            ),
        )
        self.stages: dict[str, EnvStage] = {}
        for cfg in configs:
            stage = EnvStage(self, cfg.env.capitalize(), cfg=cfg)
            pre = [pipelines.ManualApprovalStep("PromoteToProd")] if cfg.env == "prod" else []
            self.pipeline.add_stage(stage, pre=pre)
            self.stages[cfg.env] = stage
