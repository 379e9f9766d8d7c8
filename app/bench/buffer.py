"""`moerl bench buffer`: the experience buffer under the seed's traffic, against a real redis-server.

    moerl bench buffer --writers 4 --groups 48 --replay both

What one run does, per leg (``plain``: no routing replay; ``replay``: every sample carries the
engine's routed experts, as with ``rollout.routing_replay``), each on a fresh redis-server with
the buffer pod's persistence (app/buffer/redis_server.py: append-only, fsync every second):

1. queues ``--groups`` tasks, prompts of ``--prompt-len`` tokens, groups of ``--group-size``;
2. ``--writers`` writer processes lease them and publish finished groups through
   `ExperienceBuffer.publish`: completions of ``--completion-len`` tokens with one float
   logprob each and, in the replay leg, the routed experts of every layer the engine reports
   (``[P + C - 1, num_hidden_layers, K]``, what a rollout worker gets from SGLang), built once
   per writer so that the publish alone is timed. Writers respect back-pressure
   (``--capacity`` groups; by default ``(--commit-every + 1) x --batch-groups``, the smallest
   ``buffer.capacity_groups`` a trainer saving every ``--commit-every`` steps of
   ``--batch-groups`` groups was allowed before taken groups stopped counting);
3. meanwhile this process plays trainer rank 0 of a one-rank trainer: whenever ``--batch-groups``
   untaken groups are ready it takes them and turns them into the trainer's tensors
   (`trainer_take`), and commits every ``--commit-every`` batches (a save interval).

Figures per leg: groups/s (wall time from the first publish to the last take); bytes per group
on the wire (redis-server's own ``total_net_input_bytes`` / ``total_net_output_bytes``, divided
by the groups); Redis memory per group (``used_memory`` over the baseline divided by the groups
held, the largest of the readings taken before each commit); Redis CPU per group (``used_cpu_*``
of the whole server and of its main thread); the main thread's time per command
(``INFO commandstats``); publish latency and client CPU per publish (p50/p99, nearest rank, from
every writer's calls); take latency per batch and per group (p50/p99), the trainer's CPU per
group.

In-run baseline: after the load, the same server runs ``--baseline-calls`` plain XADDs of a
random payload of one group's wire bytes (what storing those bytes costs Redis at the least);
the ratio is publish main-thread time / that XADD's.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import queue
import time
from dataclasses import asdict, dataclass, replace

import numpy as np
import redis

from app.bench.results import check_out_dir, print_notes_and_write
from app.buffer import ExperienceBuffer, LocalRedis, Task
from app.buffer.records import Sample, routed_experts_of_moe_layers
from app.model.config import deepseek_v3_config, moe_layer_ids, num_routed_experts, tiny_config
from app.trainer.batch import collate_groups, split_groups

RUN_ID = "bench-buffer"
MODELS = ("deepseek-v3", "tiny")
REPLAY = ("both", "off", "on")


@dataclass
class BufferBench:
    """Flags of `moerl bench buffer` (see the module doc)."""

    writers: int = 4
    groups: int = 48
    group_size: int = 16
    prompt_len: int = 512
    completion_len: int = 8192
    batch_groups: int = 4
    commit_every: int = 5
    capacity: int = 0  # 0: (commit_every + 1) * batch_groups, the trainer's minimum (app/config.py)
    replay: str = "both"
    model: str = "deepseek-v3"
    baseline_calls: int = 5
    timeout_s: float = 600.0

    def check(self) -> None:
        """Raise ValueError naming the first bad flag."""
        for name in ("writers", "groups", "group_size", "prompt_len", "completion_len", "batch_groups",
                     "commit_every", "baseline_calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.capacity < 0:
            raise ValueError(f"--capacity must be >= 0, got {self.capacity}")
        if self.replay not in REPLAY:
            raise ValueError(f"--replay must be one of {', '.join(REPLAY)}, got {self.replay!r}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout-s must be > 0, got {self.timeout_s}")


def model_shape(name: str) -> dict:
    """Routing shape of ``--model``: decoder layers, MoE layer indices, experts per token K, experts E
    and the vocabulary (token ids are drawn below it)."""
    config = deepseek_v3_config() if name == "deepseek-v3" else tiny_config("tiny-deepseek-v3")
    return {"layers": int(config.num_hidden_layers), "moe_layers": moe_layer_ids(config),
            "topk": int(config.num_experts_per_tok), "experts": num_routed_experts(config),
            "vocab": int(config.vocab_size)}


def template_samples(bench: BufferBench, shape: dict, replay: bool, seed: int) -> list:
    """One group's G samples of the seed's size (ids and routing random, fixed per writer)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, shape["vocab"], bench.prompt_len).tolist()
    out = []
    for i in range(bench.group_size):
        completion = rng.integers(0, shape["vocab"], bench.completion_len).tolist()
        logprobs = (-rng.exponential(1.0, bench.completion_len)).tolist()
        routed = None
        if replay:
            fed = bench.prompt_len + bench.completion_len - 1
            ids = rng.integers(0, shape["experts"], (fed, shape["layers"], shape["topk"]), dtype=np.int32)
            routed = routed_for_sample(ids, shape["moe_layers"])
        out.append(Sample(sample_id="", task_id="", index=i, attempt=0, prompt_ids=prompt, completion_ids=completion,
                          logprobs=logprobs, reward=float(i % 2), policy_version=0, finish_reason="length",
                          routed_experts=routed))
    return out


