"""Network weight sync, the trainer's side: each new policy version goes to every registered
engine over torch.distributed weight-update groups (one per engine by default), through
SGLang's own weight-update routes.

Who drives what
---------------
The trainer never calls an engine, and a rollout worker never talks to the trainer: they meet
on the run's Redis (app/buffer/weight_sync.py). Each worker offers its engine (a registration:
worker id, group ranks = the engine's tp_size, the version it serves, the group epoch it is in)
and drives its own engine over loopback HTTP, as it already does for disk loads; the trainer's
rank 0 is the source rank of the group and writes one push record per version. One push of
version N (``weight_sync.mode: network``; every trainer rank calls `WeightPusher.push`, only
rank 0 talks to Redis and the group):

1. prepare: rank 0 writes ``{id, version N, state: prepare}`` (workers block on the board's
   event stream, so they see it at once). Each registered worker stops
   admitting requests, waits for its own in-flight requests (so no sequence mixes two
   versions), writes its pause marker (app/rollout/probe.py), pauses its engine
   (``rollout.pause_mode``) and acks ``ready`` with its ranks and group epoch; a worker that
   is loading from the store, or not idle in time, acks ``busy``.
2. groups: the engines ready within ``weight_sync.ready_timeout_s`` are this push's members;
   the others are left out (they keep serving, and catch up from the store). The members are
   split into groups of ``weight_sync.engines_per_group`` engines (1, the default: a group per
   engine, so that an engine that dies mid-push fails its own group only, where one NCCL group
   over every engine would leave the others hanging in the broadcast until their NCCL watchdog
   killed them; 0: one group of all, one broadcast tree, every member failing together). A
   group whose members, ranks and epoch are unchanged stays; any other is closed and a new one
   opened with a new epoch: ``state: join`` with ``groups: {worker: {epoch, name,
   master_address, master_port, world_size, backend, rank_offset}}``; each worker of a new
   group calls its engine's ``/destroy_weights_update_group`` (the old one) and
   ``/init_weights_update_group`` and acks ``joined``; rank 0 serves one rendezvous store for
   every group, on ``weight_sync.master_port`` (each group's keys under its name), and moves to
   the send once the new groups' members have joined, within ``weight_sync.timeout_s`` (a
   group with a member that did not is left out of this push). The groups' backends are made
   at their first broadcast, as SGLang's NCCL group is (app/weight_group.py says why).
3. send: rank 0 writes the bucket plan (``[{names, dtypes, shapes}]``: Hugging Face names, per
   expert, in the publish dtype; buckets of at most ``weight_sync.bucket_bytes``) and ``state:
   send``. Each member calls ``/begin_weight_update``, then per bucket
   ``/update_weights_from_distributed`` (``load_format: flattened_bucket``; ``weight_version``
   on the last bucket only, so the engine reports N only once it holds all of N;
   ``flush_cache`` false on every bucket: the worker flushed the paused engine before acking
   ready, app/rollout/weight_sync.py), then ``/end_weight_update``, and acks ``done`` or
   ``failed``. Meanwhile every trainer rank gathers the tensors in publish.py's order and way
   (a dense tensor in full, an expert tensor only over the expert-data-parallel ranks, each EP
   rank's block then sent to rank 0 point to point), and rank 0 broadcasts each bucket as
   soon as it is full, to every live group at once (a thread each; the source's link carries
   a bucket once per group). Memory: rank 0 holds one staging buffer of at most ``bucket_bytes``
   (a single larger tensor travels alone) besides the tensor being gathered, which is what
   publish.py holds too (a full dense tensor, or one EP rank's expert block); the other ranks
   hold only their gathered tensor.
4. done: rank 0 waits (``weight_sync.timeout_s``) for the members' acks and writes ``state:
   done`` with each engine's outcome; each worker continues its engine and clears its marker.

The version each engine serves is what its ``/model_info`` reports, and a worker stamps every
sample with it: an engine takes N only from a complete, successful push (or a load from the
store). The store stays the durable copy: the loop still publishes every
``weight_sync.store_every``-th version (and the first and the last) with publish.py, after the
push, ``latest`` last; an engine that starts, restarts or missed a push loads the newest stored
version through the disk path, labelled as what it is, and joins the next push.

Failure semantics
-----------------
Every wait is bounded. A member that dies or stops during a push makes its group's broadcast
fail on every live rank of that group within ``timeout_s`` (gloo and NCCL both raise on a lost
peer or a timeout); rank 0 then closes that group, marks its members failed and goes on
sending to the other groups (when none is left it keeps the gathers in step with the other
trainer ranks without sending), and returns: the trainer goes on training. The next push
rebuilds only the groups whose members changed, from whoever is ready. A surviving member whose push failed holds partly
new weights under its old version: its worker keeps it paused and reloads the newest stored
version before it serves again (app/rollout/weight_sync.py). Bounded on SGLang too: a member
stuck in a broadcast whose source died waits for SGLang's own group timeout (torch's default,
30 minutes; SGLang does not expose it), and its pause marker lapses after ``timeout_s``, so
the pod's probe restarts it; it then reloads from the store and registers again.

References: SGLang 0.5.23 ``entrypoints/http_server.py`` (the routes),
``managers/io_struct.py`` (their fields), ``managers/scheduler_components/weight_updater.py``
(the begin/end session, flush after load, version taken on success); Miles'
``update_weight_from_distributed/broadcast.py`` (pause, flush, begin, buckets, version, end,
continue; group = source rank + every engine rank) and slime's
``update_weight_from_distributed.py`` (the same without the session, an older SGLang).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from app.trainer.parallel import p2p_group, recv_block, send_block, shared_gpu
from app.trainer.publish import _gathered, plan_version
from app.weight_group import BUCKET_FORMAT, GroupError, UpdateGroup, dtype_name, open_group, pack_bucket, plan_buckets

log = logging.getLogger("moerl.weight_sync")


@dataclass
class PushResult:
    """The outcome of one push (complete on rank 0; other ranks see ``version`` and ``sent``).

    Attributes:
        version: the policy version pushed.
        sent: False when nobody was pushed to (no engine registered or ready, or the group failed
            before the first bucket).
        pushed: workers whose engines acknowledged serving ``version`` before the push ended (an
            engine's own registration on the board says what it serves).
        left_out: registered workers that were not ready in time (or busy).
        failed: members whose push failed (the group, or their engine's load).
        epoch: the newest group epoch used (None without a group).
        rebuilt: a new group (epoch) was opened for this push.
        buckets, bytes: what was broadcast.
        seconds: wall time of the whole push (prepare to the last ack).
        error: why a group failed, if one did.
    """

    version: int
    sent: bool = False
    pushed: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    epoch: int | None = None
    rebuilt: bool = False
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None


def resolve_backend(backend: str, device: torch.device) -> str:
    """``weight_sync.backend`` for a trainer on ``device``: auto is nccl on CUDA (cuda:gloo when
    ranks share a GPU: app/trainer/train.py, `SHARED_GPU_ENV`), else gloo."""
    if backend == "auto":
        if device.type != "cuda":
            return "gloo"

        return "cuda:gloo" if shared_gpu() else "nccl"
    return backend


def master_address(configured: str | None) -> str:
    """Where engines reach this rank: the configured address, else $POD_IP (the Downward API in
    the cluster), else this host's name resolved."""
    if configured:
        return configured
    return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def partition(workers: list[str], per_group: int) -> list[tuple[str, ...]]:
    """The ready workers (sorted) in groups of ``per_group`` engines (0: one group of all)."""
    workers = sorted(workers)
    if per_group <= 0 or not workers:
        return [tuple(workers)] if workers else []
    return [tuple(workers[i: i + per_group]) for i in range(0, len(workers), per_group)]


@dataclass
class _Group:
    """One open weight-update group: its members' record entry and rank 0's membership."""

    info: dict  # epoch, name, master_address, master_port, world_size, backend, members {worker: rank_offset}
    ranks: dict[str, int]  # worker -> its engine's group ranks
    group: UpdateGroup


class WeightPusher:
    """The trainer's side of network weight sync (see the module doc). Create one on every
    trainer rank; rank 0 holds the groups and the board.

    Args:
        cfg: the run's ``weight_sync`` section.
        rank: this trainer rank.
        device: the trainer's device (decides the backend for ``auto`` and where buckets are
            staged: a GPU buffer for NCCL and cuda:gloo, a pinned host buffer for gloo).
        board: the `SyncBoard` of the run (rank 0; None elsewhere).
    """

    def __init__(self, cfg, rank: int, device: torch.device, board=None):
        if rank == 0 and board is None:
            raise ValueError("rank 0 needs the run's SyncBoard to push weights")
        self.cfg = cfg
        self.rank = rank
        self.device = device
        self.board = board
        self.backend = resolve_backend(cfg.backend, device)
        self.token = uuid.uuid4().hex[:6]  # names this trainer's groups apart from a previous life's
        self.epoch = 0  # the last epoch given out: every new group gets the next one
        self.groups: dict[tuple[str, ...], _Group] = {}  # members -> open group
        self._staging: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._store: dist.TCPStore | None = None  # rank 0's rendezvous for every group (`_rendezvous`)
        self._port = 0
        self.last = PushResult(-1)  # the latest push's outcome

    # ------------------------------------------------------------------ rank 0: the board
    def _wait_acks(self, push_id: str, workers: set[str], final: set[str], timeout_s: float) -> dict[str, dict]:
        """Acks of ``workers`` once each is in a ``final`` state, or at ``timeout_s`` what there is."""
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            acks = {w: a for w, a in self.board.acks(push_id).items() if w in workers}
            left = deadline - time.monotonic()
            if all(w in acks and acks[w]["state"] in final for w in workers) or left <= 0:
                return acks
            last = self.board.wait("ack-events", last, min(left, 0.5))

    def _drop_groups(self, keys=None) -> None:
        """Close the groups of ``keys`` (default: all)."""
        for key in list(self.groups) if keys is None else keys:
            g = self.groups.pop(key, None)
            if g is not None:
                g.group.close()

    def _new_info(self, members: tuple[str, ...], ranks: dict[str, int], address: str) -> dict:
        """The record entry of a new group for ``members``: a new epoch, the rendezvous store's
        address and port (one store serves every group: `_rendezvous`)."""
        self.epoch += 1
        offsets, cursor = {}, 1
        for w in members:
            offsets[w] = cursor
            cursor += ranks[w]
        return {"epoch": self.epoch, "name": f"moerl-{self.token}-e{self.epoch}", "master_address": address,
                "master_port": self._port, "world_size": cursor, "backend": self.backend, "members": offsets}

    def _rendezvous(self, address: str) -> dist.TCPStore:
        """Rank 0's one rendezvous store for every weight-update group, on ``weight_sync.master_port``
        (else a free port), made at the first join and served for the pusher's life. Each group's
        keys live under its own name (SGLang's ``PrefixStore(group_name)``), so one fixed port serves
        every group: the one port the NetworkPolicies open and the workers accept
        (app/rollout/weight_sync.py ``refuse_source``)."""
        if self._store is None:
            self._port = self.cfg.master_port or _free_port(address)
            self._store = dist.TCPStore(address, self._port, None, is_master=True,
                                        timeout=timedelta(seconds=self.cfg.timeout_s), wait_for_workers=False)
        return self._store

    def _prepare(self, version: int, plan: list[dict]) -> dict | None:
        """Rank 0: steps 1-3 of the module doc up to the first bucket; the push record, or None
        when nothing is to be sent (``self.last`` says why)."""
        regs = self.board.engines()
        result = self.last
        if not regs:
            self._drop_groups()
            return None
        push_id = f"v{version}-{uuid.uuid4().hex[:8]}"
        record: dict = {"id": push_id, "version": version, "state": "prepare"}
        self.board.set_push(record)
        acks = self._wait_acks(push_id, set(regs), {"ready", "busy"}, self.cfg.ready_timeout_s)
        ready = {w: a for w, a in acks.items() if a["state"] == "ready"}
        result.left_out = sorted(set(regs) - set(ready))
        if not ready:
            self.board.set_push({**record, "state": "cancelled"})
            return None
        ranks = {w: int(a["ranks"]) for w, a in ready.items()}
        wanted = partition(list(ranks), self.cfg.engines_per_group)
        # A group stays when its members are the same, with the same ranks, all still in it.
        keep = [key for key in wanted if key in self.groups
                and all(self.groups[key].ranks[w] == ranks[w] and ready[w].get("epoch") == self.groups[key].info["epoch"]
                        for w in key)]
        self._drop_groups([key for key in self.groups if key not in keep])
        new = [key for key in wanted if key not in keep]
        if new:
            result.rebuilt = True
            address = master_address(self.cfg.master_address)
            store = self._rendezvous(address)
            infos = {key: self._new_info(key, ranks, address) for key in new}
            record.update(state="join", groups=self._entries({**{k: g.info for k, g in self.groups.items()}, **infos}))
            self.board.set_push(record)
            # Each member joins its group's rendezvous and acks "joined"; the backends come up at
            # the first broadcast (app/weight_group.py), so the send waits for the joins here.
            joining = {w for key in new for w in key}
            acks = self._wait_acks(push_id, joining, {"joined", "failed"}, self.cfg.timeout_s)
            for key, info in infos.items():
                if all(acks.get(w, {}).get("state") == "joined" for w in key):
                    group = open_group(self.backend, address, self._port, info["world_size"], 0, info["name"],
                                       self.cfg.timeout_s, store=store)
                    self.groups[key] = _Group(info, {w: ranks[w] for w in key}, group)
                else:
                    result.failed.extend(key)
                    why = sorted(f"{w}: {acks.get(w, {}).get('message') or acks.get(w, {}).get('state', 'no answer')}"
                                 for w in key)
                    result.error = f"group {info['name']} not joined in time ({'; '.join(why)})"
                    log.warning("push v%d: %s", version, result.error)
        if not self.groups:
            self.board.set_push({**record, "state": "failed", "error": result.error})
            return None
        record["groups"] = self._entries({k: g.info for k, g in self.groups.items()})
        result.epoch = max(g.info["epoch"] for g in self.groups.values())
        self.board.set_plan(push_id, plan)
        record.update(state="send", buckets=len(plan), load_format=BUCKET_FORMAT, progress=0)
        self.board.set_push(record)
        return record

    @staticmethod
    def _entries(infos: dict[tuple[str, ...], dict]) -> dict[str, dict]:
        """The push record's ``groups``: each member worker -> its group's entry, with its own
        ``rank_offset``."""
        return {w: {**{k: v for k, v in info.items() if k != "members"}, "rank_offset": offset}
                for info in infos.values() for w, offset in info["members"].items()}

    def _finish(self, record: dict, failed: dict[tuple[str, ...], str]) -> None:
        """Rank 0: step 4: the members' outcome, and the push record's last state."""
        result = self.last
        members = set(record["groups"])
        lost = {w for key in failed for w in key}
        # Live members answer within timeout_s; those of a failed group at once (their receive
        # fails when the group closes, or they had everything), a dead one never: a short grace.
        acks = self._wait_acks(record["id"], members - lost, {"done", "failed"}, self.cfg.timeout_s)
        if lost:
            acks.update(self._wait_acks(record["id"], lost, {"done", "failed"}, min(self.cfg.timeout_s, 2.0)))
        result.pushed = sorted(w for w, a in acks.items() if a["state"] == "done")
        result.failed = sorted(set(result.failed) | (members - set(result.pushed)))
        if failed:
            result.error = "; ".join(failed.values())
        state = "failed" if failed and not result.pushed else "done"
        self.board.set_push({**record, "state": state, "error": result.error,
                             "engines": {w: acks.get(w, {}).get("state", "missing") for w in sorted(members)}})

    # ------------------------------------------------------------------ every rank
    def _stage(self, nbytes: int) -> torch.Tensor:
        """Rank 0's reusable bucket buffer: on the GPU for NCCL and cuda:gloo, pinned host memory
        for gloo."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self.backend != "gloo":
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging

    def _broadcast(self, bucket: torch.Tensor, failed: dict[tuple[str, ...], str]) -> None:
        """Rank 0: ``bucket`` to every live group at once; a group whose broadcast fails is
        closed and recorded in ``failed`` (its members' engines reload from the store), the
        others go on."""
        live = [key for key in self.groups if key not in failed]
        if len(live) == 1:
            outcomes = {live[0]: self._try(self.groups[live[0]].group, bucket)}
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weight-push")
            futures = {key: self._pool.submit(self._try, self.groups[key].group, bucket) for key in live}
            outcomes = {key: f.result() for key, f in futures.items()}
        for key, error in outcomes.items():
            if error is not None:
                failed[key] = error
                self.groups[key].group.close()

    @staticmethod
    def _try(group: UpdateGroup, bucket: torch.Tensor) -> str | None:
        try:
            group.broadcast(bucket)
        except GroupError as e:
            return str(e)
        return None

    def push(self, model: torch.nn.Module, mesh, version: int, dtype: torch.dtype) -> PushResult:
        """Push policy ``version`` of ``model`` to the registered engines (collective: every
        trainer rank calls it, with the same model layout; see the module doc).

        Args:
            model: the policy (sharded by app/trainer/parallel.py, or a plain module on one rank).
            mesh: the `TrainerMesh`, or None for an unsharded one-rank model.
            version: the version the engines will report.
            dtype: the dtype sent for floating-point tensors (the publish dtype, ``model.dtype``);
                fp32 buffers stay fp32 (`app.trainer.publish.publish_dtype`).

        Returns:
            a `PushResult` (rank 0's is complete). Never raises for an engine's or a group's
            failure: those are in the result; the trainer goes on.
        """
        t0 = time.perf_counter()
        self.last = PushResult(version)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Every rank derives the same plan from shapes alone (publish.py's order and HF names).
        tensors = plan_version(model, mesh, dtype).tensors
        buckets = plan_buckets([t.nbytes for t in tensors], self.cfg.bucket_bytes)
        meta = [{"names": [tensors[i].name for i in b], "dtypes": [dtype_name(tensors[i].dtype) for i in b],
                 "shapes": [list(tensors[i].shape) for i in b]} for b in buckets]
        record = None
        if self.rank == 0:
            try:
                record = self._prepare(version, meta)
            except Exception as e:  # noqa: BLE001 - Redis trouble: this version goes by the store only
                self.last.error = f"push v{version} not started: {e!r}"
                log.warning(self.last.error)
        box = [record is not None]
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        if not box[0]:
            self.last.seconds = time.perf_counter() - t0
            return self.last
        failed: dict[tuple[str, ...], str] = {}
        self._send(model, mesh, tensors, buckets, dtype, record, failed)
        if self.rank == 0:
            try:
                self._finish(record, failed)
            except Exception as e:  # noqa: BLE001 - the engines' outcome is unknown; the next push re-checks
                self.last.error = self.last.error or f"push v{version}: {e!r}"
                self._drop_groups()
            self._drop_groups(list(failed))
            self.last.sent = True
            self.last.buckets = len(buckets)
            self.last.bytes = sum(t.nbytes for t in tensors)
        self.last.seconds = time.perf_counter() - t0
        return self.last

    def _send(self, model, mesh, tensors, buckets, dtype, record, failed: dict) -> None:
        """Gather every tensor (all ranks, publish.py's collectives in its order) and broadcast
        each full bucket from rank 0 to the live groups (their failures go into ``failed``)."""
        rank = self.rank
        bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
        pending: list[torch.Tensor] = []

        def add(i: int, piece: torch.Tensor) -> None:
            if len(failed) == len(self.groups):  # every group failed: keep the gathers in step only
                return
            pending.append(piece)
            k = bucket_of[i]
            if len(pending) < len(buckets[k]):
                return
            nbytes = sum(t.numel() * t.element_size() for t in pending)
            before = len(failed)
            self._broadcast(pack_bucket(pending, self._stage(nbytes)), failed)
            if len(failed) > before:
                log.warning("push v%d: bucket %d/%d: %s", record["version"], k + 1, len(buckets),
                            list(failed.values())[-1])
            pending.clear()
            self.board.set_push({**record, "progress": k + 1})  # observability (and the tests' cue)

        by_source: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            by_source.setdefault(t.source, []).append(i)
        state = model.state_dict()
        with torch.no_grad():
            for source, idx in by_source.items():
                value = _gathered(state[source], tensors[idx[0]].dtype)  # every rank: publish.py's collective
                t = state[source]
                if isinstance(t, DTensor) and "ep" in (t.device_mesh.mesh_dim_names or ()) and mesh.layout.ep > 1:
                    self._send_expert_blocks(value, mesh, [(i, tensors[i]) for i in idx], add)
                elif rank == 0:
                    for i in idx:
                        add(i, _piece(value, tensors[i], 0))
                del value

    def _send_expert_blocks(self, value: torch.Tensor, mesh, pieces, add) -> None:
        """Rank 0 takes each EP rank's [E_local, ...] block in turn (its own, then the others'
        sent point to point by the rank at mesh (0, 0, r)) and adds its per-expert pieces."""
        e_local = value.shape[0]
        group = p2p_group(mesh.world, "ep")  # every rank: collective the first time
        for r in range(mesh.layout.ep):
            holder = int(mesh.world.mesh[0, 0, r])  # in rank 0's group of the "ep" dimension
            if r == 0:
                block = value
            elif self.rank == holder:
                send_block(value, 0, group)
                continue
            elif self.rank == 0:
                block = recv_block(value, holder, group)
            else:
                continue
            if self.rank == 0:
                for i, t in pieces:
                    if r * e_local <= t.expert < (r + 1) * e_local:
                        add(i, _piece(block, t, r * e_local))

    def close(self) -> None:
        """Leave every group (the trainer stops)."""
        self._drop_groups()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        self._store = None


def _piece(value: torch.Tensor, t, e_offset: int) -> torch.Tensor:
    """HF tensor ``t`` (publish.HFTensor) out of a gathered value (full, or an EP block whose
    first expert is ``e_offset``)."""
    if t.expert is None:
        return value
    piece = value[t.expert - e_offset]
    if t.rows is not None:
        piece = piece[t.rows[0]: t.rows[1]]
    return piece
