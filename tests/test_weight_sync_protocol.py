"""The weight-update group routes against SGLang 0.5.23's own definitions (tests/sglang_oracle.py):

- the routes the client calls are SGLang's (path, method, io_struct body type) and the built-in
  engine serves each of them;
- every body the client sends uses only fields of that io_struct type, with its required ones
  and their types; every answer has the fields of the matching ``*ReqOutput``;
- the built-in engine's refusals are SGLang's own messages (update outside a session, a second
  session, ending none, destroying an unknown group, a flush refused by an in_place pause);
- a real gloo group between our trainer side (app/weight_group.py) and SGLang's own
  ``init_custom_process_group`` and bucket receive, compiled from the wheel, carries a
  flattened bucket exactly;
- the bucket helpers (plan, pack, unpack) hold their bounds.
"""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from app.buffer.redis_server import free_port
from app.rollout.engine_client import EngineClient
from app.engine.load import load_checkpoint
from app.engine.receive import NO_GROUP, NO_OPEN_SESSION, NO_SESSION, NOT_FLUSHED, SESSION_OPEN
from app.engine.scheduler import Engine
from app.engine.server import create_app
from app.weight_group import dtype_name, open_group, pack_bucket, plan_buckets, unpack_bucket
from helpers import Recorder, tiny_moe_checkpoint
from sglang_oracle import function_strings, http_routes, io_struct_fields, io_struct_required, wheel_function, wheel_module

ROUTES = {  # what the client calls -> SGLang's request type of that route
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
}
SCHEDULER = "srt/managers/scheduler_components/weight_updater.py"
RUNNER = "srt/model_executor/model_runner_components/weight_updater.py"
TYPES = {"str": str, "int": int, "bool": bool, "List[str]": list, "List[List[int]]": list}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_moe_checkpoint(tmp_path_factory.mktemp("wsproto") / "m", seed=0, max_position_embeddings=64)


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def exchange(ckpt: Path):
    """The client against an in-process built-in engine and our trainer side in a thread: a
    full push in two updates (a flattened bucket, then per tensor), plus the refusals."""
    engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=8, weight_sync_timeout_s=20)
    recorder = Recorder(create_app(engine, health_timeout_s=0.5))
    sent = {k: v + 1.0 for k, v in sorted(hf_tensors(ckpt).items())}  # new weights: the old ones + 1
    names = list(sent)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    port, name = free_port(), "moerl-test-e1"
    results: dict = {}

    def trainer_side() -> None:
        group = open_group("gloo", "127.0.0.1", port, 2, 0, name, timeout_s=20)
        group.broadcast(pack_bucket([sent[n] for n in first]))
        for n in second:  # load_format null: one broadcast per tensor, in the names' order
            group.broadcast(sent[n].contiguous())
        group.close()

    async def go():
        await engine.start()
        try:
            async with EngineClient("http://engine", transport=recorder, retries=0, timeout_s=30) as c:
                results["outside"] = await c.update_weights_from_distributed(
                    first, ["float32"] * len(first), [list(sent[n].shape) for n in first], name)
                results["end_none"] = await c.end_weight_update()
                results["destroy_unknown"] = await c.destroy_weights_update_group("no-such-group")
                thread = threading.Thread(target=trainer_side)
                thread.start()
                results["init"] = await c.init_weights_update_group("127.0.0.1", port, 1, 2, name, "gloo")
                results["begin"] = await c.begin_weight_update()
                results["begin_again"] = await c.begin_weight_update()
                results["bucket"] = await c.update_weights_from_distributed(
                    first, [dtype_name(sent[n].dtype) for n in first], [list(sent[n].shape) for n in first], name,
                    load_format="flattened_bucket")
                results["version_after_bucket"] = await c.weight_version()
                results["per_tensor"] = await c.update_weights_from_distributed(
                    second, [dtype_name(sent[n].dtype) for n in second], [list(sent[n].shape) for n in second],
                    name, flush_cache=True, weight_version=7)
                results["end"] = await c.end_weight_update()
                results["destroy"] = await c.destroy_weights_update_group(name)
                await asyncio.to_thread(thread.join, 30)
                results["version"] = await c.weight_version()
        finally:
            await engine.stop()
        return recorder.calls

    calls = asyncio.run(go())
    return calls, results, engine, sent


@pytest.fixture(scope="module")
def pushed(ckpt):
    return exchange(ckpt)


