"""Device times of ops whose time their bytes and FLOPs do not tell, read from grids the
calibration measured on the GPU: cuDNN's fused RNN (`rnn_grid`), the pixel-wise ops of a
segmentation head (`pixel_grid`) and windowed pooling (`pool_grid`). None where the calibration
lacks the grid (the op is then costed by its roofline, as before the grids existed).

- `_cudnn_rnn` / `_cudnn_rnn_backward`: the recurrence is a chain of one small GEMM per step
  and layer, each waiting on the last: the time grows with layers x steps at a rate set by the
  hidden width and the batch. The grid holds measured [[hidden, batch, layers, steps,
  seconds], ...] per "<lstm|gru>:<forward|backward>:<fp16|bf16|fp32>" (the dtype cuDNN ran:
  fp16 under either autocast) and the host's seconds to issue it under "host:<same key>"; a
  call is timed from the points of its cuDNN algorithm (persistent or standard, `_ops_rnn.
  algorithm`), at the measured layer count nearest its own and the sequence length nearest its
  own, as seconds per layer-step interpolated in (hidden, batch), times its layers x steps x
  directions. The host's time exceeds the device's (a step with an RNN waits on the host).
- `upsample_bilinear2d(_backward)`: the backward scatters each output gradient into the four
  input pixels it came from with atomicAdd, contended by scale^2 writers per input pixel;
  "_log_softmax" / "_log_softmax_backward_data" over dim 1 of an (N, C, H, W) tensor
  (a strided "spatial" softmax, not the row kernel `softmax_grid` measures); "nll_loss2d_forward"
  / "nll_loss2d_backward". Each grid is [[size, second coordinate, size per second], ...]
  keyed "<op>:<bf16|fp32>", with size and second coordinate per op (`pixel_coords`).
- `avg_pool2d(_backward)`, `max_pool2d_with_indices(_backward)`: one thread per element with
  64-bit index divisions, and for the average's backward a division per window it falls in:
  far slower than their bytes at a copy's rate. The grid holds [[map bytes, map bytes per
  second, ...], ...] per "<op>:k<kernel>s<stride>p<padding>:<bf16|fp32>:<layout>" (the map: the
  op's full-resolution tensor); a call reads the key of its own op nearest its layout, dtype
  and window (`pool_points`), the rate linear in log bytes, clamped at the measured ends.
"""

from __future__ import annotations

import math

from gobrrr.cost._ops_rnn import algorithm
from gobrrr.cost._ops_rnn import dims as rnn_dims
from gobrrr.cost.curves import grid_value, interp
from gobrrr.cost.shapes import channels_last_strides
from gobrrr.graph.ir import OpNode
from gobrrr.hardware import Calibration

RNN_OPS = ("_cudnn_rnn", "_cudnn_rnn_backward")
PIXEL_OPS = (
    "upsample_bilinear2d",
    "upsample_bilinear2d_backward",
    "_log_softmax",
    "_log_softmax_backward_data",
    "nll_loss2d_forward",
    "nll_loss2d_backward",
)


def dtype_key(dtype: str) -> str:
    return "bf16" if dtype in ("bfloat16", "float16") else "fp32"


def _nearest(values: set[float], want: float) -> float:
    return min(values, key=lambda v: abs(math.log(v) - math.log(max(want, 1))))


#: the grid keys a kernel dtype reads, in order: grids measured before the "fp16" key timed
#: bf16 modules under "bf16" (bf16-mixed steps were then traced in bf16)
RNN_DTYPE_KEYS = {"float16": ("fp16", "bf16"), "bfloat16": ("bf16",)}


