"""The built-in engine's side of SGLang's weight-update group: groups, the update session, the
receive, and loading Hugging Face named tensors into the served transformers model.

SGLang 0.5.23 behaviour kept here (``srt/managers/scheduler_components/weight_updater.py``,
``srt/model_executor/model_runner_components/weight_updater.py``):

- ``init_weights_update_group`` joins as rank ``rank_offset + tp_rank`` (one rank here); a group
  name already held fails the call (torch refuses a second group of the same name);
  ``destroy_weights_update_group`` of an unknown name answers "does not exist";
- ``update_weights_from_distributed`` runs only between ``begin_weight_update`` and
  ``end_weight_update`` (a session; a second ``begin`` fails); it receives ``names`` /
  ``dtypes`` / ``shapes`` from group rank 0, per tensor (``load_format`` None) or as one
  flattened bucket (``"flattened_bucket"``), then loads them by name; a failure after some
  tensors were loaded leaves the weights partly updated and the reported version unchanged
  (SGLang: "Please discard the whole weights"), so the caller must reload before serving;
- the names are the checkpoint's (Hugging Face, per expert); this engine's transformers model
  holds experts fused (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``), and
  each per-expert tensor lands in its rows (app.model.checkpoint.hf_pieces, the mapping the
  trainer publishes with).

The engine's own group timeout (``moerl engine --weight-sync-timeout``) bounds every join and
receive; SGLang has no such setting (its group uses torch's default, 30 minutes).
"""

from __future__ import annotations

import torch
from torch import nn

from app.model.checkpoint import hf_pieces
from app.weight_group import (BUCKET_FORMAT, GroupError, UpdateGroup, bucket_bytes, open_group, parse_dtype,
                              unpack_bucket)

# SGLang's answers, word for word where the worker or a test reads them.
NO_SESSION = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
SESSION_OPEN = "a weight-update session is already open; call end_weight_update() first"
NO_OPEN_SESSION = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still running or "
               "queued. Retract or finish them, then call /flush_cache.")
NO_GROUP = "The group to be destroyed does not exist."


class WeightLoadError(ValueError):
    """A received tensor has no place in the model, or the wrong shape (named)."""


def hf_slots(model: nn.Module) -> dict[str, tuple[torch.Tensor, tuple, tuple[int, ...]]]:
    """Where each Hugging Face checkpoint tensor goes in ``model``: name -> (model tensor, index
    into it, the HF tensor's shape). Tied output embeddings are reached through the input ones."""
    slots = {}
    for name, t in model.state_dict(keep_vars=True).items():
        shape = tuple(t.shape)
        for hf_name, src, dst in hf_pieces(name, shape, (0,) * len(shape), shape):
            hf_shape = tuple(s.stop - s.start for s in src)
            slots[hf_name] = (t.data if isinstance(t, nn.Parameter) else t, dst, hf_shape)
    return slots


@torch.no_grad()
def load_named(slots: dict, named: list[tuple[str, torch.Tensor]]) -> None:
    """Copy each (HF name, tensor) into its slot (cast to the model's dtype and device).

    Raises:
        WeightLoadError: an unknown name or a shape that does not fit; tensors before it in
            ``named`` are already loaded.
    """
    for name, value in named:
        if name not in slots:
            raise WeightLoadError(f"tensor {name}: no such weight in the served model")
        target, dst, shape = slots[name]
        if tuple(value.shape) != shape:
            raise WeightLoadError(f"tensor {name}: shape {list(value.shape)}, the served model has {list(shape)}")
        target[dst].copy_(value)


class EngineWeightGroups:
    """One engine's weight-update groups and update session (see the module doc).

    Args:
        timeout_s: bound of every join and receive, seconds.
        device: where received tensors are staged before loading ("cpu" for gloo groups).
    """

    def __init__(self, timeout_s: float = 60.0, device: str = "cpu"):
        self.timeout_s = timeout_s
        self.device = device
        self.groups: dict[str, UpdateGroup] = {}
        self.session = False
        self.received_buckets = 0  # broadcasts received (a counter in /server_info)

    # -- groups ------------------------------------------------------------------------------
    def init_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                   group_name: str, backend: str) -> tuple[bool, str]:
        """Join group ``group_name`` as rank ``rank_offset`` (blocking; run in a thread)."""
        if group_name in self.groups:
            return False, (f"Failed to initialize custom process group: the group name {group_name!r} "
                           "has already been created.")
        try:
            self.groups[group_name] = open_group(backend, master_address, master_port, world_size, rank_offset,
                                                 group_name, self.timeout_s)
        except (GroupError, ValueError) as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        """Leave and forget group ``group_name``."""
        group = self.groups.pop(group_name, None)
        if group is None:
            return False, NO_GROUP
        group.close()
        return True, "Succeeded to destroy custom process group."

    def close(self) -> None:
        """Leave every group (the engine stops)."""
        for name in list(self.groups):
            self.destroy_group(name)

    # -- the session -------------------------------------------------------------------------
    def begin(self) -> tuple[bool, str]:
        if self.session:
            return False, SESSION_OPEN
        self.session = True
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        if not self.session:
            return False, NO_OPEN_SESSION
        self.session = False
        return True, "Success"

    # -- receiving ---------------------------------------------------------------------------
    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                load_format: str | None) -> list[tuple[str, torch.Tensor]]:
        """Receive one update's tensors from group rank 0 (blocking; run in a thread).

        Raises:
            ValueError: lists of different lengths, an unknown dtype or load_format, no such group.
            GroupError: the broadcast failed or timed out.
        """
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise ValueError(f"names, dtypes and shapes must be equally long and not empty "
                             f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        if group_name not in self.groups:
            raise ValueError(f"Group {group_name} not in {sorted(self.groups)}. "
                             "Please call `init_weights_update_group` first.")
        group = self.groups[group_name]
        types = [parse_dtype(d) for d in dtypes]
        if any(not isinstance(s, list) or any(not isinstance(d, int) or d < 0 for d in s) for s in shapes):
            raise ValueError("shapes must be lists of non-negative integers")
        if load_format == BUCKET_FORMAT:
            flat = torch.empty(bucket_bytes(shapes, types), dtype=torch.uint8, device=self.device)
            group.broadcast(flat)
            tensors = unpack_bucket(flat, shapes, types)
        elif load_format is None:
            tensors = [torch.empty(s, dtype=d, device=self.device) for s, d in zip(shapes, types)]
            for t in tensors:  # SGLang's default: one broadcast per tensor, in the names' order
                group.broadcast(t)
        else:
            raise ValueError(f"load_format must be null or {BUCKET_FORMAT!r}, got {load_format!r}")
        self.received_buckets += 1
        return list(zip(names, tensors))
