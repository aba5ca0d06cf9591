"""Fused scaled-dot-product attention: every SDPA backend's forward and backward, the low-level
flash / memory-efficient ops, and gobrrr's own attention ops.

FLOPs (FlashAttention convention, as BENCHMARKS.md): forward = 2·B·Hq·Sq·Sk·(Dqk + Dv)
(= 4·B·H·S²·D), backward = 2·B·Hq·Sq·Sk·(3·Dqk + 2·Dv) (= 2.5 × forward: QKᵀ recomputed,
dP = dO·Vᵀ, dV = Pᵀ·dO, dQ = dS·K, dK = dSᵀ·Q). Causal: × 1/2 when Sq == Sk; otherwise × the
exact fraction of unmasked (query, key) pairs for the mask's alignment. FlopCounterMode never
halves for causal, so causal counts here are half of its counts.
GQA: FLOPs follow the query heads; K and V are read at their own (fewer) heads.
Bytes: q, k, v (+ bias / mask) read, out and logsumexp written; backward reads dout, q, k, v,
out, lse and writes dq, dk, dv. The Sq×Sk score matrix never reaches HBM.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from gobrrr.cost._ops_common import CostFn, OpCost, matmul_math, refs, sum_read
from gobrrr.graph.ir import OpNode


@dataclass(frozen=True)
class _Spec:
    backward: bool
    causal: tuple[int, str]  # where is_causal (or custom_mask_type) sits in the schema
    launches: int
    bshd: bool = False  # low-level ops take (B, S, H, D); SDPA ops take (B, H, S, D)
    mask_type: bool = False  # causal given as custom_mask_type: 0 none, 1 top-left, 2 bottom-right
    cum_seq: tuple[int, int] | None = None  # positions of cum_seq_q / max_q (varlen input)


# launches: forward 1; flash backward 3 (dot(dO, O) prologue, main, dq convert),
# memory-efficient backward 2 (delta prologue, main), cuDNN / CPU backward 1.
_SPECS: dict[str, _Spec] = {
    "aten._scaled_dot_product_flash_attention": _Spec(False, (4, "is_causal"), 1),
    "aten._scaled_dot_product_flash_attention_backward": _Spec(True, (11, "is_causal"), 3),
    "aten._scaled_dot_product_efficient_attention": _Spec(False, (6, "is_causal"), 1),
    "aten._scaled_dot_product_efficient_attention_backward": _Spec(True, (11, "is_causal"), 2),
    "aten._scaled_dot_product_cudnn_attention": _Spec(False, (6, "is_causal"), 1),
    "aten._scaled_dot_product_cudnn_attention_backward": _Spec(True, (14, "is_causal"), 1),
    "aten._scaled_dot_product_flash_attention_for_cpu": _Spec(False, (4, "is_causal"), 1),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": _Spec(True, (7, "is_causal"), 1),
    "aten._flash_attention_forward": _Spec(False, (8, "is_causal"), 1, True, cum_seq=(3, 5)),
    "aten._flash_attention_backward": _Spec(True, (11, "is_causal"), 3, True, cum_seq=(6, 8)),
    "aten._efficient_attention_forward": _Spec(
        False, (9, "custom_mask_type"), 1, True, True, (4, 6)
    ),
    "aten._efficient_attention_backward": _Spec(
        True, (14, "custom_mask_type"), 2, True, True, (6, 8)
    ),
    "gobrrr.attention_fwd": _Spec(False, (3, "causal"), 1),
    "gobrrr.attention_bwd": _Spec(True, (6, "causal"), 2),
}


def causal_fraction(sq: int, sk: int, bottom_right: bool = False) -> float:
    """Fraction of the Sq×Sk (query, key) pairs a causal mask keeps: 1/2 when Sq == Sk (the
    FlashAttention convention), else the exact count of unmasked pairs over Sq·Sk. Top-left
    alignment (torch's is_causal): query i sees keys j <= i; bottom-right: j <= i + Sk - Sq."""
    if sq == sk:
        return 0.5
    shift = sk - sq if bottom_right else 0
    kept = sum(min(max(i + 1 + shift, 0), sk) for i in range(sq))
    return kept / (sq * sk)


def _dims(node: OpNode, spec: _Spec, q, k, v) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Sq, Sk, Dqk, Dv) from q (.., Sq, Dqk), k (.., Sk, Dqk), v (.., Sk, Dv)."""
    if len(q.shape) == 3 and spec.cum_seq is not None:  # varlen: (total, H, D)
        cum = node.tensor(node.arg(spec.cum_seq[0], "cum_seq_q"))
        b = max(cum.numel - 1, 1) if cum is not None else 1
        sq = node.arg(spec.cum_seq[1], "max_q") or q.shape[0] // b
        sk = node.arg(spec.cum_seq[1] + 1, "max_k") or k.shape[0] // b
        return b, q.shape[1], int(sq), int(sk), q.shape[2], v.shape[2]
    if spec.bshd:  # (B, S, H, D)
        return q.shape[0], q.shape[2], q.shape[1], k.shape[1], q.shape[3], v.shape[3]
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]


def _factor(node: OpNode, spec: _Spec, sq: int, sk: int) -> float:
    flag = node.arg(*spec.causal, 0)
    if not flag:
        return 1.0
    return causal_fraction(sq, sk, bottom_right=spec.mask_type and int(flag) == 2)


def attention(node: OpNode, tf32: bool) -> OpCost:
    """Cost of a fused attention op (see the module docstring for the conventions)."""
    spec = _SPECS[_packet(node.op)]
    first = 1 if spec.backward else 0  # backward ops start with grad_out
    q, k, v = (_qkv(node, first + i, name) for i, name in enumerate(("query", "key", "value")))
    b, h, sq, sk, dqk, dv = _dims(node, spec, q, k, v)
    per_pair = 2 * (3 * dqk + 2 * dv) if spec.backward else 2 * (dqk + dv)
    flops = b * h * sq * sk * per_pair * _factor(node, spec, sq, sk)
    outs = node.outputs if spec.backward else node.outputs[:2]  # never the debug S×S mask
    nbytes = sum_read(node.inputs) + sum_read(outs)
    return OpCost(
        float(flops), float(nbytes), matmul_math(q.dtype, tf32), "attention", spec.launches
    )


#: Fused attention kernels work on (query, key) tiles of this many positions: a sequence
#: length that is not a multiple costs what the next multiple costs. Measured on an H100
#: (benchmarks/results/attention_tiles_h100.json, cuDNN, head dims 64 and 128): forward at
#: S = 192 / 197 / 256 took 15.7 / 15.7 / 14.9 µs, 320 / 384 27.2 / 29.5, 448 / 512 43.3 /
#: 39.3, 577 / 640 65.2 / 58.0; the rate over the padded lengths is smooth in S.
TILE = 128


def padded(node: OpNode) -> tuple[int | None, float]:
    """(the query length rounded up to TILE, the factor the kernel's time grows by for the
    padding of both the query and the key lengths) of a fused attention op; (None, 1.0)
    for an op this module does not cost."""
    spec = _SPECS.get(_packet(node.op))
    if spec is None:
        return None, 1.0
    first = 1 if spec.backward else 0
    q, k, v = (_qkv(node, first + i, name) for i, name in enumerate(("query", "key", "value")))
    _, _, sq, sk, _, _ = _dims(node, spec, q, k, v)
    pq, pk = -(-sq // TILE) * TILE, -(-sk // TILE) * TILE
    return pq, (pq / max(sq, 1)) * (pk / max(sk, 1))


#: Head dims the calibration's attention variants are measured at.
VARIANT_HEAD_DIMS = (64, 128)


def variant(node: OpNode) -> str | None:
    """The kernel variant an attention op runs, as the calibration keys it:
    "<mask>[+dropout]:d<head dim>", mask one of "causal", "mask" (an attention bias / mask
    tensor), "full" (neither); the head dim is the nearest of VARIANT_HEAD_DIMS. The fused
    kernels' speed differs by these: a causal kernel skips masked tiles, a bias is read per
    tile, dropout draws a random number per (query, key) pair in forward and again in
    backward. None for an op this module does not cost."""
    spec = _SPECS.get(_packet(node.op))
    if spec is None:
        return None
    first = 1 if spec.backward else 0
    q = _qkv(node, first, "query")
    causal = bool(node.arg(*spec.causal, 0))
    bias = _named(node, "attn_bias")
    if bias is None:
        bias = _named(node, "bias")
    mask = "causal" if causal else ("mask" if node.tensor(bias) is not None else "full")
    p = _named(node, "dropout_p") or 0.0
    d = min(VARIANT_HEAD_DIMS, key=lambda h: abs(h - q.shape[-1]))
    return f"{mask}{'+dropout' if p else ''}:d{d}"


def _named(node: OpNode, name: str):
    """The argument `name` of the op's ATen schema, wherever it was passed (None if the op
    has no such argument or it was left at its default)."""
    i = _arg_index(node.op, name)
    return None if i is None else node.arg(i, name)


@functools.cache
def _arg_index(op: str, name: str) -> int | None:
    ns, packet, overload = (op.split(".") + ["default"])[:3]
    try:
        schema = getattr(getattr(getattr(torch.ops, ns), packet), overload)._schema
    except (AttributeError, RuntimeError):
        return None
    names = [a.name for a in schema.arguments]
    return names.index(name) if name in names else None


def _qkv(node: OpNode, i: int, name: str):
    """q/k/v by position, or by keyword under aten's ("query") or gobrrr's ("q") name."""
    ts = refs(node, node.arg(i, name, node.kwargs.get(name[0])))
    return ts[0]


def _packet(op: str) -> str:
    return ".".join(op.split(".")[:2])


COSTS: dict[str, CostFn] = {name: attention for name in _SPECS}