def _rnn_points(grid: dict, d: dict, prefix: str) -> list[list[float]]:
    """The grid's points for a call of dims `d`: its mode, direction and kernel dtype, those
    of the same cuDNN algorithm where the grid has any (`_ops_rnn.algorithm`, each point a
    (hidden, batch, layers) call with input = hidden, one direction), at the measured layer
    count nearest the call's among those that measured two or more widths (else any) and
    then the nearest sequence length."""
    points: list[list[float]] = []
    for key in RNN_DTYPE_KEYS.get(str(d["dtype"]), ("fp32",)):
        points = grid.get(f"{prefix}{d['mode']}:{d['direction']}:{key}") or []
        if points:
            break
    if not points:
        return []
    persist = bool(grid.get("device:persist", [[0.0]])[0][0])
    want = algorithm(d, persist)

    def algo(p: list[float]) -> str:
        at = {**d, "hidden": int(p[0]), "input": int(p[0]), "batch": int(p[1])}
        return algorithm({**at, "layers": int(p[2]), "dirs": 1, "proj": 0}, persist)

    same = [p for p in points if algo(p) == want] if "device:persist" in grid else []
    points = same or points
    wide = {p[2] for p in points if len({q[0] for q in points if q[2] == p[2]}) > 1}
    layers = _nearest(wide or {p[2] for p in points}, d["layers"])
    at = [p for p in points if p[2] == layers]
    steps = _nearest({p[3] for p in at}, d["steps"])
    return [p for p in at if p[3] == steps and p[4] > 0]


def _rnn_grid_seconds(cal: Calibration | None, node: OpNode, prefix: str) -> float | None:
    if cal is None or node.name not in RNN_OPS:
        return None
    grid = getattr(cal, "rnn_grid", None) or {}
    d = rnn_dims(node)
    at = _rnn_points(grid, d, prefix)
    if not at:
        return None
    per = [[p[0], p[1], p[4] / (p[2] * p[3])] for p in at]
    per_step = grid_value(per, d["hidden"], d["batch"])
    return per_step * d["layers"] * d["steps"] * d["dirs"]


def rnn_seconds(cal: Calibration | None, node: OpNode) -> float | None:
    """Measured device seconds of a cuDNN RNN call (module docstring), or None."""
    return _rnn_grid_seconds(cal, node, "")


def rnn_issue(cal: Calibration | None, node: OpNode) -> tuple[float, float] | None:
    """(host seconds to issue a cuDNN RNN call, device seconds of one of its layer-steps), or
    None. The host's time is the grid's "host:" points read as `rnn_seconds` reads the
    device's; the call's kernels run as the host issues them, so the op ends no sooner than
    its issue plus one layer-step. None for grids measured before the host's points (the op's
    host cost is then the ordinary per-op one)."""
    host = _rnn_grid_seconds(cal, node, "host:")
    if host is None:
        return None
    d = rnn_dims(node)
    return host, (rnn_seconds(cal, node) or 0.0) / (d["layers"] * d["steps"] * d["dirs"])


