"""Hugging Face safetensors checkpoints of the policy, written and read shard-wise under EP.

A checkpoint directory holds ``config.json``, ``generation_config.json``,
``model-0000X-of-0000N.safetensors`` and ``model.safetensors.index.json`` (``weight_map``: tensor
name -> shard file; ``metadata.total_size``: bytes), the layout of transformers'
``save_pretrained`` (docs: "Sharded checkpoints"). Expert weights are stored per expert under the
Hub names, ``model.layers.L.mlp.experts.E.{gate_proj,up_proj,down_proj}.weight``, which stock
transformers (it fuses them on load with its ``qwen2_moe`` weight-conversion rules) and SGLang
both read.

Saving under EP: every rank derives the same shard plan from the config alone (no
communication), then writes only the shards holding its own experts; rank 0 also writes the
non-expert shards, the index and the configs. We chose this over gathering to rank 0 because no
rank ever holds more than its own experts (the whole point of EP: DeepSeek-V3's experts do not
fit one host) and the ranks write in parallel. The directory must be visible to every EP rank
(one host, or a shared filesystem); the trainer uploads the finished directory to the store.

Loading (`app.model.reader.CheckpointReader`): all shard headers are read and checked against the
config first (names, shapes, missing shards, FP8 scales), then each rank reads only the non-expert
tensors and its local experts' tensors, block-scaled FP8 weights (the official DeepSeek-V3
checkpoint) dequantized on read into the model's dtype. The
fused layout that transformers 5 writes with ``save_pretrained(save_original_format=False)``
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``) is accepted too;
a rank then reads only its rows of those tensors.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from app.config import RouterConfig
from app.model.config import validate_config
from app.model.parallel import EPContext, collective_device
from app.model.policy import build_policy, moe_blocks, stock_architecture
from app.model.reader import CONFIG_NAME, INDEX_NAME, SINGLE_NAME, CheckpointReader  # noqa: F401 - re-exported

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


# ---------------------------------------------------------------- the HF view of our tensors


@dataclass
class _HFTensor:
    """One checkpoint tensor: its Hub name, shape, dtype, which EP rank writes it, and (on that
    rank) a function returning its value."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: int
    get: Callable[[], torch.Tensor] | None

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class _ExpertParam:
    """A fused expert parameter of one MoE layer: ``gate_up`` [E_local, 2I, H] or ``down``
    [E_local, H, I]; ``prefix`` is ``model.layers.L.mlp.experts``."""

    prefix: str
    kind: str
    param: torch.Tensor
    offset: int
    n_local: int
    n_total: int


def _split_state(model: PreTrainedModel, ep: EPContext) -> tuple[dict[str, torch.Tensor], list[_ExpertParam]]:
    """The model's state as (non-expert tensors by name, fused expert parameters)."""
    experts: list[_ExpertParam] = []
    expert_names: set[str] = set()
    for layer, block in moe_blocks(model):
        prefix = f"model.layers.{layer}.mlp.experts"
        n_local = block.num_local_experts
        if block.local_expert_offset != ep.rank * n_local:
            raise ValueError(
                f"{prefix}: local_expert_offset {block.local_expert_offset} does not match EP rank "
                f"{ep.rank} x {n_local} local experts; was the model built with this EPContext?"
            )
        for kind, param in (("gate_up", block.experts.gate_up_proj), ("down", block.experts.down_proj)):
            experts.append(_ExpertParam(prefix, kind, param, block.local_expert_offset, n_local, n_local * ep.size))
        expert_names |= {f"{prefix}.gate_up_proj", f"{prefix}.down_proj"}
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # tied to the embedding; the Hub omits it
    others = {k: v for k, v in state.items() if k not in expert_names}
    return others, experts


def _per_expert_tensors(ep_param: _ExpertParam, rank: int) -> list[_HFTensor]:
    """Hub per-expert tensors of one fused parameter for the experts EP rank ``rank`` owns.

    Values are available (``get``) only for this process's own experts.
    """
    p = ep_param.param
    mine = rank == ep_param.offset // ep_param.n_local
    out = []
    for i in range(ep_param.n_local):
        e = rank * ep_param.n_local + i
        if ep_param.kind == "gate_up":
            inter = p.shape[1] // 2
            for j, proj in enumerate(("gate_proj", "up_proj")):
                get = (lambda i=i, j=j: p[i, j * inter : (j + 1) * inter]) if mine else None
                out.append(_HFTensor(f"{ep_param.prefix}.{e}.{proj}.weight", (inter, p.shape[2]), p.dtype, rank, get))
        else:
            get = (lambda i=i: p[i]) if mine else None
            out.append(_HFTensor(f"{ep_param.prefix}.{e}.down_proj.weight", tuple(p.shape[1:]), p.dtype, rank, get))
    return out


