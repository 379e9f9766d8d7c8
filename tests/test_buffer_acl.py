"""Per-role Redis ACL users (app/buffer/acl.py) on a real redis-server, as the cluster's buffer pod
and the embedded default configure it (issue 28 item 2):

- each role's own calls work as its user: the feed queues, a rollout worker leases, publishes,
  fails, releases, reads the policy and takes part in the weight-sync board, the trainer takes,
  requeues, commits, announces and drives a push;
- with the rollout credentials, the control plane is read-only: the push record, the plans, the
  event stream and the policy cannot be written, no admin command runs, other runs' keys are out
  of reach; the feed cannot touch the board either;
- without a password nothing connects.
"""

from __future__ import annotations

import pytest
import redis

from app.buffer import BufferConnectionError, ExperienceBuffer, LocalRedis, Sample, Task
from app.buffer.acl import ROLES, server_args, user_rules
from app.buffer.records import sample_id
from app.buffer.redis_server import new_password
from app.buffer.weight_sync import Registration, SyncBoard

RUN, PREFIX = "acl-run", "moerl"


@pytest.fixture
def acl_redis(tmp_path):
    """redis-server with an admin password and the role users of run RUN; yields (server, passwords)."""
    passwords = {role: new_password() for role in ROLES}
    server = LocalRedis(tmp_path / "redis", password=new_password(), extra_args=server_args(passwords, RUN, PREFIX))
    server.start()
    try:
        yield server, passwords
    finally:
        server.stop()


def _url(server: LocalRedis) -> str:
    return f"redis://127.0.0.1:{server.port}/0"


def _buffer(server, passwords, role: str, **kw) -> ExperienceBuffer:
    return ExperienceBuffer(_url(server), RUN, prefix=PREFIX, username=role, password=passwords[role], **kw)


def _client(server, passwords, role: str) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, username=role, password=passwords[role],
                       decode_responses=True)


def _samples(task: Task, version: int = 0) -> list[Sample]:
    return [Sample(sample_id=sample_id(RUN, task.task_id, i, task.attempt), task_id=task.task_id, index=i,
                   attempt=task.attempt, prompt_ids=[1, 2], completion_ids=[3], logprobs=[-0.5], reward=1.0,
                   policy_version=version, finish_reason="stop") for i in range(task.group_size)]


