"""Bytes a decoder layer keeps for backward, per micro-batch, term by term.

Each term is a tensor that autograd saves (``ctx.save_for_backward`` or a view that keeps its
storage alive) in transformers' ``Qwen3MoeDecoderLayer`` / ``DeepseekV3DecoderLayer`` with moerl's
MoE block (app/model/moe.py, experts.py, dispatch/) on the CUDA path, bf16 compute:

- RMSNorm (``Qwen3MoeRMSNorm`` / ``DeepseekV3RMSNorm``): ``x.to(float32)`` (fp32 copy, saved by
  ``pow`` and the multiply), ``rsqrt`` [T, 1] fp32, and the normalized ``x.to(bf16)`` (saved by the
  weight multiply); its output is saved only by a consumer that needs it (a linear layer).
- Rotary embeddings save only ``cos``/``sin`` (shared by all layers: a root term), because the
  multiplied tensors do not need them for the gradient of q and k.
- SDPA on an H200 (torch 2.11) runs cuDNN attention (``ScaledDotProductCudnnAttentionBackward0``):
  it saves q, k, v, its output and the fp32 softmax statistics [B, heads, S, 1]; no [S, S] matrix.
  With a padding mask (the trainer passes ``attention_mask``), transformers' ``sdpa_attention_forward``
  does not use ``enable_gqa`` (``use_gqa_in_sdpa`` needs ``attention_mask is None``), so Qwen3's 4
  kv heads are repeated to 32 (``repeat_kv``) before SDPA saves them, and SDPA converts the boolean
  [B, 1, S, S] mask into the query dtype in every layer and saves that copy.
- Qwen3's query comes out of the rotary multiply with [B, S, H, D] strides, so SDPA's output keeps
  them and ``reshape(...).contiguous()`` before ``o_proj`` is a view; DeepSeek-V3's query is a fresh
  ``torch.cat`` ([B, H, S, D]), so the output is [B, H, S, D] and the reshape copies it.
- DeepSeek-V3's value is a slice of ``kv_b_proj``'s output [T, heads, nope + v]: saving it keeps
  the whole output alive.
- The router keeps its weight in fp32, so `app.model.router.router_logits` takes the fp32 path and
  ``F.linear(x.float(), w)`` saves an fp32 copy of its input; softmax/sigmoid save the [T, E] scores.
- Dispatch saves the rows [N, H] its grouped GEMM reads (N = T*K rows on this rank when routing is
  balanced), their gate weights [N] fp32, and holds the row maps (int64) on its autograd context;
  the experts save gate_up [N, 2I] and the activation [N, I] (the fused SwiGLU kernel saves only
  gate_up and the weights); the down projection's and the combine's outputs are not saved.

Measured on one H200 (torch 2.11, transformers 5.17, bf16, 2 x 4096 tokens with a padding mask,
2 layers, saved-tensor hooks deduplicated by storage, checked live with weak references):
Qwen3-30B-A3B MoE layer 1444.7 MB saved, these terms 1442.6 MB (without the row maps, which
live on the autograd context where the hooks do not see them); DeepSeek-V3 dense layer 4233.2 MB
against 4232.2 MB, MoE layer 5152.2 MB against 5148.3 MB (all within 0.2 %).
tests/test_plan.py repeats the check on CPU at small widths.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from app.model.config import is_moe_layer
from app.plan.params import dense_intermediate, shared_intermediate
from app.plan.term import Term, total

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one trainer rank.

    Attributes:
        seqs: B, whole sequences of the micro-batch.
        seq_len: S, padded tokens per sequence.
        expert_rows: N, rows this rank's local experts receive per MoE layer (T*K when balanced).
        compute_bytes: bytes per element of the compute dtype (2 for bf16).
        padding_mask: whether the model gets an ``attention_mask`` (see the module docstring).
        backend: the resolved dispatcher (``local``, ``alltoall``, ``deepep``): what selective
            checkpointing keeps and the dispatch transients depend on it.
        top_k: K, experts per token (for `sent_rows`).
    """

    seqs: int
    seq_len: int
    expert_rows: int
    compute_bytes: int = 2
    padding_mask: bool = True
    backend: str = "local"
    top_k: int | None = None

    @property
    def tokens(self) -> int:
        """T = B * S."""
        return self.seqs * self.seq_len

    @property
    def sent_rows(self) -> int:
        """S = T*K, the (token, expert) rows this rank sends out (all of them, imbalance or not);
        ``expert_rows`` when ``top_k`` is not given (EP 1: every row stays)."""
        return self.tokens * self.top_k if self.top_k is not None else self.expert_rows


