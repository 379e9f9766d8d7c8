"""`moerl plan`: the trainer's per-GPU memory budget, or (``--traffic``) the weight-sync budget.

The model comes from ``--model`` (a preset name or a Hugging Face config.json, directory or
file, read from local files only) or from the run config's ``model`` section (``--config``); the
layout and the micro-batching from the run config's ``trainer`` section, each overridden by its
flag. Exit status: 0 it fits (``--traffic``: ``--publish-every`` keeps staleness within
``--max-staleness`` on the network path), 1 it does not, 2 bad input (one line naming the flag or
the field).

``--traffic`` is a flag of the same command rather than a sub-command because it needs the same
model and node count as the memory plan and only a few flags more; ``moerl plan`` stays one
command with one way to name the model.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from app.config import ParallelConfig, RunConfig
from app.layout import resolve_layout
from infra.instances import instance_spec

cli = typer.Typer(add_completion=False, help="Per-GPU memory of the trainer for a model and layout "
                  "(and, with --traffic, the weight-sync traffic budget).")


def _fail(message: str) -> None:
    print(f"moerl plan: {message}", file=sys.stderr)
    raise typer.Exit(2)


def _model(model: str | None, run, num_layers: int | None, overrides: list[str]):
    """The HF config of ``--model`` or of the run config's model section, with overrides applied."""
    # transformers and the plan's modules load when a plan runs: `moerl plan --help` stays fast
    from huggingface_hub.errors import StrictDataclassError

    from app.model.config import PRESETS, REAL_PRESETS, load_hf_config, real_config, tiny_config, validate_config

    if model is None:
        if run is None:
            raise ValueError("give --model (a preset or a config.json) or --config (a run config)")
        if run.model.path:
            if not Path(run.model.path).exists():
                raise ValueError(f"model.path {run.model.path!r} is not a local path; moerl plan reads local "
                                 f"files only (pass --model with a config.json)")
            config = load_hf_config(run.model.path)
        else:
            config = tiny_config(run.model.preset)
    elif model in REAL_PRESETS:
        config = real_config(model)
    elif model in PRESETS:
        config = tiny_config(model)
    elif Path(model).exists():
        config = load_hf_config(model)
    else:
        raise ValueError(f"--model {model!r} is neither a preset {REAL_PRESETS + PRESETS} nor a local config.json")
    if num_layers is not None:
        if num_layers > config.num_hidden_layers:
            source = model or run.model.path or run.model.preset
            raise ValueError(f"--num-layers {num_layers}: {source} has {config.num_hidden_layers} decoder layers; "
                             "--num-layers takes fewer (--set num_hidden_layers=N for a deeper model)")
        overrides = [f"num_hidden_layers={num_layers}", *overrides]
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not hasattr(config, key):
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE with a field of {type(config).__name__}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        try:
            setattr(config, key, value)
        except StrictDataclassError as e:  # transformers 5 checks the field's type
            raise ValueError(f"--set {item!r}: {' '.join(str(e).split())}") from None
    if config.model_type == "deepseek_v3" and config.first_k_dense_replace >= config.num_hidden_layers:
        raise ValueError(f"num_hidden_layers={config.num_hidden_layers} leaves no MoE layer after "
                         f"first_k_dense_replace={config.first_k_dense_replace} (--set first_k_dense_replace=N)")
    validate_config(config, ep_size=1)
    return config


def _gib(n: float) -> str:
    return f"{n / 1024**3:,.2f}"