def _hf_tensors(model: PreTrainedModel, ep: EPContext) -> list[_HFTensor]:
    """Every tensor of the full checkpoint in write order: rank 0's non-expert tensors, then
    each rank's experts (layer, expert, gate/up/down). Identical on every rank except ``get``."""
    others, experts = _split_state(model, ep)
    out = [_HFTensor(k, tuple(v.shape), v.dtype, 0, lambda v=v: v) for k, v in others.items()]
    for rank in range(ep.size):
        by_layer: dict[str, list[_HFTensor]] = defaultdict(list)
        for ep_param in experts:
            by_layer[ep_param.prefix] += _per_expert_tensors(ep_param, rank)
        for tensors in by_layer.values():
            tensors.sort(key=lambda t: (int(t.name.split(".")[-3]), _PER_EXPERT.index(t.name.split(".")[-2])))
            out += tensors
    return out


def _plan_shards(tensors: list[_HFTensor], max_shard_bytes: int) -> list[list[_HFTensor]]:
    """Pack tensors greedily, in order, into shards of at most ``max_shard_bytes`` (a bigger
    tensor gets a shard of its own); a shard never mixes owners, so one rank writes it whole."""
    shards: list[list[_HFTensor]] = []
    size = 0
    for t in tensors:
        if not shards or shards[-1][0].owner != t.owner or size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


# ---------------------------------------------------------------- save