def test_the_routes_are_sglangs_and_the_built_in_engine_serves_them(ckpt):
    routes = http_routes()
    engine = Engine(load_checkpoint(ckpt))
    ours = {(r.path, m) for r in create_app(engine).routes if hasattr(r, "methods") for m in r.methods}
    for path, body in ROUTES.items():
        assert routes[path] == {"methods": ["POST"], "body": body}, path
        assert (path, "POST") in ours, path


def test_bodies_use_sglang_io_struct_fields(pushed):
    calls = pushed[0]
    seen = set()
    for path, body, _, _ in calls:
        if path not in ROUTES:
            continue
        seen.add(path)
        fields = io_struct_fields(ROUTES[path])
        assert set(body) <= set(fields), (path, set(body) - set(fields))
        assert io_struct_required(ROUTES[path]) <= set(body), path
        for key, value in body.items():
            ann = fields[key]
            if ann in TYPES:
                assert isinstance(value, TYPES[ann]) and not (TYPES[ann] is int and isinstance(value, bool)), (key, value)
            if ann == "Optional[str]":
                assert value is None or isinstance(value, str), (key, value)
    assert seen == set(ROUTES)
    updates = [b for p, b, _, _ in calls if p == "/update_weights_from_distributed"]
    assert {b.get("load_format") for b in updates} == {None, "flattened_bucket"}
    # SGLang's receiver resolves each dtype with getattr(torch, name)
    assert all(isinstance(getattr(torch, d), torch.dtype) for b in updates for d in b["dtypes"])
    assert [b.get("weight_version") for b in updates][-1] == "7"


def test_answers_have_sglang_output_fields(pushed):
    calls = pushed[0]
    for path, _, status, got in calls:
        if path in ROUTES:
            out = ROUTES[path].replace("ReqInput", "ReqOutput")
            assert set(got) == set(io_struct_fields(out)) - set(io_struct_fields("BaseReq")), path
            assert status == (200 if got["success"] else 400), (path, status, got)


def test_refusals_are_sglangs_messages(pushed):
    results = pushed[1]
    assert results["outside"] == (False, NO_SESSION)
    assert NO_SESSION in function_strings(SCHEDULER, "SchedulerWeightUpdaterManager.update_weights_from_distributed")
    assert results["begin_again"] == (False, SESSION_OPEN)
    assert SESSION_OPEN in function_strings(SCHEDULER, "SchedulerWeightUpdaterManager.begin_weight_update")
    assert results["end_none"] == (False, NO_OPEN_SESSION)
    assert NO_OPEN_SESSION in function_strings(SCHEDULER, "SchedulerWeightUpdaterManager.end_weight_update")
    assert results["destroy_unknown"] == (False, NO_GROUP)
    assert NO_GROUP in function_strings(RUNNER, "WeightUpdater.destroy_weights_update_group")
    assert NOT_FLUSHED in function_strings(SCHEDULER, "SchedulerWeightUpdaterManager.flush_cache_after_weight_update")


def test_a_push_loads_every_tensor_and_the_version_only_at_the_end(pushed):
    _, results, engine, sent = pushed
    for key in ("init", "begin", "bucket", "per_tensor", "end", "destroy"):
        assert results[key][0], (key, results[key])
    assert results["version_after_bucket"] == 0  # no weight_version on the first update
    assert results["version"] == 7
    from app.engine.receive import hf_slots

    slots = hf_slots(engine.loaded.model)
    for name, value in sent.items():
        target, index, _ = slots[name]
        torch.testing.assert_close(target[index], value, rtol=0, atol=0, msg=name)


