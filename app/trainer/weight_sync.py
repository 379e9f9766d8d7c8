"""Network weight sync, the trainer's side: each new policy version goes to every registered
engine over one torch.distributed group, through SGLang's own weight-update routes.

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
2. group: the engines ready within ``weight_sync.ready_timeout_s`` are this push's members;
   the others are left out (they keep serving, and catch up from the store). If the members
   (or their epochs) differ from the current group's, rank 0 closes it and opens a new epoch:
   ``state: join`` with ``{epoch, name, master_address, master_port, world_size, backend,
   members: {worker: rank_offset}}``; each member's worker calls its engine's
   ``/destroy_weights_update_group`` (the old one) and ``/init_weights_update_group``, and rank
   0 serves the rendezvous (app/weight_group.py), all within ``weight_sync.timeout_s``.
3. send: rank 0 writes the bucket plan (``[{names, dtypes, shapes}]``: Hugging Face names, per
   expert, in the publish dtype; buckets of at most ``weight_sync.bucket_bytes``) and ``state:
   send``. Each member calls ``/begin_weight_update``, then per bucket
   ``/update_weights_from_distributed`` (``load_format: flattened_bucket``; ``weight_version``
   and ``flush_cache`` on the last bucket only, so the engine reports N only once it holds
   all of N), then ``/end_weight_update``, and acks ``done`` or ``failed``. Meanwhile every
   trainer rank gathers the tensors in publish.py's order and way (a dense tensor with
   ``full_tensor()``, an expert tensor only over the expert-data-parallel ranks, each EP
   rank's block then sent to rank 0 point to point), and rank 0 broadcasts each bucket as
   soon as it is full. Memory: rank 0 holds one staging buffer of at most ``bucket_bytes``
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
Every wait is bounded. A member that dies or stops during a push makes the broadcast fail on
every live rank within ``timeout_s`` (gloo and NCCL both raise on a lost peer or a timeout); rank
0 then closes the group, marks the push failed, keeps the gathers in step with the other
trainer ranks without sending, and returns: the trainer goes on training. The next push
rebuilds the group from whoever is ready. A surviving member whose push failed holds partly
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
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

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
        epoch: the group epoch used (None without a group).
        rebuilt: a new group epoch was opened for this push.
        buckets, bytes: what was broadcast.
        seconds: wall time of the whole push (prepare to the last ack).
        error: why the group failed, if it did.
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
    """``weight_sync.backend`` for a trainer on ``device``: auto is nccl on CUDA, else gloo."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
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


