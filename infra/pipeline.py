"""Promotion pipeline (CDK Pipelines): source -> synth (runs the test suite) -> dev -> staging ->
manual approval -> prod. Each stage deploys into its environment's account (cross-account keys)."""

from __future__ import annotations

from aws_cdk import Stack
from aws_cdk import aws_codepipeline as codepipeline
from aws_cdk import pipelines
from constructs import Construct

from infra.config import DeploymentConfig, PipelineConfig
from infra.stage import EnvStage

SYNTH_COMMANDS = [
    "npm install -g aws-cdk@2",
    "make test",  # creates .venv, installs the project, runs the whole suite
    "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION=1 cdk synth -c env=pipeline",
]


class PipelineStack(Stack):
    """The CodePipeline that promotes `configs` (dev, staging, prod, in that order).

    Attributes: pipeline (pipelines.CodePipeline), stages (dict env -> EnvStage).
    """

    def __init__(self, scope: Construct, id: str, *, pipeline_cfg: PipelineConfig,
                 configs: list[DeploymentConfig], **kw) -> None:
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
            synth=pipelines.ShellStep("Synth", input=source, commands=SYNTH_COMMANDS,
                                      primary_output_directory="cdk.out"),
        )
        self.stages: dict[str, EnvStage] = {}
        for cfg in configs:
            stage = EnvStage(self, cfg.env.capitalize(), cfg=cfg)
            pre = [pipelines.ManualApprovalStep("PromoteToProd")] if cfg.env == "prod" else []
            self.pipeline.add_stage(stage, pre=pre)
            self.stages[cfg.env] = stage