def test_flush_refused_under_an_in_place_pause_fails_the_update_and_keeps_the_version(ckpt):
    """SGLang flushes after the load; rows held by an in_place pause make the flush, and so the
    call, fail, and the version is not taken (the worker waits for its own requests first)."""
    engine = Engine(load_checkpoint(ckpt), weight_version="0", max_batch=8, weight_sync_timeout_s=20)
    sent = hf_tensors(ckpt)
    names = list(sent)[:3]
    port, name = free_port(), "moerl-test-flush"

    def trainer_side() -> None:
        group = open_group("gloo", "127.0.0.1", port, 2, 0, name, timeout_s=20)
        group.broadcast(pack_bucket([sent[n] for n in names]))
        group.close()

    async def go():
        from app.engine.sampler import SamplingParams

        await engine.start()
        try:
            running = asyncio.ensure_future(engine.submit([[1, 5, 6]], [SamplingParams(max_new_tokens=40, ignore_eos=True)]))
            while engine.live_rows == 0:
                await asyncio.sleep(0.005)
            await engine.pause("in_place")
            thread = threading.Thread(target=trainer_side)
            thread.start()
            assert (await asyncio.to_thread(engine.weight_groups.init_group, "127.0.0.1", port, 1, 2, name, "gloo"))[0]
            engine.weight_groups.begin()
            got = await engine.update_weights_from_distributed(
                names, ["float32"] * 3, [list(sent[n].shape) for n in names], name, "flattened_bucket", "5", True)
            await asyncio.to_thread(thread.join, 30)
            engine.resume()
            (completion, _), = await running
            return got, engine.weight_version, len(completion.token_ids)
        finally:
            await engine.stop()

    got, version, generated = asyncio.run(go())
    assert got == (False, NOT_FLUSHED)
    assert version == "0" and generated == 40


def test_our_trainer_side_talks_to_sglangs_own_group_and_bucket_code():
    """SGLang's init_custom_process_group and _receive_bucketed_weights_from_distributed, compiled
    from the wheel, receive a flattened bucket from app.weight_group over a real gloo group."""
    import torch.distributed as dist

    release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:3])  # what packaging's .release gives
    common = {"torch": torch, "torch_release": release}
    init_custom_process_group = wheel_function("srt/utils/common.py", "init_custom_process_group", common)
    bucket = wheel_module("srt/weight_sync/tensor_bucket.py")
    receive = wheel_function(RUNNER, "WeightUpdater._receive_bucketed_weights_from_distributed",
                             {"torch": torch, "FlattenedTensorBucket": bucket.FlattenedTensorBucket})
    sent = [("a.weight", torch.randn(3, 5)), ("b.weight", torch.randn(8).to(torch.bfloat16)),
            ("c.weight", torch.arange(6, dtype=torch.float32).view(2, 3))]
    port, name = free_port(), f"moerl-sglang-interop-{free_port()}"
    got: dict = {}

    def engine_side() -> None:
        pg = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1,
                                       group_name=name, timeout=timedelta(seconds=20))
        me = type("Runner", (), {"_model_update_group": {name: pg}, "device": "cpu"})()
        got["tensors"] = receive(me, names=[n for n, _ in sent], dtypes=[dtype_name(t.dtype) for _, t in sent],
                                 shapes=[list(t.shape) for _, t in sent], group_name=name)
        dist.destroy_process_group(pg)

    thread = threading.Thread(target=engine_side)
    thread.start()
    group = open_group("gloo", "127.0.0.1", port, 2, 0, name, timeout_s=20)
    group.broadcast(pack_bucket([t for _, t in sent]))
    thread.join(30)
    group.close()
    assert [n for n, _ in got["tensors"]] == [n for n, _ in sent]
    for (_, want), (_, have) in zip(sent, got["tensors"]):
        assert have.dtype == want.dtype and torch.equal(have, want)


def test_the_source_waits_for_engines_at_the_first_broadcast_as_sglangs_nccl_group_does():
    """SGLang's NCCL group (``device_id=None``) makes its communicator at the first broadcast
    inside /update_weights_from_distributed, which a worker sends only in the send phase, after
    the trainer's open_group has returned. Modelled with gloo: the engine side reaches the
    rendezvous at join (the TCPStore of init_custom_process_group, with its prefixes) and makes
    its backend only at its first receive. A source that connected at join would wait for an
    engine that is not there yet until its join timed out; ours returns from the join, and the
    first broadcast brings both sides up. The built-in engine's groups join the same way."""
    import torch.distributed as dist

    from app.engine.receive import EngineWeightGroups

    port, name = free_port(), f"moerl-lazy-{free_port()}"
    send_phase = threading.Event()
    got: dict = {}

    def engine_side() -> None:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=20))
        keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, store)))
        send_phase.wait(30)  # the worker's first update call comes in the send phase
        pg = dist.ProcessGroupGloo(keys, 1, 2, timedelta(seconds=20))
        t = torch.empty(4)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        pg.broadcast([t], opts).wait()
        got["t"] = t

    thread = threading.Thread(target=engine_side)
    thread.start()
    group = open_group("gloo", "127.0.0.1", port, 2, 0, name, timeout_s=5)
    assert not group.connected
    send_phase.set()
    group.broadcast(torch.arange(4.0))
    thread.join(30)
    group.close()
    assert torch.equal(got["t"], torch.arange(4.0))

    # the built-in engine: its join leaves the backend to the first receive
    port, name = free_port(), f"moerl-lazy-{free_port()}"
    engine = EngineWeightGroups(timeout_s=20)
    joined: dict = {}
    thread = threading.Thread(target=lambda: joined.update(
        answer=engine.init_group("127.0.0.1", port, 1, 2, name, "gloo")))
    thread.start()
    source = open_group("gloo", "127.0.0.1", port, 2, 0, name, timeout_s=20)
    thread.join(30)
    assert joined["answer"][0], joined
    assert not engine.groups[name].connected and not source.connected
    receiver = threading.Thread(target=lambda: got.update(
        named=engine.receive(["w"], ["float32"], [[3]], name, None)))
    receiver.start()
    source.broadcast(torch.tensor([1.0, 2.0, 3.0]))
    receiver.join(30)
    source.close()
    engine.close()
    assert torch.equal(got["named"][0][1], torch.tensor([1.0, 2.0, 3.0]))