def _norm(name: str, t: int, width: int, b: int) -> list[Term]:
    """An RMSNorm over [t, width]: fp32 copy, normalized copy in the compute dtype, rsqrt [t] fp32."""
    return [Term(f"{name}: fp32 copy + normalized + rsqrt [T, {width}]", (FP32 + b) * t * width + FP32 * t,
                 f"({FP32}+{b})*{t}*{width} + {FP32}*{t}")]


def _mask(mb: MicroBatch) -> list[Term]:
    if not mb.padding_mask:
        return []
    b, s = mb.compute_bytes, mb.seq_len
    return [Term("attention mask [B, 1, S, S] converted to the compute dtype (per layer)",
                 b * mb.seqs * s * s, f"{b}*{mb.seqs}*{s}*{s}")]


def attention_terms(config: PretrainedConfig, mb: MicroBatch) -> list[Term]:
    """Saved tensors of the input RMSNorm and self-attention of one layer."""
    t, b, h = mb.tokens, mb.compute_bytes, config.hidden_size
    nh = config.num_attention_heads
    out = _norm("input RMSNorm", t, h, b)
    out.append(Term("attention input (input RMSNorm output) [T, H]", b * t * h, f"{b}*{t}*{h}"))
    if config.model_type == "qwen3_moe":
        hd, nkv = config.head_dim, config.num_key_value_heads
        kvh = nh if (mb.padding_mask and nkv != nh) else nkv
        out += [
            Term(f"q_norm: fp32 copy + normalized + rsqrt [T, {nh}, {hd}]",
                 (FP32 + b) * t * nh * hd + FP32 * t * nh, f"({FP32}+{b})*{t}*{nh}*{hd} + {FP32}*{t}*{nh}"),
            Term(f"k_norm: fp32 copy + normalized + rsqrt [T, {nkv}, {hd}]",
                 (FP32 + b) * t * nkv * hd + FP32 * t * nkv, f"({FP32}+{b})*{t}*{nkv}*{hd} + {FP32}*{t}*{nkv}"),
            Term(f"SDPA query [T, {nh}, {hd}]", b * t * nh * hd, f"{b}*{t}*{nh}*{hd}"),
            Term(f"SDPA key + value [T, {kvh}, {hd}]" + (" (repeated: a mask disables enable_gqa)" if kvh != nkv else ""),
                 2 * b * t * kvh * hd, f"2*{b}*{t}*{kvh}*{hd}"),
            Term(f"SDPA output [T, {nh}, {hd}] (also o_proj's input)", b * t * nh * hd, f"{b}*{t}*{nh}*{hd}"),
            Term(f"SDPA softmax stats [T, {nh}] fp32", FP32 * t * nh, f"{FP32}*{t}*{nh}"),
        ]
    else:
        nope, rope, vd = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        qk, qr, kvr = nope + rope, config.q_lora_rank, config.kv_lora_rank
        if qr is not None:
            out += _norm("q_a_layernorm", t, qr, b)
            out.append(Term(f"q_b_proj input [T, {qr}]", b * t * qr, f"{b}*{t}*{qr}"))
        out += _norm("kv_a_layernorm", t, kvr, b)
        out += [
            Term(f"kv_b_proj input [T, {kvr}]", b * t * kvr, f"{b}*{t}*{kvr}"),
            Term(f"SDPA query + key [T, {nh}, {qk}]", 2 * b * t * nh * qk, f"2*{b}*{t}*{nh}*{qk}"),
            Term(f"SDPA value: kv_b_proj output [T, {nh}, {nope + vd}] kept by the value slice",
                 b * t * nh * (nope + vd), f"{b}*{t}*{nh}*{nope + vd}"),
            Term(f"SDPA output [T, {nh}, {vd}]", b * t * nh * vd, f"{b}*{t}*{nh}*{vd}"),
            Term(f"o_proj input: contiguous copy of the output [T, {nh * vd}]", b * t * nh * vd, f"{b}*{t}*{nh * vd}"),
            Term(f"SDPA softmax stats [T, {nh}] fp32", FP32 * t * nh, f"{FP32}*{t}*{nh}"),
        ]
    out += _mask(mb)
    return out