def routed_for_sample(ids, moe_layers: list[int]):
    """What a rollout worker stores in `Sample.routed_experts` for the engine's ``[T, layers, K]`` ids
    (app/rollout/worker.py): the MoE layers' rows, one byte per id for 256 experts."""
    return routed_experts_of_moe_layers(ids, moe_layers)


def trainer_take(buf, n: int, moe_layers: list[int] | None, num_experts: int) -> dict:
    """What a one-rank trainer does to turn ``n`` ready groups into tensors (app/trainer/intake.py).

    Rank 0's serial part (``rank0_s``): take the groups' headers, check each one (the loop's
    `usable`: `GroupHeader.check`), assign them to ranks and pickle the assignment for
    `broadcast_object_list` (``broadcast_bytes``); each rank's part (``decode_s``): read its
    groups' payloads, decode, check and collate them (here: all of them).
    """
    t0 = time.perf_counter()
    headers = buf.take_headers(n, trainer_version=0, timeout_s=5.0)
    for h in headers:
        h.check(moe_layers)
    sent = len(pickle.dumps(split_groups(headers, 1)))
    t1 = time.perf_counter()
    groups, bad = buf.read_groups(headers, num_experts=num_experts)
    if bad:
        raise RuntimeError(f"payloads that do not decode: {bad}")
    for g in groups:
        g.check(moe_layers)
    collate_groups(groups, moe_layers=moe_layers)
    return {"groups": len(headers), "rank0_s": t1 - t0, "decode_s": time.perf_counter() - t1, "broadcast_bytes": sent}


def writer(url: str, bench: BufferBench, shape: dict, replay: bool, index: int, results) -> None:
    """A writer process: lease one task at a time, publish the template group for it, until the
    queue stays empty. Puts ``{"latency_s": [...], "cpu_s": [...]}`` on `results`."""
    samples = template_samples(bench, shape, replay, seed=index)
    buf = ExperienceBuffer(url, RUN_ID, capacity_groups=bench.capacity, max_staleness=10**6)
    latency, cpu = [], []
    idle_since = None
    try:
        while True:
            if not buf.wait_for_capacity(0.5):
                continue
            tasks = buf.lease(f"w{index}", count=1, block_ms=200)
            if not tasks:
                if buf.stats()["queued"] == 0:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 1.0:
                        break
                continue
            idle_since = None
            (task,) = tasks
            group = [replace(s, sample_id=task.sample_id(RUN_ID, s.index), task_id=task.task_id, attempt=task.attempt,
                             prompt_ids=task.prompt_ids) for s in samples]
            t0, c0 = time.perf_counter(), time.process_time()
            buf.publish(task, group)
            latency.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    finally:
        results.put({"latency_s": latency, "cpu_s": cpu})
        buf.close()


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def redis_info(client) -> dict:
    """The figures read from INFO: memory, CPU (server and main thread), network bytes, commandstats."""
    info = client.info("all")
    cmds = {k[len("cmdstat_"):]: v for k, v in info.items() if k.startswith("cmdstat_")}
    return {
        "used_memory": info["used_memory"],
        "cpu_s": info["used_cpu_sys"] + info["used_cpu_user"],
        "main_cpu_s": info.get("used_cpu_sys_main_thread", math.nan) + info.get("used_cpu_user_main_thread", math.nan),
        "net_in": info["total_net_input_bytes"], "net_out": info["total_net_output_bytes"],
        "cmds": {k: (v["calls"], v["usec"]) for k, v in cmds.items()},
    }