def test_a_device_strict_group_refuses_host_tensors_as_nccl_does():
    """cuda:gloo (trainer ranks and engines sharing a GPU) and NCCL take CUDA tensors only: a host
    tensor is refused by name instead of travelling."""
    from app.weight_group import GroupError

    group = open_group("cuda:gloo", "127.0.0.1", free_port(), 1, 0, "moerl-strict", timeout_s=5)
    with pytest.raises(GroupError, match="No backend type associated with device type cpu"):
        group.broadcast(torch.zeros(2))
    group.close()


def test_an_nccl_weight_group_is_made_under_its_own_error_handling(monkeypatch):
    """The weight-update group's NCCL backend is made with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and
    a non-blocking communicator start (torch reads both in ProcessGroupNCCL's constructor), while
    the process keeps the trainer pods' 1 for its own groups before and after; the GPU shows what
    that buys (tests/test_weight_sync.py `test_an_nccl_weight_group_failure_spares_the_trainer`)."""
    import os

    import torch.distributed as dist

    from app.torchx_component import NCCL_ENV
    from app.weight_group import GROUP_NCCL_ENV, UpdateGroup

    seen = []

    class FakeNCCL:  # records the environment torch's constructor would read
        class Options:
            pass

        def __init__(self, store, rank, size, opts):
            seen.append({k: os.environ.get(k) for k in GROUP_NCCL_ENV})

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ENV["TORCH_NCCL_ASYNC_ERROR_HANDLING"])
    monkeypatch.delenv("TORCH_NCCL_USE_COMM_NONBLOCKING", raising=False)
    UpdateGroup("g", 0, 2, "nccl", 5.0, None, None, object())._connect()
    assert seen == [{"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_USE_COMM_NONBLOCKING": "1"}]
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and "TORCH_NCCL_USE_COMM_NONBLOCKING" not in os.environ


def test_buckets_hold_their_bound_and_round_trip():
    sizes = [100, 300, 50, 700, 20, 20]
    buckets = plan_buckets(sizes, limit=400)
    assert [i for b in buckets for i in b] == list(range(len(sizes)))  # every tensor once, in order
    for b in buckets:
        assert sum(sizes[i] for i in b) <= 400 or len(b) == 1  # only a lone tensor may exceed the bound
    assert buckets == [[0, 1], [2], [3], [4, 5]]
    with pytest.raises(ValueError, match="bucket limit"):
        plan_buckets(sizes, 0)
    tensors = [torch.randn(2, 3), torch.randn(5).to(torch.bfloat16), torch.arange(4, dtype=torch.int64)]
    flat = pack_bucket(tensors[:2])
    assert flat.dtype == torch.uint8 and flat.numel() == 24 + 10
    with pytest.raises(ValueError, match="unaligned"):  # bf16 ends at byte 34: an int64 cannot follow
        pack_bucket(tensors)
    with pytest.raises(ValueError, match="unaligned"):  # SGLang's receiver refuses it too
        unpack_bucket(torch.empty(66, dtype=torch.uint8), [[2, 3], [5], [4]],
                      [torch.float32, torch.bfloat16, torch.int64])
    back = unpack_bucket(pack_bucket(tensors[:2]), [[2, 3], [5]], [torch.float32, torch.bfloat16])
    assert all(torch.equal(a, b) for a, b in zip(back, tensors[:2]))
    with pytest.raises(ValueError, match="bytes"):
        unpack_bucket(pack_bucket(tensors[:2]), [[2, 3]], [torch.float32])


