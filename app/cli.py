"""The `moerl` command line.

Each sub-command lives in the module that implements its role and is imported only when it
is called, so `moerl --help` stays fast and a role's heavy imports (torch, transformers) are
paid only by the processes that need them.

To add a command, add one line to COMMANDS: ``"name": "package.module:attr"`` where ``attr``
is a ``typer.Typer`` (one command, or a group of sub-commands such as ``moerl bench ...``).
"""

from __future__ import annotations

import importlib

import click
import typer.main

# name -> "module:attribute" of a typer.Typer. One line per role.
COMMANDS: dict[str, str] = {
    "run": "app.run:cli",
    "engine": "app.rollout.engine_server:cli",
    "rollout": "app.rollout.worker:cli",
    "train": "app.trainer.train:cli",
    "warmup": "app.envs.warmup:cli",
    "reward": "app.envs.reward_server:cli",
    "chaos": "app.chaos:cli",
    "bench": "app.bench.cli:cli",
}

HELP = {
    "run": "Run the whole loop on this machine (the embedded default).",
    "engine": "Serve the built-in engine (SGLang HTTP API subset).",
    "rollout": "Run a rollout worker against an engine and the experience buffer.",
    "train": "Run a trainer rank (start with torchrun).",
    "warmup": "Make the tiny base policy with a short supervised warm-up.",
    "reward": "Serve a reward model over HTTP.",
    "chaos": "Run the loop under a seeded fault schedule and audit the ledger.",
    "bench": "Benchmarks (MoE layer, loop).",
}


class LazyGroup(click.Group):
    """A click group whose sub-commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, attr = COMMANDS[name].split(":")
        module = importlib.import_module(module_name)
        command = typer.main.get_command(getattr(module, attr))
        command.name = name
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help must not import every role: describe commands from HELP instead.
        with formatter.section("Commands"):
            formatter.write_dl([(name, HELP.get(name, "")) for name in self.list_commands(ctx)])


cli = LazyGroup(name="moerl", help="Asynchronous RL post-training of MoE language models.")


def main() -> None:
    """Entry point of the `moerl` console script."""
    cli()


if __name__ == "__main__":
    main()