def ffn_terms(config: PretrainedConfig, layer: int, mb: MicroBatch) -> list[Term]:
    """Saved tensors of the post-attention RMSNorm and the MLP or MoE block of one layer."""
    t, b, h = mb.tokens, mb.compute_bytes, config.hidden_size
    out = _norm("post-attention RMSNorm", t, h, b)
    if not is_moe_layer(config, layer):
        i = dense_intermediate(config)
        return out + [
            Term("MLP input (post-attention RMSNorm output) [T, H]", b * t * h, f"{b}*{t}*{h}"),
            Term(f"MLP gate, up, silu(gate), product [T, {i}]", 4 * b * t * i, f"4*{b}*{t}*{i}"),
        ]
    e, k, i, n = _experts(config), config.num_experts_per_tok, config.moe_intermediate_size, mb.expert_rows
    out += [
        Term("router input fp32 copy [T, H] (router weight stays fp32)", FP32 * t * h, f"{FP32}*{t}*{h}"),
        Term(f"router scores [T, {e}] fp32", FP32 * t * e, f"{FP32}*{t}*{e}"),
    ]
    # Qwen3: topk saves its ids, the renormalization the weights and their sums. DeepSeek-V3's
    # gather of the weights also saves a validity mask (bool [T, K]).
    mask_bytes = t * k if config.model_type == "deepseek_v3" else 0
    out += [
        Term(f"top-k ids int64 + weights fp32 [T, {k}], sums [T]" + (", valid bool [T, K]" if mask_bytes else ""),
             (INT64 + FP32) * t * k + FP32 * t + mask_bytes,
             f"({INT64}+{FP32})*{t}*{k} + {FP32}*{t}" + (f" + {mask_bytes}" if mask_bytes else "")),
        Term(f"dispatched rows [N, H], N = {n}", b * n * h, f"{b}*{n}*{h}"),
        Term("row gate weights [N] fp32 and their gather index int64 [N], valid bool [T*K]; row maps "
             "int64 [N], [N], [T+1] (on the autograd context)", FP32 * n + INT64 * n + t * k + INT64 * (2 * n + t + 1),
             f"{FP32}*{n} + {INT64}*{n} + {t * k} + {INT64}*(2*{n}+{t}+1)"),
        Term(f"experts gate_up [N, {2 * i}]", b * n * 2 * i, f"{b}*{n}*{2 * i}"),
        Term(f"experts activation [N, {i}]", b * n * i, f"{b}*{n}*{i}"),
    ]
    si = shared_intermediate(config)
    if si:
        out += [
            Term("shared experts input (post-attention RMSNorm output) [T, H]", b * t * h, f"{b}*{t}*{h}"),
            Term(f"shared experts gate, up, silu(gate), product [T, {si}]", 4 * b * t * si, f"4*{b}*{t}*{si}"),
        ]
    return out


def _experts(config: PretrainedConfig) -> int:
    return config.num_experts if config.model_type == "qwen3_moe" else config.n_routed_experts


def layer_terms(config: PretrainedConfig, layer: int, mb: MicroBatch) -> list[Term]:
    """Everything decoder layer ``layer`` saves for backward when it is not checkpointed."""
    return attention_terms(config, mb) + ffn_terms(config, layer, mb)


def layer_saved(config: PretrainedConfig, layer: int, mb: MicroBatch) -> int:
    """Bytes of `layer_terms`."""
    return total(layer_terms(config, layer, mb))


