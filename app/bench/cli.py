"""`moerl bench ...`: benchmark scripts (each prints its figures and writes runs/bench/*.json).

Each bench's module is imported by its command, when it runs: most import torch, and `moerl bench
--help` lists them all.
"""

from __future__ import annotations

import signal
import threading

import typer

from app.local.procs import sigterm_as_interrupt

cli = typer.Typer(help="Benchmarks: figures against a baseline of the same run (bench/README.md).", no_args_is_help=True)


@cli.callback()
def _group(ctx: typer.Context) -> None:
    """Benchmarks: each prints a table with ratios against a baseline and writes a JSON result."""
    # SIGTERM (timeout, kill, a pod's stop) would end this process without running the finally
    # blocks that stop its engines, redis-server and trainer gang: make it an interrupt instead,
    # for the command's duration.
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, sigterm_as_interrupt)
        ctx.call_on_close(lambda: signal.signal(signal.SIGTERM, previous))


def close_group() -> None:
    """End a multi-rank bench cleanly: wait until every rank is done (rank 0 writes the result
    last), then destroy the process group. Without it a rank that finished first exited with gloo
    still connected to a busy peer, and the C++ runtime sometimes aborted it at exit."""
    import torch.distributed as dist  # torch: only the multi-rank benches; `moerl bench --help` stays fast

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


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
    profile: bool = typer.Option(False, help="Profile one more fwd+bwd of ours (torch.profiler): top kernels."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """One MoE layer forward+backward: ours vs transformers' sparse MoE block vs a dense GEMM baseline."""
    # the bench's module, when it runs (module doc)
    from app.bench.moe import Shape, run

    try:
        run(Shape(family=family, hidden=hidden, intermediate=intermediate, experts=experts, topk=topk,
                  tokens=tokens, dtype=dtype, device=device, iters=iters, warmup=warmup, profile=profile),
            out_dir=out_dir)
    except ValueError as e:
        # A plain exit: the outer `moerl` group is click's, which does not know typer's exceptions.
        typer.echo(f"moerl bench moe: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("train-step")
def train_step(
    model: str = typer.Option("tiny", help="tiny | small (built in code) | qwen3-30b-a3b | deepseek-v3 (real widths)."),
    layers: int = typer.Option(0, help="Decoder layers of a real-width model (0: all)."),
    experts: int = typer.Option(0, help="Routed experts per layer of a real-width model (0: all)."),
    groups: int = typer.Option(2, help="GRPO groups per step."),
    group_size: int = typer.Option(4, help="Completions per group (G)."),
    prompt_len: int = typer.Option(16, help="Prompt tokens per sample."),
    completion_len: int = typer.Option(48, help="Completion tokens per sample."),
    micro_batch_tokens: int = typer.Option(0, help="trainer.micro_batch_tokens (0: one micro-batch)."),
    activation_checkpointing: str = typer.Option("none", help="none | full | selective."),
    logprob_chunk_tokens: int = typer.Option(4096, help="trainer.logprob_chunk_tokens."),
    dtype: str = typer.Option("float32", help="Compute dtype: float32 | bfloat16 (master weights stay fp32)."),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    iters: int = typer.Option(3, help="Timed steps."),
    warmup: int = typer.Option(1, help="Untimed warm-up steps."),
    dense_n: int = typer.Option(0, help="Dense matmul baseline size n (0: 8192 on CUDA, 512 on CPU)."),
    peer: bool = typer.Option(True, help="Also time stock transformers' step (the peer)."),
    profile: bool = typer.Option(False, help="Profile one more step (torch.profiler): top ops by self time."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """One GRPO trainer step (the trainer's layout) vs stock transformers: tokens/s, MFU, memory."""
    # the bench's module, when it runs (module doc)
    from app.bench.train_step import TrainStepBench, run

    try:
        run(TrainStepBench(model=model, layers=layers, experts=experts, groups=groups, group_size=group_size,
                           prompt_len=prompt_len, completion_len=completion_len,
                           micro_batch_tokens=micro_batch_tokens, activation_checkpointing=activation_checkpointing,
                           logprob_chunk_tokens=logprob_chunk_tokens, dtype=dtype, device=device, iters=iters,
                           warmup=warmup, dense_n=dense_n, peer=peer, profile=profile), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench train-step: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("lm-head")
def lm_head(
    model: str = typer.Option("qwen3-30b-a3b", help="Widths: qwen3-30b-a3b | deepseek-v3 | tiny."),
    tokens: int = typer.Option(16384, help="Rows N (tokens) per forward."),
    chunk: int = typer.Option(4096, help="Our chunk rows (trainer.logprob_chunk_tokens)."),
    temperature: float = typer.Option(1.0, help="Sampling temperature of the logprobs."),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16"),
    device: str = typer.Option("cuda", help="cpu | cuda"),
    iters: int = typer.Option(5, help="Timed iterations."),
    warmup: int = typer.Option(2, help="Untimed warm-up iterations."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """The LM head and the loss's logit passes: ours vs plain torch vs liger-kernel's fused linear CE."""
    # the bench's module, when it runs (module doc)
    from app.bench.lm_head import LMHeadBench, run

    try:
        run(LMHeadBench(model=model, tokens=tokens, chunk=chunk, temperature=temperature, dtype=dtype,
                        device=device, iters=iters, warmup=warmup), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench lm-head: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("engine")
def engine(
    model: str = typer.Option("tiny", help="Policy preset: tiny (CPU) | small (~0.5 B params, GPU)."),
    batch_sizes: str = typer.Option("1,8,64", help="Comma-separated batch sizes."),
    prompt_len: int = typer.Option(128, help="Prompt tokens per sequence."),
    output_len: int = typer.Option(128, help="Generated tokens per sequence (EOS ignored)."),
    repeats: int = typer.Option(1, help="Timed generate calls per batch size; the median is reported."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16"),
    device: str = typer.Option("cpu", help="cpu | cuda"),
    work_dir: str = typer.Option("", help="Scratch dir on the disk to measure (default: a temp dir)."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """Built-in engine: generation tokens/s per batch size; policy-load s/GB vs the disk's read speed."""
    # the bench's module, when it runs (module doc)
    from app.bench.engine import EngineBench, run

    try:
        try:
            sizes = tuple(int(b) for b in batch_sizes.split(",") if b.strip())
        except ValueError:
            raise ValueError(f"--batch-sizes must be comma-separated integers, got {batch_sizes!r}") from None
        run(EngineBench(model=model, batch_sizes=sizes, prompt_len=prompt_len, output_len=output_len,
                        repeats=repeats, dtype=dtype, device=device, work_dir=work_dir), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench engine: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("loop")
def loop(
    seconds: float = typer.Option(180.0, help="Training wall-clock of each leg, seconds."),
    workers: int = typer.Option(None, help="Rollout workers of the moerl leg (one engine each); default: sized "
                                "from the machine as `moerl run` does."),
    config: str = typer.Option("", help="Run config YAML (default: the embedded default of `moerl run`)."),
    task: str = typer.Option("", help="A `moerl run --task` preset instead of --config (e.g. gpu)."),
    device: str = typer.Option("cpu", help="cpu, or cuda: both legs on this machine's GPUs (moerl laid out as "
                               "`moerl run` lays it out, TRL on GPU 0)."),
    cache: str = typer.Option("runs/cache", help="Warm-up checkpoint cache (shared with `moerl run`)."),
    work_dir: str = typer.Option("", help="Run directories of both legs (default <out-dir>/loop-<time>)."),
    max_steps: int = typer.Option(0, help="Trainer step cap of both legs (0: max(100, 200 * seconds))."),
    rounds: int = typer.Option(2, help="Rounds of both legs, in the order moerl trl | trl moerl | ... (ABBA)."),
    wait_quiet: float = typer.Option(0.0, help="Before each leg, wait up to this many seconds for a quiet machine."),
    profile: bool = typer.Option(False, help="py-spy breakdown of the first moerl leg (CPU ms per step per activity)."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """The embedded loop vs TRL's GRPOTrainer, same model, task and recipe, equal wall-clock;
    records the machine's load during each leg and warns when it was not quiet."""
    # the bench's module, when it runs (module doc)
    from app.bench.loop import LoopBench, run
    from app.local.embedded import RoleFailed

    try:
        run(LoopBench(seconds=seconds, workers=workers, config=config, task=task, device=device, cache=cache,
                      work_dir=work_dir, max_steps=max_steps, rounds=rounds, wait_quiet_s=wait_quiet,
                      profile=profile), out_dir=out_dir)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"moerl bench loop: error: {e}", err=True)
        raise SystemExit(2) from None
    except RoleFailed as e:
        typer.echo(f"moerl bench loop: a moerl role failed: {e}", err=True)
        raise SystemExit(1) from None


@cli.command("rollout")
def rollout(
    url: list[str] = typer.Option([], "--url", help="Engine base URL (repeat for each engine; not with --partial-ab)."),
    seconds: float = typer.Option(30.0, help="Load phase, seconds."),
    config: str = typer.Option("", help="Run config YAML: prompts (task), group size, sampling (default: RunConfig())."),
    concurrency: int = typer.Option(0, help="Requests (prompt groups) in flight per engine (0: rollout.inflight_tasks())."),
    gpus_per_engine: int = typer.Option(1, help="GPUs of one engine (for tokens/s per GPU)."),
    max_new_tokens: int = typer.Option(0, help="Tokens per completion (0: rollout.max_new_tokens)."),
    baseline_seconds: float = typer.Option(-1.0, help="Baseline phase (engine 0, one request at a time); < 0: min(T/4, 30)."),
    wait_s: float = typer.Option(120.0, help="How long to wait for the engines to become healthy, seconds."),
    label: str = typer.Option("", help="Name printed with the figures (e.g. the engine profile)."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
    partial_ab: bool = typer.Option(False, "--partial-ab", help="Instead: one worker on the built-in engine in this "
                                    "process through weight updates, rollout.partial_rollout off then on "
                                    "(app/bench/partial.py)."),
    update_every_s: float = typer.Option(2.0, help="--partial-ab: a new policy version every this many seconds."),
    rounds: int = typer.Option(1, help="--partial-ab: (off, on) pairs to run."),
    max_batch: int = typer.Option(64, help="--partial-ab: the built-in engine's --max-running-requests."),
    router_url: str = typer.Option("", help="The router in front of the --url engines: compare pinned lanes "
                                   "with the same lanes through it (p50/p99, samples/s, engine idle)."),
    env_wait_s: list[float] = typer.Option([0.0], help="With --router-url: mean environment wait before each "
                                           "request, s; repeat once per --url for workers whose waits differ."),
    seed: int = typer.Option(0, help="With --router-url: seed of the environment waits."),
    repeats: int = typer.Option(1, help="With --router-url: pinned/router pairs, alternated."),
) -> None:
    """N SGLang-compatible engines driven with a run's prompts: aggregate tokens/s, per GPU, latency;
    or (--partial-ab) a worker through weight updates with and without partial rollout."""
    # the bench's module, when it runs (module doc)
    from app.bench.rollout import RolloutBench, run

    if partial_ab:
        # the bench's module, when it runs (module doc)
        from app.bench.partial import PartialBench
        from app.bench.partial import run as run_partial

        try:
            if url or router_url:
                raise ValueError("--partial-ab starts its own engine: give no --url or --router-url")
            run_partial(PartialBench(seconds=seconds, config=config, update_every_s=update_every_s, rounds=rounds,
                                     max_new_tokens=max_new_tokens, max_batch=max_batch), out_dir=out_dir)
        except ValueError as e:
            typer.echo(f"moerl bench rollout: error: {e}", err=True)
            raise SystemExit(2) from None
        return
    try:
        run(RolloutBench(urls=tuple(url), seconds=seconds, config=config, concurrency=concurrency,
                         gpus_per_engine=gpus_per_engine, max_new_tokens=max_new_tokens,
                         baseline_seconds=baseline_seconds, wait_s=wait_s, label=label, router_url=router_url,
                         env_wait_s=tuple(env_wait_s), seed=seed, repeats=repeats), out_dir=out_dir)
    except (ValueError, TimeoutError) as e:
        typer.echo(f"moerl bench rollout: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("dispatch")
def dispatch(
    hidden: int = typer.Option(7168, help="Hidden size H (DeepSeek-V3: 7168)."),
    topk: int = typer.Option(8, help="Experts per token K."),
    experts: int = typer.Option(256, help="Routed experts E over all ranks."),
    tokens: int = typer.Option(4096, help="Tokens per rank."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float32 (deepep: bfloat16 only)."),
    backends: str = typer.Option("auto", help="auto (alltoall + deepep where it runs) or a comma list."),
    fp8: bool = typer.Option(True, help="Also FP8 dispatch on deepep (V1 Buffer) where it runs."),
    iters: int = typer.Option(20, help="Timed iterations (median per rank)."),
    warmup: int = typer.Option(5, help="Untimed warm-up iterations."),
    out_dir: str = typer.Option("runs/bench", help="Where rank 0 writes the JSON result."),
) -> None:
    """EP dispatch+combine per-rank GB/s for each backend vs NVLink (start with torchrun, 2+ ranks)."""
    # the bench's module, when it runs (module doc)
    from app.bench.dispatch import DispatchBench, run

    try:
        run(DispatchBench(hidden=hidden, topk=topk, experts=experts, tokens=tokens, dtype=dtype,
                          backends=backends, fp8=fp8, iters=iters, warmup=warmup), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench dispatch: error: {e}", err=True)
        raise SystemExit(2) from None
    close_group()


@cli.command("ep-train-step")
def ep_train_step(
    model: str = typer.Option("tiny", help="Policy preset: tiny (CPU) | small (~0.5 B params, GPU)."),
    groups: int = typer.Option(2, help="GRPO groups per rank per step."),
    group_size: int = typer.Option(4, help="Completions per group (G)."),
    prompt_len: int = typer.Option(16, help="Prompt tokens per sample."),
    completion_len: int = typer.Option(48, help="Completion tokens per sample."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 (deepep: bfloat16 only)."),
    backends: str = typer.Option("auto", help="auto (alltoall + deepep where it runs) or a comma list."),
    ep: int = typer.Option(0, help="EP degree (0: the world size); FSDP2 shards over every rank."),
    iters: int = typer.Option(3, help="Timed steps."),
    warmup: int = typer.Option(1, help="Untimed steps before them (at least one always runs)."),
    out_dir: str = typer.Option("runs/bench", help="Where rank 0 writes the JSON result."),
) -> None:
    """Multi-rank GRPO train step on the trainer's layout: tokens/s and dispatch/combine share per backend."""
    # the bench's module, when it runs (module doc)
    from app.bench.ep_train_step import EPTrainStepBench, run

    try:
        run(EPTrainStepBench(model=model, groups=groups, group_size=group_size, prompt_len=prompt_len, ep=ep,
                             completion_len=completion_len, dtype=dtype, backends=backends, iters=iters,
                             warmup=warmup), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench ep-train-step: error: {e}", err=True)
        raise SystemExit(2) from None
    close_group()


@cli.command("weight-sync")
def weight_sync(
    model: str = typer.Option("tiny", help="cpu: tiny | medium (~85 M params) | small (~0.5 B); cuda: qwen3-30b-a3b."),
    layers: int = typer.Option(2, help="Decoder layers of the real-width model (--device cuda)."),
    engines: int = typer.Option(2, help="Built-in engines (and rollout workers) to push to (--device cpu)."),
    versions: int = typer.Option(3, help="Timed versions per path (the median is reported)."),
    bucket_mb: float = typer.Option(64.0, help="weight_sync.bucket_bytes, in MiB."),
    dtype: str = typer.Option("float32", help="Published dtype: float32 | bfloat16 (cuda: bfloat16)."),
    device: str = typer.Option("cpu", help="cpu (engines as processes) | cuda (two processes on one GPU)."),
    work_dir: str = typer.Option("", help="Scratch directory (default: a temporary one, removed after)."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """Seconds per policy version: the network path (SGLang's weight-update group) vs the store path."""
    # the bench's module, when it runs (module doc)
    from app.bench.weight_sync import WeightSyncBench, run

    try:
        run(WeightSyncBench(model=model, layers=layers, engines=engines, versions=versions, bucket_mb=bucket_mb,
                            dtype=dtype, device=device, work_dir=work_dir), out_dir=out_dir)
    except ValueError as e:
        typer.echo(f"moerl bench weight-sync: error: {e}", err=True)
        raise SystemExit(2) from None


@cli.command("buffer")
def buffer(
    writers: int = typer.Option(4, help="Writer processes publishing groups (rollout workers)."),
    groups: int = typer.Option(48, help="Groups published and taken per leg."),
    group_size: int = typer.Option(16, help="Completions per group (G)."),
    prompt_len: int = typer.Option(512, help="Prompt tokens."),
    completion_len: int = typer.Option(8192, help="Completion tokens per sample."),
    batch_groups: int = typer.Option(4, help="Groups the trainer takes at a time."),
    commit_every: int = typer.Option(5, help="Batches between commits (trainer.save_every)."),
    capacity: int = typer.Option(0, help="buffer.capacity_groups of the writers (0: (commit-every + 1) x batch-groups)."),
    replay: str = typer.Option("both", help="Routing replay legs: both | off | on."),
    model: str = typer.Option("deepseek-v3", help="Routing shape: deepseek-v3 (61 layers, top-8 of 256) | tiny."),
    baseline_calls: int = typer.Option(5, help="Plain XADDs of one group's bytes (the in-run baseline)."),
    timeout_s: float = typer.Option(600.0, help="Give up a leg after this many seconds."),
    out_dir: str = typer.Option("runs/bench", help="Where the JSON result goes."),
) -> None:
    """The experience buffer under the seed's traffic on a real redis-server: groups/s, bytes, memory and
    Redis CPU per group, publish and take latency, with and without routing replay."""
    # the bench's module, when it runs (module doc)
    from app.bench.buffer import BufferBench, run

    try:
        run(BufferBench(writers=writers, groups=groups, group_size=group_size, prompt_len=prompt_len,
                        completion_len=completion_len, batch_groups=batch_groups, commit_every=commit_every,
                        capacity=capacity, replay=replay, model=model, baseline_calls=baseline_calls,
                        timeout_s=timeout_s), out_dir=out_dir)
    except (ValueError, TimeoutError, FileNotFoundError) as e:
        typer.echo(f"moerl bench buffer: error: {e}", err=True)
        raise SystemExit(2) from None
