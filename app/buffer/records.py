"""What travels through the experience buffer: tasks (prompt groups to generate), samples and groups.

Plain dataclasses with `to_dict` / `from_dict` (JSON); a task crosses Redis as JSON, a finished
group as a JSON header and a binary payload (app/buffer/encoding.py). The ids follow the
task-lease contract (docs/ARCHITECTURE.md, "Task lease"): a sample id is a pure function of (run, prompt id, sample
index, attempt), so a replayed task produces the same ids and cannot enter training twice.
"""

from __future__ import annotations

import base64
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

import numpy as np

FINISH_REASONS = ("stop", "length", "error")


def sample_id(run_id: str, task_id: str, index: int, attempt: int) -> str:
    """The deterministic id of completion `index` of attempt `attempt` of a prompt group."""
    return f"{run_id}/{task_id}/{index}/{attempt}"


def _from_dict(cls, data: dict[str, Any]):
    """Build dataclass `cls` from `data`; a missing or unknown field raises one ValueError naming it."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected a dict, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{cls.__name__}: missing field(s) {missing}")
    return cls(**data)


@dataclass
class Task:
    """One prompt = one GRPO group to generate.

    Attributes:
        task_id: stable prompt id, e.g. "train-000123".
        prompt_ids: prompt token ids.
        prompt: prompt text (for logs and the reward function).
        answer: JSON string with what the reward function needs.
        group_size: G, completions to generate for this prompt.
        attempt: incremented when the task is re-issued after a stale group was requeued.
        failures: times a rollout of this attempt failed (a reward or environment call raised,
            timed out or answered malformed) and the task went back to the queue; the buffer
            drops the task once it reaches ``buffer.max_failures`` (`ExperienceBuffer.fail`).
        entry_id: Redis stream entry id of the current lease; set by `ExperienceBuffer.lease`.
        consumer: the rollout worker holding the lease; set by `ExperienceBuffer.lease`.
    """

    task_id: str
    prompt_ids: list[int]
    prompt: str
    answer: str
    group_size: int
    attempt: int = 0
    failures: int = 0
    entry_id: str = ""
    consumer: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Task":
        """Raises ValueError naming a missing or unknown field."""
        return _from_dict(cls, data)

    def to_json(self) -> str:
        """The queued form: lease bookkeeping (entry_id, consumer) is not part of it."""
        d = self.to_dict()
        d["entry_id"] = ""
        d["consumer"] = ""
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Task":
        return cls.from_dict(json.loads(text))

    def sample_id(self, run_id: str, index: int) -> str:
        """Id of completion `index` of this task's current attempt."""
        return sample_id(run_id, self.task_id, index, self.attempt)


@dataclass
class Sample:
    """One completion of a prompt, as the rollout worker produced it.

    Attributes:
        sample_id: deterministic, `sample_id(run, task_id, index, attempt)`.
        task_id, index, attempt: which prompt, which of its G completions, which attempt.
        prompt_ids: prompt token ids.
        completion_ids: the token ids after the prompt (length C): the generated tokens; in a
            multi-turn episode (app/rollout/episodes.py) the turns' generated tokens with the
            environment's observation tokens between them.
        logprobs: C floats, the engine's log-probability of each generated token (rollout
            logprobs); 0.0 at environment tokens.
        reward: scalar reward from the task's reward function.
        policy_version: the engine's weight_version that generated this completion; with
            several (``version_segments``: a partial rollout resumed across a weight update,
            or the turns of an episode), the OLDEST of them, which staleness is measured from.
        finish_reason: "stop" | "length" | "error".
        routed_experts: with ``rollout.routing_replay``, the experts the engine routed each token
            to in each MoE layer: an integer array ``[P + C - 1, n_moe, K]`` of global expert ids
            (the narrowest of uint8 / uint16 / int32 that holds them) for the prompt and
            completion tokens the engine fed through the model (every token but the last sampled
            one), n_moe = the MoE layers in ascending order (`app.model.config.moe_layer_ids`;
            the engine's dense layers are left out), K = ``num_experts_per_tok``; None
            otherwise. In JSON (`to_dict`) it is `encode_routed_experts`' form.
        loss_mask: C ints, 1 at tokens the policy generated (trained on), 0 at environment
            tokens (no gradient, no importance weight, not in the token-mean denominator);
            None means every completion token was generated (single-turn).
        version_segments: which completion tokens came from which weight version, as
            ``[(start, version), ...]``: segment k covers tokens ``[start_k, start_{k+1})`` (the
            last one to C), starts strictly increasing from 0 and below C, versions strictly
            increasing, the first one ``policy_version`` (`check_version_segments`). None: one
            version for every token (``policy_version``). A partial rollout (``rollout.partial_rollout``)
            writes one segment per weight version its tokens were generated by.
    """

    sample_id: str
    task_id: str
    index: int
    attempt: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    reward: float
    policy_version: int
    finish_reason: str
    routed_experts: Any = None
    loss_mask: list[int] | None = None
    version_segments: list[tuple[int, int]] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_len(self) -> int:
        return len(self.completion_ids)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if d["routed_experts"] is not None:
            d["routed_experts"] = encode_routed_experts(d["routed_experts"])
        for k in ("prompt_ids", "completion_ids", "logprobs", "loss_mask"):  # arrays of a decoded payload
            if isinstance(d[k], np.ndarray):
                d[k] = d[k].tolist()
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sample":
        """Raises ValueError naming a missing or unknown field, or bad routed_experts."""
        s = _from_dict(cls, data)
        if isinstance(s.routed_experts, dict):
            s.routed_experts = decode_routed_experts(s.routed_experts)
        if s.version_segments is not None:
            s.version_segments = [tuple(seg) for seg in s.version_segments]
        return s

    def token_versions(self) -> list[int]:
        """The weight version of each completion token (C ints), from ``version_segments``."""
        segments = self.version_segments or [(0, self.policy_version)]
        out: list[int] = []
        for k, (start, version) in enumerate(segments):
            end = segments[k + 1][0] if k + 1 < len(segments) else len(self.completion_ids)
            out += [version] * (end - start)
        return out


