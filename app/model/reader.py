"""Read slices of a Hugging Face safetensors checkpoint, dequantizing block-scaled FP8 on read.

A checkpoint directory holds ``model.safetensors``, or ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file) plus the shards it names, as transformers'
``save_pretrained`` writes them (docs: "Sharded checkpoints"). `CheckpointReader` checks the
index against the shard headers when it opens the directory (no tensor data is read) and then
reads any rectangle of any tensor with safetensors' ``get_slice``, so a rank that owns a few
experts, or one FSDP shard of a weight, reads only those bytes.

FP8 checkpoints (the official DeepSeek-V3 release, README_WEIGHTS.md of deepseek-ai/DeepSeek-V3):
config.json carries ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}``; a quantized weight ``W``
[M, N] is stored as ``float8_e4m3fn`` next to a float32 ``W_scale_inv`` of shape
[ceil(M / 128), ceil(N / 128)], one scale per 128 x 128 block, the last block row and column
partial when M or N is not a multiple of 128 (e.g. ``kv_a_proj_with_mqa`` [576, 7168]). The
weight is ``W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128]``, computed in float32: the
definition of DeepSeek's ``inference/kernel.py`` ``weight_dequant`` (its Triton kernel loads the
fp8 block as float32 and multiplies by the block's scale, masking the partial edge blocks) and of
transformers' FP8 integration (``integrations/finegrained_fp8.py``: ``_dequantize_fp8_weight``
repeats the scales over 128-row blocks, crops them to M rows and multiplies column blocks,
the remainder block included). transformers' load-time ``Fp8Dequantize`` (``dequantize=True``)
derives the block from the scale grid instead (rows // scale rows), which agrees only where each
dim is a multiple of the block or within one block: in transformers 5.24 it refuses a [576, 256]
weight with its [5, 2] scales, and dequantizes [24, 64] in 16 x 16 blocks with 12-row blocks.
The reader applies the definition transparently: ``read`` returns dequantized values, ``keys`` hides the
``*_scale_inv`` companions, and a slice read touches only the scale rows and columns of the
blocks it overlaps.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
# A dtype conversion (or a copy into a caller's tensor) goes through this many bytes of source
# data at a time, so it never holds a second copy of a large slice.
CHUNK_BYTES = 64 * 1024**2


@dataclass(frozen=True)
class Fp8Format:
    """Block-scaled FP8 of config.json's ``quantization_config``: ``block`` = (rows, cols)."""

    block: tuple[int, int]