def test_every_role_does_its_own_work_as_its_own_user(acl_redis):
    server, pw = acl_redis
    feed = _buffer(server, pw, "feed")
    tasks = [Task(task_id=f"t{i}", prompt_ids=[1, 2], prompt="p", answer="{}", group_size=2) for i in range(4)]
    assert feed.put_tasks(tasks) == 4 and feed.stats()["queued"] == 4

    rollout = _buffer(server, pw, "rollout")
    leased = rollout.lease("w0", count=4, block_ms=0)
    assert len(leased) == 4 and rollout.has_capacity()
    assert rollout.extend(leased[:1]) == leased[:1]
    assert rollout.publish(leased[0], _samples(leased[0]))
    # the same group made twice (its lease expired and was taken over): a duplicate, acked
    assert not rollout.publish(leased[0], _samples(leased[0])) and rollout.stats()["duplicates"] == 1
    rollout.fail(leased[1:2])
    rollout.note_failures(["environment: no answer to step within 10 s"])  # why (app/buffer/health.py)
    rollout.note_waiting("w0", "environment", "http://env:8090", "ConnectError")
    rollout.release(leased[2:3])
    assert rollout.publish(leased[3], _samples(leased[3], version=0))

    trainer = _buffer(server, pw, "trainer", autocommit=False, stale_policy="requeue", max_staleness=0)
    health = trainer.health()
    assert health.failures == {"environment: no answer to step within 10 s": 1} and health.waiting["w0"]["why"] == "ConnectError"
    got = trainer.take_batch(2, trainer_version=1, timeout_s=0)  # v0 groups at v1: stale -> requeued
    assert got == [] and trainer.stats()["requeued"] == 2
    assert trainer.announce_policy(1, "s3://b/v1") and rollout.current_policy() == (1, "s3://b/v1")
    leased = rollout.lease("w0", count=4, block_ms=0, engine_version=1)  # staleness admission
    assert leased and all(rollout.publish(t, _samples(t, version=1)) for t in leased)
    trainer.max_staleness = 1
    assert len(trainer.take_batch(len(leased), trainer_version=1, timeout_s=0)) == len(leased)
    assert trainer.commit() == len(leased)

    # The weight-sync board: workers register and ack, the trainer prepares, plans and reads acks.
    wboard, tboard = SyncBoard.of(rollout), SyncBoard.of(trainer)
    wboard.register(Registration("w0", 1, 1, None), ttl_s=30)
    assert set(tboard.engines()) == {"w0"}
    last = wboard.wait("events", None, 0.01)
    tboard.set_push({"id": "p1", "version": 2, "state": "prepare"})
    assert wboard.wait("events", last, 5.0) != last and wboard.push()["id"] == "p1"
    tboard.set_plan("p1", [{"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}])
    assert wboard.plan("p1")[0]["names"] == ["w"]
    wboard.ack("p1", "w0", "ready", ranks=1)
    assert tboard.acks("p1")["w0"]["state"] == "ready"
    assert tboard.wait("ack-events", "0-0", 1.0) != "0-0"
    wboard.unregister("w0")
    assert tboard.engines() == {}


def test_the_rollout_credentials_cannot_write_the_control_plane(acl_redis):
    """What a foothold in a rollout pod holds: the rollout user's password. Writing the push record
    (what would send every engine to another address), a plan, an event, the policy hash, any
    admin command and any key of another run are refused by Redis itself."""
    server, pw = acl_redis
    _buffer(server, pw, "trainer").close()  # the run's keys exist as in a live run
    board = SyncBoard(_client(server, pw, "rollout"), PREFIX, RUN)
    forged = {"id": "evil", "version": 9, "state": "join",
              "group": {"master_address": "10.9.9.9", "master_port": 1234}}
    with pytest.raises(redis.exceptions.NoPermissionError):
        board.set_push(forged)
    assert board.push() is None
    r = board.r
    for command in (("SET", board.k + "push", "{}"), ("DEL", board.k + "push"),
                    ("SET", board.k + "plan:p1", "[]"), ("XADD", board.k + "events", "*", "push", "evil"),
                    ("HSET", f"{PREFIX}:{RUN}:policy", "version", "99", "uri", "s3://attacker/v99"),
                    ("HGETALL", f"{PREFIX}:{RUN}:stats" + "-not-ours"),
                    ("XLEN", f"{PREFIX}:other-run:tasks"), ("GET", f"{PREFIX}:other-run:wsync:push"),
                    ("HGETALL", board.k + "acks:p1"), ("SMEMBERS", board.k + "engine-ids"),
                    ("GET", board.k + "engine:w1"), ("CONFIG", "GET", "requirepass"), ("KEYS", "*"),
                    ("FLUSHALL",), ("ACL", "LIST"), ("SHUTDOWN", "NOSAVE")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            r.execute_command(*command)
    with pytest.raises(redis.exceptions.NoPermissionError):
        ExperienceBuffer(_url(server), RUN, prefix=PREFIX, username="rollout",
                         password=pw["rollout"]).announce_policy(99, "s3://attacker/v99")
    assert server.client().ping()  # still up


def test_the_feed_cannot_touch_the_board_and_nothing_connects_without_a_password(acl_redis):
    server, pw = acl_redis
    feed = _client(server, pw, "feed")
    with pytest.raises(redis.exceptions.NoPermissionError):
        SyncBoard(feed, PREFIX, RUN).set_push({"id": "x", "version": 1, "state": "prepare"})
    with pytest.raises(redis.exceptions.NoPermissionError):
        feed.execute_command("XREAD", "STREAMS", f"{PREFIX}:{RUN}:samples", "0-0")
    with pytest.raises(BufferConnectionError, match="password"):
        ExperienceBuffer(_url(server), RUN, prefix=PREFIX)  # the default user without its password
    with pytest.raises(BufferConnectionError, match="refused AUTH"):
        ExperienceBuffer(_url(server), RUN, prefix=PREFIX, username="rollout", password="guess")


def test_rules_name_only_this_runs_keys():
    for role in ROLES:
        rules = user_rules(role, RUN, PREFIX)
        patterns = [r for r in rules if "~" in r]
        assert patterns and all(p.split("~", 1)[1].startswith(f"{PREFIX}:{RUN}:") for p in patterns), role
        assert "-@all" in rules and not any(r in ("+@all", "allcommands", "allkeys", "~*") for r in rules)
    with pytest.raises(ValueError, match="run_id"):
        user_rules("rollout", "bad*run", PREFIX)
    with pytest.raises(ValueError, match="role"):
        user_rules("env", RUN, PREFIX)


def test_the_embedded_default_has_a_password_and_a_user_per_role(tmp_path):
    """`moerl run`'s Redis (app/local/embedded.py): nothing connects without a password, run.yaml holds
    none, each role process gets its own user in its environment, and the rollout user cannot
    write the push record there either."""
    from app.names import PASSWORD_ENV, USER_ENV
    from app.config import RunConfig
    from app.local.embedded import EmbeddedLoop

    loop = EmbeddedLoop(RunConfig(), tmp_path / "run", workers=1)
    try:
        url = loop.start_redis()
        text = loop.config_path.read_text()
        assert url == loop.cfg.buffer.redis_url and "@" not in url
        assert all(p not in text for p in [loop.redis.password, *loop.passwords.values()])
        with pytest.raises(BufferConnectionError, match="password"):
            ExperienceBuffer(url, loop.cfg.run_id)
        env = loop.role_env("rollout")
        assert env[USER_ENV] == "rollout" and env[PASSWORD_ENV] == loop.passwords["rollout"]
        assert len({loop.redis.password, *loop.passwords.values()}) == 1 + len(ROLES)
        rollout = ExperienceBuffer(url, loop.cfg.run_id, username="rollout", password=env[PASSWORD_ENV])
        assert rollout.lease("w0", count=1, block_ms=0) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            SyncBoard.of(rollout).set_push({"id": "evil", "version": 1, "state": "prepare"})
        with loop.buffer() as admin:  # this process: the feeder and the audits, as the default user
            assert admin.stats()["queued"] == 0
    finally:
        loop.close()
