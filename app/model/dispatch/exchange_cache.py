"""Keep the EP all-to-all outputs of a checkpointed layer so its recompute does not exchange again.

Selective activation checkpointing (``trainer.activation_checkpointing: selective``) recomputes a
decoder layer in backward except its dispatch and combine exchanges, whose outputs are kept: a
recompute then spends no network time and no host synchronisation on split sizes. torchtitan gets
this from torch's selective-checkpoint policy on ``_c10d_functional.all_to_all_single``; here that
policy cannot be used, because FSDP2's hooks of the router and expert units (called again inside
a recompute) record profiler ranges that torch's policy counts and refuses when their number
differs from the forward's. So the cache is explicit:

* `checkpoint_contexts` is the ``context_fn`` of ``torch.utils.checkpoint``: its forward context
  records every exchange of the region, in order; its recompute context replays them;
* the dispatcher (app/model/dispatch/alltoall.py) `keep`s each exchange's output while the region
  records; while it replays it `take`s them instead of communicating, through `ReplayedAllToAll`,
  whose backward is the real (transposed) exchange of the gradient.

The replayed values are exactly the forward's (same splits, same order: a layer's recompute runs
the same code on the same inputs), so the result equals full recomputation.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque

import torch
from torch import Tensor

_state = threading.local()


class _Cache:
    def __init__(self) -> None:
        self.items: deque = deque()
        self.mode: str | None = None


def _current() -> _Cache | None:
    return getattr(_state, "cache", None)


@contextlib.contextmanager
def _use(cache: _Cache, mode: str):
    prev = _current()
    cache.mode = mode
    _state.cache = cache
    try:
        yield
    finally:
        _state.cache = prev


def checkpoint_contexts():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant): returns the
    (forward, recompute) context managers of one checkpointed region, sharing one cache."""
    cache = _Cache()
    return _use(cache, "record"), _use(cache, "replay")


def keep(key: str, value) -> None:
    """While a checkpointed region records: keep ``value`` (an exchange's output) for its
    recompute; elsewhere nothing."""
    cache = _current()
    if cache is not None and cache.mode == "record":
        cache.items.append((key, value))


def take(key: str):
    """While a recompute replays: the next kept value, which must be ``key``'s.

    Raises:
        RuntimeError: the recompute asks for another exchange than the forward recorded.
    """
    cache = _current()
    if not cache.items:
        raise RuntimeError(f"activation-checkpoint replay: no recorded exchange left for {key!r}")
    recorded_key, value = cache.items.popleft()
    if recorded_key != key:
        raise RuntimeError(f"activation-checkpoint replay: asked for {key!r}, recorded {recorded_key!r}")
    return value


def replaying() -> bool:
    """True inside the recompute of a checkpointed region that recorded its exchanges."""
    cache = _current()
    return cache is not None and cache.mode == "replay"


class ReplayedAllToAll(torch.autograd.Function):
    """Forward: the recorded output of an all-to-all, no communication (``box`` holds it, out of
    autograd's sight). Backward: ``backward_fn(grad)``, the transposed exchange of the gradient,
    as the real all-to-all's backward is."""

    @staticmethod
    def forward(ctx, x: Tensor, box: list, backward_fn):
        ctx.backward_fn = backward_fn
        return box[0].detach()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return ctx.backward_fn(grad.contiguous()), None, None
