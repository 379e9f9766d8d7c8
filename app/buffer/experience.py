"""The experience buffer and task queue of one run, on Redis Streams with a consumer group.

Layout (every key under ``{prefix}:{run_id}:``):

    tasks     stream: one entry per prompt attempt to generate; consumer group "rollout".
              An entry is leased by XREADGROUP, stays in the group's pending list (PEL) while a
              worker holds it, and is XACK'ed and XDEL'ed when its group is published. A lease
              idle for more than `lease_ms` is taken over by the next `lease()` (XAUTOCLAIM).
    samples   stream: one entry per finished GRPO group: {meta: the group's header (JSON, a few
              hundred bytes: ids, versions, rewards, lengths; app/buffer/encoding.py), task: the
              task (JSON), blob: the key of its payload, seq: its sequence number}. The trainer
              reads it in order with a client-side cursor; taken entries (and their payloads)
              are deleted when committed (by default when the next batch is taken), so a
              trainer that dies mid-step reads its last batch again after a restart.
    blob:<id> string per group: the group's payload (token ids, logprobs, masks, routed experts;
              binary, app/buffer/encoding.py), written by a plain SET with a time to live that
              the publish script removes once the entry references it; a writer that dies
              between the two leaves a payload that expires (`PAYLOAD_TTL_MS`). Payloads are
              deleted by UNLINK, which Redis 7 still frees on the main thread for a string (its
              free effort is 1, below the lazy-free threshold): 42 ms for a 65 MB routing-replay
              payload on the 2-core dev VM, part of the main-thread time in bench/results/buffer.md.
    dead      stream: dead letters, one entry per samples entry the trainer could not read (a
              malformed or foreign entry): {entry, reason, fields (truncated)}; the entry itself is
              deleted from samples and counted in ``dead_lettered``, and the trainer goes on.
    issued    set of "task_id/attempt" already queued (put_tasks and requeue are idempotent).
    seen      set of published sample ids: a replayed task's group is not added twice.
    dropped   set of "task_id/attempt" dropped after ``max_failures`` failed rollouts (`fail`).
    stats     hash of counters, and ``taken_seq``: the sequence number (the ``finished`` count
              when it was published) of the newest samples entry the trainer has read, so that
              back-pressure counts finished groups not yet taken (``finished - taken_seq``).
    policy    hash {version, uri} of the newest announced policy.
    health    hash: failed groups per reason and which worker waits on what (app/buffer/health.py).

The PEL, the streams and the sets are plain Redis data, so with append-only persistence a
restarted redis-server still holds the leases (reclaimed after `lease_ms` as usual) and every
published group.

Why the payload is not in the stream entry: the publish must check the sample ids and ack the
lease atomically (a Lua script), and a script's arguments are copied into Lua strings: a
group of 3.6 MB of JSON cost 40-60 plain XADDs of the same bytes in the script (106 MB with
routing replay: 1.3-1.7 s of main thread), where a SET keeps a large argument without a copy
(bench/results/buffer.md, `moerl bench buffer`). So the payload goes first by SET, and the script, with
only the header and the key as arguments, checks the ids, acks, and adds the entry.

Redis commands: https://redis.io/docs/latest/develop/data-types/streams/ (XREADGROUP, XACK,
XAUTOCLAIM, XPENDING). Needs Redis 6.2+ (XAUTOCLAIM).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import uuid
from collections import Counter
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from app.buffer.encoding import GroupHeader, decode_group, encode_group
from app.buffer.health import FAIL_PREFIX, WAIT_PREFIX, RolloutHealth
from app.buffer.keys import blob_key_prefix, buffer_keys
from app.buffer.records import FINISH_REASONS, Group, Sample, Task, check_version_segments, sample_id
from app.names import PASSWORD_ENV, USER_ENV
from app.versions import overstale

if TYPE_CHECKING:
    from app.config import RunConfig

ROLLOUT_GROUP = "rollout"
STAT_NAMES = ("issued", "finished", "taken", "consumed", "dropped_stale", "requeued",
              "duplicates", "released", "failed_requeued", "failed_dropped", "dead_lettered")
# Dead letters kept (approximately: XADD MAXLEN ~), and the characters of each field kept in one.
DEAD_LETTERS_KEPT = 10_000
DEAD_LETTER_FIELD_CHARS = 4096
# A payload SET before its publish script ran expires after this unless the script keeps it: only
# a writer that died between the two (or a duplicate group's payload) leaves one behind.
PAYLOAD_TTL_MS = 600_000

# put_tasks / requeue: queue a task attempt only if it was never queued before.
# KEYS: tasks, issued, stats, samples; ARGV: samples entry to delete ('' for none), its payload
# key ('' for none), then (issue key, task json) pairs. Returns how many were queued.
_PUT_TASKS = """
if ARGV[1] ~= '' then redis.call('XDEL', KEYS[4], ARGV[1]) end
if ARGV[2] ~= '' then redis.call('UNLINK', ARGV[2]) end
local added = 0
for i = 3, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'task', ARGV[i + 1])
    added = added + 1
  end
