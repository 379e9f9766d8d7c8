"""`moerl bench ...`: benchmark scripts (each prints its figures and writes runs/bench/*.json)."""

from __future__ import annotations

import typer

cli = typer.Typer(help="Benchmarks (MoE layer, loop).", no_args_is_help=True)


@cli.callback()
def _group() -> None:
    """Benchmarks: each prints a table with ratios against a baseline and writes a JSON result."""


@cli.command("moe")
def moe(
    family: str = typer.Option("qwen3", help="qwen3 | deepseek-v3"),
    hidden: int = typer.Option(256, help="Hidden size H."),
    intermediate: int = typer.Option(128, help="Expert intermediate size I."),
    experts: int = typer.Option(16, help="Routed experts E (all local: EP size 1)."),
    topk: int = typer.Option(4, help="Experts per token K."),
    tokens: int = typer.Option(512, help="Tokens T per forward."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    iters: int = typer.Option(5, help="Timed iterations."),
    warmup: int = typer.Option(2, help="Untimed warm-up iterations."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """One MoE layer forward+backward: ours vs transformers' sparse MoE block vs a dense GEMM baseline."""
    from app.bench.moe import Shape, run

    try:
        run(Shape(family=family, hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
                  tokens=tokens, dtype=dtype, device=device, iters=iters, warmup=warmup), out_dir=out_dir)
    except ValueError as e:
        # A plain exit: the outer `moerl` group is click's, which does not know typer's exceptions.
        typer.echo(f"moerl bench moe: error: {e}", err=True)
        raise SystemExit(2) from None
