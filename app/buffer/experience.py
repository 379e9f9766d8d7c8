"""The experience buffer and task queue of one run, on Redis Streams with consumer groups.

Layout (every key under ``{prefix}:{run_id}:``):

    tasks     stream: one entry per prompt attempt to generate; consumer group "rollout".
              An entry is leased by XREADGROUP, stays in the group's pending list (PEL) while a
              worker holds it, and is XACK'ed and XDEL'ed when its group is published. A lease
              idle for more than `lease_ms` is taken over by the next `lease()` (XAUTOCLAIM),
              whatever the back-pressure.
    samples   stream: one entry per finished GRPO group: {meta: the group's header (JSON, a few
              hundred bytes: ids, versions, rewards, lengths; app/buffer/encoding.py), task: the
              task (JSON), blob: the key of its payload}; consumer group "trainer", read by one
              consumer, "trainer". A take is an XREADGROUP: the entry moves into the trainer's
              PEL in the same step. Taken entries (and their payloads) are XACK'ed and XDEL'ed
              together when committed (the trainer commits after a save), dropped stale,
              requeued or dead-lettered, so a trainer that dies mid-step reads its PEL again
              after a restart (XREADGROUP from id 0) and then what is new (">").
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
    stats     hash of counters, and the trainer's newest take: ``take_version``, the policy
              version it trains at, and ``take_room``, the groups it still lacks (staleness
              admission, below).
    policy    hash {version, uri} of the newest announced policy.
    health    hash: failed groups per reason and which worker waits on what (app/buffer/health.py).

Back-pressure counts what exists, never sequence numbers: untaken groups are the samples
entries not yet delivered to the trainer (``XLEN samples`` minus the trainer's PEL: every
delivered entry stays pending until it is acked and deleted in one atomic step, and nothing
else deletes a pending one), and leases are the rollout group's PEL. A trainer killed between
any two Redis commands leaves both counts true; taken but uncommitted groups are pending, so
they do not throttle the fleet, and the group's last-delivered id only moves forward. `lease`
checks the room and leases in one script (`_LEASE`), so N workers cannot overshoot
``capacity_groups``, and it takes over expired leases before it looks at the room, so workers
lost holding every lease cannot close the gate for good.

Staleness admission: a group leased now is trained after the groups ahead of it (untaken and
leased): at ``take_version`` if they are fewer than ``take_room``, else in a later take, one
policy version per ``groups_per_version`` groups. `lease` admits no more groups than that
engine (its version given) can still make within ``max_staleness`` of the version they will be
trained at, if groups finish in the order they were leased: a group that the take would throw
away is not generated. The estimate errs towards generating (the most groups a step may take).

The PEL, the streams and the sets are plain Redis data, so with append-only persistence a
restarted redis-server still holds the leases (reclaimed after `lease_ms` as usual), the
trainer's taken groups and every published group.

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
# The trainer's consumer group on the samples stream, and its one consumer (a resumed trainer
# reads the pending entries of the same name again).
TRAINER_GROUP = TRAINER = "trainer"
STAT_NAMES = ("issued", "finished", "taken", "consumed", "dropped_stale", "requeued",
              "duplicates", "released", "failed_requeued", "failed_dropped", "dead_lettered")
# Dead letters kept (approximately: XADD MAXLEN ~), and the characters of each field kept in one.
DEAD_LETTERS_KEPT = 10_000
DEAD_LETTER_FIELD_CHARS = 4096
# A payload SET before its publish script ran expires after this unless the script keeps it: only
# a writer that died between the two (or a duplicate group's payload) leaves one behind.
PAYLOAD_TTL_MS = 600_000
# lease() without a task polls the gate this often at most (a script cannot block).
LEASE_POLL_MAX_S = 0.2

# put_tasks: queue a task attempt only if it was never queued before.
# KEYS: tasks, issued, stats; ARGV: (issue key, task json) pairs. Returns how many were queued.
_PUT_TASKS = """
local added = 0
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[2], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[1], '*', 'task', ARGV[i + 1])
    added = added + 1
  end
