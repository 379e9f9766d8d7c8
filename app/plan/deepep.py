"""GPU memory of DeepEP's communication buffer, as ``ElasticBuffer`` sizes it (the arithmetic only).

moerl's DeepEP dispatcher (app/model/dispatch/deepep.py) builds one ``deep_ep.ElasticBuffer`` per
process from ``ElasticBuffer.get_buffer_size_hint(group, num_max_tokens_per_rank, hidden,
num_topk)``, with ``num_max_tokens_per_rank`` the EP group's largest token count rounded up to a
power of two. Sources, sgl-deep-ep==0.1.2.post1 (the wheel the GPU images install; deep_ep 2.1.0):

- ``deep_ep/buffers/elastic.py:381-406``: the hint is ``_C.calculate_elastic_buffer_size(...)``
  with ``use_fp8_dispatch=False, allow_hybrid_mode=True, allow_multiple_reduction=True``;
  ``elastic.py:302-309``: the constructor takes the same number when no ``num_bytes`` is given.
- ``deep_ep/include/deep_ep/common/layout.cuh:179-208`` (``TokenLayout``): a token occupies
  ``align32(hidden bytes) + align32(scale bytes) + align32(metadata bytes)`` where metadata is
  ``topk * (4 + 4)`` (int32 expert id, fp32 weight) plus ``(1 + topk) * 4`` source indices when
  the layout carries them (dispatch does, combine does not); ``layout.cuh:251-281``
  (``BufferLayout``): a buffer is ``ranks * tokens * token bytes``; ``layout.cuh:43-80``
  (``WorkspaceLayout::get_num_bytes``): the fixed control workspace.
- The C++ of ``_C`` is compiled into the wheel; its source is deepseek-ai/DeepEP at dd758ca, whose
  ``deep_ep/`` Python and headers match the wheel's: ``csrc/elastic/buffer.hpp:586-614``
  (dispatch size), ``:616-650`` (combine size), ``:652-681`` (the hint: the larger of the two,
  aligned to 2 MiB), ``:57-59`` (``kNumMaxChannels = 8 * 160``), ``:102-110`` (the constructor
  adds the workspace, aligned to 2 MiB); ``csrc/kernels/backend/nccl.cu:49-60`` (topology:
  ``num_nvl_ranks`` = ranks sharing NVLink, ``num_rdma_ranks`` = group / that; hybrid mode
  scales out over RDMA ranks and up over NVLink ranks); ``csrc/kernels/elastic/dispatch.hpp:136``
  and ``combine.hpp:109`` (the two token layouts).
"""

from __future__ import annotations

ALIGN_TMA = 32  # ptx::kNumTMAAlignBytes, deep_ep/include/deep_ep/common/ptx.cuh:16
ALIGN_BUFFER = 2 * 1024 * 1024  # symmetric::kNumAlignmentBytes (csrc/kernels/backend/symmetric.hpp:16)
MAX_CHANNELS = 8 * 160  # ElasticBuffer::kNumMaxChannels (csrc/elastic/buffer.hpp:57-59)
# WorkspaceLayout constants (deep_ep/include/deep_ep/common/layout.cuh:19-24, compiled.cuh:83)
_WS_RANKS, _WS_EXPERTS, _WS_CHANNELS, _WS_AGRS = 1024, 2048, 1024, 32


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


def token_bytes(hidden_bytes: int, topk: int, with_metadata: bool, scale_bytes: int = 0) -> int:
    """Bytes of one token slot in a DeepEP buffer (``TokenLayout::get_num_bytes<false>``)."""
    metadata = topk * (4 + 4) + ((1 + topk) * 4 if with_metadata else 0)
    return _align(hidden_bytes, ALIGN_TMA) + _align(scale_bytes, ALIGN_TMA) + _align(metadata, ALIGN_TMA)


def workspace_bytes() -> int:
    """``WorkspaceLayout::get_num_bytes()`` aligned to 2 MiB: the control words the buffer adds."""
    r, e, c, a = _WS_RANKS, _WS_EXPERTS, _WS_CHANNELS, _WS_AGRS
    n = 16 + (r + e) * 8 + r * 8 * 2 + e * 8 * 2 + r * 4 + r * 4 * 2 + e * 4 * 2 + r * c * 8 + r * c * 4 + 2 * 2 * 8
    n += (a + 1) * r * 4
    return _align(n, ALIGN_BUFFER)


def elastic_buffer_bytes(ep: int, gpus_per_node: int, max_tokens: int, hidden: int, topk: int,
                         hidden_bytes_per_elem: int = 2) -> int:
    """``ElasticBuffer.get_buffer_size_hint`` for a bf16, hybrid-mode, multiple-reduction buffer.

    Args:
        ep: ranks in the EP group.
        gpus_per_node: GPUs joined by NVLink; the EP group's ranks are contiguous, so
            ``min(ep, gpus_per_node)`` of them share a node (the NVLink domain).
        max_tokens: ``num_max_tokens_per_rank`` (moerl rounds the group's largest count up to a
            power of two before asking).
        hidden: hidden size H.
        topk: experts per token K (0 means 32, as DeepEP does).
        hidden_bytes_per_elem: 2 (bf16 dispatch; FP8 dispatch is not used by moerl).

    Returns:
        Bytes of the buffer, without the workspace (`workspace_bytes`), 2 MiB-aligned.

    Raises:
        ValueError: arguments out of range, or ranks that do not fill whole NVLink domains.
    """
    if ep < 1 or gpus_per_node < 1 or max_tokens < 1 or hidden < 1 or topk < 0:
        raise ValueError(f"DeepEP buffer: bad arguments ep={ep} gpus_per_node={gpus_per_node} "
                         f"max_tokens={max_tokens} hidden={hidden} topk={topk}")
    topk = topk or 32
    nvl = min(ep, gpus_per_node)
    if ep % nvl:
        raise ValueError(f"DeepEP buffer: ep={ep} ranks do not fill NVLink domains of {nvl} GPUs")
    scaleout, scaleup = ep // nvl, nvl  # hybrid mode: (RDMA ranks, NVLink ranks)
    hb = hidden * hidden_bytes_per_elem
    tok_d = token_bytes(hb, topk, with_metadata=True)
    tok_c = token_bytes(hidden * 2, topk, with_metadata=False)  # combine is always bf16
    if scaleout == 1:  # direct: everything over NVLink, so no send buffer
        dispatch = ep * max_tokens * tok_d
        combine = min(ep, topk) * max_tokens * tok_c
    else:  # hybrid: scale-up receive, scale-out send and receive
        dispatch = (scaleup * scaleout * max_tokens * tok_d
                    + 1 * max_tokens * tok_d
                    + scaleout * (max_tokens + MAX_CHANNELS) * tok_d)
        combine = (min(scaleup, topk) * scaleout * max_tokens * tok_c
                   + min(scaleout, topk) * max_tokens * tok_c
                   + 1 * scaleout * (max_tokens + MAX_CHANNELS) * tok_c)
    return _align(max(dispatch, combine), ALIGN_BUFFER)


def max_tokens_per_rank(tokens: int) -> int:
    """The token count moerl's DeepEP dispatcher asks a buffer for: the next power of two."""
    return 1 << max(tokens - 1, 0).bit_length()