def test_registrations_expire_in_redis_and_events_wake_a_reader(redis_server):
    """The board's registrations expire by Redis' clock (no host clock compared); a push
    change is an event a blocked reader wakes on."""
    import time

    import redis

    from app.buffer.weight_sync import Registration, SyncBoard

    board = SyncBoard(redis.Redis.from_url(redis_server, decode_responses=True), "moerl", "t")
    board.register(Registration("w0", 8, 3, None), ttl_s=0.3)
    board.register(Registration("w1", 1, None, 2), ttl_s=30)
    assert board.engines() == {"w0": Registration("w0", 8, 3, None), "w1": Registration("w1", 1, None, 2)}
    time.sleep(0.5)
    assert set(board.engines()) == {"w1"}
    assert board.r.smembers(board.k + "engine-ids") == {"w1"}  # the expired one is dropped from the set
    board.unregister("w1")
    assert board.engines() == {}
    last = board.wait("events", None, 0.01)  # nothing yet: returns at once with the stream's position
    t0 = time.monotonic()
    assert board.wait("events", last, 0.2) == last and time.monotonic() - t0 >= 0.15  # timed out
    board.set_push({"id": "p1", "version": 4, "state": "prepare"})
    assert board.wait("events", last, 5.0) != last  # woken by the change
    assert board.push()["state"] == "prepare"
    board.ack("p1", "w0", "ready", ranks=8)
    assert board.acks("p1")["w0"]["ranks"] == 8


def test_a_prepare_during_a_version_check_waits_for_the_weights_lock():
    """Each policy poll holds the worker's weights lock for its version check (a Redis read and
    /model_info: a moment, longer on a loaded host). A prepare that comes then waits for the lock
    within the ready budget and acks ready; only a holder past the budget (a load from the store)
    makes the worker ack busy. (It acked busy at once: on a loaded machine both workers of
    tests/test_weight_sync.py were left out of a push that way.)"""
    from app.config import RunConfig
    from app.rollout.weight_sync import PushMember
    from app.rollout.weights import EngineWeights
    from app.rollout.worker import WorkerStats

    class Board:
        def __init__(self):
            self.acks: list[str] = []

        def ack(self, push_id, worker_id, state, **fields):
            self.acks.append(state)

        def push(self):  # the trainer cancelled it: the member leaves the weights untouched
            return {"id": "p1", "state": "cancelled"}

    class Client:
        async def server_info(self):
            return {"tp_size": 1, "startup_time": 1.0}

        async def pause_generation(self, mode):
            pass

        async def flush_until(self, within_s):
            return True

        async def continue_generation(self):
            pass

    async def take(ready_timeout_s: float, release: asyncio.Event | None):
        cfg = RunConfig()
        cfg.weight_sync.ready_timeout_s = ready_timeout_s
        w = EngineWeights(cfg, Client(), "w0", stats=WorkerStats(), current_policy=None, stop=asyncio.Event())
        board = Board()
        member = PushMember(w, board)

        async def version_check():
            async with w.lock:
                if release is None:
                    await asyncio.sleep(0.1)
                else:
                    await release.wait()

        holder = asyncio.create_task(version_check())
        await asyncio.sleep(0)  # the poll holds the lock when the prepare is taken
        assert w.lock.locked()
        await member.take({"id": "p1", "version": 1, "state": "prepare"})
        if release is not None:
            release.set()
        await holder
        member._pool.shutdown()
        return board.acks, w.lock.locked(), w.admitting.is_set()

    # a 0.1 s version check, a 29.5 s budget: ready (then cancelled), lock released, generating
    assert asyncio.run(take(30.0, None)) == (["ready"], False, True)
    # a holder past the 0.1 s budget (a store load): busy, and the lock is the holder's to release
    assert asyncio.run(take(0.6, asyncio.Event()))[0] == ["busy"]


