"""Experience buffer semantics against a real redis-server (fixtures in conftest.py)."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from app.buffer import BufferConnectionError, ExperienceBuffer, Group, LocalRedis, Sample, Task
from app.buffer.redis_server import free_port
from app.config import RunConfig

RUN = "r1"


def make_tasks(n: int, group_size: int = 2, start: int = 0) -> list[Task]:
    return [Task(f"train-{i:06d}", [1, 2, i], f"prompt {i}", f'{{"answer": {i}}}', group_size)
            for i in range(start, start + n)]


def samples_for(task: Task, version: int = 0, run: str = RUN, reward: float = 1.0) -> list[Sample]:
    return [
        Sample(task.sample_id(run, i), task.task_id, i, task.attempt, task.prompt_ids,
               [10 + i, 11], [-0.5, -0.25], reward, version, "stop")
        for i in range(task.group_size)
    ]


def buf(url: str, run: str = RUN, **kw) -> ExperienceBuffer:
    return ExperienceBuffer(url, run, **kw)


def finish(b: ExperienceBuffer, consumer: str, n: int, version: int) -> list[Task]:
    tasks = b.lease(consumer, n, block_ms=0)
    assert len(tasks) == n
    for t in tasks:
        assert b.publish(t, samples_for(t, version, b.run_id))
    return tasks


def test_records_round_trip_and_errors():
    t = make_tasks(1)[0]
    t.entry_id, t.consumer = "1-0", "w"
    back = Task.from_json(t.to_json())
    assert back.task_id == t.task_id and back.prompt_ids == t.prompt_ids
    assert back.entry_id == "" and back.consumer == ""  # lease bookkeeping is not queued
    g = Group(t.task_id, 0, samples_for(t, version=3) + [])
    g.samples[1].policy_version = 2
    assert g.policy_version == 2
    assert Group.from_json(g.to_json()).samples == g.samples
    with pytest.raises(ValueError, match="missing field.*group_size"):
        Task.from_dict({"task_id": "x", "prompt_ids": [], "prompt": "", "answer": ""})
    with pytest.raises(ValueError, match="unknown field.*bogus"):
        Sample.from_dict({**g.samples[0].to_dict(), "bogus": 1})


def test_lease_publish_ack_and_take(redis_server):
    b = buf(redis_server)
    assert b.put_tasks(make_tasks(3)) == 3
    assert b.put_tasks(make_tasks(1)) == 0  # same (task_id, attempt): not queued twice
    leased = b.lease("w1", count=2, block_ms=0)
    assert [t.task_id for t in leased] == ["train-000000", "train-000001"]
    assert all(t.entry_id and t.consumer == "w1" for t in leased)
    s = b.stats()
    assert (s["queued"], s["leased"], s["issued"]) == (1, 2, 3)

    assert b.publish(leased[0], samples_for(leased[0], version=0))
    s = b.stats()
    assert (s["leased"], s["finished"], s["ready"]) == (1, 1, 1)

    groups = b.take_batch(1, trainer_version=0, timeout_s=1.0)
    assert len(groups) == 1 and groups[0].task_id == "train-000000"
    assert [x.sample_id for x in groups[0].samples] == ["r1/train-000000/0/0", "r1/train-000000/1/0"]
    assert groups[0].samples[1].completion_ids == [11, 11]
    assert b.take_batch(1, trainer_version=0, timeout_s=0) == []  # autocommit of the first batch
    s = b.stats()
    assert (s["taken"], s["consumed"], s["ready"]) == (1, 1, 0)


def test_publish_rejects_bad_groups_before_writing(redis_server):
    b = buf(redis_server)
    b.put_tasks(make_tasks(1))
    (t,) = b.lease("w1", block_ms=0)
    good = samples_for(t)
    bad_cases = {
        "2 samples, group_size is 3": (Task(**{**t.to_dict(), "group_size": 3}), good),
        "sample_id": (t, [good[0], Sample(**{**good[1].to_dict(), "sample_id": "x"})]),
        "logprobs": (t, [good[0], Sample(**{**good[1].to_dict(), "logprobs": [-1.0]})]),
        "reward is nan": (t, [good[0], Sample(**{**good[1].to_dict(), "reward": float("nan")})]),
        "finish_reason": (t, [good[0], Sample(**{**good[1].to_dict(), "finish_reason": "eos"})]),
        "no entry_id": (Task(**{**t.to_dict(), "entry_id": ""}), good),
    }
    for match, (task, samples) in bad_cases.items():
        with pytest.raises(ValueError, match=match):
            b.publish(task, samples)
    s = b.stats()
    assert (s["finished"], s["leased"], s["ready"]) == (0, 1, 0)
    assert b.publish(t, good)


def test_expired_lease_is_reclaimed_by_another_worker(redis_server):
    b = buf(redis_server, lease_ms=1000)
    b.put_tasks(make_tasks(1))
    (t1,) = b.lease("w1", block_ms=0)
    assert b.lease("w2", block_ms=0) == []  # lease still alive
    time.sleep(1.1)
    (t2,) = b.lease("w2", block_ms=0)  # w1 "died": its lease expired
    assert (t2.task_id, t2.entry_id, t2.consumer, t2.attempt) == (t1.task_id, t1.entry_id, "w2", 0)
    assert b.stats()["leased"] == 1
    # w1 was only slow: the first publish wins, the replay is ignored.
    assert b.publish(t1, samples_for(t1))
    assert not b.publish(t2, samples_for(t2))
    s = b.stats()
    assert (s["finished"], s["duplicates"], s["leased"], s["queued"]) == (1, 1, 0, 0)
    groups = b.take_batch(5, trainer_version=0, timeout_s=0.2)
    assert [g.task_id for g in groups] == [t1.task_id]


def test_extend_and_release_act_only_on_own_leases(redis_server):
    # Between extend() and w2's lease, and between w2's and w3's leases, less than lease_ms may
    # pass, or w2 takes the extended lease too and w3 takes w2's: 1 s, not 100 ms, so that a
    # loaded CI machine pausing the test for a moment cannot expire them.
    b = buf(redis_server, lease_ms=1000)
    b.put_tasks(make_tasks(2))
    mine = b.lease("w1", count=2, block_ms=0)
    time.sleep(1.1)
    assert [t.task_id for t in b.extend(mine[:1])] == [mine[0].task_id]  # idle clock reset
    (stolen,) = b.lease("w2", count=2, block_ms=0)  # only the un-extended one expired
    assert stolen.task_id == mine[1].task_id
    assert b.extend(mine[1:]) == []  # w1 lost it
    b.release(mine)  # gives back only the lease w1 still holds
    s = b.stats()
    assert (s["queued"], s["leased"], s["released"]) == (1, 1, 1)
    (again,) = b.lease("w3", block_ms=0)
    assert (again.task_id, again.attempt) == (mine[0].task_id, 0)
    with pytest.raises(ValueError, match="no lease"):
        b.release(make_tasks(1))


def test_back_pressure(redis_server):
    b = buf(redis_server, capacity_groups=2)
    b.put_tasks(make_tasks(4))
    assert b.has_capacity()
    finish(b, "w1", 1, version=0)
    b.lease("w1", 1, block_ms=0)  # one finished + one in flight = capacity
    assert not b.has_capacity()
    assert not b.wait_for_capacity(0.1)

    result = {}
    waiter = threading.Thread(target=lambda: result.setdefault("ok", b.wait_for_capacity(10.0)))
    waiter.start()
    trainer = buf(redis_server, capacity_groups=2)
    assert len(trainer.take_batch(1, trainer_version=0, timeout_s=1.0)) == 1
    trainer.commit()
    waiter.join(10.0)
    assert result == {"ok": True}
    assert b.has_capacity()


@pytest.mark.parametrize("policy", ["drop", "requeue"])
def test_stale_groups_dropped_or_requeued(redis_server, policy):
    b = buf(redis_server, max_staleness=1, stale_policy=policy)
    b.put_tasks(make_tasks(3))
    for version in (0, 1, 2):  # train-0 at v0, train-1 at v1, train-2 at v2
        finish(b, "w1", 1, version)
    groups = b.take_batch(3, trainer_version=2, timeout_s=0.3)
    assert [(g.task_id, g.policy_version) for g in groups] == [("train-000001", 1), ("train-000002", 2)]
    b.commit()
    s = b.stats()
    assert s["ready"] == 0
    if policy == "drop":
        assert (s["dropped_stale"], s["requeued"], s["queued"]) == (1, 0, 0)
        return
    assert (s["dropped_stale"], s["requeued"], s["queued"]) == (0, 1, 1)
    (again,) = b.lease("w2", block_ms=0)
    assert (again.task_id, again.attempt, again.prompt) == ("train-000000", 1, "prompt 0")
    assert b.publish(again, samples_for(again, version=2))  # new attempt, new sample ids
    (g,) = b.take_batch(1, trainer_version=2, timeout_s=1.0)
    assert [x.sample_id for x in g.samples] == ["r1/train-000000/0/1", "r1/train-000000/1/1"]


def test_trainer_restart_rereads_uncommitted_batch(redis_server):
    b = buf(redis_server, autocommit=False)
    b.put_tasks(make_tasks(3))
    finish(b, "w1", 3, version=0)
    first = b.take_batch(2, trainer_version=0, timeout_s=1.0)
    assert len(first) == 2
    # The trainer dies before committing: a new one reads the same groups again.
    b2 = buf(redis_server, autocommit=False)
    again = b2.take_batch(3, trainer_version=0, timeout_s=0.3)
    assert [g.task_id for g in again] == ["train-000000", "train-000001", "train-000002"]
    assert b2.commit() == 3
    assert buf(redis_server).take_batch(3, trainer_version=0, timeout_s=0.1) == []


def test_take_batch_waits_for_groups(redis_server):
    b = buf(redis_server)
    b.put_tasks(make_tasks(2))
    worker = buf(redis_server)
    timer = threading.Timer(0.3, finish, args=(worker, "w1", 2, 0))
    timer.start()
    groups = b.take_batch(2, trainer_version=0, timeout_s=20.0)
    timer.join()
    assert sorted(g.task_id for g in groups) == ["train-000000", "train-000001"]


def test_policy_announce_moves_forward(redis_server):
    b = buf(redis_server)
    assert b.current_policy() is None
    assert b.announce_policy(1, "file:///s/r1/policy/v1")
    assert b.announce_policy(3, "file:///s/r1/policy/v3")
    assert not b.announce_policy(2, "file:///s/r1/policy/v2")
    assert b.current_policy() == (3, "file:///s/r1/policy/v3")
    assert b.announce_policy(2, "u2", force=True)
    assert buf(redis_server).current_policy() == (2, "u2")


def test_runs_are_isolated_by_prefix(redis_server):
    a, b = buf(redis_server, "run-a"), buf(redis_server, "run-b")
    other_prefix = ExperienceBuffer(redis_server, "run-a", prefix="other")
    a.put_tasks(make_tasks(2))
    assert b.lease("w1", block_ms=0) == [] and other_prefix.lease("w1", block_ms=0) == []
    assert b.put_tasks(make_tasks(1)) == 1  # same task id, other run: its own queue
    a.announce_policy(5, "ua")
    assert b.current_policy() is None
    assert (a.stats()["queued"], b.stats()["queued"]) == (2, 1)
    keys = redis.Redis.from_url(redis_server, decode_responses=True).keys("*")
    assert keys and all(k.startswith(("moerl:run-a:", "moerl:run-b:", "other:run-a:")) for k in keys)


def test_auth(tmp_path):
    with LocalRedis(tmp_path / "redis", password="s3cret-pw") as server:
        no_pw = server.url.replace(":s3cret-pw@", "")
        with pytest.raises(BufferConnectionError, match="password") as e:
            buf(no_pw)
        assert str(server.port) in str(e.value)
        with pytest.raises(BufferConnectionError) as e:
            buf(no_pw, password="not-the-pw")
        assert "not-the-pw" not in str(e.value)
        assert buf(no_pw, password="s3cret-pw").put_tasks(make_tasks(1)) == 1
        b = buf(server.url)
        assert b.lease("w1", block_ms=0)[0].task_id == "train-000000"
        with pytest.raises(BufferConnectionError) as e:
            buf(server.url.replace("s3cret-pw", "bad-pw"))
        assert "bad-pw" not in str(e.value) and "***" in str(e.value)


def test_unreachable_url_is_one_clear_error():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(BufferConnectionError, match=f"cannot reach Redis at {url}"):
        buf(url)
    with pytest.raises(ValueError, match="redis://"):
        buf("http://127.0.0.1:1/0")
    with pytest.raises(ValueError, match="stale_policy"):
        buf(url, stale_policy="keep")


def test_from_config(redis_server, monkeypatch):
    cfg = RunConfig(run_id="cfg-run")
    cfg.buffer.redis_url = redis_server
    cfg.buffer.capacity_groups = 3
    cfg.buffer.stale_policy = "requeue"
    monkeypatch.delenv("MOERL_REDIS_PASSWORD", raising=False)
    b = ExperienceBuffer.from_config(cfg)
    assert (b.run_id, b.capacity_groups, b.stale_policy, b.prefix) == ("cfg-run", 3, "requeue", "moerl")
    assert b.put_tasks(make_tasks(1)) == 1


@pytest.mark.parametrize("graceful", [True, False])
def test_redis_restart_keeps_acked_samples_and_leases(tmp_path, graceful):
    # A SIGKILL loses up to 1 s of writes with appendfsync everysec; use "always" for that case.
    server = LocalRedis(tmp_path / "redis", appendfsync="everysec" if graceful else "always").start()
    try:
        b = buf(server.url, lease_ms=500)
        b.put_tasks(make_tasks(4))
        done = finish(b, "w1", 2, version=0)
        in_flight = b.lease("w2", 2, block_ms=0)  # w2 dies with the node
        b.announce_policy(1, "u1")
        server.restart(graceful=graceful)

        # The same client reconnects; the data survived.
        s = b.stats()
        assert (s["ready"], s["leased"], s["queued"], s["finished"]) == (2, 2, 0, 2)
        assert b.current_policy() == (1, "u1")
        groups = b.take_batch(2, trainer_version=1, timeout_s=1.0)
        assert sorted(g.task_id for g in groups) == sorted(t.task_id for t in done)
        time.sleep(0.6)
        reclaimed = b.lease("w3", 2, block_ms=0)
        assert sorted(t.task_id for t in reclaimed) == sorted(t.task_id for t in in_flight)
        for t in reclaimed:
            assert b.publish(t, samples_for(t, version=1))
        assert not b.publish(done[0], samples_for(done[0]))  # acked before the restart
        assert b.stats()["finished"] == 4
    finally:
        server.stop()


def test_failed_rollouts_requeue_then_drop_and_publish_nothing(redis_server):
    b = buf(redis_server, max_failures=2, lease_ms=200)
    b.put_tasks(make_tasks(1))
    (t,) = b.lease("w1", count=1, block_ms=0)
    assert b.fail([t]) == []  # first failure: back in the queue, failures counted on the task
    (again,) = b.lease("w2", count=1, block_ms=0)
    assert (again.task_id, again.attempt, again.failures) == (t.task_id, 0, 1)
    time.sleep(0.3)
    (taken,) = b.lease("w3", count=1, block_ms=0)  # w2's lease expired and w3 took it over
    assert b.fail([again]) == []  # not w2's any more: left alone
    assert b.stats()["leased"] == 1
    assert [d.task_id for d in b.fail([taken])] == [t.task_id]  # second failure: dropped
    s = b.stats()
    assert (s["failed_requeued"], s["failed_dropped"], s["queued"], s["leased"], s["finished"]) == (1, 1, 0, 0, 0)
    assert b.dropped_tasks() == {f"{t.task_id}/0"}
    assert b.take_batch(8, trainer_version=0, timeout_s=0) == []
    with pytest.raises(ValueError, match="no lease"):
        b.fail([make_tasks(1)[0]])


def test_loss_mask_must_fit_the_completion(redis_server):
    b = buf(redis_server)
    b.put_tasks(make_tasks(1))
    (t,) = b.lease("w", count=1, block_ms=0)
    samples = samples_for(t)
    samples[0].loss_mask = [1] * (len(samples[0].completion_ids) + 1)
    with pytest.raises(ValueError, match="loss_mask"):
        b.publish(t, samples)
    samples[0].loss_mask = [1] * len(samples[0].completion_ids)
    assert b.publish(t, samples)


def test_a_malformed_entry_is_dead_lettered_and_the_trainer_takes_the_good_ones(redis_server):
    """The attack: whoever can write to Redis adds entries to the samples stream that are not
    groups (an unknown header key, a header that is not JSON, no header at all, a payload key
    that names another key of the run, a good header over a payload that is not one). The
    trainer side dead-letters each one (the dead stream keeps the entry id and the reason;
    dead_lettered counts them), deletes no key it does not own, takes the good groups around
    them, and the next take does not meet them again."""
    b = buf(redis_server, autocommit=False)
    b.put_tasks(make_tasks(3))
    b.announce_policy(1, "u1")
    (first,) = finish(b, "w1", 1, version=0)
    raw = redis.Redis.from_url(redis_server, decode_responses=True)
    (_, good), = raw.xrange(b.keys["samples"], count=1)
    junk, junk2 = b.blob_prefix + "junk", b.blob_prefix + "junk2"
    raw.set(junk2, "not a payload")
    (copied,) = b.lease("w1", 1, block_ms=0)  # a real task, its header copied over a junk payload
    header = good["meta"].replace(first.task_id, copied.task_id)
    bad_ids = [
        raw.xadd(b.keys["samples"], {"meta": '{"bogus": 1}', "task": first.to_json(), "blob": junk}),
        raw.xadd(b.keys["samples"], {"meta": "not json", "task": "{}", "blob": junk}),
        raw.xadd(b.keys["samples"], {"something": "else"}),
        raw.xadd(b.keys["samples"], {**good, "blob": b.keys["policy"]}),
        raw.xadd(b.keys["samples"], {"meta": header, "task": copied.to_json(), "blob": junk2}),
    ]
    b.release([copied])
    (second,) = finish(b, "w1", 1, version=0)
    groups = b.take_batch(8, trainer_version=0, timeout_s=0.5)
    assert sorted(g.task_id for g in groups) == sorted([first.task_id, second.task_id])
    assert b.stats()["dead_lettered"] == 5
    dead = b.dead_letters()
    assert [d["entry"] for d in dead] == bad_ids
    assert "unknown key" in dead[0]["reason"] and "bogus" in dead[0]["fields"]
    assert "not a payload key of this run" in dead[3]["reason"]
    assert "safetensors" in dead[4]["reason"]
    assert b.current_policy() == (1, "u1")  # the foreign key named as a payload was not deleted
    assert not raw.exists(junk2)  # the run's own junk payload went with its entry
    assert b.commit() == 2
    assert raw.xlen(b.keys["samples"]) == 0  # the bad entries are gone from the samples stream
    again = buf(redis_server, autocommit=False)  # a restarted trainer reads from the start
    assert again.take_batch(4, trainer_version=0, timeout_s=0.2) == []


def test_taken_but_uncommitted_groups_do_not_throttle_the_fleet(redis_server):
    """Back-pressure counts finished groups not yet taken plus leases. With capacity C = 4 and a
    trainer that commits only after a save every 5 steps (2 groups a step), the fleet keeps
    its full capacity step after step, although up to 10 taken groups wait in Redis for the
    commit; the untaken groups and the leases still throttle it."""
    capacity, per_step, save_every = 4, 2, 5
    fleet = buf(redis_server, capacity_groups=capacity)
    trainer = buf(redis_server, capacity_groups=capacity, autocommit=False)
    fleet.put_tasks(make_tasks(2 * per_step * save_every))
    for step in range(1, save_every + 1):
        finish(fleet, "w1", per_step, version=0)
        assert len(trainer.take_batch(per_step, trainer_version=0, timeout_s=1.0)) == per_step
        assert fleet.has_capacity(), f"step {step}: the fleet is throttled by taken groups"
        assert fleet.stats()["ready"] == step * per_step  # taken, not yet committed
    assert fleet.stats()["untaken"] == 0
    finish(fleet, "w1", 2, version=0)
    fleet.lease("w1", 1, block_ms=0)
    assert fleet.has_capacity()  # 2 untaken + 1 leased < 4
    fleet.lease("w1", 1, block_ms=0)
    assert not fleet.has_capacity()  # 2 untaken + 2 leased = 4
    assert trainer.commit() == per_step * save_every  # the save: the trained groups leave Redis
    assert not fleet.has_capacity()  # the commit frees nothing the fleet counts
    trainer.take_batch(2, trainer_version=0, timeout_s=1.0)
    assert fleet.has_capacity()
