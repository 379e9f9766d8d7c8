"""The `moerl` command line.

Each sub-command lives in the module that implements its role and is imported only when it
is called, so `moerl --help` stays fast and a role's heavy imports (torch, transformers) are
paid only by the processes that need them.

To add a command, add one line to COMMANDS: ``"name": "package.module:attr"`` where ``attr``
is a ``typer.Typer`` (one command, or a group of sub-commands such as ``moerl bench ...``).
"""

from __future__ import annotations

import importlib
import os
import sys

# name -> "module:attribute" of a typer.Typer. One line per role.
COMMANDS: dict[str, str] = {
    "run": "app.local.run:cli",
    "engine": "app.engine.server:cli",
    "rollout": "app.rollout.worker:cli",
    "train": "app.trainer.train:cli",
    "warmup": "app.envs.warmup:cli",
    "reward": "app.envs.reward_server:cli",
    "env": "app.envs.openenv_server:cli",
    "chaos": "app.local.chaos:cli",
    "feed": "app.feed:cli",
    "replica": "app.replica:cli",
    "bench": "app.bench.cli:cli",
    "plan": "app.plan.cli:cli",
}

HELP = {
    "run": "Run the whole loop on this machine (the embedded default).",
    "engine": "Serve the built-in engine (SGLang HTTP API subset).",
    "rollout": "Run a rollout worker against an engine and the experience buffer.",
    "train": "Run a trainer rank (start with torchrun).",
    "warmup": "Make the tiny base policy with a short supervised warm-up.",
    "reward": "Serve a reward model over HTTP.",
    "env": "Serve the run's environment over OpenEnv's protocol (multi-turn episodes).",
    "chaos": "Run the loop under a seeded fault schedule and audit the ledger.",
    "feed": "Queue the run's prompts until the trainer is done; held-out evaluation.",
    "replica": "Run every pod of synthesized manifests (dist/) as local processes.",
    "bench": "Benchmarks: figures against a baseline of the same run (bench/README.md).",
    "plan": "Per-GPU trainer memory and weight-sync traffic for a model and layout.",
}


def usage() -> str:
    """The top-level help: the commands and what each does (imports no role module)."""
    width = max(map(len, COMMANDS))
    lines = ["Usage: moerl COMMAND [OPTIONS]", "", "Asynchronous RL post-training of MoE language models.", "",
             "Commands:"]
    lines += [f"  {name:<{width}}  {HELP.get(name, '')}" for name in sorted(COMMANDS)]
    lines += ["", "Run `moerl COMMAND --help` for a command's options."]
    return "\n".join(lines)


def load(name: str):
    """The typer app of command `name` (imports its module).

    Raises:
        KeyError: `name` is not a moerl command.
    """
    module_name, attr = COMMANDS[name].split(":")
    return getattr(importlib.import_module(module_name), attr)


def command(name: str):
    """The click command behind `moerl name` (for introspection, e.g. its options in tests)."""
    import typer.main  # only here: `moerl --help` imports no third-party package (module doc)

    return typer.main.get_command(load(name))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `moerl` console script: import the command's module, hand it the rest.

    Each role's typer app parses its own options, so typer's own click handles --help and errors.
    A ValueError, OSError, ConnectionError or TimeoutError escaping a command is printed as one
    line and exits 2 (set MOERL_TRACEBACK=1 for the traceback).
    """
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moerl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        sys.exit(2)
    try:
        load(name)(args=rest, prog_name=f"moerl {name}")
    except (ValueError, OSError, ConnectionError, TimeoutError) as e:
        # Bad input (a config field, a file, an unreachable service): the roles raise errors
        # that name the field or file, so one line says it; MOERL_TRACEBACK=1 shows the rest.
        if os.environ.get("MOERL_TRACEBACK"):
            raise
        print(f"moerl {name}: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