def checkpoint_kept(config: PretrainedConfig, layer: int, mb: MicroBatch, mode: str) -> int:
    """Bytes a checkpointed layer keeps between its forward and its backward.

    ``full``: its input [T, H]. ``selective``: also, for a MoE layer on the ``alltoall``
    dispatcher, the outputs of its three exchanges, which app/model/dispatch/alltoall.py keeps
    for the recompute (app/model/dispatch/exchange_cache.py): the received rows [N, H] and their
    gate weights [N] fp32 (dispatch) and the rows received back [S, H] (combine, before the
    per-token sum; S = T*K). The ``local`` and ``deepep`` dispatchers keep nothing, so selective
    is full checkpointing there.
    """
    t, b, h = mb.tokens, mb.compute_bytes, config.hidden_size
    kept = b * t * h
    if mode == "selective" and is_moe_layer(config, layer) and mb.backend == "alltoall":
        kept += b * mb.expert_rows * h + FP32 * mb.expert_rows + b * mb.sent_rows * h
    return kept


def recompute_bytes(config: PretrainedConfig, layer: int, mb: MicroBatch, mode: str) -> int:
    """Bytes the recomputed forward of a checkpointed layer materializes in its backward (beyond
    what `checkpoint_kept` already holds): every tensor the layer saves, in both modes (a
    selective recompute replays the kept exchanges but regroups the received rows again, a new
    [N, H] copy that the experts save)."""
    return layer_saved(config, layer, mb)


def dispatch_forward(config: PretrainedConfig, layer: int, mb: MicroBatch) -> Term:
    """Transient tensors of one MoE layer's combine in the forward (or in a checkpointed layer's
    recompute), beyond the layer's saved tensors; the largest moment of dispatch + combine.

    From the code (app/model/moe.py ``MoEBlock.forward``, app/model/dispatch/): the experts'
    output y [N, H] is alive (the block's local) while the combine runs;
      ``local``:    unpermute sums y into the output [T, H]:                     b*H*(N + T)
      ``alltoall``: y regrouped by source rank [N, H] (a local of ``combine``), the exchange
                    back [S, H], its per-token sum [T, H]:                       b*H*(2N + S + T)
      ``deepep``:   unpermute to received tokens [<= N, H], DeepEP's combined [T, H]:
                                                                                 b*H*(2N + T)
    (dispatch's own transients, the send rows [S, H] and received rows [N, H] beside the
    regrouped copy, are smaller and gone by then). N: the busiest EP rank's received rows.
    """
    if not is_moe_layer(config, layer):
        return Term("dispatch/combine transients (dense layer: none)", 0, "0")
    b, h, t, n, s = mb.compute_bytes, config.hidden_size, mb.tokens, mb.expert_rows, mb.sent_rows
    rows = {"local": n + t, "alltoall": 2 * n + s + t, "deepep": 2 * n + t}[mb.backend]
    what = {"local": "N + T", "alltoall": "2N + S + T", "deepep": "2N + T"}[mb.backend]
    return Term(f"combine forward transients ({mb.backend}: expert output, regrouped/sent-back rows, token sums)",
                b * h * rows, f"{b}*{h}*({what}) with N={n}, S={s}, T={t}")


def dispatch_backward(config: PretrainedConfig, layer: int, mb: MicroBatch) -> Term:
    """Transient gradient rows of one MoE layer's combine backward (the first op of its backward,
    when all of the layer's saved tensors are still alive), beyond the residual gradient [T, H]:
      ``local``:    the gathered row gradient [N, H]:                            b*H*N
      ``alltoall``: the gathered rows to send [S, H] and the received [N, H] (the exchange's
                    input and output), then the received and its regrouped copy: b*H*(N + max(S, N))
      ``deepep``:   DeepEP's received token gradients [<= N, H] and their row gather [N, H]:
                                                                                 b*H*2N
    """
    if not is_moe_layer(config, layer):
        return Term("dispatch/combine backward transients (dense layer: none)", 0, "0")
    b, h, n, s = mb.compute_bytes, config.hidden_size, mb.expert_rows, mb.sent_rows
    rows = {"local": n, "alltoall": n + max(s, n), "deepep": 2 * n}[mb.backend]
    what = {"local": "N", "alltoall": "N + max(S, N)", "deepep": "2N"}[mb.backend]
    return Term(f"combine backward transients ({mb.backend}: row gradients sent and received)",
                b * h * rows, f"{b}*{h}*({what}) with N={n}, S={s}")


