"""How a finished GRPO group is stored in Redis: a small JSON header in the samples stream and a
binary payload under a key of its own (app/buffer/experience.py holds the keys and the scripts).

Header (`GroupHeader`; the stream entry's ``meta`` field; JSON, a few hundred bytes a group)::

    {"v": 1, "task_id": str, "attempt": int,
     "sample_ids": [str] * G, "policy_versions": [int] * G, "rewards": [float] * G,
     "finish_reasons": [str] * G, "prompt_lens": [int] * G, "completion_lens": [int] * G,
     "shared_prompt": bool, "loss_mask": [bool] * G,
     "routed": null | {"layers": n_moe, "k": K, "dtype": "uint8" | "uint16" | "int32"},
     "version_segments": [null | [[start, version], ...]] * G}    (optional)

``version_segments`` is written only when a sample's tokens came from more than one weight
version (a partial rollout, ``rollout.partial_rollout``): per sample null (every token from its
``policy_versions`` entry) or its segments, ``[start, version]`` pairs over its completion
tokens (`app.buffer.records.check_version_segments`): a few bytes per update a sample lived
through, never one version per token.

Everything the trainer's rank 0 needs to check, filter and assign a group (staleness, the
lineage's duplicates, error groups, rewards, token counts) is in the header; it never reads a
payload.

Payload (`encode_payload` / `decode_group`): one safetensors file (little-endian, C order; the
format of https://github.com/huggingface/safetensors, read and written by its numpy API)::

    prompt_ids      int32   [P]            the prompt once (shared_prompt), else [sum P_i]
    completion_ids  int32   [sum C_i]      the samples' completions, in index order
    logprobs        float32 [sum C_i]      the engine's logprob of each completion token
    loss_mask       uint8   [sum C_i of the samples with a mask]    only if one has one
    routed_experts  uint8 | uint16 | int32 [sum (P_i + C_i - 1), n_moe, K]   routing replay only

Per DeepSeek-V3 group of 16 x (512 + 8192) tokens: 1.05 MB of payload (the JSON it replaces
wrote every float as a ~20-character decimal and the prompt into every sample: 3.55 MB), and
with routing replay 64.6 MB of expert ids for the 58 MoE layers, one byte each.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from app.buffer.records import FINISH_REASONS, Group, Sample, check_version_segments

FORMAT_VERSION = 1
MAX_TOKEN_ID = 2**31 - 1
# Narrowest dtype that holds every expert id (DeepSeek-V3's 256 experts fit uint8).
ROUTED_DTYPES = (("uint8", 1 << 8), ("uint16", 1 << 16), ("int32", 1 << 31))
_HEADER_KEYS = {"v", "task_id", "attempt", "sample_ids", "policy_versions", "rewards", "finish_reasons",
                "prompt_lens", "completion_lens", "shared_prompt", "loss_mask", "routed"}
_PER_SAMPLE = ("sample_ids", "policy_versions", "rewards", "finish_reasons", "prompt_lens", "completion_lens",
               "loss_mask")
_OPTIONAL_KEYS = {"version_segments"}  # absent: one version per sample (format 1 as first written)


def routed_dtype(top: int) -> str:
    """The narrowest of ROUTED_DTYPES that holds expert id `top`. Raises ValueError beyond int32."""
    for name, limit in ROUTED_DTYPES:
        if 0 <= top < limit:
            return name
    raise ValueError(f"routed_experts: expert id {top} does not fit int32")


@dataclass
class SampleHeader:
    """What rank 0 knows of one sample without its payload (the fields of `Sample` it needs)."""

    sample_id: str
    index: int
    policy_version: int
    reward: float
    finish_reason: str
    prompt_len: int
    completion_len: int
    version_segments: list[tuple[int, int]] | None = None


@dataclass
class GroupHeader:
    """One published group as rank 0 takes it: the header, where its payload is, and its entry.

    Attributes:
        task_id, attempt, samples: as in `Group` (samples are `SampleHeader`s).
        shared_prompt: every sample has the same prompt (stored once).
        loss_mask: per sample, whether it carries a loss_mask.
        routed: ``(n_moe, K, dtype)`` of the routed experts, or None.
        entry_id: the samples-stream entry; blob: the Redis key of the payload.
    """

    task_id: str
    attempt: int
    samples: list[SampleHeader]
    shared_prompt: bool = True
    loss_mask: list[bool] = field(default_factory=list)
    routed: tuple[int, int, str] | None = None
    entry_id: str = ""
    blob: str = ""

    @property
    def policy_version(self) -> int:
        """The oldest policy version among the samples (staleness is measured from it)."""
        return min(s.policy_version for s in self.samples)

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens of all samples (what `split_groups` balances)."""
        return sum(s.prompt_len + s.completion_len for s in self.samples)

    def check(self, moe_layers: list[int] | None = None) -> None:
        """Rank 0's cheap checks of what the header alone can show; the payload is checked by the
        rank that decodes it (`decode_group`).

        Raises:
            ValueError: an empty prompt; with ``moe_layers``, no routed experts or routed experts
                of another number of layers (all but an all-"error" group); without, routed
                experts anyway.
        """
        for s in self.samples:
            if s.prompt_len < 1:
                raise ValueError(f"sample {s.sample_id!r}: empty prompt_ids")
        if all(s.finish_reason == "error" for s in self.samples):
            return
        if moe_layers is not None:
            if self.routed is None:
                raise ValueError(f"group {self.task_id!r}: routing replay is on but the group has no routed_experts")
            if self.routed[0] != len(moe_layers):
                raise ValueError(f"group {self.task_id!r}: routed experts of {self.routed[0]} layers, the model has "
                                 f"{len(moe_layers)} MoE layers")

    def to_json(self) -> str:
        """The stream entry's ``meta`` field."""
        segments = [None if s.version_segments is None else [list(seg) for seg in s.version_segments]
                    for s in self.samples]
        extra = {"version_segments": segments} if any(x is not None for x in segments) else {}
        return json.dumps({
            "v": FORMAT_VERSION, "task_id": self.task_id, "attempt": self.attempt,
            "sample_ids": [s.sample_id for s in self.samples],
            "policy_versions": [s.policy_version for s in self.samples],
            "rewards": [s.reward for s in self.samples],
            "finish_reasons": [s.finish_reason for s in self.samples],
            "prompt_lens": [s.prompt_len for s in self.samples],
            "completion_lens": [s.completion_len for s in self.samples],
            "shared_prompt": self.shared_prompt, "loss_mask": self.loss_mask,
            "routed": None if self.routed is None else
            {"layers": self.routed[0], "k": self.routed[1], "dtype": self.routed[2]},
            **extra,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "GroupHeader":
        """Parse and check a ``meta`` field written by anyone.

        Raises:
            ValueError: not JSON, an unknown or missing key, a value of the wrong type or range,
                per-sample lists of different lengths (the message names the key).
        """
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"meta: expected a JSON object, got {type(d).__name__}")
        unknown, missing = sorted(set(d) - _HEADER_KEYS - _OPTIONAL_KEYS), sorted(_HEADER_KEYS - set(d))
        if unknown or missing:
            raise ValueError(f"meta: unknown key(s) {unknown}, missing key(s) {missing}")
        if d["v"] != FORMAT_VERSION:
            raise ValueError(f"meta.v: format {d['v']!r}, this trainer reads {FORMAT_VERSION}")
        _want(isinstance(d["task_id"], str) and d["task_id"], "task_id", "a non-empty string")
        _want(_is_int(d["attempt"]) and d["attempt"] >= 0, "attempt", "an integer >= 0")
        _want(isinstance(d["shared_prompt"], bool), "shared_prompt", "true or false")
        lists = {k: d[k] for k in _PER_SAMPLE}
        for k, v in lists.items():
            _want(isinstance(v, list), k, "a list")
        g = len(d["sample_ids"])
        _want(g >= 1 and all(len(v) == g for v in lists.values()), "sample_ids",
              f"one value per sample in every per-sample list ({ {k: len(v) for k, v in lists.items()} })")
        _want(all(isinstance(x, str) and x for x in d["sample_ids"]), "sample_ids", "non-empty strings")
        _want(len(set(d["sample_ids"])) == g, "sample_ids", "distinct ids")
        _want(all(_is_int(x) and x >= 0 for x in d["policy_versions"]), "policy_versions", "integers >= 0")
        _want(all(_is_num(x) and math.isfinite(x) for x in d["rewards"]), "rewards", "finite numbers")
        _want(all(x in FINISH_REASONS for x in d["finish_reasons"]), "finish_reasons", f"one of {FINISH_REASONS}")
        for k in ("prompt_lens", "completion_lens"):
            _want(all(_is_int(x) and 0 <= x <= MAX_TOKEN_ID for x in d[k]), k, "integers >= 0")
        _want(all(isinstance(x, bool) for x in d["loss_mask"]), "loss_mask", "true or false per sample")
        if d["shared_prompt"]:
            _want(len(set(d["prompt_lens"])) == 1, "prompt_lens", "one length with shared_prompt")
        routed = d["routed"]
        if routed is not None:
            _want(isinstance(routed, dict) and set(routed) == {"layers", "k", "dtype"}, "routed",
                  "null or {layers, k, dtype}")
            _want(_is_int(routed["layers"]) and routed["layers"] >= 1 and _is_int(routed["k"]) and routed["k"] >= 1,
                  "routed", "layers and k >= 1")
            _want(routed["dtype"] in {n for n, _ in ROUTED_DTYPES}, "routed.dtype",
                  f"one of {[n for n, _ in ROUTED_DTYPES]}")
            routed = (routed["layers"], routed["k"], routed["dtype"])
        segments = d.get("version_segments", [None] * g)
        _want(isinstance(segments, list) and len(segments) == g, "version_segments", "one entry per sample")
        for i, seg in enumerate(segments):
            try:
                check_version_segments(seg, d["completion_lens"][i], d["policy_versions"][i], f"sample {i}")
            except ValueError as e:
                raise ValueError(f"meta.version_segments: {e}") from None
        samples = [SampleHeader(sample_id=d["sample_ids"][i], index=i, policy_version=d["policy_versions"][i],
                                reward=float(d["rewards"][i]), finish_reason=d["finish_reasons"][i],
                                prompt_len=d["prompt_lens"][i], completion_len=d["completion_lens"][i],
                                version_segments=None if segments[i] is None else [tuple(x) for x in segments[i]])
                   for i in range(g)]
        return cls(task_id=d["task_id"], attempt=d["attempt"], samples=samples, shared_prompt=d["shared_prompt"],
                   loss_mask=list(d["loss_mask"]), routed=routed)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _want(ok: bool, key: str, what: str) -> None:
    if not ok:
        raise ValueError(f"meta.{key}: expected {what}")


def _token_ids(values: Any, where: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.int64).reshape(-1)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise ValueError(f"{where}: token ids must be in [0, 2**31)")
    return arr.astype("<i4")


def encode_group(group: Group) -> tuple[GroupHeader, bytes]:
    """The header and payload of a group whose samples `ExperienceBuffer.publish` has checked
    (index order, one logprob and at most one 0/1 mask value per completion token).

    Raises:
        ValueError: a token id outside ``[0, 2**31)``; routed experts on some samples only, of
            differing ``[n_moe, K]``, of the wrong row count (``P + C - 1``), not integers or with a
            negative id. The message names the sample.
    """
    samples = group.samples
    prompts = [_token_ids(s.prompt_ids, f"sample {s.sample_id!r} prompt_ids") for s in samples]
    shared = all(p.shape == prompts[0].shape and np.array_equal(p, prompts[0]) for p in prompts[1:])
    completions = [_token_ids(s.completion_ids, f"sample {s.sample_id!r} completion_ids") for s in samples]
    tensors = {
        "prompt_ids": prompts[0] if shared else np.concatenate(prompts),
        "completion_ids": np.concatenate(completions),
        "logprobs": np.concatenate([np.asarray(s.logprobs, dtype="<f4").reshape(-1) for s in samples]),
    }
    masks = [s.loss_mask is not None for s in samples]
    if any(masks):
        tensors["loss_mask"] = np.concatenate([np.asarray(s.loss_mask, dtype=np.uint8).reshape(-1)
                                               for s in samples if s.loss_mask is not None])
    routed = None
    with_routing = [s.routed_experts is not None for s in samples]
    if any(with_routing):
        if not all(with_routing):
            raise ValueError(f"group {group.task_id!r}: routed_experts on some samples only")
        arrays = []
        for s in samples:
            ids = np.asarray(s.routed_experts)
            fed = len(s.prompt_ids) + len(s.completion_ids) - 1
            if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[0] != fed:
                raise ValueError(f"sample {s.sample_id!r}: routed_experts must be integers [{fed}, n_moe, K] "
                                 f"(P + C - 1 tokens), got {ids.dtype} {list(ids.shape)}")
            if ids.size and int(ids.min()) < 0:
                raise ValueError(f"sample {s.sample_id!r}: routed_experts: negative expert id {int(ids.min())}")
            if arrays and ids.shape[1:] != arrays[0].shape[1:]:
                raise ValueError(f"sample {s.sample_id!r}: routed_experts [.., {ids.shape[1]}, {ids.shape[2]}] differ "
                                 f"from sample 0's [.., {arrays[0].shape[1]}, {arrays[0].shape[2]}]")
            arrays.append(ids)
        top = max((int(a.max()) for a in arrays if a.size), default=0)
        name = routed_dtype(top)
        tensors["routed_experts"] = np.concatenate([a.astype(np.dtype(name).newbyteorder("<"), copy=False)
                                                    for a in arrays])
        routed = (int(arrays[0].shape[1]), int(arrays[0].shape[2]), name)
    header = GroupHeader(
        task_id=group.task_id, attempt=group.attempt, shared_prompt=bool(shared), loss_mask=masks, routed=routed,
        samples=[SampleHeader(sample_id=s.sample_id, index=s.index, policy_version=int(s.policy_version),
                              reward=float(s.reward), finish_reason=s.finish_reason, prompt_len=len(p),
                              completion_len=len(c),
                              version_segments=None if s.version_segments is None else
                              [(int(a), int(b)) for a, b in s.version_segments])
                     for s, p, c in zip(samples, prompts, completions)],
    )
    return header, st_save(tensors)


def decode_group(header: GroupHeader, payload: bytes, *, as_lists: bool = False,
                 num_experts: int | None = None) -> Group:
    """The `Group` a header and its payload describe; every sample's arrays are views of the payload.

    Args:
        as_lists: token ids, logprobs and masks as Python lists (the records `publish` took)
            instead of numpy arrays (int32 / float32 / uint8) for the trainer's collate.
        num_experts: with routing, refuse an expert id >= this (the trainer's E).

    Returns:
        the group; with routing, each sample's ``routed_experts`` is ``[P + C - 1, n_moe, K]``.

    Raises:
        ValueError: not a safetensors payload, a tensor missing, extra, of another dtype or
            length than the header says, a non-finite logprob, a mask value other than 0/1, an
            expert id >= ``num_experts``. The message names the tensor or the sample.
    """
    try:
        t = st_load(payload)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types on bad bytes
        raise ValueError(f"payload: not a safetensors file ({type(e).__name__}: {e})") from None
    samples = header.samples
    p_total = samples[0].prompt_len if header.shared_prompt else sum(s.prompt_len for s in samples)
    c_total = sum(s.completion_len for s in samples)
    want = {"prompt_ids": ("int32", (p_total,)), "completion_ids": ("int32", (c_total,)),
            "logprobs": ("float32", (c_total,))}
    if any(header.loss_mask):
        want["loss_mask"] = ("uint8", (sum(s.completion_len for s, m in zip(samples, header.loss_mask) if m),))
    if header.routed is not None:
        n_moe, k, dtype = header.routed
        want["routed_experts"] = (dtype, (sum(s.prompt_len + s.completion_len - 1 for s in samples), n_moe, k))
    if set(t) != set(want):
        raise ValueError(f"payload: tensors {sorted(t)}, the header describes {sorted(want)}")
    for name, (dtype, shape) in want.items():
        if t[name].dtype != np.dtype(dtype) or t[name].shape != shape:
            raise ValueError(f"payload.{name}: {t[name].dtype} {list(t[name].shape)}, the header says {dtype} "
                             f"{list(shape)}")
    if not np.isfinite(t["logprobs"]).all():
        bad = int(np.flatnonzero(~np.isfinite(t["logprobs"]))[0])
        raise ValueError(f"sample {_owner(samples, bad)!r}: non-finite rollout logprob")
    if (t["prompt_ids"] < 0).any() or (t["completion_ids"] < 0).any():
        raise ValueError("payload: negative token id")
    if "loss_mask" in t and (t["loss_mask"] > 1).any():
        raise ValueError("payload.loss_mask: values must be 0 or 1")
    routed = t.get("routed_experts")
    if routed is not None and routed.size:
        top, low = int(routed.max()), int(routed.min())
        if low < 0 or (num_experts is not None and top >= num_experts):
            raise ValueError(f"payload.routed_experts: expert id {low if low < 0 else top} outside "
                             f"[0, {num_experts if num_experts is not None else 'E'})")
    out = []
    po = co = mo = ro = 0
    conv = (lambda a: a.tolist()) if as_lists else (lambda a: a)
    for s, has_mask in zip(samples, header.loss_mask):
        if header.shared_prompt:
            prompt = t["prompt_ids"]
        else:
            prompt = t["prompt_ids"][po:po + s.prompt_len]
            po += s.prompt_len
        completion = t["completion_ids"][co:co + s.completion_len]
        logprobs = t["logprobs"][co:co + s.completion_len]
        co += s.completion_len
        mask = None
        if has_mask:
            mask = conv(t["loss_mask"][mo:mo + s.completion_len])
            mo += s.completion_len
        ids = None
        if routed is not None:
            fed = s.prompt_len + s.completion_len - 1
            ids = routed[ro:ro + fed]
            ro += fed
        out.append(Sample(sample_id=s.sample_id, task_id=header.task_id, index=s.index, attempt=header.attempt,
                          prompt_ids=conv(prompt), completion_ids=conv(completion), logprobs=conv(logprobs),
                          reward=s.reward, policy_version=s.policy_version, finish_reason=s.finish_reason,
                          routed_experts=ids, loss_mask=mask,
                          version_segments=None if s.version_segments is None else list(s.version_segments)))
    return Group(task_id=header.task_id, attempt=header.attempt, samples=out, entry_id=header.entry_id)


def _owner(samples: list[SampleHeader], completion_offset: int) -> str:
    """The id of the sample whose completion holds flat position `completion_offset`."""
    for s in samples:
        if completion_offset < s.completion_len:
            return s.sample_id
        completion_offset -= s.completion_len
    return samples[-1].sample_id