def _all_ok(ok: bool, ep: EPContext) -> bool:
    """True on every rank iff ``ok`` is True on every EP rank (an all-reduce MIN, which also acts
    as a barrier). Unlike a bare barrier it cannot hang when one rank failed: every rank learns."""
    if ep.size == 1 or ep.group is None:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=collective_device(ep.group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ep.group)
    return bool(flag.item())


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_policy(
    model: PreTrainedModel,
    out_dir: str | os.PathLike,
    ep: EPContext,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write the policy as a Hugging Face checkpoint directory; call on every EP rank.

    Files go into ``.<name>.partial`` beside ``out_dir`` and the directory is renamed to
    ``out_dir`` once every rank has written its shards, so ``out_dir`` never holds a partial
    checkpoint. Tensors are written in their own dtype (router weights stay float32).

    Args:
        model: a policy from `build_policy` / `load_policy` with this ``ep``.
        out_dir: the checkpoint directory to create (visible to all EP ranks).
        ep: this process's EP place.
        max_shard_bytes: upper bound of one shard file's tensor bytes (a larger tensor gets its
            own shard).
        overwrite: replace an existing ``out_dir`` (old directory moved aside, then deleted).

    Returns:
        ``Path(out_dir)``, complete on every rank when this returns.

    Raises:
        FileExistsError: ``out_dir`` exists and not ``overwrite`` (raised on every rank, nothing
            written).
        ValueError: ``max_shard_bytes`` < 1, or the model's experts do not match ``ep``.
        RuntimeError: another EP rank failed while writing (the partial directory is removed).
    """
    out_dir = Path(out_dir)
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: must be >= 1, got {max_shard_bytes}")
    if out_dir.exists() and not overwrite:
        raise FileExistsError(f"{out_dir}: already exists (pass overwrite=True to replace it)")
    shards = _plan_shards(_hf_tensors(model, ep), max_shard_bytes)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    tmp = out_dir.parent / f".{out_dir.name}.partial"

    error: BaseException | None = None
    if ep.rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # left over from a crashed save
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    if not _all_ok(error is None, ep):
        raise error or RuntimeError(f"{tmp}: EP rank 0 could not create the directory")

    try:
        for name, shard in zip(names, shards):
            if shard[0].owner == ep.rank:
                tensors = {t.name: t.get().detach().to("cpu", copy=True).contiguous() for t in shard}
                save_file(tensors, tmp / name, metadata={"format": "pt"})
                _fsync(tmp / name)
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        error = e
    if _all_ok(error is None, ep) and ep.rank == 0:
        try:
            _write_metadata(model, tmp, shards, names)
            if out_dir.exists():
                old = out_dir.parent / f".{out_dir.name}.old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(out_dir, old)
                os.replace(tmp, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, out_dir)
        except Exception as e:  # noqa: BLE001
            error = e
    if not _all_ok(error is None, ep):
        if ep.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error or RuntimeError(f"{out_dir}: another EP rank failed to write its shards")
    return out_dir


def _write_metadata(model: PreTrainedModel, tmp: Path, shards: list[list[_HFTensor]], names: list[str]) -> None:
    """Index, config.json and generation_config.json into ``tmp`` (rank 0)."""
    weight_map = {t.name: name for name, shard in zip(names, shards) for t in shard}
    total = sum(t.nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    write_metadata(model, tmp, model.get_input_embeddings().weight.dtype)
    for f in tmp.iterdir():
        _fsync(f)


def write_metadata(model: PreTrainedModel, out_dir: Path, dtype: torch.dtype) -> None:
    """config.json (naming the stock transformers class and ``dtype``, the dtype the weights are
    saved in, without any ``quantization_config``) and generation_config.json of ``model`` into
    ``out_dir``."""
    config = copy.deepcopy(model.config)
    config.architectures = [stock_architecture(model)]
    config.dtype = dtype
    data = json.loads(config.to_json_string())
    # The weights written are plain ``dtype`` tensors (an FP8 source is dequantized on read, and a
    # version is a cast of the fp32 master weights): an inherited quantization_config would make
    # stock from_pretrained refuse the directory and SGLang read bf16 tensors as FP8.
    data.pop("quantization_config", None)
    # transformers < 5 (as pinned by some SGLang releases) reads rope_theta at the top level.
    rope = data.get("rope_parameters") or {}
    if "rope_theta" in rope:
        data.setdefault("rope_theta", rope["rope_theta"])
    (out_dir / CONFIG_NAME).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)


# ---------------------------------------------------------------- load


def read_config(path: str | os.PathLike) -> PretrainedConfig:
    """Read ``<path>/config.json`` with ``AutoConfig`` (local files only).

    Raises:
        FileNotFoundError: no config.json.
        ValueError: it does not parse or names an unknown model type (message names the file).
    """
    file = Path(path) / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a policy checkpoint directory needs config.json")
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - AutoConfig raises several types
        raise ValueError(f"{file}: cannot read config: {e}") from None


@dataclass
class _Copy:
    """Read ``rows`` (None: all) of checkpoint tensor ``key`` into ``dst``."""

    key: str
    dst: torch.Tensor
    rows: tuple[int, int] | None = None


def _plan_load(model: PreTrainedModel, ep: EPContext, reader: CheckpointReader) -> list[_Copy]:
    """Match checkpoint tensors to the model's parameters, checking names and shapes of the full
    checkpoint (all experts). Returns the copies this rank needs (works on a meta model too).

    Raises:
        ValueError: a tensor is missing, unexpected, or has the wrong shape (named, with file).
    """
    config = model.config
    others, experts = _split_state(model, ep)
    copies: list[_Copy] = []
    used: set[str] = set()

    def expect(key: str, shape: tuple[int, ...]) -> None:
        if key not in reader:
            raise ValueError(
                f"{reader.path}: tensor {key} is missing from the checkpoint (config expects shape {list(shape)})"
            )
        got = reader.shape(key)
        if got != shape:
            raise ValueError(f"{reader.file(key)}: tensor {key} has shape {list(got)}, config expects {list(shape)}")
        used.add(key)

    for key, dst in others.items():
        expect(key, tuple(dst.shape))
        copies.append(_Copy(key, dst))
    for ep_param in experts:
        p, lo, hi = ep_param.param, ep_param.offset, ep_param.offset + ep_param.n_local
        fused_key = f"{ep_param.prefix}.{'gate_up_proj' if ep_param.kind == 'gate_up' else 'down_proj'}"
        if fused_key in reader:  # transformers 5 fused layout
            expect(fused_key, (ep_param.n_total, *p.shape[1:]))
            copies.append(_Copy(fused_key, p, (lo, hi)))
            continue
        for rank in range(ep.size):
            for t in _per_expert_tensors(ep_param, rank):
                expect(t.name, t.shape)
        for i in range(ep_param.n_local):
            e = lo + i
            if ep_param.kind == "gate_up":
                inter = p.shape[1] // 2
                copies.append(_Copy(f"{ep_param.prefix}.{e}.gate_proj.weight", p[i, :inter]))
                copies.append(_Copy(f"{ep_param.prefix}.{e}.up_proj.weight", p[i, inter:]))
            else:
                copies.append(_Copy(f"{ep_param.prefix}.{e}.down_proj.weight", p[i]))

    # Tolerated extras: tied lm_head, rotary caches of old exports, DeepSeek MTP layers
    # (transformers ignores these too: DeepseekV3PreTrainedModel._keys_to_ignore_on_load_unexpected).
    n_layers = config.num_hidden_layers
    n_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
    mtp = re.compile(rf"^model\.layers\.({'|'.join(str(n_layers + i) for i in range(n_mtp)) or '-'})\.")
    for key in sorted(set(reader.keys()) - used):
        if key.endswith("rotary_emb.inv_freq") or mtp.match(key):
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        raise ValueError(f"{reader.file(key)}: tensor {key} does not belong to a {config.model_type} model with this config")
    return copies


def _model_config(path: Path, ep: EPContext) -> PretrainedConfig:
    """config.json, checked for ``ep``, as the config of the model `load_policy` builds."""
    config = read_config(path)
    try:
        validate_config(config, ep.size)
    except ValueError as e:
        raise ValueError(f"{path / CONFIG_NAME}: {e}") from None
    # The model holds dequantized weights: a quantization_config would make its saved versions
    # claim an FP8 layout their tensors no longer have.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def check_checkpoint(path: str | os.PathLike, ep: EPContext | None = None) -> PretrainedConfig:
    """Every check `load_policy` makes before it reads a tensor, without loading anything:
    config.json, EP divisibility, router settings, quantization format, shards present, every
    tensor's name and shape (FP8 scales included).

    Returns:
        The checkpoint's config (without ``quantization_config``: it describes what
        `load_policy` builds, dequantized weights).

    Raises:
        FileNotFoundError, ValueError: as `load_policy` (file, field or tensor named).
    """
    path, ep = Path(path), ep or EPContext.local()
    config = _model_config(path, ep)
    with CheckpointReader(path) as reader:
        _plan_load(build_policy(config, RouterConfig(), ep, device="meta", init=False), ep, reader)
    return config


def load_policy(
    path: str | os.PathLike,
    router: RouterConfig,
    ep: EPContext,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Load a Hugging Face checkpoint directory as the policy, with this rank's experts only.

    Every check (config, EP divisibility, shards present, every tensor's name and shape) runs
    on headers and a shape-only (meta) model before any memory is allocated or tensor read.
    Tensors are read through `app.model.reader.CheckpointReader` straight into the parameters,
    converted to their dtype; block-scaled FP8 weights (the official DeepSeek-V3 checkpoint) are
    dequantized on read.

    Args:
        path: directory with config.json and ``model.safetensors`` or an index plus shards;
            per-expert (Hub) or fused (transformers 5) expert layout; unquantized or
            block-scaled FP8 (``quantization_config.quant_method == "fp8"``).
        router, ep, device, dtype: as for `build_policy`.

    Returns:
        The policy (see `build_policy`), in eval mode like ``from_pretrained``; its config has no
        ``quantization_config`` (its weights are ``dtype``).

    Raises:
        FileNotFoundError: missing config.json, weights or a shard (named).
        ValueError: bad config for ``ep.size`` or an unsupported router or quantization setting
            (field named), or a tensor missing, unexpected or of the wrong shape (tensor and
            file named).
    """
    path = Path(path)
    config = _model_config(path, ep)
    with CheckpointReader(path) as reader:
        _plan_load(build_policy(config, router, ep, device="meta", init=False), ep, reader)
        model = build_policy(config, router, ep, device=device, dtype=dtype, init=False)
        copies = _plan_load(model, ep, reader)
        with torch.no_grad():
            for c in sorted(copies, key=lambda c: str(reader.file(c.key))):  # one shard after another
                reader.read(c.key, () if c.rows is None else (slice(*c.rows),), out=c.dst)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