end
redis.call('HINCRBY', KEYS[3], 'issued', added)
return added
"""

# stale: a taken group too stale to train leaves in one step: its entry acked and deleted, its
# payload deleted, and (stale_policy requeue) its task queued as the next attempt, unless that
# attempt was queued before: a newer attempt of the prompt exists, so the group is dropped.
# KEYS: samples, stats, tasks, issued, payload; ARGV: trainer group, entry id[, issue key, task json].
# Returns 1 if requeued, 0 if dropped.
_STALE = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('UNLINK', KEYS[5])
if ARGV[3] and redis.call('SADD', KEYS[4], ARGV[3]) == 1 then
  redis.call('XADD', KEYS[3], '*', 'task', ARGV[4])
  redis.call('HINCRBY', KEYS[2], 'issued', 1)
  redis.call('HINCRBY', KEYS[2], 'requeued', 1)
  return 1
end
redis.call('HINCRBY', KEYS[2], 'dropped_stale', 1)
return 0
"""

# publish: add a finished group (its payload already SET at KEYS[5] with a time to live) unless
# one of its sample ids was published before; in both cases the task's lease is acked and its
# entry deleted (the task is done). A duplicate's payload is deleted unless it has no time to live
# left: then it is this very call's, retried after its reply was lost, and an entry holds it. A
# payload that is gone (expired) changes nothing and returns -1.
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
redis.call('HINCRBY', KEYS[4], 'finished', 1)
redis.call('XADD', KEYS[2], '*', 'meta', ARGV[3], 'task', ARGV[4], 'blob', KEYS[5])
for i = 5, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
return 1
"""

# What back-pressure counts, from what exists: untaken = samples entries not delivered to the
# trainer's group (every delivered one is pending until acked and deleted together), leased =
# the rollout group's pending entries. KEYS: tasks, samples; ARGV: rollout group, trainer group.
_BACKLOG = """
local function backlog()
  local untaken = redis.call('XLEN', KEYS[2]) - redis.call('XPENDING', KEYS[2], ARGV[2])[1]
  return untaken, redis.call('XPENDING', KEYS[1], ARGV[1])[1]
end
"""
_COUNTS = _BACKLOG + """
local untaken, leased = backlog()
return {untaken, leased}
"""

# lease: take over expired leases (whatever the room: they are counted already), then lease new
# tasks up to the room left under capacity and, given the engine's version, under staleness
# admission (module docstring), all in one step. A task entry deleted while pending (Redis 6.2
# returns it without fields) is acked and skipped. The counts come first: taking over changes
# neither, and a missing group fails the script before it wrote anything.
# KEYS: tasks, samples, stats; ARGV: rollout group, trainer group, consumer, count, lease_ms,
# capacity, engine version ('' unknown), max_staleness, groups per version.
# Returns the entries taken over or read: {{id, {field, value, ...}}, ...}.
_LEASE = _BACKLOG + """
local untaken, leased = backlog()
local count = tonumber(ARGV[4])
local out = {}
local start = '0-0'
for _ = 1, 8 do
  local r = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[3], ARGV[5], start, 'COUNT', count - #out)
  start = r[1]
  for _, e in ipairs(r[2]) do
    if e[2] then table.insert(out, e) else redis.call('XACK', KEYS[1], ARGV[1], e[1]) end
  end
  if #out >= count or start == '0-0' then break end
end
local room = tonumber(ARGV[6]) - untaken - leased
local take = redis.call('HMGET', KEYS[3], 'take_version', 'take_room')
if ARGV[7] ~= '' and take[1] then
  local lag = tonumber(take[1]) - tonumber(ARGV[7])
  local fresh = 0
  if lag <= tonumber(ARGV[8]) then
    fresh = tonumber(take[2] or '0') + (tonumber(ARGV[8]) - lag) * tonumber(ARGV[9]) - untaken - leased
  end
  room = math.min(room, fresh)
end
local want = math.min(count - #out, room)
if want > 0 then
  local r = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[3], 'COUNT', want, 'STREAMS', KEYS[1], '>')
  if r then
    for _, e in ipairs(r[1][2]) do table.insert(out, e) end
  end