def backward_transient(config: PretrainedConfig, layer: int, mb: MicroBatch) -> int:
    """Activation gradients alive at the peak of one layer's backward, beyond its saved tensors
    and its parameter gradients (which the FSDP unit terms count).

    MoE layer (from the op order of `GroupedExperts` backward): when the gate_up GEMM's backward
    writes the row gradient [N, H], the gate_up gradient [N, 2I] is alive and the activation
    [N, I] and gate_up [N, 2I] have been freed: ``b * N * (H - I)`` net (Qwen3-30B-A3B at 2 x 4096
    tokens: 168 MB predicted, 168 MB measured on the H200 above the layer's start minus its expert
    gradients). Dense MLP: one [T, I] gradient (DeepSeek-V3: 302 MB predicted, 183 MB measured).
    Attention's q/k/v gradients come after the FFN's saved tensors are freed and only count
    where they exceed them.
    """
    t, b, h = mb.tokens, mb.compute_bytes, config.hidden_size
    if is_moe_layer(config, layer):
        ffn = b * mb.expert_rows * max(h - config.moe_intermediate_size, 0)
    else:
        ffn = b * t * dense_intermediate(config)
    qkv = total([x for x in attention_terms(config, mb) if x.name.startswith("SDPA query") or
                 x.name.startswith("SDPA key") or x.name.startswith("SDPA value")])
    return max(ffn, qkv - total(ffn_terms(config, layer, mb)))


def root_terms(config: PretrainedConfig, mb: MicroBatch) -> list[Term]:
    """Saved tensors outside the decoder layers, per micro-batch (the LM head's chunks apart).

    The scored rows are the trunk outputs of completion tokens that `chunked_logprobs` keeps as
    its input; all T tokens are counted (an upper bound: the prompt share is not known here).
    """
    t, b, h, s = mb.tokens, mb.compute_bytes, config.hidden_size, mb.seq_len
    rot = config.head_dim if config.model_type == "qwen3_moe" else config.qk_rope_head_dim
    return [
        Term("input ids int64 [T]", INT64 * t, f"{INT64}*{t}"),
        Term(f"rotary cos, sin [S, {rot}] (shared by all layers)", 2 * b * s * rot, f"2*{b}*{s}*{rot}"),
        *_norm("final RMSNorm", t, h, b),
        Term("trunk output [T, H]", b * t * h, f"{b}*{t}*{h}"),
        Term("scored rows: LM-head input [T, H] + logsumexp [T] fp32", b * t * h + FP32 * t,
             f"{b}*{t}*{h} + {FP32}*{t}"),
    ]


def _chunks(rows: int, chunk: int) -> list[int]:
    """The sizes of the chunks of ``rows`` rows that the peaks below need: the first two and the
    last. Every later full chunk repeats the second's (previous, this) pair, so listing them all
    (10**15 rows are 2.4 x 10**11 chunks of 4096) changes no maximum and would not end."""
    full, rest = divmod(rows, chunk)
    return [chunk] * min(full, 2) + ([rest] if rest else []) or [0]


