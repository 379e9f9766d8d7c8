"""One trainer rank as torchtitan lays it out: `Trainer.__init__` builds (mesh, models, store,
buffer, resume), `Trainer.train_step` runs one step (a rollout batch: its optimizer steps) and what
follows it (ledger line, publish, save, metrics), `Trainer.train` loops; `moerl train`
(app/trainer/train.py) runs ``Trainer(cfg, run_dir, resume).train()`` on every rank.

Each step, rank 0 takes ``groups_per_step`` whole GRPO groups' headers from the buffer and assigns
them, whole, to the ranks (every rank is a data-parallel rank; app/layout.py); each rank reads and
decodes its own groups, and rank 0 takes the next step's during the step (app/trainer/intake.py);
each rank runs its micro-batches (app/trainer/step.py); then the step may publish a policy version
(app/trainer/publish.py: every rank uploads what it owns) and save the training state
(app/trainer/state.py: DCP, each tensor once).

Policy versions (docs/ARCHITECTURE.md, "Policy version and staleness"): version 0 is the initial
policy, published before the first step if the store has none; every ``trainer.publish_every``
steps the next version is published and announced. With ``weight_sync.mode: network`` each
version is first pushed to the registered engines (app/trainer/weight_sync.py) and only every
``weight_sync.store_every``-th one (and the last) is published to the store
(`app.trainer.publish.next_version` decides).

Training state and resume: every ``trainer.save_every`` steps (and after the last) the sharded
model and optimizer state of every module, each rank's RNG state, and rank 0's `TrainState`, the
buffer commit point and the keys of the groups trained on go to ``<run>/train/s{step}/`` in the
store; the manifest is written last. Taken groups are committed (deleted from Redis) only after
that save, so a trainer killed between saves re-reads the groups its lost steps had taken.
``--resume`` loads the newest complete state (or, if none was saved yet, starts from the initial
weights), deletes the groups the saved state had already taken, and publishes its weights as the
version after the newest one in the store, so versions keep increasing and engines move to the
resumed weights. Groups whose (task, attempt) the lineage already trained on are skipped
(counted in ``duplicates``): a group republished after a Redis failure cannot be trained twice.

Trained-sample record: rank 0 appends one JSON line per step to ``<run_dir>/trained.jsonl``
(fsync'd): ``{"step", "trainer_version", "time", "groups": [{"task_id", "attempt",
"samples": [[sample_id, policy_version], ...]}], "skipped": [[task_id, attempt, reason], ...]}``;
a resume appends ``{"resume_from_step": S, "version": V, "time"}``: lines of steps after S that
precede it were rolled back (their groups are trained again). app/ledger.py audits this file.

Metrics: one JSON line per step in ``<run_dir>/metrics.jsonl`` (rank 0), whole-batch figures:
  step, policy_version, applied (False: non-finite step skipped), bad_steps, time (unix s);
  objective (`TrainerConfig.objective`: grpo, gspo, dr_grpo, ppo, and the modifiers that are on);
  groups, samples, reward_mean, reward_max, completion_len_mean, staleness_mean, staleness_max;
  push_s, pushed_engines, push_failed_engines, push_left_out (network weight sync only);
  loss, pg_loss, tokens, clip_frac, ratio, ratio_max, approx_kl (k3, old||current),
  mismatch_kl (k3, engine||trainer), tis, tis_max, tis_trunc_frac, is_masked_frac (tokens whose
  importance weight a *_mask rollout_is mode zeroed), dual_clip_frac (dual_clip), entropy, kl_ref (kl_coef>0),
  no_signal_skipped, no_signal_admitted (dynamic_sampling, app/trainer/sampling.py),
  grad_norm (before clipping), lr, micro_batches; optimizer_steps (this batch's: trainer.ppo_epochs x
  mini-batches), optimizer_steps_total (the run's, resumed with the state), mini_batch_stats (with more
  than one optimizer step a batch: each step's epoch, mini_batch, loss, grad_norm, tokens, clip_frac,
  dual_clip_frac, approx_kl, ratio, ratio_max, tis, vf_clip_frac; the figures above are then over
  the batch's steps, app/trainer/step.py `train_step`); PPO: vf_loss, vf_clip_frac, value, return,
  value_error, critic_grad_norm; wait_s (waiting for groups; in the background while the
  previous step ran), read_s (rank 0 reading, decoding and collating its share), step_s,
  publish_s, save_s;
  samples_total, overstale_dropped, malformed_groups, error_groups; buffer (ExperienceBuffer.stats()).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path

import torch

from app.buffer import ExperienceBuffer
from app.buffer.weight_sync import SyncBoard
from app.config import RunConfig
from app.layout import resolve_layout
from app.model.config import moe_layer_ids, num_routed_experts
from app.model.parallel import init_ep
from app.model.source import resolve_model_path
from app.storage import mark_done, open_store
from app.storage.policy import latest_policy_version
from app.trainer import TrainingError
from app.trainer.intake import BatchIntake, Stop
from app.trainer.models import build_critic_parts, build_policy_model, build_reference, policy_config
from app.trainer.parallel import broadcast_from_rank0, build_mesh, init_distributed, on_rank0
from app.trainer.publish import first_version, next_version, publish_version
from app.trainer.state import TrainState, drop_committed, latest_state, load_state, newer_entry, save_state
from app.trainer.step import build_optimizer, step_lr, train_step
from app.trainer.weight_sync import WeightPusher

log = logging.getLogger("moerl.train")


def append_line(f, record: dict) -> None:
    """Append one JSON line to ``f`` and fsync it (the ledger must survive a SIGKILL)."""
    f.write(json.dumps(record, separators=(",", ":")) + "\n")
    f.flush()
    os.fsync(f.fileno())


def open_trained_log(path: Path):
    """Open trained.jsonl for appending; a line cut short by a kill is closed with a newline
    first, so the next record starts on a line of its own."""
    if path.exists() and path.stat().st_size > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
        if cut:
            with open(path, "ab") as f:
                f.write(b"\n")
    return open(path, "a")


class Trainer:
    """This rank's part of a run: built once, then stepped (see the module docstring).

    Raises (from `__init__`, `start` and `train_step`): see `train`.
    """

    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False):
        # The cross-field rules (capacity vs save_every, PPO's loss aggregation) live in RunConfig;
        # validate again in case fields were set in code after loading.
        self.cfg = cfg = cfg.validated()
        self.resume = resume
        t = cfg.trainer
        self.rank, self.world, self.device = init_distributed(timeout_s=t.batch_timeout_s + 600)
        # A Hub id or an s3:// prefix is downloaded to this host's cache first (one process per host).
        self.path = str(resolve_model_path(cfg.model.path, cfg.model.cache_dir)) if cfg.model.path else None
        if t.critic_path:
            t.critic_path = str(resolve_model_path(t.critic_path, cfg.model.cache_dir))
        config = policy_config(cfg, self.path)
        layout = resolve_layout(t.parallel, self.world, num_routed_experts(config))
        self.mesh = build_mesh(layout, self.device.type)
        ep = self.mesh.ep_context(init_ep(t.parallel, group=self.mesh.ep.get_group(),
                                          hidden_size=config.hidden_size).backend)
        torch.manual_seed(cfg.task.seed)
        self.store = open_store(cfg.store_url)
        self.run_dir = Path(run_dir)

        # Groups leave Redis (commit) only after a saved state includes the steps that trained on
        # them, so a trainer killed at any point loses nothing.
        checked = on_rank0(self._connect_and_check, self.rank)
        self.buffer = checked[0] if self.rank == 0 else None
        self.latest, manifest = broadcast_from_rank0(checked[1:] if self.rank == 0 else None, self.rank)

        self.model = build_policy_model(cfg, self.path, ep, self.mesh, self.device)
        self.ref_model = build_reference(cfg, self.path, ep, self.mesh, self.device) if t.kl_coef > 0 else None
        self.optimizer = build_optimizer(self.model.parameters(), t.lr, t.adam_betas, t.weight_decay, self.device)
        self.critic = build_critic_parts(cfg, self.path, ep, self.mesh, self.device) if t.algorithm == "ppo" else None
        self.modules = {"policy": (self.model, self.optimizer)}
        if self.critic is not None:
            self.modules["critic"] = (self.critic.module, self.critic.optimizer)
        self.pad_id = getattr(config, "pad_token_id", None) or 0
        self.dtype = getattr(torch, cfg.model.dtype)
        # Routing replay (rollout.routing_replay): samples carry the engine's experts of the MoE layers.
        moe_layers = moe_layer_ids(config) if cfg.rollout.routing_replay else None
        self.intake = BatchIntake(cfg, self.buffer, self.rank, self.world, self.pad_id, moe_layers,
                                  num_routed_experts(config))

        self.state = TrainState()
        self.trained: set[str] = set()  # rank 0: "task_id/attempt" of every group this lineage trained on
        self.commit_point: str | None = None  # rank 0: newest samples-stream entry taken
        if manifest is not None:
            self.trained = set(load_state(self.store, cfg.run_id, manifest, self.modules))
            self.state = TrainState(**manifest["train_state"])
            self.state.resumed_from = manifest["step"]
            self.commit_point = manifest.get("commit_point")
            if self.rank == 0:
                log.info("resumed from the training state of step %d (policy v%d)", self.state.step,
                         self.state.version)
        elif resume and self.rank == 0:
            log.info("--resume: no complete training state in the store; starting from step 0")
        if self.rank != 0:
            self.trained = set()  # only rank 0 checks groups against the lineage

        # SIGTERM / Ctrl-C: finish the current step, then stop on every rank (rank 0 decides).
        self.stop_requested = False
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir = self.run_dir / "trainer-publish"
        # weight_sync.mode network: every version is also pushed to the engines over the network,
        # and only every store_every-th (and the last) goes to the store (app/trainer/weight_sync.py).
        self.pusher = None
        if cfg.weight_sync.mode == "network":
            board = SyncBoard.of(self.buffer) if self.rank == 0 else None
            self.pusher = WeightPusher(cfg.weight_sync, self.rank, self.device, board=board)
        self.metrics_file = self.trained_file = None
        self.stored: int | None = None  # the newest version in the store (with store_every, not every one)

    def _connect_and_check(self):
        """Rank 0 alone talks to Redis and checks the store; its error reaches every rank."""
        cfg, run_dir = self.cfg, self.run_dir
        buf = ExperienceBuffer.from_config(cfg, autocommit=False)
        latest = latest_policy_version(self.store, cfg.run_id)
        earlier = [n for n in ("metrics.jsonl", "trained.jsonl")
                   if (run_dir / n).is_file() and (run_dir / n).stat().st_size]
        if latest is None and earlier:
            # A new run (no version in the store) must not append to another run's records; a
            # resumed one finds its own versions (v0 is published before either file is opened).
            raise ValueError(f"--run-dir {run_dir}: holds {' and '.join(earlier)} of an earlier run, and "
                             f"{cfg.store_url} has no policy of run {cfg.run_id!r}: give a new run a new run "
                             "directory")
        if latest is not None and not self.resume:
            raise ValueError(
                f"{cfg.store_url}: run {cfg.run_id!r} already has policy v{latest}; use a new "
                "run_id, or --resume to continue it"
            )
        manifest = latest_state(self.store, cfg.run_id) if self.resume else None
        if manifest is not None:
            if manifest["world_size"] != self.world:  # DCP reshards (app/trainer/state.py load_state)
                log.info("resuming step %d, saved by %d ranks, on %d", manifest["step"], manifest["world_size"],
                         self.world)
            # Finish a commit that a kill interrupted: the saved state has taken these groups.
            drop_committed(buf, manifest.get("commit_point"))
        return buf, latest, manifest

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    # -- publishing and saving ------------------------------------------------------------------

    def publish(self, version: int, announce: bool = True) -> tuple[str, float]:
        """Store policy ``version`` (every rank) and, with ``announce``, announce it (rank 0)."""
        return publish_version(
            self.model, self.mesh, version, store=self.store, run_id=self.cfg.run_id, work_dir=self.work_dir,
            keep=self.cfg.trainer.keep_versions, dtype=self.dtype, buffer=self.buffer if announce else None,
            tokenizer_source=self.path,
        )

    def push(self, version: int) -> dict:
        """Push policy ``version`` to the registered engines; the figures for the metrics line."""
        r = self.pusher.push(self.model, self.mesh, version, self.dtype)
        return {"push_s": r.seconds, "pushed_engines": len(r.pushed), "push_failed_engines": len(r.failed),
                "push_left_out": len(r.left_out)}

    def save(self) -> float:
        """Save the training state of the current step; seconds taken."""
        state = self.state
        meta = {"train_state": asdict(state), "policy_version": state.version, "commit_point": self.commit_point}
        try:
            return save_state(self.store, self.cfg.run_id, state.step, self.modules, meta,
                              lineage=sorted(self.trained) if self.rank == 0 else None, work_dir=self.work_dir,
                              keep=self.cfg.trainer.keep_states)
        except RuntimeError as e:
            raise TrainingError(str(e)) from None

    # -- the run -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Publish the starting policy (`first_version`: a store with versions was refused at
        build unless resuming, since mixing two runs' versions would break the version contract)
        and open rank 0's records."""
        first = first_version(self.latest)
        uri, secs = self.publish(first)
        self.state.version = self.stored = first
        if self.rank == 0:
            log.info("published %s policy v%d -> %s (%.1fs)", "resumed" if self.resume else "initial", first, uri,
                     secs)
            self.metrics_file = open(self.run_dir / "metrics.jsonl", "a")
            self.trained_file = open_trained_log(self.run_dir / "trained.jsonl")
            if self.resume:
                append_line(self.trained_file, {"resume_from_step": self.state.resumed_from or 0, "version": first,
                                                 "time": time.time()})

    def train_step(self) -> None:
        """One step (a rollout batch's optimizer steps) on this rank and what follows it: the ledger
        line, the policy decision (`next_version`), a save when due, the metrics line.

        Raises:
            Stop: rank 0 was asked to stop (app/trainer/intake.py).
            TrainingError: see `train`.
        """
        cfg, t, state = self.cfg, self.cfg.trainer, self.state
        taken = self.intake.next(state, self.trained, lambda: self.stop_requested)
        self.commit_point = newer_entry(self.commit_point, taken.commit_point)
        t0 = time.perf_counter()
        lr = step_lr(t, state.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.critic is not None:
            for group in self.critic.optimizer.param_groups:
                group["lr"] = lr * self.critic.base_lr / t.lr  # same warm-up, its own peak
        applied, stats = train_step(cfg, self.model, self.optimizer, taken.train, pad_id=self.pad_id,
                                    device=self.device, ref_model=self.ref_model, critic=self.critic)
        trainer_version = state.version
        state.step += 1
        state.optimizer_steps += int(stats["optimizer_steps"])
        step_s = time.perf_counter() - t0
        if applied:
            state.bad_in_row = 0
            state.samples += int(taken.meta.get("samples", 0))
        else:
            state.bad_steps += 1
            state.bad_in_row += 1
            log.warning("step %d: non-finite loss or gradient; step skipped (%d in a row)",
                        state.step, state.bad_in_row)
        if self.rank == 0:
            self._record_trained(taken.groups, taken.skipped, applied, trainer_version)
        give_up = state.bad_in_row >= t.max_bad_steps
        publish_s = save_s = 0.0
        push_meta: dict = {}
        if not give_up:
            decided = next_version(cfg, state.step, state.version)
            if decided.push:
                push_meta = self.push(decided.version)
            if decided.store:
                _, publish_s = self.publish(decided.version, announce=decided.announce)
                self.stored = decided.version
            state.version = decided.version
            if state.step % t.save_every == 0 or state.step == t.steps:
                save_s = self.save()
                if self.rank == 0:
                    self.buffer.commit(upto=self.commit_point)  # a skipped (non-finite) step consumes its groups too
        if self.rank == 0:
            self._record_metrics(taken, applied, stats, lr, step_s, publish_s, save_s, push_meta)
        if give_up:
            raise TrainingError(
                f"{state.bad_in_row} steps in a row had a non-finite loss or gradient "
                f"(trainer.max_bad_steps={t.max_bad_steps}); stopping at step {state.step}, "
                f"policy v{state.version}. Lower trainer.lr or check the rollout logprobs."
            )

    def _record_trained(self, groups: list, skipped: list, applied: bool, trainer_version: int) -> None:
        """Rank 0: the step's line of trained.jsonl; the lineage grows by the groups trained on."""
        if applied:
            self.trained.update(f"{g.task_id}/{g.attempt}" for g in groups)
        else:
            skipped = skipped + [[g.task_id, g.attempt, "nonfinite"] for g in groups]
        append_line(self.trained_file, {
            "step": self.state.step, "trainer_version": trainer_version, "time": time.time(),
            "groups": [{"task_id": g.task_id, "attempt": g.attempt,
                        "samples": [[s.sample_id, s.policy_version] for s in g.samples]}
                       for g in (groups if applied else [])],
            "skipped": skipped,
        })

    def _record_metrics(self, taken, applied: bool, stats: dict, lr: float, step_s: float, publish_s: float,
                        save_s: float, push_meta: dict) -> None:
        """Rank 0: the step's line of metrics.jsonl and its log line."""
        state, meta = self.state, taken.meta
        record = {
            "time": time.time(), "step": state.step, "policy_version": state.version,
            "objective": self.cfg.trainer.objective(), "applied": applied, "bad_steps": state.bad_steps, **meta,
            **{k: v for k, v in stats.items()}, "lr": lr,
            "optimizer_steps_total": state.optimizer_steps,
            "wait_s": taken.wait_s, "step_s": step_s, "publish_s": publish_s, "save_s": save_s, **push_meta,
            "samples_total": state.samples, "overstale_dropped": state.overstale,
            "malformed_groups": state.malformed, "error_groups": state.error_groups,
            "duplicate_groups": state.duplicates, "buffer": self.buffer.stats(),
        }
        self.metrics_file.write(json.dumps(record, allow_nan=True) + "\n")
        self.metrics_file.flush()
        log.info(
            "step %d v%d loss %.4f reward %.3f grad_norm %.3f clip %.3f tis %.3f "
            "wait %.1fs step %.2fs",
            state.step, state.version, stats["loss"], meta.get("reward_mean", float("nan")),
            stats["grad_norm"], stats["clip_frac"], stats.get("tis", 1.0), taken.wait_s, step_s,
        )

    def store_last(self) -> None:
        """After a stop (every rank): store and announce the current version if it was only pushed
        (``weight_sync.store_every``), so that the store's newest version is the policy trained
        last, as after a run's last step."""
        if self.stored != self.state.version:
            _, secs = self.publish(self.state.version)
            self.stored = self.state.version
            if self.rank == 0:
                log.info("stored policy v%d at the stop (%.1fs)", self.state.version, secs)

    def close(self) -> None:
        """Stop the prefetch and the pusher, close the records, give the signals back."""
        self.intake.close()
        if self.pusher is not None:
            self.pusher.close()
        for f in (self.metrics_file, self.trained_file):
            if f is not None:
                f.close()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def finish(self) -> None:
        """Rank 0, after the last step: mark the run done (the feeder, app/feed.py, stops on it)."""
        if self.rank == 0 and self.state.step >= self.cfg.trainer.steps:
            mark_done(self.store, self.cfg.run_id, self.state.step, self.state.version)

    def train(self) -> TrainState:
        """Train for ``trainer.steps`` steps (this rank's part): `start`, `train_step` until the last
        step or a stop, then `close` and `finish`. Returns the final state.

        The run directory gets metrics.jsonl and trained.jsonl (rank 0) and this rank's scratch
        (``trainer-publish/``) for files on their way to the store. With ``resume`` it continues
        from the newest complete training state in the store (without one, from the initial
        weights); either way the first version published is one after the newest in the store.

        Raises:
            ValueError: ``trainer.parallel`` does not fit the world or the model (app/layout.py);
                ``buffer.capacity_groups`` is smaller than ``trainer.groups_per_step``; the store
                already holds policy versions of this run and ``resume`` is False; ``run_dir``
                holds metrics.jsonl or trained.jsonl while the store has no version of this run
                (an earlier run's records).
            TrainingError: no batch in time, too many non-finite steps in a row, a failed publish
                or save, Redis unreachable: raised on every rank with the same message (rank 0
                may raise the original exception instead, e.g. BufferConnectionError naming the URL).
        """
        try:
            self.start()
            while self.state.step < self.cfg.trainer.steps:
                self.train_step()
        except Stop:
            log.info("stop requested: ending at step %d, policy v%d", self.state.step, self.state.version)
            self.store_last()
        finally:
            self.close()
        self.finish()
        return self.state