# ---------------------------------------------------------------- the sharded trainer's view


def local_block(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global offset, local shape)`` of a parameter: for a DTensor (FSDP2 shard,
    experts also sharded over EP) its block of the global tensor; a plain tensor is all of itself."""
    # torch.distributed.tensor: only where torch has distributed (the engine and warm-up load here too)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(t, DTensor):
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offset), tuple(shape)
    return t, (0,) * t.dim(), tuple(t.shape)


_FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def hf_pieces(name: str, shape: tuple[int, ...], offset: tuple[int, ...], block: tuple[int, ...],
              fused_in_checkpoint: bool = False) -> list[tuple[str, tuple[slice, ...], tuple[slice, ...]]]:
    """Where a block of one of our tensors lives in a Hugging Face checkpoint.

    Our expert tensors are fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H,
    I]``); the Hub stores one tensor per expert and projection (``experts.{e}.gate_proj.weight
    [I, H]``, ``up_proj [I, H]``, ``down_proj [H, I]``). Everything else maps one to one.

    Args:
        name: our parameter (or buffer) name, e.g. ``model.layers.3.mlp.experts.gate_up_proj``.
        shape: its global shape.
        offset, block: the block's global offset and shape (`local_block`).
        fused_in_checkpoint: the checkpoint stores the fused expert tensors (transformers 5's
            ``save_original_format=False``) instead of per-expert ones.

    Returns:
        ``[(hf_name, slices into the HF tensor, slices into the block)]`` covering the block.
    """
    m = _FUSED_EXPERT.match(name)
    full = tuple(slice(o, o + b) for o, b in zip(offset, block))
    if m is None or fused_in_checkpoint:
        return [(name, full, tuple(slice(0, b) for b in block))]
    prefix, kind = m.groups()
    (e0, r0, c0), (ne, nr, nc) = offset, block
    cols, dst_cols = slice(c0, c0 + nc), slice(0, nc)
    out = []
    for i in range(ne):
        e = e0 + i
        if kind == "down_proj":
            out.append((f"{prefix}.{e}.down_proj.weight", (slice(r0, r0 + nr), cols), (i, slice(0, nr), dst_cols)))
            continue
        inter = shape[1] // 2
        for j, proj in enumerate(("gate_proj", "up_proj")):
            lo, hi = max(r0, j * inter), min(r0 + nr, (j + 1) * inter)
            if lo < hi:
                out.append((f"{prefix}.{e}.{proj}.weight", (slice(lo - j * inter, hi - j * inter), cols),
                            (i, slice(lo - r0, hi - r0), dst_cols)))
    return out


@torch.no_grad()
def load_policy_shards(model: nn.Module, path: str | os.PathLike, rename: tuple[str, str] | None = None,
                       skip: tuple[str, ...] = ()) -> None:
    """Fill a sharded policy (parameters and persistent buffers materialised, e.g. after
    ``to_empty``) from a Hugging Face checkpoint directory; each rank reads only its blocks.

    Names and shapes are checked against the checkpoint headers first (all of them, before any
    tensor is read); per-expert (Hub) and fused (transformers 5) expert layouts are accepted.

    Args:
        model: the module to fill (a policy, or a critic whose ``trunk.`` is the checkpoint's ``model.``).
        path: the checkpoint directory.
        rename: ``(ours, theirs)``: a name prefix of ours that is another in the checkpoint.
        skip: name prefixes of ours that the checkpoint does not hold (left as they are).

    Raises:
        FileNotFoundError: missing weights or shard (named).
        ValueError: a tensor missing or of the wrong shape (tensor and file named).
    """
    path = Path(path)
    state = model.state_dict()
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied:
        state.pop("lm_head.weight", None)
    with CheckpointReader(path) as reader:
        plan = []
        for ours, t in state.items():
            if skip and ours.startswith(skip):
                continue
            name = ours
            if rename and ours.startswith(rename[0]):
                name = rename[1] + ours[len(rename[0]):]
            local, offset, block = local_block(t)
            fused = name in reader and _FUSED_EXPERT.match(name) is not None
            for key, src, dst in hf_pieces(name, tuple(t.shape), offset, block, fused):
                if key not in reader:
                    raise ValueError(f"{path}: tensor {key} is missing from the checkpoint")
                want = _hf_shape(name, key, tuple(t.shape), fused)
                if reader.shape(key) != want:
                    raise ValueError(f"{reader.file(key)}: tensor {key} has shape {list(reader.shape(key))}, "
                                     f"config expects {list(want)}")
                plan.append((key, src, local, dst))
        # Every check passed: now read, each block straight into its place (FP8 dequantised on read).
        for key, src, local, dst in plan:
            reader.read(key, src, dtype=local.dtype, out=local[dst])
    if tied:
        model.tie_weights()


def _hf_shape(name: str, key: str, shape: tuple[int, ...], fused: bool) -> tuple[int, ...]:
    """Shape of checkpoint tensor ``key`` that holds (part of) our tensor ``name`` of ``shape``."""
    m = _FUSED_EXPERT.match(name)
    if m is None or fused:
        return shape
    if m.group(2) == "down_proj":
        return tuple(shape[1:])
    return (shape[1] // 2, shape[2])