end
return out
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
        groups_per_version: groups the trainer takes per policy version (groups_per_step x
            publish_every), for staleness admission (module docstring); None: admission by
            capacity only.
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
        groups_per_version: int | None = None,
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
        if groups_per_version is not None and groups_per_version < 1:
            raise ValueError(f"groups_per_version must be >= 1, got {groups_per_version}")
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
        self.groups_per_version = groups_per_version
        self.blob_prefix = blob_key_prefix(run_id, prefix)
        # take_headers reads the trainer's pending entries (an earlier incarnation's taken groups)
        # from _cursor on, then only new ones (">").
        self._cursor: str | None = "0-0"
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
        self._stale_script = self.r.register_script(_STALE)
        self._lease_script = self.r.register_script(_LEASE)
        self._counts = self.r.register_script(_COUNTS)
        self._publish = self.r.register_script(_PUBLISH)
        self._owned = self.r.register_script(_OWNED)
        self._fail = self.r.register_script(_FAIL)
        self._announce = self.r.register_script(_ANNOUNCE)
        self._ensure_groups()

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
        b, t = cfg.buffer, cfg.trainer
        # The most groups a step may take (dynamic sampling skips some): staleness admission
        # errs towards generating.
        per_step = t.groups_per_step + (t.dynamic_sampling_max_skipped if t.dynamic_sampling else 0)
        kwargs = dict(
            prefix=b.run_prefix, capacity_groups=b.capacity_groups, lease_ms=b.lease_ms,
            max_staleness=b.max_staleness, stale_policy=b.stale_policy, max_failures=b.max_failures,
            groups_per_version=per_step * t.publish_every,
            password=os.environ.get(PASSWORD_ENV) or None, username=os.environ.get(USER_ENV) or None,
        )
        kwargs.update(overrides)
        return cls(b.redis_url, cfg.run_id, **kwargs)

    def _ensure_groups(self) -> None:
        """Create the rollout group on tasks and the trainer's on samples (every role does: the
        gate counts both). Id 0: entries added before a group existed are delivered too."""
        for stream, group in (("tasks", ROLLOUT_GROUP), ("samples", TRAINER_GROUP)):
            try:
                self.r.xgroup_create(self.keys[stream], group, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def _with_groups(self, call):
        """``call()``, once more after creating the groups if Redis lost them (a restart without
        persistence answers NOGROUP)."""
        try:
            return call()
        except redis.ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._ensure_groups()
            return call()

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
            args: list[str] = []
            for t in tasks[start:start + 500]:
                args += [f"{t.task_id}/{t.attempt}", t.to_json()]
            added += int(self._put_tasks(keys=self._k("tasks", "issued", "stats"), args=args))
        return added

    def _k(self, *names: str) -> list[str]:
        return [self.keys[n] for n in names]

    def lease(self, consumer: str, count: int = 1, block_ms: int = 1000, *,
              engine_version: int | None = None) -> list[Task]:
        """Lease up to `count` tasks for rollout worker `consumer`, within back-pressure.

        Leases idle for more than `lease_ms` (their worker died or hung) are taken over first,
        whatever the back-pressure (they are counted already); then new tasks are leased while
        untaken groups plus leases stay below ``capacity_groups`` and, with `engine_version` (the
        version the worker's engine serves), while a group made now can still be trained within
        ``max_staleness`` (module docstring). Check and lease are one script: workers leasing at
        once cannot overshoot. With nothing to lease, it polls again until `block_ms` passed
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
        admit = "" if engine_version is None or self.groups_per_version is None else str(int(engine_version))
        args = [ROLLOUT_GROUP, TRAINER_GROUP, consumer, count, self.lease_ms, self.capacity_groups, admit,
                self.max_staleness, self.groups_per_version or 1]
        deadline = time.monotonic() + block_ms / 1000
        pause = 0.02
        while True:
            entries = self._with_groups(lambda: self._lease_script(keys=self._k("tasks", "samples", "stats"),
                                                                   args=args))
            tasks = self._tasks(entries, consumer)
            left = deadline - time.monotonic()
            if tasks or left <= 0:
                return tasks
            time.sleep(min(pause, left))
            pause = min(pause * 2, LEASE_POLL_MAX_S)

    def _tasks(self, entries, consumer: str) -> list[Task]:
        """Tasks of the lease script's entries ({id, {field, value, ...}})."""
        tasks = []
        for entry_id, flat in entries:
            fields = dict(zip(flat[::2], flat[1::2]))
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

    def _backlog(self) -> tuple[int, int]:
        """(untaken, leased): finished groups the trainer has not taken yet, and leased tasks
        (`_BACKLOG`). Groups taken but not yet committed (the trainer commits after a save) do
        not count: they are the trainer's, and counting them throttled the fleet to almost
        nothing just before each save."""
        untaken, leased = self._with_groups(lambda: self._counts(keys=self._k("tasks", "samples"),
                                                                 args=[ROLLOUT_GROUP, TRAINER_GROUP]))
        return int(untaken), int(leased)

    def has_capacity(self) -> bool:
        """True while finished groups not yet taken by the trainer plus leased tasks < capacity_groups
        (what `lease` checks, staleness admission aside)."""
        return sum(self._backlog()) < self.capacity_groups

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

        Every entry read is taken in the same step (XREADGROUP puts it in the trainer's
        pending list), and leaves that list only with the entry itself (commit, stale, dead
        letter): a kill between any two calls loses no group and leaves the back-pressure count
        true. A new `ExperienceBuffer` first reads the entries an earlier trainer took and did
        not commit, in order, then new ones.

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
        # Where the trainer takes now and how much: what staleness admission counts from (`lease`).
        self.r.hset(self.keys["stats"], mapping={"take_version": trainer_version, "take_room": n_groups})
        deadline = time.monotonic() + timeout_s
        headers: list[GroupHeader] = []
        while len(headers) < n_groups:
            left_ms = int((deadline - time.monotonic()) * 1000)
            block = min(left_ms, 1000) if left_ms >= 1 else None  # BLOCK 0 would wait forever
            entries = self._read(n_groups - len(headers), block)
            if entries is None:
                continue  # the earlier incarnation's pending entries are all read: now new ones
            for entry_id, fields in entries:
                if not fields:  # deleted while pending: nothing to take (never left so by this class)
                    self.r.xack(self.keys["samples"], TRAINER_GROUP, entry_id)
                    continue
                try:
                    h = self._header(entry_id, fields)
                    stale = overstale(trainer_version, h.policy_version, self.max_staleness)
                except (KeyError, TypeError, ValueError) as e:  # JSONDecodeError is a ValueError
                    self.dead_letter(entry_id, fields, f"{type(e).__name__}: {e}")
                    continue
                if stale:
                    self._stale(h, fields["task"])
                else:
                    headers.append(h)
                    with self._lock:
                        self._taken.append((entry_id, h.blob))
            if block is None:
                break
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(self.keys["stats"], "take_room", n_groups - len(headers))
        pipe.hincrby(self.keys["stats"], "taken", len(headers))
        pipe.execute()
        return headers

    def _read(self, count: int, block: int | None) -> list | None:
        """The next samples entries for the trainer: first its own pending ones (an earlier
        incarnation's taken groups) from the cursor on, then new ones, waiting up to `block` ms.
        None when the pending ones have just run out."""
        def read(cursor: str, block: int | None):
            resp = self.r.xreadgroup(TRAINER_GROUP, TRAINER, {self.keys["samples"]: cursor}, count=count, block=block)
            return resp[0][1] if resp else []

        if self._cursor is None:
            return self._with_groups(lambda: read(">", block))
        entries = self._with_groups(lambda: read(self._cursor, None))
        if not entries:
            self._cursor = None
            return None
        self._cursor = entries[-1][0]
        return entries

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
        pipe.xack(self.keys["samples"], TRAINER_GROUP, entry_id)
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
        """Drop a taken stale group, or (stale_policy requeue) queue its task's next attempt, in
        one step (`_STALE`)."""
        args = [TRAINER_GROUP, g.entry_id]
        if self.stale_policy == "requeue":
            task = Task.from_json(task_json)
            task.attempt = g.attempt + 1
            task.failures = 0  # failures are counted per attempt
            args += [f"{task.task_id}/{task.attempt}", task.to_json()]
        self._stale_script(keys=[*self._k("samples", "stats", "tasks", "issued"), g.blob], args=args)

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
        pipe.xack(self.keys["samples"], TRAINER_GROUP, *[e for e, _ in done])
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
            pipe.xack(self.keys["samples"], TRAINER_GROUP, *[e for e, _ in entries])
            pipe.xdel(self.keys["samples"], *[e for e, _ in entries])
            if blobs:
                pipe.unlink(*blobs)
            deleted += int(pipe.execute()[1])

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
        untaken, leased = self._backlog()
        pipe = self.r.pipeline(transaction=False)
        pipe.xlen(self.keys["tasks"])
        pipe.xlen(self.keys["samples"])
        pipe.hgetall(self.keys["stats"])
        n_tasks, ready, counters = pipe.execute()
        out = {"queued": n_tasks - leased, "leased": leased, "ready": ready, "untaken": untaken}
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


def stale_share(stats: dict) -> float | None:
    """Of the finished groups in ``stats`` (`ExperienceBuffer.stats`), the share thrown away at
    the take as too stale (requeued or dropped); None before any finished."""
    finished = int(stats.get("finished", 0))
    return (int(stats.get("requeued", 0)) + int(stats.get("dropped_stale", 0))) / finished if finished else None


def _entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id 'ms-seq' as a sortable pair."""
    ms, _, sq = entry_id.partition("-")
    return int(ms), int(sq or 0)
