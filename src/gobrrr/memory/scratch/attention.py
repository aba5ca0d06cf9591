"""What fused attention kernels allocate inside the call, beyond their outputs.

The trace sees an attention op's outputs (the meta kernels give CUDA's shapes); buffers the
kernel allocates and frees within the call go through PyTorch's caching allocator and count in
`max_memory_allocated`, so the memory model adds them while the op runs. Measured on an H100
(torch 2.11, cuDNN 9.19) in `tests/fixtures/sdpa_backends_h100.json`, checked by
`tests/test_sdpa.py`:

- cuDNN forward: nothing. cuDNN backward: dQ accumulated in fp32 and the row terms
  (4 x B x Hq x Sq x (D + 1) bytes, plus 256) in one block, seen request by request in the
  allocator traces of the zoo's steps (`tests/fixtures/zoo_diagnose_h100.json`: ViT-B/16 at
  S=197, Whisper at Sq=1500 and 128, exact to the byte); with grouped-query attention (fewer
  KV heads than query heads) it computes dK and dV at the query heads in fp32 and sums them
  after instead: 2 x 4 bytes x B x Hq x Sk x D.
- memory-efficient (CUTLASS) backward: its row terms (delta, 4 bytes x B x Hq x Sq) and its
  workspace, dQ accumulated across key blocks in fp32 per 64-query block and 64 head columns
  with a 4-float lock each (`_efficient_workspace`), in fp32 as in 16-bit: BERT-base in fp32
  (B=16, H=12, S=512, D=64) requests 25,190,400 bytes in the allocator trace of its step
  (`zoo_diagnose_h100.json`), the formula's figure.
- FlashAttention-2 backward (taken before cuDNN on GPUs older than Hopper; not measured
  here, from its source, flash_api.cpp `mha_bwd`): dQ accumulated in fp32 at
  (B, Sq rounded up to 128, H, D rounded up to 32, or 64 past 128) and softmax_d
  (B, H, Sq rounded to 128) in fp32; with grouped-query attention dK and dV expanded to the
  query heads in the input dtype.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import targ
from gobrrr.graph.ir import OpNode, StepGraph

_CUDNN_BWD = "aten._scaled_dot_product_cudnn_attention_backward"
_EFFICIENT_BWD = "aten._scaled_dot_product_efficient_attention_backward"
_FLASH_BWD = "aten._scaled_dot_product_flash_attention_backward"


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


def _efficient_workspace(b: int, h: int, sq: int, d: int) -> int:
    """The CUTLASS backward's workspace (kernel_backward.h `workspace_size`): per batch and
    head, dQ accumulated per 64-query block and 64-column slice of the head dim
    (`GradQTempStorage`: 64 x 64 floats and a 4-float lock), rounded to 4 floats."""
    per_bh = _round(-(-sq // 64) * -(-d // 64) * (64 * 64 + 4), 4)
    return 4 * b * h * per_bh


def op_scratch(node: OpNode) -> int:
    """Bytes an attention op allocates and frees inside itself (0 for other ops)."""
    name = node.op.rsplit(".", 1)[0]
    if name not in (_CUDNN_BWD, _EFFICIENT_BWD, _FLASH_BWD):
        return 0
    q, k = targ(node, 1, "query"), targ(node, 2, "key")
    if q is None or k is None or len(q.shape) != 4 or len(k.shape) != 4:
        return 0
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if name == _CUDNN_BWD:
        return 2 * 4 * b * hq * sk * d if hk != hq else 4 * b * hq * sq * (d + 1) + 256
    if name == _EFFICIENT_BWD:
        return _efficient_workspace(b, hq, sq, d) + 4 * b * hq * sq
    sq_r = _round(sq, 128)
    dq_accum = 4 * b * sq_r * hq * _round(d, 32 if d <= 128 else 64)
    expanded = 2 * b * sk * hq * d * q.itemsize if hk != hq else 0
    return dq_accum + 4 * b * hq * sq_r + expanded


def scratch(graph: StepGraph) -> dict[int, int]:
    """{op index: bytes} for the attention ops of `graph` that allocate inside the call."""
    out = {}
    for node in graph.nodes:
        n = op_scratch(node)
        if n:
            out[node.index] = n
    return out
