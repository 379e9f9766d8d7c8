"""Redis restarts as the trainer sees them (issue 4, part 3), against a real redis-server.

test_buffer.py covers the buffer alone (acked groups and leases survive a restart). Here the
trainer's side: groups a trainer took but had not committed (its state was not saved yet) are
read again by the restarted trainer after redis-server was SIGKILLed; committed ones are not;
and `drop_committed` finishes a commit that a kill interrupted, leaving later groups alone.
The embedded loop's server is started with ``appendfsync always`` where the chaos harness
needs every acknowledged write to survive a SIGKILL.
"""

from __future__ import annotations

import time

from app.buffer import ExperienceBuffer, Sample, Task
from app.buffer.redis_server import LocalRedis
from app.trainer.state import drop_committed

RUN = "rr"
G = 2


def _tasks(ids) -> list[Task]:
    return [Task(task_id=f"t{i}", prompt_ids=[1, 2], prompt="", answer="{}", group_size=G) for i in ids]


def _finish(buf: ExperienceBuffer, n: int, consumer: str = "w") -> list[str]:
    done = []
    for task in buf.lease(consumer, n, block_ms=0):
        buf.publish(task, [Sample(sample_id=task.sample_id(RUN, k), task_id=task.task_id, index=k,
                                  attempt=task.attempt, prompt_ids=task.prompt_ids, completion_ids=[5],
                                  logprobs=[-1.0], reward=0.0, policy_version=0, finish_reason="stop")
                           for k in range(G)])
        done.append(task.task_id)
    return done


def test_sigkilled_redis_keeps_uncommitted_groups_for_the_restarted_trainer(tmp_path):
    server = LocalRedis(tmp_path / "redis", appendfsync="always").start()
    try:
        producer = ExperienceBuffer(server.url, RUN, lease_ms=300)
        producer.put_tasks(_tasks(range(6)))
        assert _finish(producer, 6) == [f"t{i}" for i in range(6)]

        trainer = ExperienceBuffer(server.url, RUN, autocommit=False)
        step1 = trainer.take_batch(2, trainer_version=0, timeout_s=1)
        trainer.commit()  # step 1 saved, then committed
        step2 = trainer.take_batch(2, trainer_version=0, timeout_s=1)  # trained, not yet saved
        assert [g.task_id for g in step1 + step2] == ["t0", "t1", "t2", "t3"]
        producer.put_tasks(_tasks([6]))
        leased = producer.lease("dies", 1, block_ms=0)  # its worker dies with the node

        server.restart(graceful=False)  # SIGKILL, then start on the same port and data dir
        # The trainer died too: a new process reads from the start of the samples stream.
        again = ExperienceBuffer(server.url, RUN, autocommit=False)
        got = again.take_batch(10, trainer_version=0, timeout_s=1)
        assert [g.task_id for g in got] == ["t2", "t3", "t4", "t5"]
        time.sleep(0.4)  # lease_ms
        assert [t.task_id for t in producer.lease("w2", 5, block_ms=0)] == [t.task_id for t in leased]
    finally:
        server.stop()


def test_drop_committed_finishes_an_interrupted_commit(tmp_path):
    with LocalRedis(tmp_path / "redis") as server:
        buf = ExperienceBuffer(server.url, RUN, autocommit=False)
        buf.put_tasks(_tasks(range(5)))
        _finish(buf, 5)
        taken = buf.take_batch(3, trainer_version=0, timeout_s=1)
        # The state saved after these 3 groups records the newest entry id; the kill came
        # before commit(), so they are still in Redis.
        point = taken[-1].entry_id
        fresh = ExperienceBuffer(server.url, RUN, autocommit=False)
        assert drop_committed(fresh, point) == 3
        assert drop_committed(fresh, point) == 0  # idempotent
        assert drop_committed(fresh, None) == 0
        assert [g.task_id for g in fresh.take_batch(10, trainer_version=0, timeout_s=0.5)] == ["t3", "t4"]


def test_embedded_loop_redis_uses_the_requested_fsync(tmp_path):
    from app.config import RunConfig
    from app.local.embedded import EmbeddedLoop

    loop = EmbeddedLoop(RunConfig(), tmp_path / "run", workers=1)
    try:
        loop.start_redis(appendfsync="always")
        client = loop.redis.client()
        assert client.config_get("appendonly")["appendonly"] == "yes"
        assert client.config_get("appendfsync")["appendfsync"] == "always"
        client.close()
    finally:
        loop.close()


def test_server_restarted_from_a_worker_thread_outlives_the_thread(tmp_path):
    """PR_SET_PDEATHSIG follows the forking *thread*: a restart from a pool thread (as the worker
    test does through asyncio.to_thread) must not shut the server down when that thread ends."""
    import threading

    server = LocalRedis(tmp_path / "redis").start()
    try:
        t = threading.Thread(target=server.restart)
        t.start()
        t.join()
        time.sleep(1.0)  # a SIGTERM'd server would have shut down by now
        assert server.alive() and server.client().ping()
    finally:
        server.stop()