end
redis.call('HINCRBY', KEYS[3], 'issued', added)
return added
"""

# publish: add a finished group (its payload already SET at KEYS[5] with a time to live) unless
# one of its sample ids was published before; in both cases the task's lease is acked and its
# entry deleted (the task is done). A duplicate's payload is deleted unless it has no time to live
# left: then it is this very call's, retried after its reply was lost, and an entry holds it. A
# payload that is gone (expired) changes nothing and returns -1. The entry carries its sequence
# number (the finished count), which back-pressure compares with stats.taken_seq.
# KEYS: tasks, samples, seen, stats, payload; ARGV: group name, task entry id, header json, task
# json, ids...
_PUBLISH = """
local dup = false
for i = 5, #ARGV do
  if redis.call('SISMEMBER', KEYS[3], ARGV[i]) == 1 then dup = true; break end
end
if not dup and redis.call('EXISTS', KEYS[5]) == 0 then return -1 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if dup then
  if redis.call('PTTL', KEYS[5]) > 0 then redis.call('UNLINK', KEYS[5]) end
  redis.call('HINCRBY', KEYS[4], 'duplicates', 1)
  return 0
end
redis.call('PERSIST', KEYS[5])
local seq = redis.call('HINCRBY', KEYS[4], 'finished', 1)
redis.call('XADD', KEYS[2], '*', 'meta', ARGV[3], 'task', ARGV[4], 'blob', KEYS[5], 'seq', seq)
for i = 5, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
return 1
"""

# release / extend: act only on leases this consumer still holds (another worker may have
# reclaimed an expired one). KEYS: tasks, stats; ARGV: group, consumer, mode, then
# (entry id, task json) pairs. mode "release": ack + delete + queue again at the tail;
# mode "extend": reset the idle time. Returns the entry ids acted on.
_OWNED = """
local done = {}
for i = 4, #ARGV, 2 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 1 then
    if ARGV[3] == 'release' then
      redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
      redis.call('XDEL', KEYS[1], ARGV[i])
      redis.call('XADD', KEYS[1], '*', 'task', ARGV[i + 1])
      redis.call('HINCRBY', KEYS[2], 'released', 1)
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    end
    table.insert(done, ARGV[i])
  end
end
return done
"""

# fail: a rollout of a leased task failed (reward / environment). Only for leases this consumer
# still holds: ack + delete, then queue the task again (its failures already counted up) or, at
# the limit, drop it and remember it. KEYS: tasks, stats, dropped; ARGV: group, consumer, then
# (entry id, task json, drop flag, "task_id/attempt") quads. Returns the entry ids dropped.
_FAIL = """
local dropped = {}
for i = 3, #ARGV, 4 do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #p == 1 then
    redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
    redis.call('XDEL', KEYS[1], ARGV[i])
    if ARGV[i + 2] == '1' then
      redis.call('SADD', KEYS[3], ARGV[i + 3])
      redis.call('HINCRBY', KEYS[2], 'failed_dropped', 1)
      table.insert(dropped, ARGV[i])
    else
      redis.call('XADD', KEYS[1], '*', 'task', ARGV[i + 1])
      redis.call('HINCRBY', KEYS[2], 'failed_requeued', 1)
    end
  end
end
return dropped
"""

# announce_policy: versions only move forward unless forced. KEYS: policy; ARGV: version, uri, force.
_ANNOUNCE = """
local cur = redis.call('HGET', KEYS[1], 'version')
if ARGV[3] == '1' or not cur or tonumber(cur) < tonumber(ARGV[1]) then
  redis.call('HSET', KEYS[1], 'version', ARGV[1], 'uri', ARGV[2])
  return 1
