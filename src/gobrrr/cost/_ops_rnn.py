"""cuDNN's fused recurrent layers: `_cudnn_rnn` (the whole stack of layers, forward) and
`_cudnn_rnn_backward` (data and weight gradients).

FLOPs: per layer and direction, the input GEMM 2·T·N·G·H·I (batched over all steps) and the
recurrent GEMM 2·T·N·G·H·H (one small GEMM per step), G the gates (LSTM 4, GRU 3, RNN 1), I the
layer's input width (the input's for layer 0, H·directions above); the gates' pointwise work
is left out (it is small against the GEMMs). Backward: twice the forward (data gradient and
weight gradient). Bytes: each input and output once. Kind "rnn": the roofline's matmul rate
at one step's GEMM, unless the calibration measured cuDNN's RNN (`Rates.rnn`): the recurrence
is a chain of T small GEMMs whose time the FLOPs do not tell.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost, io_bytes, matmul_math
from gobrrr.graph.ir import OpNode

GATES = {0: 1, 1: 1, 2: 4, 3: 3}  # cuDNN mode -> gates: relu, tanh, LSTM, GRU
MODE_NAMES = {0: "rnn_relu", 1: "rnn_tanh", 2: "lstm", 3: "gru"}


def dims(node: OpNode) -> dict[str, int | str]:
    """The call's shape: mode, layers, directions, steps, batch, hidden, input width, dtype."""
    backward = node.name.endswith("backward")
    first = 10 if backward else 6  # mode's position in the schema
    mode = int(node.arg(first, "mode"))
    hidden = int(node.arg(first + 1, "hidden_size"))
    layers = int(node.arg(first + 3, "num_layers"))
    batch_first = bool(node.arg(first + 4, "batch_first"))
    bidir = bool(node.arg(first + 7, "bidirectional"))
    x = node.inputs[0]
    steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    return {
        "mode": MODE_NAMES[mode],
        "gates": GATES[mode],
        "layers": layers,
        "dirs": 2 if bidir else 1,
        "steps": int(steps),
        "batch": int(batch),
        "hidden": hidden,
        "input": int(x.shape[-1]),
        "dtype": x.dtype,
        "direction": "backward" if backward else "forward",
        "proj": int(node.arg(first + 2, "proj_size") or 0),
    }


def algorithm(d: dict, device_persist: bool) -> str:
    """The cuDNN algorithm PyTorch picks for a call of dims `d` (aten/src/ATen/native/cudnn/
    RNN.cpp, `get_algo`; unpacked input): "small_h" (any dtype but double, hidden <= 192 LSTM /
    GRU or 384 plain RNN forward, 128 / 256 backward), "persist" (fp16 only: one layer, one
    direction, hidden <= 1024 and input both multiples of 128, `use_persist_device_heuristics`
    on an sm80+ GPU of >= 98 SMs, `device_persist`: batch a multiple of 8 up to 128, never GRU,
    a plain RNN under batch 96 or hidden 896), else "standard". dtype: a dtype name."""
    if d["proj"]:
        return "standard"
    fwd = d["direction"] == "forward"
    gated = d["mode"] in ("lstm", "gru")
    if d["hidden"] <= ((192 if fwd else 128) if gated else (384 if fwd else 256)):
        return "small_h"
    common = d["layers"] == 1 and d["dirs"] == 1 and d["hidden"] <= 1024
    common = common and d["hidden"] % 128 == 0 and d["input"] % 128 == 0
    b = d["batch"]
    device = device_persist and b % 8 == 0 and b <= 128 and d["mode"] != "gru"
    device = device and (d["mode"] == "lstm" or b < 96 or d["hidden"] < 896)
    return "persist" if str(d["dtype"]) == "float16" and common and device else "standard"


def forward_flops(d: dict) -> float:
    """GEMM FLOPs of the forward over the whole stack (see the module docstring)."""
    per_step = 0.0
    width = d["input"]
    for _ in range(d["layers"]):
        per_step += d["dirs"] * 2.0 * d["batch"] * d["gates"] * d["hidden"] * (width + d["hidden"])
        width = d["hidden"] * d["dirs"]
    return per_step * d["steps"]


def rnn(node: OpNode, tf32) -> OpCost:
    d = dims(node)
    flops = forward_flops(d) * (2 if d["direction"] == "backward" else 1)
    launches = d["layers"] * d["dirs"] * (2 if d["direction"] == "backward" else 1)
    return OpCost(flops, float(io_bytes(node)), matmul_math(d["dtype"], tf32), "rnn", launches)


COSTS: dict[str, CostFn] = {"aten._cudnn_rnn": rnn, "aten._cudnn_rnn_backward": rnn}


def step_dims(node: OpNode) -> tuple[float, float]:
    """(output elements, depth) of one step's recurrent GEMM: (batch x gates·hidden, hidden),
    the matmul shape whose rate an uncalibrated RNN call is costed at."""
    d = dims(node)
    return float(d["batch"] * d["gates"] * d["hidden"]), float(d["hidden"])