def run_leg(bench: BufferBench, replay: bool) -> tuple[dict, list[dict]]:
    """One leg on a fresh redis-server; returns (its figures row, per-command rows)."""
    shape = model_shape(bench.model)
    leg = "replay" if replay else "plain"
    load_start = os.getloadavg()[0]
    with LocalRedis() as server:
        # The server's main thread is busy for long stretches under this load: a patient client.
        admin = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=120.0)
        trainer = ExperienceBuffer(server.url, RUN_ID, capacity_groups=bench.capacity, max_staleness=10**6,
                                   autocommit=False)
        prompt = list(range(bench.prompt_len))
        trainer.put_tasks([Task(f"t{i:06d}", prompt, "", "{}", bench.group_size) for i in range(bench.groups)])
        admin.config_resetstat()
        base = redis_info(admin)
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=writer, args=(server.url, bench, shape, replay, i, results), daemon=True)
                 for i in range(bench.writers)]
        for p in procs:
            p.start()
        take_s, take_cpu_s, rank0_s, decode_s, sent, per_group_mem = [], [], [], [], [], []
        taken = batches = 0
        start = None
        done = False
        deadline = time.monotonic() + bench.timeout_s
        try:
            while taken < bench.groups:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{leg}: only {taken}/{bench.groups} groups taken in --timeout-s "
                                       f"{bench.timeout_s:g}; writers alive: {sum(p.is_alive() for p in procs)}")
                finished = int(admin.hget(trainer.keys["stats"], "finished") or 0)
                if start is None and finished > 0:
                    start = time.perf_counter()
                want = min(bench.batch_groups, bench.groups - taken)
                if finished - taken < want:
                    time.sleep(0.01)
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                r = trainer_take(trainer, want, shape["moe_layers"] if replay else None, shape["experts"])
                got = r["groups"]
                take_s.append(time.perf_counter() - t0)
                take_cpu_s.append((time.process_time() - c0) / max(got, 1))
                rank0_s.append(r["rank0_s"] / max(got, 1))
                decode_s.append(r["decode_s"] / max(got, 1))
                sent.append(r["broadcast_bytes"] / max(got, 1))
                taken += got
                batches += 1
                if batches % bench.commit_every == 0 or taken >= bench.groups:
                    held = admin.xlen(trainer.keys["samples"])
                    if held:
                        per_group_mem.append((admin.info("memory")["used_memory"] - base["used_memory"]) / held)
                    trainer.commit()
            wall = time.perf_counter() - (start or time.perf_counter())
            done = True
        finally:
            lat, cpu = [], []
            for p in procs:
                if not done:  # interrupted or failed: stop the writers now
                    p.kill()
                p.join(timeout=30)
            while True:
                try:
                    r = results.get(timeout=1)
                except queue.Empty:
                    break
                lat += r["latency_s"]
                cpu += r["cpu_s"]
            for p in procs:
                if p.is_alive():
                    p.kill()
        end = redis_info(admin)
        n = bench.groups
        cmd_rows = []
        for name, (calls, usec) in sorted(end["cmds"].items()):
            c0, u0 = base["cmds"].get(name, (0, 0))
            if calls - c0 > 0:
                cmd_rows.append({"name": f"{leg} {name}", "calls": calls - c0,
                                 "usec_per_call": (usec - u0) / (calls - c0), "main_ms_per_group": (usec - u0) / 1e3 / n})
        wire_in = (end["net_in"] - base["net_in"]) / n
        # Baseline: plain XADDs of one group's wire bytes on the same server.
        admin.config_resetstat()
        payload = os.urandom(int(wire_in))
        for _ in range(bench.baseline_calls):
            admin.xadd("bench:baseline", {"p": payload})
            admin.delete("bench:baseline")
        xadd = admin.info("commandstats")["cmdstat_xadd"]
        trainer.close()
        admin.close()
    publish_cmds = [r for r in cmd_rows if r["name"].split()[1] in ("evalsha", "eval", "set", "xadd")]
    row = {
        "name": leg, "groups": n, "writers": bench.writers, "groups_per_s": n / wall if wall > 0 else math.nan,
        "wire_bytes_in_per_group": wire_in, "wire_bytes_out_per_group": (end["net_out"] - base["net_out"]) / n,
        "redis_memory_bytes_per_group": max(per_group_mem) if per_group_mem else math.nan,
        "redis_cpu_ms_per_group": (end["cpu_s"] - base["cpu_s"]) * 1e3 / n,
        "redis_main_thread_cpu_ms_per_group": (end["main_cpu_s"] - base["main_cpu_s"]) * 1e3 / n,
        "redis_publish_command_ms_per_group": sum(r["main_ms_per_group"] for r in publish_cmds),
        "publish_p50_s": percentile(lat, 50), "publish_p99_s": percentile(lat, 99),
        "publish_client_cpu_p50_s": percentile(cpu, 50),
        "take_batch_p50_s": percentile(take_s, 50), "take_batch_p99_s": percentile(take_s, 99),
        "take_per_group_p99_s": percentile([t / bench.batch_groups for t in take_s], 99),
        "take_client_cpu_per_group_p50_s": percentile(take_cpu_s, 50),
        "rank0_serial_s_per_group_p50": percentile(rank0_s, 50), "rank_decode_s_per_group_p50": percentile(decode_s, 50),
        "broadcast_bytes_per_group": sum(sent) / len(sent) if sent else math.nan,
        "baseline_xadd_usec": xadd["usec"] / xadd["calls"],
        "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0],
    }
    return row, cmd_rows