end
return 0
"""

class BufferConnectionError(ConnectionError):
    """Redis cannot be reached or refuses the credentials; the message names the URL."""


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


class ExperienceBuffer:
    """Task queue (prompt groups) and experience buffer (finished groups) of one run.

    Args:
        url: redis://[user:password@]host:port/db (rediss:// for TLS).
        run_id: the run; every key lives under f"{prefix}:{run_id}:".
        prefix: key prefix shared by all runs of this deployment.
        capacity_groups: back-pressure bound on finished groups not yet taken by the trainer
            plus leased tasks.
        lease_ms: a lease idle for longer than this is taken over by the next lease() call.
        max_staleness: the trainer takes a group only if trainer_version - group version <= this.
        stale_policy: "drop" (count and discard stale groups) or "requeue" (discard and queue the
            task again with attempt + 1).
        password: AUTH password; overrides the one in the URL.
        username: ACL user (app/buffer/acl.py); overrides the one in the URL.
        autocommit: take_batch() first commits the previous batch (deletes its entries).
            Set False when the trainer commits itself after saving its state.
        max_failures: failed rollouts of one task attempt before `fail` drops it.

    Raises:
        ValueError: a bad argument (named).
        BufferConnectionError: Redis is unreachable, refuses AUTH or is older than 6.2; the
            message names the URL (password redacted).
    """

    def __init__(
        self,
        url: str,
        run_id: str,
        *,
        prefix: str = "moerl",
        capacity_groups: int = 64,
        lease_ms: int = 60_000,
        max_staleness: int = 1,
        stale_policy: str = "drop",
        password: str | None = None,
        username: str | None = None,
        autocommit: bool = True,
        max_failures: int = 3,
    ):
        if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"url must be redis://, rediss:// or unix://, got {redact_url(url)!r}")
        self.keys = buffer_keys(run_id, prefix)
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if lease_ms < 1:
            raise ValueError(f"lease_ms must be >= 1, got {lease_ms}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_failures < 1:
            raise ValueError(f"max_failures must be >= 1, got {max_failures}")
        if stale_policy not in ("drop", "requeue"):
            raise ValueError(f"stale_policy must be 'drop' or 'requeue', got {stale_policy!r}")
        self.url = url
        self.run_id = run_id
        self.prefix = prefix
        self.capacity_groups = capacity_groups
        self.lease_ms = lease_ms
        self.max_staleness = max_staleness
        self.stale_policy = stale_policy
        self.autocommit = autocommit
        self.max_failures = max_failures
        self.blob_prefix = blob_key_prefix(run_id, prefix)
        self._cursor = "0-0"  # last samples entry read by take_batch (this process only)
        self._taken: list[tuple[str, str]] = []  # (entry, payload key) taken but not yet committed
        self._lock = threading.Lock()  # _taken: a take in a prefetch thread, a commit in the loop

        kwargs = dict(decode_responses=True, socket_connect_timeout=2.0, socket_timeout=30.0)
        if password is not None:
            kwargs["password"] = password
        if username is not None:
            kwargs["username"] = username
        self._check_reachable(url, kwargs)
        # Reconnect through short outages (a redis-server restart) instead of failing the role.
        self.r = redis.Redis.from_url(
            url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 8),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError], **kwargs,
        )
        # Payloads are bytes: a client of their own that does not decode replies.
        self.raw = redis.Redis.from_url(
            url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.1), 8),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError], **{**kwargs, "decode_responses": False},
        )
        self._put_tasks = self.r.register_script(_PUT_TASKS)
        self._publish = self.r.register_script(_PUBLISH)
        self._owned = self.r.register_script(_OWNED)
        self._fail = self.r.register_script(_FAIL)
        self._announce = self.r.register_script(_ANNOUNCE)
        self._ensure_group()

    @staticmethod
    def _check_reachable(url: str, kwargs: dict) -> None:
        """One PING without retries, so a wrong URL fails at once with a clear message."""
        try:
            probe = redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(), 0), **kwargs)
        except ValueError as e:
            raise ValueError(f"bad Redis URL {redact_url(url)!r}: {e}") from None
        try:
            probe.ping()
            version = probe.info("server")["redis_version"]
        except redis.AuthenticationError as e:
            raise BufferConnectionError(
                f"Redis at {redact_url(url)} refused AUTH (missing or wrong password; set it in the "
                f"URL or ${PASSWORD_ENV}): {e}") from None
        except redis.ResponseError as e:
            if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
                raise BufferConnectionError(
                    f"Redis at {redact_url(url)} needs a password (set it in the URL or "
                    f"${PASSWORD_ENV}): {e}") from None
            raise
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise BufferConnectionError(f"cannot reach Redis at {redact_url(url)}: {e}") from None
        except redis.RedisError as e:  # e.g. InvalidResponse: an HTTP server or another protocol
            raise BufferConnectionError(f"{redact_url(url)} did not answer as Redis does "
                                        f"({type(e).__name__}: {str(e)[:120]})") from None
        finally:
            probe.close()
        if tuple(int(x) for x in version.split(".")[:2]) < (6, 2):
            raise BufferConnectionError(
                f"Redis at {redact_url(url)} is {version}; the buffer needs 6.2+ (XAUTOCLAIM)")

    @classmethod
    def from_config(cls, cfg: "RunConfig", **overrides) -> "ExperienceBuffer":
        """The buffer of run `cfg.run_id` with the settings of `cfg.buffer`.

        The password comes from the URL or from the environment variable MOERL_REDIS_PASSWORD
        (a Kubernetes Secret in the cluster), never from the config document; the ACL user of
        the role from MOERL_REDIS_USER (app/buffer/acl.py), else the URL's, else "default".
        """
        b = cfg.buffer
        kwargs = dict(
            prefix=b.run_prefix, capacity_groups=b.capacity_groups, lease_ms=b.lease_ms,
            max_staleness=b.max_staleness, stale_policy=b.stale_policy, max_failures=b.max_failures,
            password=os.environ.get(PASSWORD_ENV) or None, username=os.environ.get(USER_ENV) or None,
        )
        kwargs.update(overrides)
        return cls(b.redis_url, cfg.run_id, **kwargs)

    def _ensure_group(self) -> None:
        try:
            # Id 0: tasks queued before the group existed are delivered too.
            self.r.xgroup_create(self.keys["tasks"], ROLLOUT_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def close(self) -> None:
        self.r.close()
        self.raw.close()

    def __enter__(self) -> "ExperienceBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- task queue -------------------------------------------------------------------------

    def put_tasks(self, tasks: list[Task]) -> int:
        """Queue prompt groups; a (task_id, attempt) queued before in this run is skipped.

        Skipping makes a restarted feeder harmless. A second pass over the same prompts (an
        epoch) therefore needs new task ids, e.g. "e1-train-000123".

        Returns:
            how many tasks were queued.
        Raises:
            ValueError: a task has an empty or '/'-containing task_id or group_size < 1 (nothing
                is queued then).
        """
        for i, t in enumerate(tasks):
            if not isinstance(t, Task):
                raise ValueError(f"tasks[{i}] is a {type(t).__name__}, not a Task")
            if not t.task_id or "/" in t.task_id:
                raise ValueError(f"tasks[{i}].task_id must be non-empty without '/', got {t.task_id!r}")
            if t.group_size < 1:
                raise ValueError(f"tasks[{i}].group_size must be >= 1, got {t.group_size}")
            if t.attempt < 0:
                raise ValueError(f"tasks[{i}].attempt must be >= 0, got {t.attempt}")
        added = 0
        for start in range(0, len(tasks), 500):  # bounded script calls
            args: list[str] = ["", ""]
            for t in tasks[start:start + 500]:
                args += [f"{t.task_id}/{t.attempt}", t.to_json()]
            added += int(self._put_tasks(keys=self._k("tasks", "issued", "stats", "samples"), args=args))
        return added

    def _k(self, *names: str) -> list[str]:
        return [self.keys[n] for n in names]

    def lease(self, consumer: str, count: int = 1, block_ms: int = 1000) -> list[Task]:
        """Lease up to `count` tasks for rollout worker `consumer`.

        Leases idle for more than `lease_ms` (their worker died or hung) are taken over first
        (XAUTOCLAIM); then new tasks are read (XREADGROUP), waiting up to `block_ms` if none
        (0: do not wait).

        Returns:
            the leased tasks, with `entry_id` and `consumer` set; empty if none came in time.
        Raises:
            ValueError: empty consumer, count < 1, or block_ms outside 0..20000.
        """
        if not consumer:
            raise ValueError("consumer must be a non-empty worker name")
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not 0 <= block_ms <= 20_000:
            raise ValueError(f"block_ms must be in 0..20000, got {block_ms}")
        try:
            return self._lease(consumer, count, block_ms)
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._ensure_group()  # Redis lost its data (no persistence): start the group again
            return self._lease(consumer, count, block_ms)

    def _lease(self, consumer: str, count: int, block_ms: int) -> list[Task]:
        out: list[Task] = []
        start = "0-0"
        for _ in range(8):  # XAUTOCLAIM scans a bounded slice of the PEL per call
            start, entries, *_ = self.r.xautoclaim(
                self.keys["tasks"], ROLLOUT_GROUP, consumer, self.lease_ms,
                start_id=start, count=count - len(out))
            out += self._tasks(entries, consumer)
            if len(out) >= count or start == "0-0":
                break
        if len(out) < count:
            block = block_ms if (not out and block_ms > 0) else None
            resp = self.r.xreadgroup(ROLLOUT_GROUP, consumer, {self.keys["tasks"]: ">"},
                                     count=count - len(out), block=block)
            for _, entries in resp or []:
                out += self._tasks(entries, consumer)
        return out

    def _tasks(self, entries, consumer: str) -> list[Task]:
        tasks = []
        for entry_id, fields in entries:
            if not fields:  # deleted while pending (Redis 6.2 returns it with no fields)
                self.r.xack(self.keys["tasks"], ROLLOUT_GROUP, entry_id)
                continue
            t = Task.from_json(fields["task"])
            t.entry_id, t.consumer = entry_id, consumer
            tasks.append(t)
        return tasks

    def extend(self, tasks: list[Task]) -> list[Task]:
        """Reset the lease clock of tasks their worker still holds (a long generation).

        Returns:
            the tasks still held by their consumer; the others were taken over by another worker.
        """
        done = set(self._owned_call(tasks, "extend"))
        return [t for t in tasks if t.entry_id in done]

    def release(self, tasks: list[Task]) -> None:
        """Give leased tasks back to the queue now (worker drain), same attempt.

        A task whose lease was already taken over by another worker is left alone.
        """
        self._owned_call(tasks, "release")

    def fail(self, tasks: list[Task]) -> list[Task]:
        """Return leased tasks whose rollout failed (a reward or environment call raised, timed
        out or answered malformed): each goes back to the queue with ``failures + 1``, or, when
        that reaches ``max_failures``, is dropped (counted in ``failed_dropped``, its
        "task_id/attempt" kept in the ``dropped`` set). Nothing of a failed rollout is published,
        so it is never trained. A task whose lease another worker took over is left alone.

        Returns:
            the tasks dropped.
        Raises:
            ValueError: a task has no lease.
        """
        dropped: list[str] = []
        by_consumer: dict[str, list[Task]] = {}
        for t in tasks:
            if not t.entry_id or not t.consumer:
                raise ValueError(f"task {t.task_id!r} has no lease (entry_id/consumer empty)")
            by_consumer.setdefault(t.consumer, []).append(t)
        for consumer, ts in by_consumer.items():
            args = [ROLLOUT_GROUP, consumer]
            for t in ts:
                again = Task.from_dict({**t.to_dict(), "failures": t.failures + 1})
                args += [t.entry_id, again.to_json(), "1" if again.failures >= self.max_failures else "0",
                         f"{t.task_id}/{t.attempt}"]
            dropped += self._fail(keys=self._k("tasks", "stats", "dropped"), args=args)
        return [t for t in tasks if t.entry_id in set(dropped)]

    def dropped_tasks(self) -> set[str]:
        """"task_id/attempt" of every task dropped after ``max_failures`` failed rollouts."""
        return set(self.r.smembers(self.keys["dropped"]))

    def _owned_call(self, tasks: list[Task], mode: str) -> list[str]:
        done: list[str] = []
        by_consumer: dict[str, list[Task]] = {}
        for t in tasks:
            if not t.entry_id or not t.consumer:
                raise ValueError(f"task {t.task_id!r} has no lease (entry_id/consumer empty)")
            by_consumer.setdefault(t.consumer, []).append(t)
        for consumer, ts in by_consumer.items():
            args = [ROLLOUT_GROUP, consumer, mode]
            for t in ts:
                args += [t.entry_id, t.to_json()]
            done += self._owned(keys=self._k("tasks", "stats"), args=args)
        return done

    def publish(self, task: Task, samples: list[Sample]) -> bool:
        """Add the finished group of a leased task and ack the task: the payload by a plain SET,
        then one Lua script that checks the sample ids, acks and adds the entry, atomically.

        Args:
            task: the task as returned by lease().
            samples: its group_size samples, indices 0..G-1, ids from `sample_id(run, ...)`.
        Returns:
            True if added; False if a sample id was published before (a replayed task): the
            group is ignored and counted as a duplicate, the task is acked all the same.
        Raises:
            ValueError: the task has no lease, or a sample does not belong to it (wrong count,
                index, task_id, attempt, sample_id, finish_reason, logprobs length, non-finite
                reward, a token id outside [0, 2**31), routed experts of the wrong shape);
                nothing is written then.
            BufferError: the payload expired before the script ran (Redis was away for longer
                than `PAYLOAD_TTL_MS`); nothing was added or acked: publish again.
        """
        if not task.entry_id:
            raise ValueError(f"task {task.task_id!r} has no entry_id: publish tasks from lease()")
        if len(samples) != task.group_size:
            raise ValueError(f"task {task.task_id!r}: {len(samples)} samples, group_size is {task.group_size}")
        samples = sorted(samples, key=lambda s: s.index)
        for i, s in enumerate(samples):
            where = f"task {task.task_id!r} sample {i}"
            if s.index != i:
                raise ValueError(f"{where}: indices must be 0..{task.group_size - 1}, got {s.index}")
            if s.task_id != task.task_id or s.attempt != task.attempt:
                raise ValueError(f"{where}: task_id/attempt {s.task_id!r}/{s.attempt} != "
                                 f"{task.task_id!r}/{task.attempt}")
            expect = sample_id(self.run_id, task.task_id, i, task.attempt)
            if s.sample_id != expect:
                raise ValueError(f"{where}: sample_id {s.sample_id!r}, expected {expect!r}")
            if s.finish_reason not in FINISH_REASONS:
                raise ValueError(f"{where}: finish_reason {s.finish_reason!r} not in {FINISH_REASONS}")
            if len(s.logprobs) != len(s.completion_ids):
                raise ValueError(f"{where}: {len(s.logprobs)} logprobs for "
                                 f"{len(s.completion_ids)} completion tokens")
            if s.loss_mask is not None and (len(s.loss_mask) != len(s.completion_ids)
                                            or any(m not in (0, 1) for m in s.loss_mask)):
                raise ValueError(f"{where}: loss_mask must hold one 0/1 per completion token "
                                 f"({len(s.completion_ids)})")
            if not math.isfinite(s.reward):
                raise ValueError(f"{where}: reward is {s.reward}")
            if s.policy_version < 0:
                raise ValueError(f"{where}: policy_version {s.policy_version} < 0")
            check_version_segments(s.version_segments, len(s.completion_ids), s.policy_version, where)
        header, payload = encode_group(Group(task.task_id, task.attempt, samples))
        blob = f"{self.blob_prefix}{uuid.uuid4().hex}"
        self.raw.set(blob, payload, px=PAYLOAD_TTL_MS)
        args = [ROLLOUT_GROUP, task.entry_id, header.to_json(), task.to_json()]
        args += [s.sample_id for s in samples]
        added = int(self._publish(keys=[*self._k("tasks", "samples", "seen", "stats"), blob], args=args))
        if added < 0:
            raise BufferError(f"task {task.task_id!r}: the group's payload expired before it was published; "
                              "nothing was written: publish again")
        return bool(added)

    # ---- back-pressure ----------------------------------------------------------------------

    def _backlog(self) -> int:
        """Finished groups the trainer has not taken yet plus leased tasks. Groups taken but not
        yet committed (the trainer commits after a save) do not count: they are the trainer's, and
        counting them throttled the fleet to almost nothing just before each save."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.keys["stats"], "finished", "taken_seq")
        pipe.xpending(self.keys["tasks"], ROLLOUT_GROUP)
        (finished, taken_seq), pending = pipe.execute()
        return _untaken(finished, taken_seq) + pending["pending"]

    def has_capacity(self) -> bool:
        """True while finished groups not yet taken by the trainer plus leased tasks < capacity_groups."""
        return self._backlog() < self.capacity_groups

    def wait_for_capacity(self, timeout_s: float) -> bool:
        """Wait (polling, 20 ms growing to 0.5 s) until has_capacity(); False on timeout."""
        deadline = time.monotonic() + timeout_s
        pause = 0.02
        while True:
            if self.has_capacity():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    # ---- trainer side -----------------------------------------------------------------------

    def take_batch(self, n_groups: int, trainer_version: int, timeout_s: float) -> list[Group]:
        """Take up to `n_groups` whole groups, oldest first, for a trainer at `trainer_version`,
        with their payloads read and decoded here (`take_headers` + `read_groups`; a trainer of
        several ranks takes headers on rank 0 and lets every rank read its own share).

        Returns:
            between 0 and n_groups groups (fewer only when `timeout_s` ran out, or when a payload
            was malformed: that group is dead-lettered), each with `entry_id` set and its samples'
            ids, logprobs and masks as lists, routed experts as arrays. The groups stay in Redis
            until commit() (autocommit: the next call).
        Raises:
            ValueError: n_groups < 1 or timeout_s < 0.
        """
        headers = self.take_headers(n_groups, trainer_version, timeout_s)
        groups, bad = self.read_groups(headers, as_lists=True)
        for h, reason in bad:
            self.dead_letter_taken(h, reason)
        return groups

    def take_headers(self, n_groups: int, trainer_version: int, timeout_s: float) -> list[GroupHeader]:
        """Take up to `n_groups` whole groups' headers, oldest first, for a trainer at
        `trainer_version`; their payloads are read later, by whoever trains them (`read_groups`).

        A group with staleness = trainer_version - group.policy_version > max_staleness is not
        returned: it is dropped (counted in dropped_stale) or, with stale_policy "requeue", its
        task is queued again with attempt + 1 (counted in requeued). An entry that is not a
        well-formed group (its header, its task or its payload key) is dead-lettered
        (`dead_letter`) and skipped.

        Returns:
            between 0 and n_groups headers (fewer only when `timeout_s` ran out), each with
            `entry_id` and `blob` set. The groups stay in Redis until commit() (autocommit: the
            next call).
        Raises:
            ValueError: n_groups < 1 or timeout_s < 0.
        """
        if n_groups < 1:
            raise ValueError(f"n_groups must be >= 1, got {n_groups}")
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        if self.autocommit:
            self.commit()
        deadline = time.monotonic() + timeout_s
        headers: list[GroupHeader] = []
        seq = 0  # newest sequence number read (stats.taken_seq)
        while len(headers) < n_groups:
            left_ms = int((deadline - time.monotonic()) * 1000)
            block = min(left_ms, 1000) if left_ms >= 1 else None  # BLOCK 0 would wait forever
            resp = self.r.xread({self.keys["samples"]: self._cursor},
                                count=n_groups - len(headers), block=block)
            for _, entries in resp or []:
                for entry_id, fields in entries:
                    self._cursor = entry_id
                    try:
                        h = self._header(entry_id, fields)
                        stale = overstale(trainer_version, h.policy_version, self.max_staleness)
                    except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
                        self.dead_letter(entry_id, fields, f"{type(e).__name__}: {e}")
                        continue
                    seq = max(seq, _seq(fields))  # a malformed entry's own number is not trusted
                    if stale:
                        self._stale(h, fields["task"])
                    else:
                        headers.append(h)
                        with self._lock:
                            self._taken.append((entry_id, h.blob))
            if block is None:
                break
        pipe = self.r.pipeline(transaction=False)
        if headers:
            pipe.hincrby(self.keys["stats"], "taken", len(headers))
        if seq > 0:
            pipe.hset(self.keys["stats"], "taken_seq", seq)
        pipe.execute()
        return headers

    def _header(self, entry_id: str, fields: dict) -> GroupHeader:
        """The header of samples entry `entry_id`. Raises KeyError, TypeError or ValueError (named)
        for an entry that is not one `publish` writes."""
        h = GroupHeader.from_json(fields["meta"])
        blob, task = fields["blob"], fields["task"]
        if not isinstance(task, str):
            raise ValueError("task: expected the task's JSON")
        if not isinstance(blob, str) or not blob.startswith(self.blob_prefix) or len(blob) > len(self.blob_prefix) + 64:
            raise ValueError(f"blob: {str(blob)[:80]!r} is not a payload key of this run ({self.blob_prefix}...)")
        for s in h.samples:
            expect = sample_id(self.run_id, h.task_id, s.index, h.attempt)
            if s.sample_id != expect:
                raise ValueError(f"meta.sample_ids[{s.index}]: {s.sample_id!r}, expected {expect!r}")
        h.entry_id, h.blob = entry_id, blob
        return h

    def read_payloads(self, headers: list[GroupHeader]) -> list[bytes | None]:
        """The payloads of `headers`, in order (None where the key holds nothing)."""
        if not headers:
            return []
        return list(self.raw.mget([h.blob for h in headers]))

    def read_groups(self, headers: list[GroupHeader], *, as_lists: bool = False,
                    num_experts: int | None = None) -> tuple[list[Group], list[tuple[GroupHeader, str]]]:
        """Read and decode the payloads of `headers` (`app.buffer.encoding.decode_group`).

        Returns:
            ``(groups, bad)``: the groups that decoded, in order, and ``(header, reason)`` for each
            one whose payload is missing or malformed (nothing is written here: the caller
            dead-letters them, `dead_letter_taken`, once every rank agrees).
        """
        groups, bad = [], []
        for h, payload in zip(headers, self.read_payloads(headers)):
            if payload is None:
                bad.append((h, f"payload {h.blob!r} is missing"))
                continue
            try:
                groups.append(decode_group(h, payload, as_lists=as_lists, num_experts=num_experts))
            except ValueError as e:
                bad.append((h, str(e)))
        return groups, bad

    def dead_letter_taken(self, header: GroupHeader, reason: str) -> None:
        """`dead_letter` a group taken (by `take_headers`) whose payload turned out malformed; it is
        no longer the trainer's to commit."""
        with self._lock:
            self._taken = [t for t in self._taken if t[0] != header.entry_id]
        self.dead_letter(header.entry_id, {"meta": header.to_json(), "blob": header.blob}, reason)

    def dead_letter(self, entry_id: str, fields: dict, reason: str) -> None:
        """Move samples entry `entry_id` (a malformed or foreign entry, read with `fields`) to the
        ``dead`` stream with `reason`, delete it from ``samples`` and count it in
        ``dead_lettered``: it is never trained, and it cannot stop the trainer again."""
        kept = {str(k)[:64]: str(v)[:DEAD_LETTER_FIELD_CHARS] for k, v in list((fields or {}).items())[:16]}
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(self.keys["dead"], {"entry": entry_id, "reason": reason[:DEAD_LETTER_FIELD_CHARS],
                                      "fields": json.dumps(kept), "time": f"{time.time():.3f}"},
                  maxlen=DEAD_LETTERS_KEPT, approximate=True)
        pipe.xdel(self.keys["samples"], entry_id)
        blob = (fields or {}).get("blob")
        if isinstance(blob, str) and blob.startswith(self.blob_prefix):  # never a key of someone else
            pipe.unlink(blob)
        pipe.hincrby(self.keys["stats"], "dead_lettered", 1)
        pipe.execute()

    def dead_letters(self, count: int = 100) -> list[dict]:
        """The newest `count` dead letters, oldest first: ``{"entry", "reason", "fields", "time"}``."""
        return [f for _, f in reversed(self.r.xrevrange(self.keys["dead"], count=count))]

    def _stale(self, g: GroupHeader, task_json: str) -> None:
        if self.stale_policy == "drop":
            pipe = self.r.pipeline(transaction=True)
            pipe.xdel(self.keys["samples"], g.entry_id)
            pipe.unlink(g.blob)
            pipe.hincrby(self.keys["stats"], "dropped_stale", 1)
            pipe.execute()
            return
        task = Task.from_json(task_json)
        task.attempt = g.attempt + 1
        task.failures = 0  # failures are counted per attempt
        args = [g.entry_id, g.blob, f"{task.task_id}/{task.attempt}", task.to_json()]
        added = int(self._put_tasks(keys=self._k("tasks", "issued", "stats", "samples"), args=args))
        self.r.hincrby(self.keys["stats"], "requeued", added)

    def commit(self, upto: str | None = None) -> int:
        """Delete the groups taken so far (the trainer has trained on them) and their payloads;
        with `upto`, only those at or before that samples-stream entry (a batch taken ahead for
        the next step stays the trainer's). Returns how many."""
        with self._lock:
            if upto is None:
                done, self._taken = self._taken, []
            else:
                done = [t for t in self._taken if _entry_order(t[0]) <= _entry_order(upto)]
                self._taken = [t for t in self._taken if _entry_order(t[0]) > _entry_order(upto)]
        if not done:
            return 0
        pipe = self.r.pipeline(transaction=True)
        pipe.xdel(self.keys["samples"], *[e for e, _ in done])
        pipe.unlink(*[b for _, b in done])
        pipe.hincrby(self.keys["stats"], "consumed", len(done))
        pipe.execute()
        return len(done)

    def drop_through(self, commit_point: str) -> int:
        """Delete every samples entry up to and including `commit_point`, and their payloads (a
        resumed trainer finishing a commit that a kill interrupted). Returns how many entries."""
        deleted = 0
        while True:
            entries = self.r.xrange(self.keys["samples"], "-", commit_point, count=500)
            if not entries:
                return deleted
            blobs = [f["blob"] for _, f in entries
                     if isinstance((f or {}).get("blob"), str) and f["blob"].startswith(self.blob_prefix)]
            pipe = self.r.pipeline(transaction=True)
            pipe.xdel(self.keys["samples"], *[e for e, _ in entries])
            if blobs:
                pipe.unlink(*blobs)
            deleted += int(pipe.execute()[0])

    # ---- policy versions --------------------------------------------------------------------

    def announce_policy(self, version: int, uri: str, *, force: bool = False) -> bool:
        """Make policy `version` at `uri` the current one; an older version is ignored unless
        `force` (a trainer resumed from an earlier state). Returns True if it became current."""
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        return bool(self._announce(keys=[self.keys["policy"]], args=[version, uri, int(force)]))

    def current_policy(self) -> tuple[int, str] | None:
        """(version, uri) of the newest announced policy, or None before the first announce."""
        d = self.r.hgetall(self.keys["policy"])
        return (int(d["version"]), d["uri"]) if d else None

    # ---- figures ----------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Counters of this run.

        queued: tasks waiting to be leased; leased: tasks held by workers; ready: finished groups
        not yet committed by the trainer; untaken: finished groups the trainer has not taken yet
        (what back-pressure counts, with leased); issued, finished, taken, consumed,
        dropped_stale, requeued, duplicates, released, failed_requeued, failed_dropped,
        dead_lettered: totals since the run started.
        """
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(self.keys["tasks"])
        pipe.xpending(self.keys["tasks"], ROLLOUT_GROUP)
        pipe.xlen(self.keys["samples"])
        pipe.hgetall(self.keys["stats"])
        n_tasks, pending, ready, counters = pipe.execute()
        out = {"queued": n_tasks - pending["pending"], "leased": pending["pending"], "ready": ready,
               "untaken": _untaken(counters.get("finished"), counters.get("taken_seq"))}
        out.update({n: int(counters.get(n, 0)) for n in STAT_NAMES})
        return out

    # ---- rollout health (app/buffer/health.py) ----------------------------------------------

    def note_failures(self, reasons: list[str]) -> None:
        """Count failed groups by reason (`app.buffer.health.failure_reason`)."""
        pipe = self.r.pipeline(transaction=False)
        for reason, n in Counter(reasons).items():
            pipe.hincrby(self.keys["health"], FAIL_PREFIX + reason, n)
        pipe.execute()

    def note_waiting(self, worker_id: str, on: str | None, what: str = "", why: str = "") -> None:
        """Say that ``worker_id`` leases nothing because ``on`` ("environment", "engine") at
        ``what`` does not answer (``why``: its error); ``on=None``: it answers again."""
        value = json.dumps({"on": on, "what": what, "why": why, "since": time.time()}) if on else ""
        self.r.hset(self.keys["health"], WAIT_PREFIX + worker_id, value)

    def health(self) -> RolloutHealth:
        """The workers' failure reasons and waits (`app.buffer.health.RolloutHealth`)."""
        return RolloutHealth.from_hash(self.r.hgetall(self.keys["health"]))


def _seq(fields: dict) -> int:
    """The sequence number of a samples entry (0 when it has none or a bad one)."""
    try:
        return int((fields or {}).get("seq", 0))
    except (TypeError, ValueError):
        return 0


def _untaken(finished, taken_seq) -> int:
    """Finished groups with a sequence number above the trainer's ``taken_seq`` (never < 0)."""
    return max(int(finished or 0) - int(taken_seq or 0), 0)


def _entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id 'ms-seq' as a sortable pair."""
    ms, _, sq = entry_id.partition("-")
    return int(ms), int(sq or 0)