def check_version_segments(segments: Any, completion_len: int, policy_version: int, where: str) -> None:
    """Check a sample's ``version_segments`` (see `Sample`); None passes.

    Raises:
        ValueError: naming ``where`` and ``version_segments``: not a list of ``[start, version]``
            integer pairs, a first start other than 0, starts not strictly increasing or not below
            ``completion_len``, versions not strictly increasing or negative, or a first version
            other than ``policy_version`` (the oldest, which staleness is measured from).
    """
    if segments is None:
        return
    ok = isinstance(segments, (list, tuple)) and len(segments) >= 1 and all(
        isinstance(seg, (list, tuple)) and len(seg) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in seg) for seg in segments)
    if not ok:
        raise ValueError(f"{where}: version_segments must be a non-empty list of [start, version] integer pairs, "
                         f"got {segments!r}")
    starts, versions = [seg[0] for seg in segments], [seg[1] for seg in segments]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or (
            len(starts) > 1 and starts[-1] >= completion_len):
        raise ValueError(f"{where}: version_segments starts {starts} must begin at 0 and increase strictly "
                         f"below the {completion_len} completion tokens")
    if versions[0] < 0 or any(b <= a for a, b in zip(versions, versions[1:])):
        raise ValueError(f"{where}: version_segments versions {versions} must be >= 0 and increase strictly")
    if versions[0] != policy_version:
        raise ValueError(f"{where}: version_segments begin at version {versions[0]}, policy_version is "
                         f"{policy_version} (the oldest version of the sample's tokens)")


# Narrowest unsigned dtype that holds every expert id (DeepSeek-V3's 256 experts fit uint8).
_ROUTED_DTYPES = (("uint8", 1 << 8), ("uint16", 1 << 16), ("int32", 1 << 31))


def routed_experts_of_moe_layers(ids: Any, moe_layers: list[int]) -> np.ndarray:
    """`Sample.routed_experts` from the engine's ``[T, num_hidden_layers, K]`` expert ids: the MoE
    layers' rows, in the narrowest unsigned dtype that holds every id (uint8 for 256 experts).

    Raises:
        ValueError: not an integer array [T, L, K], a MoE layer index >= L, a negative id.
    """
    arr = np.asarray(ids)
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routed_experts: expected an integer array [T, L, K], got {arr.dtype} {list(arr.shape)}")
    if moe_layers and max(moe_layers) >= arr.shape[1]:
        raise ValueError(f"routed_experts: {arr.shape[1]} layers, MoE layer {max(moe_layers)} asked for")
    arr = arr[:, moe_layers]
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"routed_experts: negative expert id {int(arr.min())}")
    top = int(arr.max()) if arr.size else 0
    name = next((n for n, limit in _ROUTED_DTYPES if top < limit), None)
    if name is None:
        raise ValueError(f"routed_experts: expert id {top} does not fit int32")
    return np.ascontiguousarray(arr, dtype=np.dtype(name))


def encode_routed_experts(ids: Any) -> dict[str, Any]:
    """Store a ``[T, L, K]`` integer array of expert ids compactly for JSON.

    Returns:
        ``{"dtype": "uint8" | "uint16" | "int32", "shape": [T, L, K], "data": base64}``: the ids
        in the narrowest of those dtypes that holds the largest id, C order, little-endian.

    Raises:
        ValueError: not 3-dimensional, or an id is negative or >= 2**31.
    """
    arr = np.asarray(ids)
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"routed_experts: expected an integer array [T, L, K], got {arr.dtype} {list(arr.shape)}")
    top = int(arr.max()) if arr.size else 0
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"routed_experts: negative expert id {int(arr.min())}")
    name = next((n for n, limit in _ROUTED_DTYPES if top < limit), None)
    if name is None:
        raise ValueError(f"routed_experts: expert id {top} does not fit int32")
    data = np.ascontiguousarray(arr, dtype=np.dtype(name).newbyteorder("<")).tobytes()
    return {"dtype": name, "shape": [int(x) for x in arr.shape], "data": base64.b64encode(data).decode("ascii")}