def read_quantization(path: Path) -> Fp8Format | None:
    """The block-scaled FP8 format that ``path/config.json`` declares, or None (no
    ``quantization_config``, or no config.json at all).

    Raises:
        ValueError: config.json does not parse, or its quantization_config is not the
            block-scaled FP8 that DeepSeek-V3 uses (quant_method 'fp8', fmt 'e4m3', activation_scheme
            'dynamic', weight_block_size [rows, cols]); the message names the file and field.
    """
    file = path / CONFIG_NAME
    if not file.is_file():
        return None
    try:
        quant = json.loads(file.read_text()).get("quantization_config")
    except (ValueError, AttributeError) as e:
        raise ValueError(f"{file}: not a valid JSON object ({e})") from None
    if quant is None:
        return None
    where = f"{file}: quantization_config"
    if not isinstance(quant, dict):
        raise ValueError(f"{where} must be an object, got {quant!r}")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ValueError(
            f"{where}.quant_method {method!r} is not supported; moerl reads unquantized checkpoints "
            f"and block-scaled 'fp8' ones (DeepSeek-V3)"
        )
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}.fmt {quant['fmt']!r} is not supported; expected 'e4m3' (float8_e4m3fn)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(
            f"{where}.activation_scheme {quant['activation_scheme']!r} is not supported; expected 'dynamic' "
            f"(static activation scales are an inference setting the trainer cannot use)"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(
            f"{where}.weight_block_size must be [rows, cols] of positive integers (block-scaled FP8), got {block!r}"
        )
    return Fp8Format(block=(block[0], block[1]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Entry:
    file: Path
    shape: tuple[int, ...]
    stored: torch.dtype  # dtype in the file
    scale: str | None = None  # key of the FP8 scale_inv companion


class CheckpointReader:
    """Random access to the tensors of a safetensors checkpoint directory.

    Opening reads config.json's ``quantization_config``, the index and every shard header (no
    tensor data) and checks them: every shard the index names exists and holds the tensors the
    index puts there, no tensor is in two shards, every ``float8_e4m3fn`` tensor has a float32
    ``<key>_scale_inv`` of shape [ceil(M / block_rows), ceil(N / block_cols)] and config.json
    declares the format. A directory whose config.json still carries a quantization_config but
    holds no FP8 tensor (as DeepSeek's ``fp8_cast_bf16.py`` leaves it) reads as unquantized.

    Use as a context manager (or call `close`); shard files are opened once, on first read.

    Raises (on open):
        FileNotFoundError: no index and no model.safetensors, or a shard named in the index is
            missing (file named).
        ValueError: the index does not parse, a shard is unreadable, a tensor is missing from
            the shard the index names or present in two shards, an FP8 tensor lacks its scale or
            has one of the wrong shape or dtype, a scale has no FP8 weight, or config.json's
            quantization_config is unsupported (file and tensor or field named).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.fp8 = read_quantization(self.path)
        self._entries = _read_headers(self.path)
        scales = self._pair_fp8_scales()
        self._public = {k: e for k, e in self._entries.items() if k not in scales}
        self._files = ExitStack()
        self._handles: dict[Path, object] = {}

    # -- lifecycle

    def close(self) -> None:
        """Close the shard files opened so far."""
        self._handles.clear()
        self._files.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what is there

    def keys(self) -> list[str]:
        """Sorted tensor names, without the ``*_scale_inv`` companions of FP8 weights."""
        return sorted(self._public)

    def __contains__(self, key: str) -> bool:
        return key in self._public

    def shape(self, key: str) -> tuple[int, ...]:
        """Shape of tensor ``key`` (for an FP8 weight: of the dequantized weight, the same)."""
        return self._entry(key).shape

    def dtype(self, key: str) -> torch.dtype:
        """The dtype `read` returns without ``dtype``: the stored dtype, or float32 for an FP8
        weight (dequantization computes fp8 x fp32 scale in float32)."""
        e = self._entry(key)
        return torch.float32 if e.scale else e.stored

    def quantized(self, key: str) -> bool:
        """Whether ``key`` is stored as block-scaled FP8 (dequantized on read)."""
        return self._entry(key).scale is not None

    def file(self, key: str) -> Path:
        """The shard file holding ``key`` (for messages that name it)."""
        return self._entry(key).file

    # -- reading

    def read(
        self,
        key: str,
        index: tuple[slice, ...] = (),
        dtype: torch.dtype | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read ``tensor[index]``, dequantized if it is FP8, in ``dtype``.

        Only the elements asked for are read from the file (safetensors ``get_slice``); a dtype
        conversion or a copy into ``out`` goes in chunks of at most `CHUNK_BYTES` of source data
        along dim 0, and an FP8 read one block row at a time (the fp8 rows, their float32
        product and the few scales of those blocks), so besides the result the reader holds at
        most one chunk or one block row.

        Args:
            key: tensor name (see `keys`).
            index: up to ``ndim`` slices with step 1, for dims 0, 1, ...; missing dims are whole.
                E.g. ``(slice(e0, e1),)`` for one EP rank's experts of a fused [E, 2I, H] tensor,
                ``(slice(r0, r1), slice(c0, c1))`` for a rectangle of a 2-D weight (an FP8 slice
                may start and end anywhere, mid-block included).
            dtype: result dtype; default `dtype(key)`; ignored if ``out`` is given.
            out: a tensor of the slice's shape (any dtype and device) to read into; returned.

        Returns:
            A new CPU tensor of the slice's shape in ``dtype`` (or ``out``).

        Raises:
            KeyError: no tensor ``key`` (a ``*_scale_inv`` companion is not a tensor here).
            ValueError: ``index`` is not a tuple of at most ``ndim`` slices with step 1, or
                ``out`` has the wrong shape (tensor named).
        """
        e = self._entry(key)
        bounds = _bounds(key, e.shape, index)
        shape = tuple(hi - lo for lo, hi in bounds)
        if out is not None:
            if tuple(out.shape) != shape:
                raise ValueError(f"{key}: out has shape {list(out.shape)}, the slice has {list(shape)}")
        elif e.scale is None and dtype in (None, e.stored):
            return self._slice(e.file, key)[_as_slices(bounds)]  # exactly the slice, nothing more
        else:
            out = torch.empty(shape, dtype=dtype or self.dtype(key))
        if out.numel() == 0:
            return out
        if e.scale is None:
            self._copy_plain(e, key, bounds, out)
        else:
            self._copy_fp8(e, key, bounds, out)
        return out

    def _copy_plain(self, e: _Entry, key: str, bounds: list[tuple[int, int]], out: torch.Tensor) -> None:
        sl = self._slice(e.file, key)
        if len(bounds) == 0:
            out.copy_(sl[...])
            return
        rest = _as_slices(bounds[1:])
        row_bytes = out[0].numel() * e.stored.itemsize
        step = max(1, CHUNK_BYTES // max(1, row_bytes))
        (r0, r1) = bounds[0]
        for lo in range(r0, r1, step):
            hi = min(r1, lo + step)
            out[lo - r0 : hi - r0].copy_(sl[(slice(lo, hi), *rest)])

    def _copy_fp8(self, e: _Entry, key: str, bounds: list[tuple[int, int]], out: torch.Tensor) -> None:
        (r0, r1), (c0, c1) = bounds
        bm, bn = self.fp8.block
        b0, b1 = r0 // bm, _cdiv(r1, bm)  # block rows and block columns this slice overlaps
        k0, k1 = c0 // bn, _cdiv(c1, bn)
        scales = self._slice(self._entries[e.scale].file, e.scale)[b0:b1, k0:k1].float()  # [b1-b0, k1-k0]
        col_block = torch.arange(c0, c1) // bn - k0  # block column of each requested column
        weight = self._slice(e.file, key)
        for b in range(b0, b1):
            lo, hi = max(r0, b * bm), min(r1, (b + 1) * bm)
            rows = weight[lo:hi, c0:c1].to(torch.float32)
            rows.mul_(scales[b - b0, col_block])
            out[lo - r0 : hi - r0].copy_(rows)

    # -- internals

    def _entry(self, key: str) -> _Entry:
        try:
            return self._public[key]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {key!r} in the checkpoint") from None

    def _slice(self, file: Path, key: str):
        handle = self._handles.get(file)
        if handle is None:
            handle = self._files.enter_context(safe_open(file, framework="pt", device="cpu"))
            self._handles[file] = handle
        return handle.get_slice(key)

    def _pair_fp8_scales(self) -> set[str]:
        """Check every FP8 weight against its scale, record the pair; returns the scale keys."""
        entries = self._entries
        scales = {k for k in entries if k.endswith(SCALE_SUFFIX)}
        fp8_keys = [k for k, e in entries.items() if e.stored == torch.float8_e4m3fn]
        for key, e in entries.items():
            if e.stored.is_floating_point and e.stored.itemsize == 1 and e.stored != torch.float8_e4m3fn:
                raise ValueError(f"{e.file}: tensor {key} is {e.stored}; only float8_e4m3fn (fmt e4m3) is supported")
        for key in fp8_keys:
            e = entries[key]
            if self.fp8 is None:
                raise ValueError(
                    f"{e.file}: tensor {key} is float8_e4m3fn but {self.path / CONFIG_NAME} declares no "
                    f"quantization_config (its block size is unknown)"
                )
            scale_key = key + SCALE_SUFFIX
            if scale_key not in entries:
                raise ValueError(f"{e.file}: tensor {key} is float8_e4m3fn but {scale_key} is missing")
            s = entries[scale_key]
            if len(e.shape) != 2:
                raise ValueError(
                    f"{e.file}: tensor {key} is float8_e4m3fn with shape {list(e.shape)}; only 2-D block-scaled "
                    f"weights are supported"
                )
            bm, bn = self.fp8.block
            want = (_cdiv(e.shape[0], bm), _cdiv(e.shape[1], bn))
            if s.shape != want:
                raise ValueError(
                    f"{s.file}: tensor {scale_key} has shape {list(s.shape)}; weight {key} {list(e.shape)} in "
                    f"{bm}x{bn} blocks needs {list(want)}"
                )
            if s.stored != torch.float32:
                raise ValueError(f"{s.file}: tensor {scale_key} is {s.stored}; FP8 block scales must be float32")
            e.scale = scale_key
        used = {entries[k].scale for k in fp8_keys}
        orphans = sorted(scales - used)
        if orphans:
            key = orphans[0]
            raise ValueError(
                f"{entries[key].file}: tensor {key} is a block scale but {key[: -len(SCALE_SUFFIX)]} is not a "
                f"float8_e4m3fn weight"
            )
        return used


def _bounds(key: str, shape: tuple[int, ...], index: tuple[slice, ...]) -> list[tuple[int, int]]:
    """[(start, stop)] per dim of ``shape`` for ``index`` (Python slice rules, step 1)."""
    if not isinstance(index, tuple) or len(index) > len(shape) or not all(isinstance(s, slice) for s in index):
        raise ValueError(f"{key}: index must be a tuple of at most {len(shape)} slices, got {index!r}")
    out = []
    for dim, size in enumerate(shape):
        s = index[dim] if dim < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"{key}: index {index!r} has a step; only contiguous ranges are read")
        out.append((start, max(start, stop)))
    return out


def _as_slices(bounds: list[tuple[int, int]]) -> tuple[slice, ...]:
    return tuple(slice(lo, hi) for lo, hi in bounds) if bounds else (...,)


# safetensors' dtype names (the format's header "dtype" field, huggingface/safetensors README).
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _read_headers(path: Path) -> dict[str, _Entry]:
    """Tensor name -> (shard file, shape, stored dtype) from the index (or the single file) and
    shard headers.

    Raises:
        FileNotFoundError: no weights file, or a shard named in the index is missing.
        ValueError: the index does not parse, names a tensor its shard does not hold, or a
            tensor is in two shards.
    """
    index_file, single = path / INDEX_NAME, path / SINGLE_NAME
    if index_file.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index_file.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index_file}: not a valid safetensors index ({e})") from None
    elif single.is_file():
        weight_map, files = {}, [SINGLE_NAME]
    else:
        raise FileNotFoundError(f"{path}: no {INDEX_NAME} and no {SINGLE_NAME}")
    for name in files:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name}: shard listed in {INDEX_NAME} is missing")
    entries: dict[str, _Entry] = {}
    for name in files:
        file = path / name
        try:
            with safe_open(file, framework="pt") as f:
                found = {}
                for key in f.keys():
                    sl = f.get_slice(key)
                    found[key] = (tuple(sl.get_shape()), sl.get_dtype())
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
        for key, (shape, name) in found.items():
            if name not in _DTYPES:
                raise ValueError(f"{file}: tensor {key} has dtype {name}, which moerl does not read")
            if key in entries:
                raise ValueError(f"{file}: tensor {key} is also in {entries[key].file.name}")
            entries[key] = _Entry(file, shape, _DTYPES[name])
    for key, name in weight_map.items():
        if key not in entries or entries[key].file.name != name:
            raise ValueError(f"{path / name}: tensor {key} is listed in {INDEX_NAME} but not in this shard")
    return entries