def run(bench: BufferBench, out_dir: str = "runs/bench") -> dict:
    """Run the legs, print the table, write the result file."""
    bench.check()
    check_out_dir(out_dir)
    if bench.capacity == 0:
        bench = replace(bench, capacity=(bench.commit_every + 1) * bench.batch_groups)
    legs = {"both": (False, True), "off": (False,), "on": (True,)}[bench.replay]
    figures, commands = [], []
    shape = model_shape(bench.model)
    print(f"buffer: {bench.groups} groups of {bench.group_size} x ({bench.prompt_len} + {bench.completion_len}) "
          f"tokens, {bench.writers} writers, batches of {bench.batch_groups}, capacity {bench.capacity}, {bench.model} "
          f"routing ({shape['layers']} layers, {len(shape['moe_layers'])} MoE, top-{shape['topk']} of {shape['experts']})",
          flush=True)
    for replay in legs:
        r, cmds = run_leg(bench, replay)
        figures.append(r)
        commands += cmds
        print(f"  {r['name']:>6}: {r['groups_per_s']:.2f} groups/s | wire {r['wire_bytes_in_per_group'] / 1e6:.2f} MB in, "
              f"{r['wire_bytes_out_per_group'] / 1e6:.2f} MB out per group | Redis {r['redis_memory_bytes_per_group'] / 1e6:.2f} "
              f"MB, {r['redis_cpu_ms_per_group']:.1f} ms CPU ({r['redis_main_thread_cpu_ms_per_group']:.1f} main thread) "
              f"per group, publish commands {r['redis_publish_command_ms_per_group']:.2f} ms | publish p50 "
              f"{r['publish_p50_s'] * 1e3:.1f} p99 {r['publish_p99_s'] * 1e3:.1f} ms (client CPU "
              f"{r['publish_client_cpu_p50_s'] * 1e3:.1f} ms) | take p50 {r['take_batch_p50_s'] * 1e3:.1f} p99 "
              f"{r['take_batch_p99_s'] * 1e3:.1f} ms per batch (client CPU {r['take_client_cpu_per_group_p50_s'] * 1e3:.1f} "
              f"ms per group; rank 0 serial {r['rank0_serial_s_per_group_p50'] * 1e3:.1f} ms, rank decode "
              f"{r['rank_decode_s_per_group_p50'] * 1e3:.1f} ms, broadcast {r['broadcast_bytes_per_group'] / 1e6:.2f} MB "
              f"per group) | plain XADD of the same bytes {r['baseline_xadd_usec'] / 1e3:.2f} ms | load average "
              f"{r['load_avg_1m_start']:.1f} -> {r['load_avg_1m_end']:.1f} on {os.cpu_count()} CPUs", flush=True)
        for c in cmds:
            print(f"    {c['name']:<24} {c['calls']:>7} calls {c['usec_per_call']:>11.1f} us/call "
                  f"{c['main_ms_per_group']:>9.3f} ms/group")
    ratios = {f"{r['name']} publish commands / plain XADD of the same bytes (Redis main thread)":
              r["redis_publish_command_ms_per_group"] * 1e3 / r["baseline_xadd_usec"] for r in figures}
    if len(figures) == 2:
        ratios["replay / plain wire bytes per group"] = (figures[1]["wire_bytes_in_per_group"]
                                                        / figures[0]["wire_bytes_in_per_group"])
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}")
    notes = ["memory per group: (used_memory - baseline) / groups in the samples stream, largest reading before a "
             "commit; CPU: redis-server's INFO used_cpu_*; latency percentiles nearest-rank",
             "take: what a one-rank trainer does per batch (trainer_take): rank 0's serial part and a rank's decode"]
    return print_notes_and_write("buffer", {**asdict(bench), **{f"model_{k}": v for k, v in shape.items()
                                                              if k != "moe_layers"},
                                            "moe_layer_count": len(shape["moe_layers"])},
                                 figures + commands, ratios, notes, out_dir)