def pixel_coords(node: OpNode) -> tuple[str, float, float] | None:
    """(grid key stem, size, second coordinate) of a pixel-wise op, or None:
    upsampling forward (output elements, scale), backward (output-gradient elements, scale);
    log-softmax over dim 1 of a 4-D tensor (elements, channels); nll_loss2d (pixels,
    channels)."""
    name = node.name
    if name.startswith("upsample_bilinear2d") and node.inputs and node.outputs:
        big, small = (
            (node.inputs[0], node.outputs[0])
            if name.endswith("backward")
            else (node.outputs[0], node.inputs[0])
        )
        if len(big.shape) != 4:
            return None
        return name, float(big.numel), big.shape[-1] / max(small.shape[-1], 1)
    if name in ("_log_softmax", "_log_softmax_backward_data") and node.inputs:
        x = node.inputs[0]
        dim = node.arg(1 if name == "_log_softmax" else 2, "dim", -1)
        if len(x.shape) != 4 or int(dim) % 4 != 1:
            return None
        return name, float(x.numel), float(x.shape[1])
    if name in ("nll_loss2d_forward", "nll_loss2d_backward"):
        x = node.inputs[0 if name.endswith("forward") else 1]
        if len(x.shape) != 4:
            return None
        return name, float(x.numel // x.shape[1]), float(x.shape[1])
    return None


def pixel_seconds(cal: Calibration | None, node: OpNode) -> float | None:
    """Measured device seconds of a pixel-wise op (module docstring), or None."""
    grid = (getattr(cal, "pixel_grid", None) or {}) if cal is not None else {}
    if not grid or node.name not in PIXEL_OPS:
        return None
    coords = pixel_coords(node)
    if coords is None:
        return None
    stem, size, second = coords
    x = node.inputs[1] if stem == "nll_loss2d_backward" else node.inputs[0]
    points = grid.get(f"{stem}:{dtype_key(x.dtype)}")
    if not points:
        return None
    return size / grid_value(points, size, second)


POOL_OPS = (
    "avg_pool2d",
    "avg_pool2d_backward",
    "max_pool2d_with_indices",
    "max_pool2d_with_indices_backward",
)


def pool_key(op: str, window: tuple[int, int, int], dtype: str, layout: str) -> str:
    """The `pool_grid` key of `op` over a (kernel, stride, padding) window, a grid dtype
    ("bf16" | "fp32") and a layout ("channels_first" | "channels_last")."""
    k, s, p = window
    return f"{op}:k{k}s{s}p{p}:{dtype}:{layout}"


def _parse_key(key: str) -> tuple[str, tuple[int, int, int], str, str] | None:
    """`pool_key`'s inverse, or None for a key of another form."""
    parts = key.split(":")
    if len(parts) != 4 or not parts[1].startswith("k"):
        return None
    k, _, rest = parts[1][1:].partition("s")
    s, _, p = rest.partition("p")
    if not (k.isdigit() and s.isdigit() and p.isdigit()):
        return None
    return parts[0], (int(k), int(s), int(p)), parts[2], parts[3]


def _square(value, default: int) -> int:
    """One side of a pooling argument (an int or a list of one or two; empty: `default`)."""
    if isinstance(value, (list, tuple)):
        if not value:
            return default
        return round(sum(int(v) for v in value) / len(value))
    return default if value is None else int(value)


def pool_coords(node: OpNode) -> tuple[tuple[int, int, int], str, str, float] | None:
    """((kernel, stride, padding), grid dtype, layout, map bytes) of a 4-D windowed pooling
    call, or None. The map is the full-resolution tensor: the forward's input, the backward's
    `self` (the size of the gradient it writes); a stride left empty is the kernel."""
    if node.name not in POOL_OPS:
        return None
    back = node.name.endswith("backward")
    first = 2 if back else 1
    if len(node.inputs) <= int(back) or len(node.inputs[int(back)].shape) != 4:
        return None
    x = node.inputs[int(back)]
    k = _square(node.arg(first, "kernel_size", None), 1)
    s = _square(node.arg(first + 1, "stride", None), k)
    p = _square(node.arg(first + 2, "padding", None), 0)
    layout = "channels_last" if channels_last_strides(x) else "channels_first"
    return (k, s, p), dtype_key(x.dtype), layout, float(x.nbytes)


def pool_points(grid: dict, op: str, window, dtype: str, layout: str) -> list[list[float]]:
    """The points of `op` nearest the call: its layout first (another layout runs another
    kernel), then its dtype, then the window nearest in stride, kernel and padding."""
    keys = [(key, k) for key in grid if (k := _parse_key(key)) is not None and k[0] == op]
    if not keys:
        return []

    def distance(parsed) -> tuple:
        _, (k, s, p), d, lay = parsed
        return (
            lay != layout,
            d != dtype,
            abs(s - window[1]),
            abs(k - window[0]),
            abs(p - window[2]),
        )

    key, _ = min(keys, key=lambda kp: distance(kp[1]))
    return grid[key]


def pool_seconds(cal: Calibration | None, node: OpNode) -> float | None:
    """Measured device seconds of a windowed pooling call (module docstring), or None."""
    grid = (getattr(cal, "pool_grid", None) or {}) if cal is not None else {}
    coords = pool_coords(node) if grid else None
    if coords is None:
        return None
    window, dtype, layout, nbytes = coords
    points = sorted(p for p in pool_points(grid, node.name, window, dtype, layout) if p[1] > 0)
    if not points or nbytes <= 0:
        return None
    logs = [math.log(p[0]) for p in points]
    return nbytes / interp(logs, [p[1] for p in points], math.log(nbytes))


def op_seconds(cal: Calibration | None, node: OpNode) -> float | None:
    """The measured device seconds of `node` from the calibration's grids, or None."""
    if cal is None:
        return None
    return rnn_seconds(cal, node) or pixel_seconds(cal, node) or pool_seconds(cal, node)
