"""`moerl bench rollout`: drive N SGLang-compatible engines with a run's prompts for T seconds.

    moerl bench rollout --url http://e0:30000 --url http://e1:30000 --seconds 60 --config run.yaml

What it does, in one run:

1. waits (``--wait-s``) until every engine answers ``/health_generate``;
2. baseline: engine 0 alone, one request at a time, for ``--baseline-seconds``;
3. load: every engine with ``--concurrency`` requests in flight for ``--seconds``. A request is
   one prompt group as a rollout worker sends it: the prompt text of the run's task
   (``task`` section, `app.envs.tasks.make_splits`, train split in order), ``n =
   rollout.group_size``, ``rollout.max_new_tokens`` (or ``--max-new-tokens``), the run's
   temperature and top_p, logprobs on. No new request starts after ``--seconds``; the ones in
   flight finish and count.

With ``--router-url`` (the router in front of those engines, app/rollout/router.py) it compares
the two layouts instead, in one run: ``--concurrency`` lanes per engine, each a worker's in-flight
episode that waits on its environment (an exponential wait of mean ``--env-wait-s``, seeded; one
value for every worker, or one per ``--url``: workers whose environments differ) and then sends
one group; first every lane pinned to its engine (today's one worker per engine), then
every lane through the router, ``--seconds`` each, alternated ``--repeats`` times (a shared
machine's load then falls on both alike; the figures pool the repeats). Figures per layout: request latency p50/p99,
samples (sequences) per second, and each engine's idle fraction (its ``/server_info`` polled
every 20 ms: no sequence running or waiting; the built-in engine's fields, nan on SGLang).

Figures: generated tokens (the completions' ``output_ids``) per second over the load phase's wall
time, aggregate and per engine; per GPU (``--gpus-per-engine`` x engines); request latency
percentiles (p50/p90/p99, seconds, nearest-rank); failed requests. Ratio: aggregate tokens/s over
the baseline's (what batching and the engines add over one sequential stream, measured in the
same run). The A/B between engine profiles (all-to-all vs DeepEP) is two runs of this command,
one against each fleet (charts8s/benchrollout.py renders them as Jobs).

HTTP: one `app.rollout.engine_client.EngineClient` per engine (asyncio + httpx, a connection per
in-flight request; no thread per request), with the bearer token of ``$MOERL_ENGINE_API_KEY`` when
it is set (the cluster's bench fleets serve on the pod network with SGLang's ``--api-key``).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field

from app.bench.results import print_notes_and_write
from app.config import RunConfig
from app.envs.tasks import make_splits
from app.names import API_KEY_ENV, ROUTER_API_KEY_ENV
from app.rollout.engine_client import EngineClient, EngineError


@dataclass
class RolloutBench:
    """Inputs of the rollout benchmark (the CLI's flags)."""

    urls: tuple[str, ...] = ()
    seconds: float = 30.0
    config: str = ""  # run config YAML ("" = RunConfig defaults)
    concurrency: int = 0  # requests in flight per engine (0 = the run config's rollout.inflight_tasks())
    gpus_per_engine: int = 1
    max_new_tokens: int = 0  # 0 = rollout.max_new_tokens
    baseline_seconds: float = -1.0  # < 0: min(seconds / 4, 30)
    wait_s: float = 120.0
    request_timeout_s: float = 600.0
    label: str = ""
    router_url: str = ""  # "" = no layout comparison
    env_wait_s: tuple[float, ...] = (0.0,)  # mean environment wait before each request: one, or one per url (s)
    seed: int = 0
    repeats: int = 1  # pinned/router pairs of the layout comparison

    def check(self) -> None:
        """Raise ValueError naming the first bad flag."""
        if not self.urls:
            raise ValueError("--url: give at least one engine URL")
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"--url {u!r}: must start with http:// or https://")
        if not self.seconds > 0:
            raise ValueError(f"--seconds must be > 0, got {self.seconds}")
        for name in ("concurrency", "max_new_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.router_url and not self.router_url.startswith(("http://", "https://")):
            raise ValueError(f"--router-url {self.router_url!r}: must start with http:// or https://")
        if len(self.env_wait_s) not in (1, len(self.urls)) or any(not w >= 0 for w in self.env_wait_s):
            raise ValueError(f"--env-wait-s: one value >= 0, or one per --url ({len(self.urls)}), got "
                             f"{list(self.env_wait_s)}")
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        if self.gpus_per_engine < 1:
            raise ValueError(f"--gpus-per-engine must be at least 1, got {self.gpus_per_engine}")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list; nan when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latencies(values: list[float]) -> dict[str, float]:
    """p50 / p90 / p99 of request latencies, seconds."""
    return {f"latency_p{q}_s": percentile(values, q) for q in (50, 90, 99)}


@dataclass
class Tally:
    """What one phase measured on one engine."""

    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    sequences: int = 0
    errors: int = 0


async def drive(clients, prompts: list[str], seconds: float, concurrency: int, gen_kwargs: dict) -> tuple[list[Tally], float]:
    """Keep ``concurrency`` requests in flight on each client for ``seconds``; the ones in flight
    then finish. Returns (one Tally per client, wall seconds from start to the last answer)."""
    tallies = [Tally() for _ in clients]
    counter = iter(range(1 << 62))
    start = time.perf_counter()
    deadline = start + seconds

    async def lane(i: int) -> None:
        client, tally = clients[i], tallies[i]
        while time.perf_counter() < deadline:
            prompt = prompts[next(counter) % len(prompts)]
            t0 = time.perf_counter()
            try:
                outs = await client.generate(prompt, **gen_kwargs)
            except EngineError:
                tally.errors += 1
                await asyncio.sleep(0.1)  # do not spin on an engine that refuses everything
                continue
            tally.latencies.append(time.perf_counter() - t0)
            tally.tokens += sum(len(o.token_ids) for o in outs)
            tally.sequences += len(outs)

    await asyncio.gather(*(lane(i) for i in range(len(clients)) for _ in range(concurrency)))
    return tallies, time.perf_counter() - start


async def idle_fractions(engines, stop: asyncio.Event, every_s: float = 0.02) -> list[float]:
    """Poll each engine's ``/server_info`` every ``every_s`` until ``stop``; the fraction of polls
    where it had no sequence running or waiting (nan for an engine that does not report them)."""
    idle, polls = [0] * len(engines), [0] * len(engines)
    while not stop.is_set():
        infos = await asyncio.gather(*(e.server_info() for e in engines), return_exceptions=True)
        for i, info in enumerate(infos):
            if isinstance(info, dict) and "running" in info and "waiting" in info:
                polls[i] += 1
                idle[i] += info["running"] == 0 and info["waiting"] == 0
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except asyncio.TimeoutError:
            pass
    return [i / p if p else math.nan for i, p in zip(idle, polls)]


async def drive_layout(lane_clients, engines, prompts: list[str], seconds: float, env_wait_s: list[float],
                       seed: int, gen_kwargs: dict) -> dict:
    """One lane per entry of ``lane_clients`` (the client its requests go to): wait on the
    environment (exponential, mean ``env_wait_s[lane]``), send one group, repeat for ``seconds``.
    Returns latencies (s), sequences, errors, wall seconds and the engines' idle fractions."""
    rng = random.Random(seed)  # the same waits for both layouts
    waits = [[rng.expovariate(1 / w) if w else 0.0 for _ in range(4096)] for w in env_wait_s]
    lat: list[float] = []
    counts = {"sequences": 0, "errors": 0}
    stop = asyncio.Event()
    poller = asyncio.create_task(idle_fractions(engines, stop))
    start = time.perf_counter()
    deadline = start + seconds

    async def lane(i: int) -> None:
        k = 0
        while time.perf_counter() < deadline:
            await asyncio.sleep(waits[i][k % len(waits[i])])
            prompt = prompts[(i * 7919 + k) % len(prompts)]
            k += 1
            t0 = time.perf_counter()
            try:
                outs = await lane_clients[i].generate(prompt, **gen_kwargs)
            except EngineError:
                counts["errors"] += 1
                continue
            lat.append(time.perf_counter() - t0)
            counts["sequences"] += len(outs)

    await asyncio.gather(*(lane(i) for i in range(len(lane_clients))))
    wall = time.perf_counter() - start
    stop.set()
    return {"latencies": lat, "wall_s": wall, "idle": await poller, **counts}


def pool(runs: list[dict]) -> dict:
    """`drive_layout` results of several repeats as one: latencies and counts summed, idle
    fractions averaged per engine (weighted by each repeat's wall time)."""
    wall = sum(m["wall_s"] for m in runs)
    idle = [sum(m["idle"][i] * m["wall_s"] for m in runs) / wall for i in range(len(runs[0]["idle"]))]
    return {"latencies": [x for m in runs for x in m["latencies"]], "wall_s": wall, "idle": idle,
            "sequences": sum(m["sequences"] for m in runs), "errors": sum(m["errors"] for m in runs),
            "per_repeat_samples_per_s": [m["sequences"] / m["wall_s"] for m in runs]}


async def _compare_async(bench: RolloutBench, cfg, prompts: list[str], concurrency: int) -> tuple[dict, dict, dict]:
    r = cfg.rollout
    gen_kwargs = dict(n=r.group_size, max_new_tokens=bench.max_new_tokens or r.max_new_tokens,
                      temperature=r.temperature, top_p=r.top_p, return_logprob=True)
    key = os.environ.get(API_KEY_ENV) or None
    lanes = len(bench.urls) * concurrency
    engines = [EngineClient(u, timeout_s=bench.request_timeout_s, retries=0, max_connections=lanes + 4, api_key=key)
               for u in bench.urls]
    router = EngineClient(bench.router_url, timeout_s=bench.request_timeout_s, retries=0, max_connections=lanes + 4,
                          api_key=os.environ.get(ROUTER_API_KEY_ENV) or None)  # the router's --api-key, if any
    try:
        deadline = time.monotonic() + bench.wait_s
        for c in [*engines, router]:
            while not await c.health_generate(timeout_s=30.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{c.url} not healthy after --wait-s {bench.wait_s:.0f} s")
                await asyncio.sleep(2.0)
        # lane j belongs to worker j // concurrency, and waits on that worker's environment
        means = list(bench.env_wait_s) * (len(engines) if len(bench.env_wait_s) == 1 else 1)
        waits = [means[j // concurrency] for j in range(lanes)]
        pinned = [engines[j // concurrency] for j in range(lanes)]
        runs: tuple[list, list] = ([], [])
        for k in range(bench.repeats):
            runs[0].append(await drive_layout(pinned, engines, prompts, bench.seconds, waits, bench.seed + k, gen_kwargs))
            runs[1].append(await drive_layout([router] * lanes, engines, prompts, bench.seconds, waits, bench.seed + k,
                                              gen_kwargs))
        return pool(runs[0]), pool(runs[1]), gen_kwargs
    finally:
        for c in [*engines, router]:
            await c.aclose()


def compare(bench: RolloutBench, cfg, prompts: list[str], concurrency: int, out_dir: str) -> dict:
    """The layout comparison (``--router-url``): pinned lanes, then the same lanes through the router."""
    pinned, routed, gen_kwargs = asyncio.run(_compare_async(bench, cfg, prompts, concurrency))
    figures = []
    for name, m in (("pinned (one worker per engine)", pinned), ("router", routed)):
        idle = [x for x in m["idle"] if not math.isnan(x)]
        figures.append({"name": name, "requests": len(m["latencies"]), "sequences": m["sequences"],
                        "errors": m["errors"], "wall_s": m["wall_s"], "samples_per_s": m["sequences"] / m["wall_s"],
                        "engine_idle_fraction": sum(idle) / len(idle) if idle else math.nan,
                        "engine_idle_fractions": m["idle"], "per_repeat_samples_per_s": m["per_repeat_samples_per_s"],
                        **latencies(m["latencies"])})
    a, b = figures
    ratios = {"router samples/s / pinned samples/s": b["samples_per_s"] / a["samples_per_s"] if a["samples_per_s"]
              else math.nan,
              "router p99 / pinned p99": b["latency_p99_s"] / a["latency_p99_s"] if a["latency_p99_s"] else math.nan}
    notes = ["latency: one request = one prompt group, seconds, nearest-rank; the environment waits are not in it",
             "idle: the fraction of /server_info polls (every 20 ms) with nothing running or waiting, mean over engines"]
    if a["errors"] or b["errors"]:
        notes.append(f"failed requests: pinned {a['errors']}, router {b['errors']} (not counted)")
    shape = {**asdict(bench), "urls": list(bench.urls), "concurrency": concurrency, "prompts": len(prompts),
             "task": cfg.task.name, **{k: v for k, v in gen_kwargs.items() if k != "return_logprob"}}
    title = f" [{bench.label}]" if bench.label else ""
    print(f"rollout layouts{title}: {len(bench.urls)} engines x {concurrency} lanes, env wait mean "
          f"{'/'.join(f'{w:g}' for w in bench.env_wait_s)} s (n={gen_kwargs['n']}, max_new_tokens={gen_kwargs['max_new_tokens']}), "
          f"{bench.seconds:g} s each, {bench.repeats} repeat(s)")
    print(f"{'layout':<34}{'samples/s':>11}{'requests':>10}{'errors':>8}{'p50 s':>8}{'p99 s':>8}{'idle':>7}")
    for f in figures:
        print(f"{f['name']:<34}{f['samples_per_s']:>11.1f}{f['requests']:>10}{f['errors']:>8}"
              f"{f['latency_p50_s']:>8.3f}{f['latency_p99_s']:>8.3f}{f['engine_idle_fraction']:>7.2f}")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    return print_notes_and_write("rollout", shape, figures, ratios, notes, out_dir)


async def _run_async(bench: RolloutBench, cfg, prompts: list[str], concurrency: int, baseline_s: float):
    r = cfg.rollout
    gen_kwargs = dict(n=r.group_size, max_new_tokens=bench.max_new_tokens or r.max_new_tokens,
                      temperature=r.temperature, top_p=r.top_p, return_logprob=True)
    key = os.environ.get(API_KEY_ENV) or None
    clients = [EngineClient(u, timeout_s=bench.request_timeout_s, retries=0, max_connections=concurrency + 4,
                            api_key=key) for u in bench.urls]
    try:
        deadline = time.monotonic() + bench.wait_s
        for c in clients:
            while not await c.health_generate(timeout_s=30.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"engine {c.url} not healthy after --wait-s {bench.wait_s:.0f} s")
                await asyncio.sleep(2.0)
        base = None
        if baseline_s > 0:
            base = await drive(clients[:1], prompts, baseline_s, 1, gen_kwargs)
        load = await drive(clients, prompts, bench.seconds, concurrency, gen_kwargs)
        return base, load, gen_kwargs
    finally:
        for c in clients:
            await c.aclose()


def run(bench: RolloutBench, out_dir: str = "runs/bench") -> dict:
    """Run the benchmark, print the figures, write the result file.

    Returns:
        dict with ``figures``, ``ratios``, ``notes`` and ``path``.

    Raises:
        ValueError: a bad flag or run config (named); TimeoutError: an engine never answered.
    """
    bench.check()
    cfg = RunConfig.load(bench.config) if bench.config else RunConfig()
    prompts = [p.text for p in make_splits(cfg.task)[0]]
    concurrency = bench.concurrency or cfg.rollout.inflight_tasks()
    if bench.router_url:
        return compare(bench, cfg, prompts, concurrency, out_dir)
    baseline_s = min(bench.seconds / 4, 30.0) if bench.baseline_seconds < 0 else bench.baseline_seconds
    base, (tallies, wall), gen_kwargs = asyncio.run(_run_async(bench, cfg, prompts, concurrency, baseline_s))

    notes: list[str] = []
    figures: list[dict] = []
    for url, t in zip(bench.urls, tallies):
        figures.append({"name": f"engine {url}", "tokens": t.tokens, "sequences": t.sequences,
                        "requests": len(t.latencies), "errors": t.errors, "tokens_per_s": t.tokens / wall,
                        **latencies(t.latencies)})
    lat = [x for t in tallies for x in t.latencies]
    tokens = sum(t.tokens for t in tallies)
    gpus = bench.gpus_per_engine * len(bench.urls)
    agg = {"name": "aggregate", "engines": len(bench.urls), "gpus": gpus, "concurrency_per_engine": concurrency,
           "wall_s": wall, "tokens": tokens, "sequences": sum(t.sequences for t in tallies), "requests": len(lat),
           "errors": sum(t.errors for t in tallies), "tokens_per_s": tokens / wall, "tokens_per_s_per_gpu": tokens / wall / gpus,
           **latencies(lat)}
    figures.append(agg)
    ratios = {}
    if base is not None:
        (bt,), bwall = base
        figures.append({"name": "baseline (engine 0, 1 request in flight)", "wall_s": bwall, "tokens": bt.tokens,
                        "requests": len(bt.latencies), "errors": bt.errors, "tokens_per_s": bt.tokens / bwall,
                        **latencies(bt.latencies)})
        if bt.tokens:
            ratios["aggregate tokens/s / baseline tokens/s"] = agg["tokens_per_s"] / (bt.tokens / bwall)
        else:
            notes.append("the baseline generated no token: no ratio")
    if agg["errors"]:
        notes.append(f"{agg['errors']} requests failed (not counted in tokens or latency)")
    notes.append("latency: one request = one prompt group (n = rollout.group_size sequences), seconds, nearest-rank")

    shape = {**asdict(bench), "urls": list(bench.urls), "concurrency": concurrency, "baseline_seconds": baseline_s,
             "prompts": len(prompts), "task": cfg.task.name, **{k: v for k, v in gen_kwargs.items() if k != "return_logprob"}}
    title = f" [{bench.label}]" if bench.label else ""
    print(f"rollout{title}: {len(bench.urls)} engines x {concurrency} requests in flight (n={gen_kwargs['n']}, "
          f"max_new_tokens={gen_kwargs['max_new_tokens']}) for {bench.seconds:g} s; {gpus} GPUs")
    print(f"{'what':<46}{'tokens/s':>11}{'tok/s/GPU':>11}{'requests':>10}{'errors':>8}{'p50 s':>8}{'p90 s':>8}{'p99 s':>8}")
    for f in figures:
        per_gpu = f.get("tokens_per_s_per_gpu")
        print(f"{f['name'][:45]:<46}{f['tokens_per_s']:>11.1f}{'' if per_gpu is None else f'{per_gpu:.1f}':>11}"
              f"{f['requests']:>10}{f['errors']:>8}{f['latency_p50_s']:>8.3f}{f['latency_p90_s']:>8.3f}"
              f"{f['latency_p99_s']:>8.3f}")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.2f}")
    return print_notes_and_write("rollout", shape, figures, ratios, notes, out_dir)