class WeightPusher:
    """The trainer's side of network weight sync (see the module doc). Create one on every
    trainer rank; rank 0 holds the group and the board.

    Args:
        cfg: the run's ``weight_sync`` section.
        rank: this trainer rank.
        device: the trainer's device (decides the backend for ``auto`` and where buckets are
            staged: a GPU buffer for NCCL, a pinned host buffer for gloo).
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
        self.epoch = 0
        self.group: UpdateGroup | None = None
        self.members: dict[str, tuple[int, int]] = {}  # worker -> (rank_offset, ranks)
        self.group_info: dict = {}  # the push record's "group" of the current epoch
        self._staging: torch.Tensor | None = None
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

    def _drop_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group, self.members, self.group_info = None, {}, {}

    def _prepare(self, version: int, plan: list[dict]) -> dict | None:
        """Rank 0: steps 1-3 of the module doc up to the first bucket; the push record, or None
        when nothing is to be sent (``self.last`` says why)."""
        regs = self.board.engines()
        result = self.last
        if not regs:
            self._drop_group()
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
        same = (self.group is not None and set(ranks) == set(self.members)
                and all(self.members[w][1] == ranks[w] and ready[w].get("epoch") == self.epoch for w in ranks))
        if not same:
            self._drop_group()
            self.epoch += 1
            result.rebuilt = True
            address = master_address(self.cfg.master_address)
            port = self.cfg.master_port or _free_port(address)
            offsets, cursor = {}, 1
            for w in sorted(ranks):
                offsets[w] = cursor
                cursor += ranks[w]
            group = {"epoch": self.epoch, "name": f"moerl-{self.token}-e{self.epoch}", "master_address": address,
                     "master_port": port, "world_size": cursor, "backend": self.backend, "members": offsets}
            record.update(state="join", group=group)
            self.board.set_push(record)
            try:
                self.group = open_group(self.backend, address, port, cursor, 0, group["name"], self.cfg.timeout_s,
                                        self.device if self.backend == "nccl" else None)
            except GroupError as e:
                result.error = str(e)
                result.failed = sorted(ranks)
                self.board.set_push({**record, "state": "failed", "error": str(e)})
                log.warning("push v%d: %s", version, e)
                return None
            self.members = {w: (offsets[w], ranks[w]) for w in ranks}
            self.group_info = group
        record["group"] = self.group_info
        result.epoch = self.epoch
        self.board.set_plan(push_id, plan)
        record.update(state="send", buckets=len(plan), load_format=BUCKET_FORMAT, progress=0)
        self.board.set_push(record)
        return record

    def _finish(self, record: dict, error: str | None) -> None:
        """Rank 0: step 4: the members' outcome, and the push record's last state."""
        result = self.last
        members = set(record["group"]["members"])
        if error is not None:
            result.error = error
            self._drop_group()
            # Live members answer at once (their receive fails when the group closes, or they had
            # everything); a dead one never does: a short grace, not the full timeout.
            acks = self._wait_acks(record["id"], members, {"done", "failed"}, min(self.cfg.timeout_s, 2.0))
        else:
            acks = self._wait_acks(record["id"], members, {"done", "failed"}, self.cfg.timeout_s)
        result.pushed = sorted(w for w, a in acks.items() if a["state"] == "done")
        result.failed = sorted(members - set(result.pushed))
        state = "failed" if error else "done"
        self.board.set_push({**record, "state": state, "error": error,
                             "engines": {w: acks.get(w, {}).get("state", "missing") for w in sorted(members)}})

    # ------------------------------------------------------------------ every rank
    def _stage(self, nbytes: int) -> torch.Tensor:
        """Rank 0's reusable bucket buffer: on the GPU for NCCL, pinned host memory for gloo."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self.backend == "nccl":
                self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            else:
                self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        return self._staging

    def push(self, model: torch.nn.Module, mesh, version: int, dtype: torch.dtype) -> PushResult:
        """Push policy ``version`` of ``model`` to the registered engines (collective: every
        trainer rank calls it, with the same model layout; see the module doc).

        Args:
            model: the policy (sharded by app/trainer/parallel.py, or a plain module on one rank).
            mesh: the `TrainerMesh`, or None for an unsharded one-rank model.
            version: the version the engines will report.
            dtype: the dtype sent (the publish dtype, ``model.dtype``).

        Returns:
            a `PushResult` (rank 0's is complete). Never raises for an engine's or the
            group's failure: those are in the result; the trainer goes on.
        """
        t0 = time.perf_counter()
        self.last = PushResult(version)
        world = dist.get_world_size() if dist.is_initialized() else 1
        # Every rank derives the same plan from shapes alone (publish.py's order and HF names).
        tensors = plan_version(model, mesh, dtype).tensors
        buckets = plan_buckets([t.nbytes for t in tensors], self.cfg.bucket_bytes)
        meta = [{"names": [tensors[i].name for i in b], "dtypes": [dtype_name(dtype)] * len(b),
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
        error = self._send(model, mesh, tensors, buckets, dtype, record)
        if self.rank == 0:
            try:
                self._finish(record, error)
            except Exception as e:  # noqa: BLE001 - the engines' outcome is unknown; the next push re-checks
                self.last.error = self.last.error or f"push v{version}: {e!r}"
                self._drop_group()
            self.last.sent = True
            self.last.buckets = len(buckets)
            self.last.bytes = sum(t.nbytes for t in tensors)
        self.last.seconds = time.perf_counter() - t0
        return self.last

    def _send(self, model, mesh, tensors, buckets, dtype, record) -> str | None:
        """Gather every tensor (all ranks, publish.py's collectives in its order) and broadcast
        each full bucket from rank 0. Returns rank 0's group error, if any (None elsewhere)."""
        rank = self.rank
        bucket_of = {i: k for k, b in enumerate(buckets) for i in b}
        pending: list[torch.Tensor] = []
        error: str | None = None

        def add(i: int, piece: torch.Tensor) -> None:
            nonlocal error
            if error is not None:
                return
            pending.append(piece)
            k = bucket_of[i]
            if len(pending) < len(buckets[k]):
                return
            try:
                nbytes = sum(t.numel() * t.element_size() for t in pending)
                self.group.broadcast(pack_bucket(pending, self._stage(nbytes)))
            except (GroupError, ValueError) as e:
                error = str(e)
                log.warning("push v%d: bucket %d/%d: %s", record["version"], k + 1, len(buckets), e)
                self._drop_group()
            pending.clear()
            if error is None:
                self.board.set_push({**record, "progress": k + 1})  # observability (and the tests' cue)

        by_source: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            by_source.setdefault(t.source, []).append(i)
        state = model.state_dict()
        with torch.no_grad():
            for source, idx in by_source.items():
                value = _gathered(state[source], dtype)  # every rank: publish.py's collective
                t = state[source]
                if isinstance(t, DTensor) and "ep" in (t.device_mesh.mesh_dim_names or ()) and mesh.layout.ep > 1:
                    self._send_expert_blocks(value, mesh, [(i, tensors[i]) for i in idx], add)
                elif rank == 0:
                    for i in idx:
                        add(i, _piece(value, tensors[i], 0))
                del value
        return error

    def _send_expert_blocks(self, value: torch.Tensor, mesh, pieces, add) -> None:
        """Rank 0 takes each EP rank's [E_local, ...] block in turn (its own, then the others'
        sent point to point by the rank at mesh (0, 0, r)) and adds its per-expert pieces."""
        e_local = value.shape[0]
        for r in range(mesh.layout.ep):
            holder = int(mesh.world.mesh[0, 0, r])
            if r == 0:
                block = value
            elif self.rank == holder:
                dist.send(value.contiguous(), dst=0)
                continue
            elif self.rank == 0:
                block = torch.empty_like(value)
                dist.recv(block, src=holder)
            else:
                continue
            if self.rank == 0:
                for i, t in pieces:
                    if r * e_local <= t.expert < (r + 1) * e_local:
                        add(i, _piece(block, t, r * e_local))

    def close(self) -> None:
        """Leave the group (the trainer stops)."""
        self._drop_group()


def _piece(value: torch.Tensor, t, e_offset: int) -> torch.Tensor:
    """HF tensor ``t`` (publish.HFTensor) out of a gathered value (full, or an EP block whose
    first expert is ``e_offset``)."""
    if t.expert is None:
        return value
    piece = value[t.expert - e_offset]
    if t.rows is not None:
        piece = piece[t.rows[0]: t.rows[1]]
    return piece
