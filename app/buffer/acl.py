"""Redis ACL users of one run: each role of moerl connects as its own user, allowed the commands and
keys that role uses and nothing else (Redis 7 ACL: https://redis.io/docs/latest/operate/oss_and_stack/management/security/acl/).

Why: the run's Redis is also the weight-sync control plane (app/buffer/weight_sync.py), and a
rollout pod is the likeliest foothold (32 Spot pods running model-generated text through
verifiers). With one shared password, a rollout pod could write the push record and send every
engine to an address of its choosing. As user ``rollout`` it can only read the push record, the
bucket plans, the event stream and the policy hash; it writes its own queue work, its engine's
registration and its acks.

Roles (`ROLES`) and their keys (every key is ``{prefix}:{run_id}:<name>``, app/buffer/keys.py
and app/buffer/weight_sync.py):

- ``trainer``: every key of the run (it takes and commits samples, requeues stale tasks, announces
  versions, writes the push record and plans, reads registrations and acks);
- ``rollout``: read-write the task queue and what its Lua scripts touch (tasks, samples, seen,
  stats, dropped, and the group payloads ``blob:*``, app/buffer/encoding.py: Redis checks a
  script's declared keys for read and write), and a multi-node engine's fetchers' reports
  (``group:*``, app/rollout/group.py) and its failure reasons and waits (``health``,
  app/buffer/health.py); read-only the policy
  hash and ``wsync:push``, ``wsync:plan:*``, ``wsync:events``; write-only the registrations
  (``wsync:engine:*``, ``wsync:engine-ids``: it cannot list the other engines) and the acks
  (``wsync:acks:*``, ``wsync:ack-events``);
- ``feed``: read-write tasks, issued, stats and samples (the keys of the queueing script); read-only
  the policy hash.

The ``default`` user (``requirepass``) stays the administrator: the buffer pod's own probe and
exporter, and an operator. Every role may PING and read INFO (the buffer checks the server's
version); no role may run CONFIG, KEYS, FLUSH*, DEBUG, MODULE, ACL, ... . The scripts
run through EVALSHA and SCRIPT LOAD (redis-py's ``register_script``), so a role that may run the
buffer's scripts may also load its own Lua: that is what keeps Redis's Lua CVEs relevant and the
image patched (charts8s/workloads.py ``BufferSpec.image``).
"""

from __future__ import annotations

from app.buffer.keys import buffer_keys

ROLES = ("trainer", "rollout", "feed")
# redis-py also sends CLIENT SETINFO on connect and ignores a refusal; Redis 7.0 has no such
# subcommand to allow, so the same rules load on 7.0 (this machine's) and 7.4 (the image's).
CONNECT = ["+ping", "+info"]
SCRIPTS = ["+evalsha", "+script|load"]
TRANSACTIONS = ["+multi", "+exec", "+discard"]

# Commands per role: what its code calls (redis-py) and what its Lua scripts call inside.
COMMANDS = {
    "trainer": CONNECT + SCRIPTS + TRANSACTIONS + [
        "+xgroup|create", "+xread", "+xreadgroup", "+xrange", "+xrevrange", "+xdel", "+xlen", "+xpending", "+xadd",
        "+hincrby", "+hgetall", "+hget", "+hset", "+sadd", "+smembers", "+srem", "+sismember",
        "+get", "+set", "+mget", "+expire", "+unlink", "+hmget", "+exists", "+persist", "+xautoclaim",
        "+xack"],
    "rollout": CONNECT + SCRIPTS + TRANSACTIONS + [
        "+xgroup|create", "+xautoclaim", "+xreadgroup", "+xack", "+xclaim", "+xdel", "+xlen", "+xpending",
        "+xadd", "+xread", "+xrevrange", "+hincrby", "+hgetall", "+hset", "+expire", "+sadd", "+srem",
        "+sismember", "+get", "+set", "+del", "+mget", "+hmget", "+exists", "+persist", "+pttl", "+unlink"],
    "feed": CONNECT + SCRIPTS + [
        "+xgroup|create", "+xlen", "+xpending", "+xadd", "+xdel", "+hincrby", "+hgetall", "+sadd"],
}


def key_rules(role: str, run_id: str, prefix: str = "moerl") -> list[str]:
    """The key patterns of ``role`` for run ``run_id`` (``~`` read-write, ``%R~`` read-only,
    ``%W~`` write-only).

    Raises:
        ValueError: an unknown role, or a run_id / prefix the buffer refuses (named).
    """
    keys = buffer_keys(run_id, prefix)
    run = f"{prefix}:{run_id}:"
    ws = run + "wsync:"
    if role == "trainer":
        return [f"~{run}*"]
    if role == "rollout":
        return ([f"~{keys[n]}" for n in ("tasks", "samples", "seen", "stats", "dropped", "health")]
                + [f"~{run}blob:*", f"~{run}group:*"]
                + [f"%R~{keys['policy']}", f"%R~{ws}push", f"%R~{ws}plan:*", f"%R~{ws}events"]
                + [f"%W~{ws}engine:*", f"%W~{ws}engine-ids", f"%W~{ws}acks:*", f"%W~{ws}ack-events"])
    if role == "feed":
        return [f"~{keys[n]}" for n in ("tasks", "issued", "stats", "samples")] + [f"%R~{keys['policy']}"]
    raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def user_rules(role: str, run_id: str, prefix: str = "moerl") -> list[str]:
    """``ACL SETUSER``/``user`` rules of ``role`` without its password: on, no channels, its key
    patterns, no command but its own."""
    if role not in COMMANDS:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return ["on", "resetkeys", "resetchannels", *key_rules(role, run_id, prefix), "-@all", *COMMANDS[role]]


def server_args(passwords: dict[str, str], run_id: str, prefix: str = "moerl") -> list[str]:
    """redis-server command-line options that create the role users: ``--user <role> <rules>
    ><password>`` per entry of ``passwords`` (role -> password, or a ``$(ENV)`` reference that the
    kubelet expands). Command-line options are config lines (redis.conf ``user`` directive)."""
    out: list[str] = []
    for role, password in passwords.items():
        out += ["--user", role, *user_rules(role, run_id, prefix), f">{password}"]
    return out