def logprob_forward(config: PretrainedConfig, chunk: int, entropy: bool, rows: int | None = None,
                    compute_bytes: int = 2, fused: bool = True) -> Term:
    """Peak of the chunked LM head + log-softmax forward (`app.model.logprobs.chunked_logprobs`)
    over ``rows`` scored rows (default: one chunk), beyond its inputs.

    ``fused`` (the Triton passes, app/model/logit_kernels.py; CUDA): per chunk the GEMM's output
    z [c, V] in the compute dtype and `logit_stats`'s three fp32 [c] results, while the previous
    chunk's results (2, with entropy 3, fp32 [c]) are still bound and the outputs logp and lse
    [rows] (and the entropy [rows]) fp32 exist: ``b*c*V + 12*c + 4*c_prev*(2 + e) + 4*rows*(2 + e)``.
    No fp32 [c, V] block is made. Checked exactly on CPU through Triton's interpreter
    (tests/test_plan.py).

    Torch path (not ``fused``): the previous chunk's fp32 logits [C, V] are still referenced while
    the next chunk's bf16 GEMM output and its fp32 copy are made, 10 bytes per element; with
    entropy, ``exp(z - lse)`` and ``p * z`` add two fp32 [C, V], 16 bytes. Measured on the H200 with
    C = 4096: 6.224 GB (Qwen3, 622.3 M elements) and 5.295 GB (DeepSeek-V3, 529.5 M) without
    entropy, 9.957 and 8.473 GB with it: 10.0 and 16.0 bytes per element.
    """
    v = config.vocab_size
    if not fused:
        per = 16 if entropy else 10
        return Term(f"LM-head chunk forward, torch ops [C={chunk}, V={v}] ({per} B/elem"
                    f"{', with entropy' if entropy else ''})", per * chunk * v, f"{per}*{chunk}*{v}")
    rows = chunk if rows is None else rows
    b, e = compute_bytes, int(entropy)
    sizes = _chunks(rows, chunk)
    peak = max(b * c * v + 12 * c + 4 * (sizes[i - 1] if i else 0) * (2 + e) for i, c in enumerate(sizes))
    peak += 4 * rows * (2 + e)
    return Term(f"LM-head chunk forward, Triton [C={chunk}, V={v}]: z in the compute dtype, no fp32 block",
                peak, f"{b}*{sizes[0]}*{v} + fp32 row stats ({rows} rows)")


def logprob_backward(config: PretrainedConfig, chunk: int, tokens: int, compute_bytes: int,
                     fused: bool = True) -> Term:
    """Peak of the chunked backward over ``tokens`` scored rows, beyond its inputs and saved
    tensors: the row gradient [rows, H] (compute dtype) and the fp32 LM-head weight-gradient
    accumulator [V, H] throughout, plus the largest of

      ``fused`` (`logit_grad`, the Triton pass): while chunk i's kernel runs, the previous chunk's
      dz [c, V] is still bound and chunk i's z and dz [c, V] (compute dtype) exist: 3 blocks of
      ``b`` bytes per element once a second chunk runs (2 for one chunk); when ``dz.T @ h`` makes
      the chunk's [V, H] weight gradient in the compute dtype beside dz; at the end, the last dz
      and the bf16 copy of the accumulator [V, H]. An entropy output the loss does not use gets
      no gradient (app/model/logprobs.py does not materialise zeros for it). Checked exactly on
      CPU through Triton's interpreter (tests/test_plan.py).

      torch path: two chunks' logits (8 bytes per [C, V] element: the previous bf16 gradient and
      the next recomputed bf16 and fp32 logits). Fitted to the H200 measurement (C = 4096, 16384
      rows): 6.325 GB Qwen3 (formula 6.29), 8.179 GB DeepSeek-V3 (formula 8.17).
    """
    v, h, b = config.vocab_size, config.hidden_size, compute_bytes
    base = FP32 * v * h + b * tokens * h
    if not fused:
        return Term("LM-head chunk backward, torch ops: logits 8 B/elem [C, V] + fp32 weight grad [V, H] "
                    "+ row grads [T, H]", 8 * chunk * v + base, f"8*{chunk}*{v} + {FP32}*{v}*{h} + {b}*{tokens}*{h}")
    sizes = _chunks(tokens, chunk)
    kernel = max(b * v * ((sizes[i - 1] if i else 0) + 2 * c) for i, c in enumerate(sizes))
    weight_grad = max(b * c * v + b * v * h for c in sizes)
    peak = base + max(kernel, weight_grad)
    return Term(f"LM-head chunk backward, Triton [C={chunk}, V={v}]: dz, z, dz in the compute dtype + fp32 "
                f"weight grad [V, H] + row grads [T, H]", peak,
                f"{FP32}*{v}*{h} + {b}*{tokens}*{h} + max({kernel:,}, {weight_grad:,})")
