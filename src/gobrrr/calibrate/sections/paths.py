"""Calibration of memory-bound kernels by the path they take and the shape they run at.

- `path_bandwidths`: TensorIterator's elementwise kernels by path (`cost.shapes.elementwise_path`):
  the same bytes move at different rates through the vectorized kernel, the unrolled kernel
  that casts each element (a bf16 -> fp32 copy, bf16 + fp32), and the generic kernel that
  computes every operand's offset (broadcasts, transposes), and that kernel again when it
  also casts each operand (a broadcast with dtypes that differ). Measured over sizes, each case's
  path checked with the cost model's own classifier on the recorded op, bytes counted as the
  cost model counts them. Also torch's `_foreach_*` list kernels (the optimizer's) over the
  bytes of the lists, at a transformer's parameter shapes.
- `softmax_grid`: log-softmax and softmax, forward and backward, over the row width and the
  rows, per dtype: a row that fits on chip is read once, a wider one (a 128k vocabulary in
  fp32) more than once, so one point cannot stand for every width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from gobrrr.calibrate.sections.shapes import kernel_latency
from gobrrr.calibrate.sections.step import _record
from gobrrr.calibrate.timing import flush_buffer, time_op
from gobrrr.cost.flops import op_cost
from gobrrr.cost.shapes import elementwise_path

PATH_ELEMENTS = tuple(2**k for k in range(14, 29, 2))  # 16K .. 256M output elements
SOFTMAX_WIDTHS = (256, 1024, 4096, 32768, 50257, 128256)
SOFTMAX_ELEMENTS = (2**22, 2**25, 2**28)  # rows = elements / width


def path_bandwidths(
    dev: torch.device, sizes: tuple[int, ...] = PATH_ELEMENTS
) -> dict[str, list[list[float]]]:
    """{"<kind>:<path>:<bf16|fp32>" | "foreach": [[bytes, bytes/s], ...]} (bytes as the
    cost model counts them, the kernel latency taken off as for `size_bandwidth`; keyed by
    the output's dtype, 16-bit or not: the generic kernel's time follows its elements more
    than its bytes), L2 flushed before each run. Raises if a case does not take the path it
    stands for."""
    flush = flush_buffer(dev)
    lat = kernel_latency(dev)
    out: dict[str, list[list[float]]] = {}
    for n in sizes:
        for key, op, fn in _path_cases(dev, n):
            node = _record(fn, op)
            cost = op_cost(node)
            kind, path = key.split(":")
            got = elementwise_path(node, cost.kind)
            if (cost.kind, got) != (kind, path):
                raise AssertionError(f"{key} case ran {op} as {cost.kind}:{got}")
            t = time_op(fn, dev, 10, flush)
            dtype = "bf16" if node.outputs[0].itemsize == 2 else "fp32"
            out.setdefault(f"{key}:{dtype}", []).append(
                [cost.bytes, cost.bytes / max(t - lat, 0.5 * t)]
            )
    for _key, op, fn in _foreach_cases(dev):
        nbytes = op_cost(_record(fn, op)).bytes
        t = time_op(fn, dev, 5, flush)
        out.setdefault("foreach", []).append([nbytes, nbytes / t])
    for pts in out.values():
        pts.sort()
    return out


def _path_cases(dev: torch.device, n: int) -> Iterator[tuple[str, str, Callable[[], object]]]:
    """("<kind>:<path>", ATen op name, fn) with `n` output elements, in bf16 and fp32."""
    aten = torch.ops.aten
    w = 1024 if n >= 1024 else n
    rows = n // w
    for dt in (torch.bfloat16, torch.float32):
        a = torch.randn(rows, w, device=dev, dtype=dt)
        b = torch.randn(rows, w, device=dev, dtype=dt)
        other = torch.float32 if dt == torch.bfloat16 else torch.bfloat16
        c = torch.randn(rows, w, device=dev, dtype=other)
        bias = torch.randn(w, device=dev, dtype=dt)
        scale = torch.randn(rows, 1, device=dev, dtype=dt)
        heads = a.view(-1, 64, 16, 64) if n >= 2**16 else a.view(-1, 16, 4, 64)
        yield "pointwise:vector", "add", lambda a=a, b=b: aten.add(a, b)
        yield "pointwise:dyncast", "add", lambda a=a, c=c: aten.add(a, c)
        yield "pointwise:bcast", "add", lambda a=a, bias=bias: aten.add(a, bias)
        yield "pointwise:bcast_inner", "mul", lambda a=a, s=scale: aten.mul(a, s)
        if dt == torch.bfloat16:  # bf16 rows plus an fp32 bias, in place: bf16 out
            rows16, bias32 = c.to(dt), bias.float()
            yield "pointwise:generic_cast", "add_", lambda a=rows16, b=bias32: aten.add_(a, b)
        else:  # bf16 rows times an fp32 scale (an RMSNorm's weight): fp32 out
            yield "pointwise:generic_cast", "mul", lambda c=c, b=bias: aten.mul(c, b)
        yield (
            "pointwise:strided",
            "add",
            lambda h=heads, b=b: aten.add(h.transpose(1, 2), b.view(h.transpose(1, 2).shape)),
        )
        yield "pointwise:transposed", "add", lambda a=a, b=b: aten.add(a.t(), b.view(w, rows))
        if dt == torch.bfloat16:
            yield "copy:dyncast", "_to_copy", lambda a=a: aten._to_copy(a, dtype=torch.float32)
        else:
            yield "copy:cast_down", "_to_copy", lambda a=a: aten._to_copy(a, dtype=torch.bfloat16)
        yield (
            "copy:strided",
            "clone",
            lambda h=heads: aten.clone(h.transpose(1, 2), memory_format=torch.contiguous_format),
        )
        yield (
            "copy:transposed",
            "clone",
            lambda a=a: aten.clone(a.t(), memory_format=torch.contiguous_format),
        )
        # attention's q, k and v gradients stacked from their (batch, token, head) layout
        heads_b = b.view(heads.shape)
        yield (
            "copy:cat_strided",
            "stack",
            lambda h=heads, g=heads_b: aten.stack(
                [h.transpose(1, 2), g.transpose(1, 2), h.transpose(1, 2)]
            ),
        )
        kv = a.view(-1, 4, 1, 256, 64) if n >= 2**16 else a.view(-1, 4, 1, 16, 64)
        yield (
            "copy:bcast",
            "clone",
            lambda kv=kv: aten.clone(
                kv.expand(kv.shape[0], kv.shape[1], 4, kv.shape[3], 64),
                memory_format=torch.contiguous_format,
            ),
        )
        del a, b, c


def _foreach_cases(dev: torch.device) -> Iterator[tuple[str, str, Callable[[], object]]]:
    """AdamW's list ops over fp32 parameter lists shaped as a transformer's (per layer: four
    d x d attention weights, three d x 4d MLP weights, two norm weights), at d = 768 and 2048
    and 1 to 8 layers."""
    for d, layers in ((768, 1), (768, 4), (2048, 1), (2048, 4), (2048, 8)):
        shapes = [(d, d)] * 4 + [(4 * d, d)] * 3 + [(d,)] * 2
        lists = [[torch.randn(s, device=dev) for s in shapes * layers] for _ in range(3)]
        p, m, v = lists
        yield "foreach", "_foreach_mul_", lambda p=p: torch._foreach_mul_(p, 0.999)
        yield "foreach", "_foreach_lerp_", lambda m=m, p=p: torch._foreach_lerp_(m, p, 0.1)
        yield (
            "foreach",
            "_foreach_addcdiv_",
            lambda p=p, m=m, v=v: torch._foreach_addcdiv_(p, m, v, [0.01] * len(p)),
        )
        del lists, p, m, v


def softmax_grid(dev: torch.device) -> dict[str, list[list[float]]]:
    """{"<op>:<bf16|fp32>": [[width, rows, bytes/s], ...]} for _log_softmax, _softmax and
    their backwards over the row width and the rows, bytes as the cost model counts them."""
    aten, flush = torch.ops.aten, flush_buffer(dev)
    out: dict[str, list[list[float]]] = {}
    for key, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for width in SOFTMAX_WIDTHS:
            for total in SOFTMAX_ELEMENTS:
                rows = max(total // width, 1)
                x = torch.randn(rows, width, device=dev, dtype=dt)
                for fwd, bwd in (
                    ("_log_softmax", "_log_softmax_backward_data"),
                    ("_softmax", "_softmax_backward_data"),
                ):
                    y = getattr(aten, fwd)(x, 1, False)
                    cases = (
                        (fwd, lambda f=fwd, x=x: getattr(aten, f)(x, 1, False)),
                        (bwd, lambda f=bwd, y=y, dt=dt: getattr(aten, f)(y, y, 1, dt)),
                    )
                    for op, fn in cases:
                        nbytes = op_cost(_record(fn, op)).bytes
                        t = time_op(fn, dev, 10, flush)
                        out.setdefault(f"{op}:{key}", []).append(
                            [float(width), float(rows), nbytes / t]
                        )
                    del y
                del x
    return out