@cli.command()
def plan(
    config_path: Path = typer.Option(None, "--config", help="Run config YAML (its model and trainer sections)."),
    model: str = typer.Option(None, "--model", help="Preset (qwen3-30b-a3b, deepseek-v3, tiny-*) or an HF "
                              "config.json (file or directory)."),
    num_layers: int = typer.Option(None, "--num-layers", min=1, help="Fewer decoder layers at the same widths."),
    overrides: list[str] = typer.Option([], "--set", help="FIELD=VALUE override of the model config (repeatable)."),
    nodes: int = typer.Option(1, "--nodes", min=1, help="Trainer nodes."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, help="GPUs per trainer node."),
    ep: int = typer.Option(None, "--ep", min=1, help="trainer.parallel.ep."),
    dp_shard: int = typer.Option(None, "--dp-shard", help="trainer.parallel.dp_shard (-1: world / dp_replicate)."),
    dp_replicate: int = typer.Option(None, "--dp-replicate", min=1, help="trainer.parallel.dp_replicate."),
    ep_backend: str = typer.Option(None, "--ep-backend", help="auto | local | alltoall | deepep (auto: what the "
                                   "trainer would run; the plan says which and why)."),
    micro_batch_tokens: int = typer.Option(None, "--micro-batch-tokens", min=1,
                                           help="trainer.micro_batch_tokens (default: one micro-batch)."),
    activation_checkpointing: str = typer.Option(None, "--activation-checkpointing", help="none | full | selective."),
    logprob_chunk_tokens: int = typer.Option(None, "--logprob-chunk-tokens", min=1,
                                             help="trainer.logprob_chunk_tokens."),
    rollouts_per_gpu: int = typer.Option(8, "--rollouts-per-gpu", min=1, help="Sequences each GPU trains per step."),
    seq_len: int = typer.Option(8192, "--seq-len", min=1, help="Tokens per sequence (prompt + completion)."),
    algorithm: str = typer.Option(None, "--algorithm", help="grpo | ppo (ppo adds a critic)."),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype, bfloat16 | float32 (default: model.dtype of "
                              "--config, else bfloat16)."),
    gpu_memory_gib: float = typer.Option(None, "--gpu-memory-gib", help="Device memory, GiB (default: p5en's "
                                         "H200, infra/instances.py)."),
    fragmentation: float = typer.Option(None, "--fragmentation", help="Allocator reserve over live tensors "
                                        "(default 1.16: expandable_segments:True, as the GPU trainer pods "
                                        "run; 1.33 for the default allocator)."),
    expert_imbalance: float = typer.Option(None, "--expert-imbalance", help="Rows the busiest EP rank receives "
                                           "over the mean (default 1.7, measured: app/plan/memory.py)."),
    collectives: str = typer.Option("nccl", "--collectives", help="nccl (one rank per GPU) | gloo (several ranks "
                                    "on one GPU over cuda:gloo: no NCCL buffers)."),
    kl_coef: float = typer.Option(None, "--kl-coef", help="trainer.kl_coef (> 0 holds the frozen reference)."),
    search: bool = typer.Option(False, "--search", help="List every layout, micro-batch size and checkpointing "
                                "mode that fits the world, best first."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    detail: bool = typer.Option(False, "--detail", help="Also list one decoder layer's saved tensors per kind."),
    traffic: bool = typer.Option(False, "--traffic", help="Print the weight-sync traffic budget instead."),
    rollout_nodes: int = typer.Option(1, "--rollout-nodes", min=1, help="--traffic: rollout nodes receiving versions."),
    link_gbps: float = typer.Option(None, "--link-gbps", help="--traffic: per-node network rate, Gbit/s "
                                    "(default 3200, p5en EFA)."),
    s3_gbps_per_node: float = typer.Option(None, "--s3-gbps-per-node", help="--traffic: per-node S3 rate, Gbit/s "
                                           "(default 100; app/plan/traffic.py says why)."),
    step_s: float = typer.Option(60.0, "--step-s", help="--traffic: trainer step time, seconds."),
    publish_every: int = typer.Option(None, "--publish-every", min=1, help="--traffic: steps between versions "
                                      "(default trainer.publish_every)."),
    max_staleness: int = typer.Option(None, "--max-staleness", min=0, help="--traffic: buffer.max_staleness."),
    generation_s: float = typer.Option(None, "--generation-s", help="--traffic: seconds from a rollout's start "
                                       "to the buffer (default --step-s)."),
    load_s: float = typer.Option(0.0, "--load-s", help="--traffic: engine load time per version, seconds."),
    fsx_tib: float = typer.Option(0.0, "--fsx-tib", help="--traffic: FSx for Lustre capacity, TiB (0: none)."),
    fsx_mbps_per_tib: int = typer.Option(None, "--fsx-mbps-per-tib", help="--traffic: FSx throughput per TiB "
                                         "(with --fsx-tib; default 1000)."),
) -> None:
    """Print the per-GPU memory budget (exit 0 fits, 1 does not, 2 bad input)."""
    # transformers: when a plan runs (see _model)
    from app.model.config import num_routed_experts

    try:
        if fsx_mbps_per_tib is not None and not fsx_tib:
            raise ValueError("--fsx-mbps-per-tib needs --fsx-tib (the file system's capacity): alone it changes nothing")
        fsx_mbps_per_tib = 1000 if fsx_mbps_per_tib is None else fsx_mbps_per_tib
        run = RunConfig.load(config_path) if config_path else RunConfig()
        if dtype is not None or not config_path:
            if (dtype or "bfloat16") not in ("bfloat16", "float32"):
                raise ValueError(f"--dtype must be bfloat16 or float32, got {dtype!r}")
            run.model.dtype = dtype or "bfloat16"
        cfg = _model(model, run if config_path else None, num_layers, overrides)
        par = run.trainer.parallel.model_dump()
        par.update({k: v for k, v in dict(ep=ep, dp_shard=dp_shard, dp_replicate=dp_replicate,
                                          ep_backend=ep_backend).items() if v is not None})
        try:
            parallel = ParallelConfig(**par)
        except ValidationError as e:  # name the field the flag sets
            raise ValueError(f"trainer.parallel.{e.errors()[0]['loc'][0]}: {e.errors()[0]['msg']}") from None
        if search:
            _print_search(cfg, run, nodes, gpus_per_node, parallel, rollouts_per_gpu, seq_len, algorithm,
                          logprob_chunk_tokens, gpu_memory_gib, fragmentation, expert_imbalance, collectives,
                          kl_coef, json_out)
            return
        layout = resolve_layout(parallel, nodes * gpus_per_node, num_routed_experts(cfg))
        if traffic:
            _print_traffic(cfg, run, nodes, rollout_nodes, link_gbps, s3_gbps_per_node, step_s, publish_every,
                           max_staleness, generation_s, load_s, json_out, fsx_tib, fsx_mbps_per_tib, seq_len)
            return
        _print_memory(cfg, run, layout, gpus_per_node, parallel, micro_batch_tokens, activation_checkpointing,
                      logprob_chunk_tokens, rollouts_per_gpu, seq_len, algorithm, gpu_memory_gib, fragmentation,
                      json_out, detail, expert_imbalance, collectives, kl_coef)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _plan_input(cfg, run, layout, gpus_per_node, ep_backend, micro_batch_tokens, activation_checkpointing,
                logprob_chunk_tokens, rollouts_per_gpu, seq_len, algorithm, gpu_memory_gib, fragmentation,
                expert_imbalance, collectives, kl_coef):
    """The `PlanInput` of the flags over the run config, and why the dispatcher is the one it is."""
    # transformers and torchx: when a plan runs (see _model)
    from app.plan.memory import EXPERT_IMBALANCE, PlanInput, fragmentation_for, resolve_ep_backend
    from app.torchx_component import GPU_ALLOC_ENV

    t = run.trainer
    if collectives not in ("nccl", "gloo"):
        raise ValueError(f"--collectives must be nccl or gloo, got {collectives!r}")
    if kl_coef is not None and not 0 <= kl_coef < float("inf"):
        raise ValueError(f"--kl-coef must be finite and >= 0, got {kl_coef}")
    backend, reason = resolve_ep_backend(ep_backend, layout.ep, cfg.hidden_size, collectives)
    inp = PlanInput(
        config=cfg, layout=layout, gpus_per_node=gpus_per_node, rollouts_per_gpu=rollouts_per_gpu, seq_len=seq_len,
        micro_batch_tokens=micro_batch_tokens if micro_batch_tokens is not None else t.micro_batch_tokens,
        activation_checkpointing=activation_checkpointing or t.activation_checkpointing,
        logprob_chunk_tokens=logprob_chunk_tokens or t.logprob_chunk_tokens,
        algorithm=algorithm or t.algorithm, ep_backend=backend, compute_dtype=run.model.dtype,
        log_entropy=t.log_entropy,
        gpu_memory_gib=gpu_memory_gib if gpu_memory_gib is not None else instance_spec("p5en.48xlarge").gpu_memory_gib,
        # by default the allocator the GPU trainer pods configure
        fragmentation=fragmentation_for(GPU_ALLOC_ENV.get("PYTORCH_CUDA_ALLOC_CONF")) if fragmentation is None
        else fragmentation,
        reference=(t.kl_coef if kl_coef is None else kl_coef) > 0,
        expert_imbalance=EXPERT_IMBALANCE if expert_imbalance is None else expert_imbalance,
        collectives=collectives,
    )
    return inp, reason


def _print_memory(cfg, run, layout, gpus_per_node, parallel, micro_batch_tokens, activation_checkpointing,
                  logprob_chunk_tokens, rollouts_per_gpu, seq_len, algorithm, gpu_memory_gib, fragmentation,
                  json_out, detail, expert_imbalance=None, collectives="nccl", kl_coef=None):
    # transformers: when a plan runs (see _model)
    from app.plan.memory import constants, plan_memory

    inp, reason = _plan_input(cfg, run, layout, gpus_per_node, parallel.ep_backend, micro_batch_tokens,
                              activation_checkpointing, logprob_chunk_tokens, rollouts_per_gpu, seq_len, algorithm,
                              gpu_memory_gib, fragmentation, expert_imbalance, collectives, kl_coef)
    p = plan_memory(inp)
    if json_out:
        out = p.to_json()
        out["layout"]["ep_backend_requested"] = parallel.ep_backend
        out["layout"]["ep_backend_reason"] = reason
        print(json.dumps(out, indent=1))
    else:
        console = Console(width=160)
        m, lay = p.micro_batch, layout
        console.print(
            f"[bold]{cfg.model_type}[/] {cfg.num_hidden_layers} layers, {p.params.total / 1e9:.2f} B params "
            f"({p.params.experts / 1e9:.2f} B routed experts) | world {lay.world} = {lay.world // gpus_per_node} x "
            f"{gpus_per_node}, dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard}, ep {lay.ep}, efsdp "
            f"{lay.efsdp}, {inp.ep_backend} | {inp.rollouts_per_gpu} x {inp.seq_len} tokens per GPU in "
            f"{p.micro_batches} micro-batches of {m.seqs} x {m.seq_len} = {m.tokens} tokens | checkpointing "
            f"{inp.activation_checkpointing} | {inp.algorithm}{' + reference' if inp.reference else ''} | "
            f"{inp.compute_dtype} | expert imbalance {inp.expert_imbalance:g} | {inp.collectives}")
        console.print(f"ep_backend {parallel.ep_backend} -> {inp.ep_backend}: {reason}")
        table = Table(title="Per-GPU memory (GiB)", show_lines=False)
        for col, kw in (("term", {}), ("GiB", dict(justify="right")), ("in peak", dict(justify="center")),
                        ("formula", dict(overflow="fold", max_width=70))):
            table.add_column(col, **kw)
        peak = p.peak_phase
        for key, term in p.terms.items():
            table.add_row(term.name, _gib(term.bytes), "x" if key in p.phases[peak] else "", term.formula)
        console.print(table)
        phases = Table(title="Phases (GiB of live tensors)")
        phases.add_column("phase")
        phases.add_column("GiB", justify="right")
        for name in p.phases:
            phases.add_row(("[bold]" if name == peak else "") + name, _gib(p.phase_bytes(name)))
        console.print(phases)
        over = Table(title="Outside torch's allocator (GiB)")
        over.add_column("what")
        over.add_column("GiB", justify="right")
        over.add_column("formula", overflow="fold", max_width=80)
        for term in p.overhead_terms:
            over.add_row(term.name, _gib(term.bytes), term.formula)
        console.print(over)
        c = constants() | {"FRAGMENTATION": inp.fragmentation}
        summary = Table(title="Total", show_header=False)
        summary.add_column("")
        summary.add_column("", justify="right")
        summary.add_row(f"tensors at the peak ({peak}; compare max_memory_allocated)", _gib(p.tensors_peak))
        summary.add_row(f"x FRAGMENTATION {c['FRAGMENTATION']} (compare max_memory_reserved)", _gib(p.reserved))
        summary.add_row("+ CUDA context and NCCL buffers (table above)", _gib(p.overhead))
        summary.add_row("[bold]predicted device memory", _gib(p.predicted))
        summary.add_row("capacity (--gpu-memory-gib)", _gib(p.capacity))
        summary.add_row("headroom", _gib(p.headroom))
        summary.add_row("[bold]verdict", "[green]FITS" if p.fits else "[red]DOES NOT FIT")
        console.print(summary)
        console.print("constants (app/plan/memory.py): " + ", ".join(f"{k}={v}" for k, v in c.items()))
        if detail:
            for kind, terms in p.layer_detail.items():
                d = Table(title=f"One {kind} layer's saved tensors, one micro-batch (bytes)")
                d.add_column("tensor")
                d.add_column("bytes", justify="right")
                d.add_column("formula", overflow="fold")
                for term in terms:
                    d.add_row(term.name, f"{term.bytes:,}", term.formula)
                d.add_row("[bold]total", f"{sum(x.bytes for x in terms):,}", "")
                console.print(d)
    if not p.fits:
        raise typer.Exit(1)


def _print_search(cfg, run, nodes, gpus_per_node, parallel, rollouts_per_gpu, seq_len, algorithm,
                  logprob_chunk_tokens, gpu_memory_gib, fragmentation, expert_imbalance, collectives, kl_coef,
                  json_out):
    """``--search``: every candidate of `app.plan.search.candidates` planned; those that fit,
    best first (`app.plan.search.rank_key` says what best means). Exit 0 if one fits, else 1."""
    # transformers: when a plan runs (see _model)
    from app.plan import search as sr

    world = nodes * gpus_per_node
    rows = []
    for cand in sr.candidates(cfg, world, rollouts_per_gpu, seq_len):
        try:
            inp, reason = _plan_input(cfg, run, cand.layout, gpus_per_node, parallel.ep_backend,
                                      cand.micro_batch_tokens, cand.activation_checkpointing, logprob_chunk_tokens,
                                      rollouts_per_gpu, seq_len, algorithm, gpu_memory_gib, fragmentation,
                                      expert_imbalance, collectives, kl_coef)
        except ValueError as e:  # e.g. --ep-backend local for an ep > 1 candidate
            if cand.layout.ep == 1:
                raise
            rows.append(dict(ep=cand.layout.ep, fits=False, error=str(e)))
            continue
        rows.append(sr.evaluate(inp, reason))
    fits = sorted((r for r in rows if r["fits"]), key=sr.rank_key)
    if json_out:
        print(json.dumps(dict(world=world, gpus_per_node=gpus_per_node, rollouts_per_gpu=rollouts_per_gpu,
                              seq_len=seq_len, best_first=sr.RANKING, candidates=len(rows), fits=fits), indent=1))
    else:
        console = Console(width=160)
        console.print(f"[bold]{cfg.model_type}[/] {cfg.num_hidden_layers} layers on {nodes} x {gpus_per_node} GPUs, "
                      f"{rollouts_per_gpu} x {seq_len} tokens per GPU: {len(fits)} of {len(rows)} candidates fit. "
                      f"Best first: {sr.RANKING}")
        table = Table(title="Layouts that fit")
        for col in ("#", "ep", "dp_shard", "dp_replicate", "efsdp", "backend", "micro-batch tokens", "micro-batches",
                    "AC", "peak phase", "tensors GiB", "device GiB", "headroom GiB"):
            table.add_column(col, justify="left" if col in ("backend", "AC", "peak phase") else "right")
        for i, r in enumerate(fits, 1):
            table.add_row(str(i), str(r["ep"]), str(r["dp_shard"]), str(r["dp_replicate"]), str(r["efsdp"]),
                          r["ep_backend"], str(r["micro_batch_tokens"]), str(r["micro_batches"]),
                          r["activation_checkpointing"], r["peak_phase"], _gib(r["tensors_peak"]),
                          _gib(r["predicted"]), _gib(r["headroom"]))
        console.print(table)
    if not fits:
        raise typer.Exit(1)


def _print_traffic(cfg, run, nodes, rollout_nodes, link_gbps, s3_gbps_per_node, step_s, publish_every,
                   max_staleness, generation_s, load_s, json_out, fsx_tib=0.0, fsx_mbps_per_tib=1000, seq_len=None):
    # transformers: when a plan runs (see _model)
    from app.plan import traffic as tr

    dtype_bytes = 2 if run.model.dtype == "bfloat16" else 4
    t = tr.TrafficInput(
        trainer_nodes=nodes, rollout_nodes=rollout_nodes,
        link_gbps=link_gbps if link_gbps is not None else tr.LINK_GBPS_P5EN,
        s3_gbps_per_node=s3_gbps_per_node if s3_gbps_per_node is not None else tr.S3_GBPS_PER_NODE,
        step_s=step_s, publish_every=publish_every or run.trainer.publish_every,
        max_staleness=run.buffer.max_staleness if max_staleness is None else max_staleness,
        generation_s=step_s if generation_s is None else generation_s, load_s=load_s,
    )
    t.check()
    v = tr.version_bytes(cfg, dtype_bytes)
    v8 = tr.fp8_version_bytes(cfg)
    rows = []
    per_hour = tr.versions_per_hour(t)
    for path, path8 in zip(tr.paths(v, t), tr.paths(v8, t)):
        pmin = tr.min_publish_every(path.latency_s, t)
        rows.append(dict(
            path=path.name, link_bytes=path.link_bytes, seconds=path.seconds, fp8_seconds=path8.seconds,
            latency_s=path.latency_s, staleness=tr.staleness(path.latency_s, t), min_publish_every=pmin,
            s3_bytes_per_version=path.s3_bytes, s3_bytes_per_hour=path.s3_bytes * per_hour,
            s3_bytes_per_hour_at_min=(path.s3_bytes * tr.versions_per_hour(t, pmin)) if pmin else None,
        ))
    network_ok = rows[0]["staleness"] <= t.max_staleness
    starts = [vars(r) for r in tr.startup(cfg, nodes, rollout_nodes, dtype_bytes, fsx_tib=fsx_tib,
                                          fsx_mbps_per_tib=fsx_mbps_per_tib, s3_gbps_per_node=t.s3_gbps_per_node)]
    buffer_rows = _buffer_traffic(cfg, run, seq_len, step_s)
    if json_out:
        print(json.dumps(dict(
            model=dict(model_type=cfg.model_type, num_hidden_layers=cfg.num_hidden_layers),
            input=dict(trainer_nodes=t.trainer_nodes, rollout_nodes=t.rollout_nodes, link_gbps=t.link_gbps,
                       s3_gbps_per_node=t.s3_gbps_per_node, step_s=t.step_s, publish_every=t.publish_every,
                       max_staleness=t.max_staleness, generation_s=t.generation_s, load_s=t.load_s,
                       publish_dtype=run.model.dtype),
            version_bytes=v, fp8_version_bytes=v8, versions_per_hour=per_hour, paths=rows,
            network_within_staleness=network_ok, startup=starts, buffer=buffer_rows), indent=1))
    else:
        console = Console(width=160)
        console.print(
            f"[bold]{cfg.model_type}[/] {cfg.num_hidden_layers} layers | one version: {v / 1e12:.3f} TB "
            f"{run.model.dtype}, {v8 / 1e12:.3f} TB FP8 (e4m3, 128x128 block scales) | {t.trainer_nodes} trainer + "
            f"{t.rollout_nodes} rollout nodes | link {t.link_gbps:g} Gbit/s, S3 {t.s3_gbps_per_node:g} Gbit/s per "
            f"node | step {t.step_s:g} s, publish every {t.publish_every} step(s) = {per_hour:.1f} versions/h, "
            f"generation {t.generation_s:g} s, load {t.load_s:g} s, max_staleness {t.max_staleness}")
        table = Table(title="Weight sync per version")
        for col in ("path", "busiest link (GB)", "time (s)", "time FP8 (s)", "latency L (s)",
                    f"staleness at P={t.publish_every}", "min P (steps)", "S3 GB/version", "S3 TB/hour",
                    "S3 TB/hour at min P"):
            table.add_column(col, justify="right" if col != "path" else "left")
        for r in rows:
            table.add_row(
                r["path"], f"{r['link_bytes'] / 1e9:,.1f}", f"{r['seconds']:,.1f}", f"{r['fp8_seconds']:,.1f}",
                f"{r['latency_s']:,.1f}", str(r["staleness"]),
                str(r["min_publish_every"]) if r["min_publish_every"] else "none",
                f"{r['s3_bytes_per_version'] / 1e9:,.1f}", f"{r['s3_bytes_per_hour'] / 1e12:,.2f}",
                f"{r['s3_bytes_per_hour_at_min'] / 1e12:,.2f}" if r["s3_bytes_per_hour_at_min"] is not None else "-")
        console.print(table)
        console.print("staleness = ceil((L + generation + step) / (P * step)); formulas and assumptions: "
                      "app/plan/traffic.py")
        st = Table(title=f"Start-up reads per node (FSx: {fsx_tib:g} TiB x {fsx_mbps_per_tib} MB/s/TiB)")
        for col in ("read", "GB per node", "nodes at once", "from S3 (s)", "from FSx (s)", "reads from"):
            st.add_column(col, justify="left" if col in ("read", "reads from") else "right")
        for r in starts:
            st.add_row(r["role"], f"{r['nbytes'] / 1e9:,.1f}", str(r["nodes"]), f"{r['s3_s']:,.0f}",
                       "-" if r["fsx_s"] is None else f"{r['fsx_s']:,.0f}", r["reads_from"])
        console.print(st)
        console.print("[green]network path keeps staleness within max_staleness" if network_ok else
                      f"[red]network path exceeds max_staleness at P={t.publish_every}; min P: "
                      f"{rows[0]['min_publish_every'] or 'none (max_staleness 0)'}")
        _print_buffer_table(console, run, seq_len, buffer_rows)
    if not network_ok:
        raise typer.Exit(1)


def _buffer_traffic(cfg, run, seq_len: int, step_s: float) -> list[dict]:
    """`app.plan.traffic.buffer_traffic` without and with routing replay; prompts of
    ``seq_len - rollout.max_new_tokens`` tokens."""
    # transformers: when a plan runs (see _model)
    from app.plan import traffic as tr

    prompt = seq_len - run.rollout.max_new_tokens
    if prompt < 1:  # no prompt left within --seq-len: no buffer table (the weight-sync one stands)
        return []
    return [{**asdict(tr.buffer_traffic(cfg, run, prompt, step_s, replay)), "this_config": replay == run.rollout.routing_replay}
            for replay in (False, True)]


def _print_buffer_table(console, run, seq_len: int, rows: list[dict]) -> None:
    t = run.trainer
    if not rows:
        console.print(f"experience buffer: --seq-len {seq_len} leaves no prompt beside rollout.max_new_tokens "
                      f"{run.rollout.max_new_tokens}; give --seq-len as prompt + completion tokens")
        return
    table = Table(title=f"Experience buffer per step ({t.groups_per_step} groups of {run.rollout.group_size} x "
                        f"({seq_len - run.rollout.max_new_tokens} + {run.rollout.max_new_tokens}) tokens, capacity "
                        f"{run.buffer.capacity_groups}, save every {t.save_every})")
    for col in ("routing replay", "payload MB/group", "of it routed MB", "GB in = out per step", "groups held",
                "Redis GB held", "main thread s/step", "link Gbit/s"):
        table.add_column(col, justify="right" if col != "routing replay" else "left")
    for r in rows:
        table.add_row(("yes" if r["routing_replay"] else "no") + (" (this config)" if r["this_config"] else ""),
                      f"{r['payload_bytes'] / 1e6:,.2f}", f"{r['routed_bytes'] / 1e6:,.2f}", f"{r['step_bytes'] / 1e9:,.2f}",
                      str(r["held_groups"]), f"{r['memory_bytes'] / 1e9:,.1f}", f"{r['main_thread_s']:,.2f}",
                      f"{r['link_gbps']:,.2f}")
    console.print(table)
    console.print("groups held = capacity_groups + (save_every + 1) x groups_per_step; main thread at "
                  "6.9 ns per payload byte (measured, app/plan/traffic.py)")