def _member_against(board, trainer_host: str, master_port: int):
    """A `PushMember` over ``board`` with a recording engine client (what it asks the engine)."""
    from app.config import RunConfig
    from app.rollout.weight_sync import PushMember
    from app.rollout.weights import EngineWeights
    from app.rollout.worker import WorkerStats

    class Client:
        def __init__(self):
            self.calls: list[tuple] = []

        async def server_info(self):
            return {"tp_size": 1, "startup_time": 1.0}

        async def pause_generation(self, mode):
            self.calls.append(("pause",))

        async def continue_generation(self):
            self.calls.append(("continue",))

        async def flush_until(self, within_s, every_s=1.0):
            self.calls.append(("flush",))
            return True

        async def init_weights_update_group(self, *args, timeout_s=None):
            self.calls.append(("init_weights_update_group", *args))
            return True, "joined"

        async def destroy_weights_update_group(self, name, timeout_s=None):
            self.calls.append(("destroy", name))
            return True, ""

    cfg = RunConfig()
    ws = cfg.weight_sync
    ws.mode, ws.trainer_host, ws.master_port, ws.ready_timeout_s, ws.timeout_s = "network", trainer_host, master_port, 1.0, 1.0
    w = EngineWeights(cfg, Client(), "w0", stats=WorkerStats(), current_policy=None, stop=asyncio.Event())
    return PushMember(w, board), w.client


def test_a_push_record_pointing_elsewhere_is_refused_and_no_engine_joins(tmp_path):
    """The attack of issue 28 item 2. A holder of the rollout credentials cannot write the push
    record at all (Redis ACL); and a record that points the group anywhere but the trainer's
    source rank (another address, or the trainer's torchrun rendezvous port) is refused by the
    worker before its engine hears of it: no /init_weights_update_group, nothing connects to the
    attacker's listener, the worker acks failed and keeps generating. The trainer's own record
    (same fields, its address and port) is joined."""
    import socket

    import redis

    from app.buffer import LocalRedis
    from app.buffer.acl import ROLES, server_args
    from app.buffer.redis_server import new_password
    from app.buffer.weight_sync import SyncBoard

    run, port = "t", 29601  # the trainer's weight-update port, fixed and declared (charts8s)
    pw = {role: new_password() for role in ROLES}
    listener = socket.socket()
    listener.bind(("127.0.0.2", 0))  # the attacker's rendezvous, on another loopback address
    listener.listen(8)
    listener.setblocking(False)
    server = LocalRedis(tmp_path / "redis", password=new_password(), extra_args=server_args(pw, run)).start()
    try:
        def board(role):
            return SyncBoard(redis.Redis(host="127.0.0.1", port=server.port, username=role, password=pw[role],
                                         decode_responses=True), "moerl", run)

        worker_board, trainer_board = board("rollout"), board("trainer")

        def record(pid, address, group_port):  # the record's groups, as the trainer writes them (one per worker)
            return {"id": pid, "version": 7, "state": "join", "groups": {"w0": {
                "epoch": 1, "name": f"g-{pid}", "master_address": address, "master_port": group_port,
                "world_size": 2, "backend": "gloo", "rank_offset": 1}}}

        forged = record("evil", "127.0.0.2", listener.getsockname()[1])
        with pytest.raises(redis.exceptions.NoPermissionError):
            worker_board.set_push(forged)  # layer 1: the rollout user cannot write it

        async def take(rec, cancel_after_join=False):
            member, client = _member_against(worker_board, "127.0.0.1", port)
            trainer_board.set_push(rec)  # layer 2: a record there anyway (as if the ACL were lost)
            task = asyncio.create_task(member.take({"id": rec["id"], "version": 7, "state": "prepare"}))
            if cancel_after_join:
                for _ in range(200):
                    if any(c[0] == "init_weights_update_group" for c in client.calls):
                        break
                    await asyncio.sleep(0.02)
                trainer_board.set_push({**rec, "state": "cancelled"})
            await asyncio.wait_for(task, 30)
            member._pool.shutdown()
            return client.calls, trainer_board.acks(rec["id"])["w0"], member.w.admitting.is_set()

        for rec in (forged, record("rdzv", "127.0.0.1", 29500)):
            calls, ack, generating = asyncio.run(take(rec))
            assert not [c for c in calls if c[0] == "init_weights_update_group"], (rec["id"], calls)
            assert ack["state"] == "failed" and ack["message"].startswith("refused:"), ack
            assert generating  # the engine was continued, its weights untouched
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody was sent to the attacker's address

        calls, ack, _ = asyncio.run(take(record("real", "127.0.0.1", port), cancel_after_join=True))
        joins = [c for c in calls if c[0] == "init_weights_update_group"]
        assert joins and joins[0][1:3] == ("127.0.0.1", port), calls
    finally:
        server.stop()
        listener.close()