def decode_routed_experts(stored: dict[str, Any]) -> np.ndarray:
    """The ``[T, L, K]`` int64 array of `encode_routed_experts`' output.

    Raises:
        ValueError: unknown dtype, or the data does not match the shape (names the field).
    """
    if not isinstance(stored, dict) or set(stored) != {"dtype", "shape", "data"}:
        raise ValueError("routed_experts: expected {dtype, shape, data}")
    if stored["dtype"] not in {n for n, _ in _ROUTED_DTYPES}:
        raise ValueError(f"routed_experts.dtype: {stored['dtype']!r} is not one of uint8, uint16, int32")
    raw = np.frombuffer(base64.b64decode(stored["data"]), dtype=np.dtype(stored["dtype"]).newbyteorder("<"))
    shape = tuple(int(x) for x in stored["shape"])
    if len(shape) != 3 or raw.size != int(np.prod(shape)):
        raise ValueError(f"routed_experts: {raw.size} ids do not fill shape {list(shape)}")
    return raw.reshape(shape).astype(np.int64)


def check_group(group, moe_layers: list[int] | None = None) -> None:
    """What the trainer needs of a group before it collates it (one definition: `Group.check`,
    and so the intake's `usable`, and app/trainer/batch.py `collate_groups`). ``group`` has
    ``task_id`` and ``samples`` with the fields of `Sample` (duck-typed: app/bench/train_step.py
    builds its own).

    Raises:
        ValueError: no samples; a sample has no prompt tokens, a logprob count or a loss_mask
            length that differs from its completion length, a loss_mask value other than 0
            or 1, a non-finite reward or logprob; with ``moe_layers``, a sample has no
            routed experts or ones that are not ``[P + C - 1, len(moe_layers), K]``. The
            message names the sample id.
    """
    if not group.samples:
        raise ValueError(f"group {group.task_id!r} has no samples")
    for s in group.samples:
        c = len(s.completion_ids)
        if not len(s.prompt_ids):
            raise ValueError(f"sample {s.sample_id!r}: empty prompt_ids")
        if len(s.logprobs) != c:
            raise ValueError(f"sample {s.sample_id!r}: {len(s.logprobs)} logprobs for {c} completion tokens")
        if not math.isfinite(s.reward):
            raise ValueError(f"sample {s.sample_id!r}: reward {s.reward} is not finite")
        if c and not np.isfinite(np.asarray(s.logprobs, dtype=np.float64)).all():
            raise ValueError(f"sample {s.sample_id!r}: non-finite rollout logprob")
        if getattr(s, "loss_mask", None) is not None:
            mask = np.asarray(s.loss_mask)
            if mask.shape != (c,):
                raise ValueError(f"sample {s.sample_id!r}: loss_mask has {mask.size} values for {c} "
                                 "completion tokens")
            if c and not np.isin(mask, (0, 1)).all():
                raise ValueError(f"sample {s.sample_id!r}: loss_mask values must be 0 or 1")
        if moe_layers is not None:
            if getattr(s, "routed_experts", None) is None:
                raise ValueError(f"sample {s.sample_id!r}: routing replay is on but the sample has no "
                                 "routed_experts")
            shape = tuple(np.shape(s.routed_experts))
            fed = len(s.prompt_ids) + c - 1
            if len(shape) != 3 or shape[:2] != (fed, len(moe_layers)):
                raise ValueError(f"sample {s.sample_id!r}: routed_experts of shape {list(shape)}, expected "
                                 f"[{fed}, {len(moe_layers)}, K] (the MoE layers)")


@dataclass
class Group:
    """The G samples of one prompt attempt: trained on whole or not at all (docs/ARCHITECTURE.md, "GRPO group").

    Attributes:
        task_id, attempt: the prompt attempt these samples answer.
        samples: the G samples, ordered by index.
        entry_id: Redis stream entry id in the samples stream; set by `ExperienceBuffer.take_batch`.
    """

    task_id: str
    attempt: int
    samples: list[Sample]
    entry_id: str = ""

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the samples (staleness is measured from it)."""
        return min(s.policy_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens of all samples (what the trainer balances over ranks)."""
        return sum(len(s.prompt_ids) + len(s.completion_ids) for s in self.samples)

    def check(self, moe_layers: list[int] | None = None) -> None:
        """What the trainer needs of a group before it collates it (`check_group`). Raises
        ValueError naming the sample."""
        check_group(self, moe_layers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "attempt": self.attempt,
            "samples": [s.to_dict() for s in self.samples],
            "entry_id": self.entry_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Group":
        """Raises ValueError naming a missing or unknown field."""
        data = dict(data)
        data["samples"] = [Sample.from_dict(s) for s in data.get("samples", [])]
        return _from_dict(cls, data)

    def to_json(self) -> str:
        d = self.to_dict()
        d["entry_id"] = ""
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Group":
        return cls.from_dict(json.loads(text))
