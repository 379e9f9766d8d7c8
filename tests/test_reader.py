"""app.model.reader: slice reads of safetensors checkpoints, block-scaled FP8 dequantized on read,
and an FP8 DeepSeek-V3 checkpoint loaded through load_policy.

FP8 checkpoints here are made the way DeepSeek made theirs (inference/kernel.py `weight_quant`:
per block, s = max|W| / 448, q = float8_e4m3fn(W / s), stored with s as `W_scale_inv`) from an
fp32 reference whose blocks differ in magnitude by up to 4^5, so a scale applied to the wrong
block is off by a factor >= 4.

Two checks per read:
- exact: the reader equals transformers' own dequantization (`_dequantize_fp8_weight`, the one
  its FP8 backward uses; it handles edge blocks by repeating and cropping the scales) in float32,
  bit for bit: both compute float32(fp8) * float32 scale once per element.
- precision: |read - W| <= 2^-4 |W| + 2^-10 s (+ 1e-6 |W| float32 rounding), per element with s
  its block's scale. e4m3 has 3 mantissa bits, so rounding to nearest is within 2^-4 relative for
  normal values; below its smallest normal (2^-6) the spacing is 2^-9, an absolute error of at
  most 2^-10 in units of the scale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

import app.model.reader as reader_mod
from app.config import RouterConfig
from app.model.checkpoint import load_policy, save_policy
from app.model.config import tiny_config
from app.model.parallel import EPContext
from app.model.reader import INDEX_NAME, CheckpointReader

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's weight_quant: w [M, N] -> (fp8 [M, N], fp32 scale_inv [ceil(M/bm), ceil(N/bn)])."""
    bm, bn = block
    m, n = w.shape
    q = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // bm), -(-n // bn))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].float()
            s[i, j] = blk.abs().max() / 448.0
            q[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def block_scaled_reference(m: int, n: int, block: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """fp32 [m, n] whose (i, j) block has magnitude 4^((i + 2j) % 6) / 100."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, n, generator=g)
    rows = torch.arange(m)[:, None] // block[0]
    cols = torch.arange(n)[None, :] // block[1]
    return w * (4.0 ** ((rows + 2 * cols) % 6)) / 100


def fp8_bound(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    per_elem = s.repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)[:, : w.shape[1]]
    return 2**-4 * w.abs() + 2**-10 * per_elem + 1e-6 * w.abs()


class SliceLog:
    """Wraps reader_mod.safe_open; records (key, index) of every data read through get_slice."""

    def __init__(self, real):
        self.real, self.reads = real, []

    def __call__(self, *args, **kwargs):
        log, handle = self.reads, self.real(*args, **kwargs)

        class Handle:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_slice(self, key):
                s = handle.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return s.get_shape()

                    def get_dtype(self):
                        return s.get_dtype()

                    def __getitem__(self, item):
                        log.append((key, item))
                        return s[item]

                return Slice()

        handle.__enter__()
        return Handle()


@pytest.fixture
def slice_log(monkeypatch):
    log = SliceLog(reader_mod.safe_open)
    monkeypatch.setattr(reader_mod, "safe_open", log)
    return log


def write_sharded(directory: Path, shards: dict[str, dict[str, torch.Tensor]], config: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, directory / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


# ---------------------------------------------------------------- unquantized


@pytest.fixture
def plain(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {
        "a": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b": torch.randn(4, 6, 3, generator=g),
        "c": torch.arange(9, dtype=torch.int64),
        "d": torch.tensor(2.5),
    }
    directory = write_sharded(tmp_path / "plain", {"s1.safetensors": {"a": tensors["a"], "d": tensors["d"]},
                                                   "s2.safetensors": {"b": tensors["b"], "c": tensors["c"]}})
    return directory, tensors


def test_plain_keys_shapes_dtypes_and_slices(plain, slice_log):
    directory, ref = plain
    with CheckpointReader(directory) as r:
        assert r.keys() == ["a", "b", "c", "d"]
        assert r.shape("b") == (4, 6, 3) and r.dtype("a") == torch.bfloat16 and r.dtype("c") == torch.int64
        assert r.file("b") == directory / "s2.safetensors" and not r.quantized("a")
        for key, index in [("a", ()), ("a", (slice(2, 5),)), ("a", (slice(None), slice(1, 3))),
                           ("a", (slice(-3, None), slice(4, 5))), ("b", (slice(1, 3),)),
                           ("b", (slice(0, 4), slice(5, 6))), ("c", (slice(3, 7),)), ("d", ()),
                           ("a", (slice(3, 3),))]:
            got = r.read(key, index)
            assert got.dtype == ref[key].dtype and torch.equal(got, ref[key][index]), (key, index)
        # Asked-for rows and columns only: safetensors is handed exactly the slice.
        assert slice_log.reads[1] == ("a", (slice(2, 5), slice(0, 5)))
        # dtype conversion, and reading into a caller's tensor (e.g. a parameter's rows).
        torch.testing.assert_close(r.read("a", (slice(1, 6),), dtype=torch.float32),
                                   ref["a"][1:6].float(), atol=0, rtol=0)
        dst = torch.zeros(10, 6, 3, dtype=torch.bfloat16)
        assert r.read("b", (slice(1, 4),), out=dst[5:8]).data_ptr() == dst[5:8].data_ptr()
        assert torch.equal(dst[5:8], ref["b"][1:4].bfloat16()) and not dst[:5].any() and not dst[8:].any()


def test_conversion_goes_in_chunks(plain, slice_log, monkeypatch):
    directory, ref = plain
    monkeypatch.setattr(reader_mod, "CHUNK_BYTES", 2 * 6 * 3 * 4)  # two rows of b[i] per chunk
    with CheckpointReader(directory) as r:
        got = r.read("b", (), dtype=torch.float64)
    assert torch.equal(got, ref["b"].double())
    assert [item for key, item in slice_log.reads if key == "b"] == [
        (slice(0, 2), slice(0, 6), slice(0, 3)), (slice(2, 4), slice(0, 6), slice(0, 3))]


def test_bad_index_out_and_key(plain):
    directory, _ = plain
    with CheckpointReader(directory) as r:
        with pytest.raises(ValueError, match=r"a: index must be a tuple of at most 2 slices"):
            r.read("a", (slice(0, 1), slice(0, 1), slice(0, 1)))
        with pytest.raises(ValueError, match=r"a: index must be a tuple"):
            r.read("a", (1,))
        with pytest.raises(ValueError, match=r"a: index .* has a step"):
            r.read("a", (slice(0, 6, 2),))
        with pytest.raises(ValueError, match=r"a: out has shape \[2, 5\], the slice has \[3, 5\]"):
            r.read("a", (slice(0, 3),), out=torch.empty(2, 5))
        with pytest.raises(KeyError, match="no tensor 'zz'"):
            r.read("zz")


def test_tensor_in_two_shards_and_bad_index_file(tmp_path):
    directory = write_sharded(tmp_path / "dup", {"s1.safetensors": {"x": torch.ones(2), "y": torch.ones(1)},
                                                 "s2.safetensors": {"x": torch.ones(2)}})
    with pytest.raises(ValueError, match=r"s2\.safetensors: tensor x is also in s1\.safetensors"):
        CheckpointReader(directory)
    (directory / INDEX_NAME).write_text('{"weight_map": 3}')
    with pytest.raises(ValueError, match=rf"{INDEX_NAME}: not a valid safetensors index"):
        CheckpointReader(directory)


# ---------------------------------------------------------------- FP8


BLOCK = (128, 128)
M, N = 300, 200  # 3 x 2 blocks, the last row block 44 rows and the last column block 72 wide


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    """A checkpoint with one FP8 weight (its scale in another shard) and a bf16 tensor."""
    w = block_scaled_reference(M, N, BLOCK)
    q, s = quantize(w, BLOCK)
    directory = write_sharded(
        tmp_path_factory.mktemp("fp8") / "ckpt",
        {"model-1.safetensors": {"layer.weight": q, "norm.weight": torch.ones(N, dtype=torch.bfloat16)},
         "model-2.safetensors": {"layer.weight_scale_inv": s}},
        config={"model_type": "deepseek_v3", "quantization_config": FP8_CONFIG},
    )
    return directory, w, q, s


SLICES = [
    (),  # whole
    (slice(100, 260), slice(50, 190)),  # starts and ends mid-block in both dims
    (slice(129, 130),),  # one row inside the second block row
    (slice(256, 300), slice(128, 200)),  # the partial corner block exactly
    (slice(5, 20), slice(3, 9)),  # inside one block
    (slice(None), slice(127, 129)),  # two columns straddling a block edge
]


@pytest.mark.parametrize("index", SLICES, ids=[str(i) for i in range(len(SLICES))])
def test_fp8_slice_is_the_dequantized_weight(fp8_dir, slice_log, index):
    directory, w, q, s = fp8_dir
    oracle = _dequantize_fp8_weight(q, s, list(BLOCK), torch.float32)
    with CheckpointReader(directory) as r:
        assert r.keys() == ["layer.weight", "norm.weight"]  # the scale is hidden
        assert r.quantized("layer.weight") and r.dtype("layer.weight") == torch.float32
        assert r.shape("layer.weight") == (M, N)
        got = r.read("layer.weight", index)
        bf16 = r.read("layer.weight", index, dtype=torch.bfloat16)
    assert got.dtype == torch.float32 and torch.equal(got, oracle[index])
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, oracle[index].bfloat16())
    ref = w[index]
    assert ((got - ref).abs() <= fp8_bound(w, s, BLOCK)[index]).all()
    assert (got - ref).abs().max() > 0  # it really went through fp8

    # Only the scales of the overlapped blocks, and the weight one block row at a time.
    rows = index[0] if index else slice(None)
    cols = index[1] if len(index) > 1 else slice(None)
    r0, r1, _ = rows.indices(M)
    c0, c1, _ = cols.indices(N)
    scale_reads = [item for key, item in slice_log.reads if key == "layer.weight_scale_inv"]
    assert scale_reads == [(slice(r0 // 128, -(-r1 // 128)), slice(c0 // 128, -(-c1 // 128)))] * 2
    weight_reads = [item for key, item in slice_log.reads if key == "layer.weight"][: len(range(r0 // 128, -(-r1 // 128)))]
    expected = [(slice(max(r0, b * 128), min(r1, (b + 1) * 128)), slice(c0, c1)) for b in range(r0 // 128, -(-r1 // 128))]
    assert weight_reads == expected


def test_fp8_read_into_parameter_rows(fp8_dir):
    directory, _, q, s = fp8_dir
    oracle = _dequantize_fp8_weight(q, s, list(BLOCK), torch.float32)
    dst = torch.zeros(2, M, N, dtype=torch.bfloat16)
    with CheckpointReader(directory) as r:
        r.read("layer.weight", out=dst[1])
    assert torch.equal(dst[1], oracle.bfloat16()) and not dst[0].any()


def _fp8_variant(tmp_path, fp8_dir, config=..., drop=(), extra=None, scale=None) -> Path:
    src, _, q, s = fp8_dir
    tensors = {"layer.weight": q, "norm.weight": torch.ones(N, dtype=torch.bfloat16),
               "layer.weight_scale_inv": s if scale is None else scale}
    tensors.update(extra or {})
    for k in drop:
        tensors.pop(k)
    directory = tmp_path / "v"
    directory.mkdir()
    save_file(tensors, directory / "model.safetensors")
    cfg = {"model_type": "deepseek_v3", "quantization_config": FP8_CONFIG} if config is ... else config
    if cfg is not None:
        (directory / "config.json").write_text(json.dumps(cfg))
    return directory


QUANT = "quantization_config"
BAD_FP8 = {
    "no-scale": (dict(drop=["layer.weight_scale_inv"]),
                 r"model\.safetensors: tensor layer\.weight is float8_e4m3fn but layer\.weight_scale_inv is missing"),
    "scale-shape": (dict(scale=torch.ones(2, 2)),
                    r"tensor layer\.weight_scale_inv has shape \[2, 2\]; weight layer\.weight \[300, 200\] in "
                    r"128x128 blocks needs \[3, 2\]"),
    "scale-dtype": (dict(scale=torch.ones(3, 2, dtype=torch.bfloat16)),
                    r"tensor layer\.weight_scale_inv is torch\.bfloat16; FP8 block scales must be float32"),
    "orphan-scale": (dict(extra={"norm.weight_scale_inv": torch.ones(2)}),
                     r"tensor norm\.weight_scale_inv is a block scale but norm\.weight is not a float8_e4m3fn weight"),
    "no-quant-config": (dict(config={"model_type": "deepseek_v3"}),
                        r"tensor layer\.weight is float8_e4m3fn but .*config\.json declares no quantization_config"),
    "no-config-json": (dict(config=None), r"declares no quantization_config"),
    "awq": (dict(config={QUANT: {"quant_method": "awq", "bits": 4}}),
            r"config\.json: quantization_config\.quant_method 'awq' is not supported"),
    "e5m2-fmt": (dict(config={QUANT: {**FP8_CONFIG, "fmt": "e5m2"}}),
                 r"config\.json: quantization_config\.fmt 'e5m2' is not supported"),
    "static": (dict(config={QUANT: {**FP8_CONFIG, "activation_scheme": "static"}}),
               r"quantization_config\.activation_scheme 'static' is not supported"),
    "no-block": (dict(config={QUANT: {**FP8_CONFIG, "weight_block_size": None}}),
                 r"quantization_config\.weight_block_size must be \[rows, cols\]"),
    "e5m2-tensor": (dict(extra={"e5.weight": torch.ones(2, 2).to(torch.float8_e5m2)}),
                    r"tensor e5\.weight is torch\.float8_e5m2; only float8_e4m3fn"),
    "3d": (dict(extra={"x.weight": torch.ones(2, 2, 2).to(torch.float8_e4m3fn), "x.weight_scale_inv": torch.ones(1, 1, 1)}),
           r"tensor x\.weight is float8_e4m3fn with shape \[2, 2, 2\]; only 2-D"),
}


@pytest.mark.parametrize("variant, message", BAD_FP8.values(), ids=BAD_FP8.keys())
def test_fp8_bad_input_names_file_and_tensor(tmp_path, fp8_dir, variant, message):
    with pytest.raises(ValueError, match=message):
        CheckpointReader(_fp8_variant(tmp_path, fp8_dir, **variant))


def test_quantization_config_without_fp8_tensors_reads_plain(tmp_path, fp8_dir):
    """DeepSeek's fp8_cast_bf16.py writes bf16 weights and leaves config.json as it was."""
    directory = _fp8_variant(tmp_path, fp8_dir, drop=["layer.weight", "layer.weight_scale_inv"])
    with CheckpointReader(directory) as r:
        assert r.keys() == ["norm.weight"] and not r.quantized("norm.weight")


# ---------------------------------------------------------------- an FP8 DeepSeek-V3 through load_policy


def _quantized_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The weights DeepSeek-V3's release stores in FP8: every linear projection (attention, dense
    MLP, shared and routed experts), not the embedding, LM head, norms or router."""
    return [k for k, v in tensors.items() if v.ndim == 2 and re.search(r"_proj(_with_mqa)?\.weight$", k)]


def _fp8_deepseek(tmp_path: Path, block: tuple[int, int]) -> tuple[Path, dict[str, torch.Tensor], object]:
    """A stock tiny DeepSeek-V3 saved, then quantized like the official release; returns the FP8
    directory, transformers' dequantization of each FP8 weight, and the fp32 stock model."""
    torch.manual_seed(5)
    stock = AutoModelForCausalLM.from_config(tiny_config("tiny-deepseek-v3")).eval()
    stock.save_pretrained(tmp_path / "ref")
    tensors = {}
    for f in (tmp_path / "ref").glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    weights, scales, oracle = {}, {}, {}
    for k, v in tensors.items():
        if k in _quantized_names(tensors):
            q, s = quantize(v, block)
            weights[k], scales[k + "_scale_inv"] = q, s
            oracle[k] = _dequantize_fp8_weight(q, s, list(block), torch.float32)
        else:
            weights[k] = v
    config = json.loads((tmp_path / "ref" / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "weight_block_size": list(block)}
    # Real values of DeepSeek-V3's config.json that transformers passes through as attributes.
    config.update(scoring_func="sigmoid", topk_method="noaux_tc")
    names = sorted(weights)
    half = len(names) // 2
    directory = write_sharded(tmp_path / "fp8", {
        "model-00001-of-00003.safetensors": {k: weights[k] for k in names[:half]},
        "model-00002-of-00003.safetensors": {k: weights[k] for k in names[half:]},
        "model-00003-of-00003.safetensors": scales,
    }, config=config)
    return directory, oracle, stock


def test_fp8_deepseek_v3_loads_dequantized(tmp_path):
    # 16 x 16 blocks: every projection of the tiny model has several, with partial edge blocks
    # (kv_a_proj_with_mqa is [24, 64]; the experts' down_proj [64, 32]).
    directory, oracle, stock = _fp8_deepseek(tmp_path, (16, 16))
    assert any(s % 16 for k in oracle for s in oracle[k].shape)
    ours = load_policy(directory, RouterConfig(), EPContext.local())
    state = ours.state_dict()
    for k, v in oracle.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if m is None:
            got = state[k]
        else:
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            inter = state[f"{prefix}.down_proj"].shape[2]
            got = {"gate": state[f"{prefix}.gate_up_proj"][e, :inter], "up": state[f"{prefix}.gate_up_proj"][e, inter:],
                   "down": state[f"{prefix}.down_proj"][e]}[kind]
        assert torch.equal(got, v), k
    stock_state = stock.state_dict()
    assert torch.equal(state["model.embed_tokens.weight"], stock_state["model.embed_tokens.weight"])  # not quantized
    assert not hasattr(ours.config, "quantization_config")

    bf16 = load_policy(directory, RouterConfig(), EPContext.local(), dtype=torch.bfloat16)
    assert torch.equal(bf16.model.layers[0].self_attn.kv_a_proj_with_mqa.weight,
                       oracle["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].bfloat16())

    # What it publishes is an ordinary (unquantized) checkpoint that stock transformers loads.
    out = save_policy(ours, tmp_path / "published", EPContext.local())
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    back = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, ours(ids).logits, atol=1e-5, rtol=0)


def test_fp8_deepseek_v3_matches_stock_transformers_fp8_load(tmp_path):
    """At DeepSeek-V3's own 128 x 128 blocks (one block per tiny weight, where transformers'
    load-time dequantization, which takes the block size from the scale grid, is exact), our
    load gives the logits of ``from_pretrained(quantization_config=FineGrainedFP8Config(dequantize=True))``.
    atol 1e-5: the two models sum the same fp32 products in a different order (test_checkpoint.py)."""
    directory, _, stock = _fp8_deepseek(tmp_path, BLOCK)
    theirs = AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32).eval()
    ours = load_policy(directory, RouterConfig(), EPContext.local())
    ids = torch.randint(4, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = theirs(ids).logits
        torch.testing.assert_close(ours(ids).logits, ref, atol=1e-5, rtol=0)
        # and FP8 moved them away from the fp32 model's (the quantization is real)
        assert (stock(ids).logits - ref).abs().max() > 1e-3
