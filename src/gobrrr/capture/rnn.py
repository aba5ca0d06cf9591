"""Recurrent layers as CUDA runs them, reproduced in the CPU trace.

`nn.LSTM`, `nn.GRU` and `nn.RNN` call aten::lstm / gru / rnn_tanh / rnn_relu, composites
that pick their kernel by device: on the CPU (where the trace runs) oneDNN's
`mkldnn_rnn_layer`, one op per layer; on a CUDA GPU with cuDNN (aten/src/ATen/native/cudnn/
RNN.cpp, `_cudnn_impl`) one fused `_cudnn_rnn` over the whole stack of layers, which returns,
besides the output and the final states, a reserve space that autograd keeps for
`_cudnn_rnn_backward`: the per-step gate activations and states of every layer.

While `cuda_rnn()` is active those composites run `aten._cudnn_rnn` with the arguments
`_cudnn_impl` passes, so the trace records CUDA's one op, its outputs and what its backward
keeps. The op's meta kernel (torch/_meta_registrations.py) leaves the reserve empty ("TODO:
query cudnnGetRNNTrainingReserveSize"), and `_cudnn_rnn_backward` has none: both are given
here. cuDNN's reserve size cannot be asked for off a GPU; `reserve_bytes` sizes it from the
layout cuDNN keeps for backward (one set of per-gate activations and states per layer,
direction, step and sequence), to be checked against `rnn_grid`'s measured sizes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from gobrrr.capture.dropout import cpu_composite

#: cuDNN's cell modes (cudnnRNNMode_t), as aten passes them
MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
NAMES = {v: k for k, v in MODES.items()}

#: Elements of the reserve space per (layer, direction, step, sequence, hidden unit), the
#: last layer's output not counted (it is the op's `output`, kept by autograd on its own):
#: LSTM keeps its 4 gate activations, the cell state and each layer's hidden output (6); GRU
#: its 3 input gates, the 3 recurrent pre-activations (the candidate's reset product needs
#: W_hn·h) and the output (7); a plain RNN its pre-activation and output (2). Measured on an
#: H100 (cuDNN 9, torch 2.11; calibration `rnn_grid` "reserve:*"): LSTM 5 elements for one
#: layer and 17/3 a layer for three, i.e. 6·L − 1; GRU 6 and 20/3, i.e. 7·L − 1 — in bf16
#: and fp32 alike, at every hidden width, batch and length of the grid.
RESERVE_ELEMENTS = {"lstm": 6, "gru": 7, "rnn_tanh": 2, "rnn_relu": 2}


def reserve_bytes(
    mode: str, layers: int, directions: int, steps: int, batch: int, hidden: int, itemsize: int
) -> int:
    """Bytes of the training reserve space of one `_cudnn_rnn` call (see RESERVE_ELEMENTS)."""
    per = RESERVE_ELEMENTS[mode] * layers - 1
    return directions * steps * batch * hidden * per * itemsize


def _steps_batch(x: torch.Tensor, batch_first: bool) -> tuple[int, int]:
    return (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])


def _rnn_meta(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
):
    """_cudnn_rnn's outputs (output, hy, cy, reserve, weight_buf), the reserve sized."""
    if len(batch_sizes):
        steps, batch = len(batch_sizes), batch_sizes[0]
    else:
        steps, batch = _steps_batch(input, batch_first)
    dirs = 2 if bidirectional else 1
    out_size = proj_size or hidden_size
    if len(batch_sizes):
        out_shape = (input.shape[0], out_size * dirs)
    else:
        out_shape = (
            (batch, steps, out_size * dirs) if batch_first else (steps, batch, out_size * dirs)
        )
    out = input.new_empty(out_shape)
    hy = hx.new_empty((num_layers * dirs, batch, out_size))
    cy = (
        cx.new_empty((num_layers * dirs, batch, hidden_size))
        if cx is not None
        else input.new_empty(0)
    )
    n = reserve_bytes(
        NAMES[mode], num_layers, dirs, steps, batch, hidden_size, input.element_size()
    )
    reserve = input.new_empty((n if train else 0,), dtype=torch.uint8)
    return out, hy, cy, reserve, weight_buf.view(weight_buf.shape)


def _rnn_backward_meta(
    input,
    weight,
    weight_stride0,
    weight_buf,
    hx,
    cx,
    output,
    grad_output,
    grad_hy,
    grad_cy,
    mode,
    hidden_size,
    proj_size,
    num_layers,
    batch_first,
    dropout,
    train,
    bidirectional,
    batch_sizes,
    dropout_state,
    reserve,
    output_mask,
):
    """_cudnn_rnn_backward's gradients: input, hx, cx, and one per weight."""
    dcx = cx.new_empty(cx.shape) if cx is not None else input.new_empty(0)
    return (
        input.new_empty(input.shape),
        hx.new_empty(hx.shape),
        dcx,
        [w.new_empty(w.shape) for w in weight],
    )


def _cudnn(mode: str, input, hx, cx, params, has_biases, num_layers, dropout, train, bidir, bf):
    """What `_cudnn_impl` calls: the flat weight list with its stride (2 weights, + 2 biases,
    + 1 projection), the weights' flat buffer (nn.RNNBase keeps its parameters in one on CUDA:
    a view, no copy), the cell state for LSTM only."""
    stride = (4 if has_biases else 2) + (
        1 if cx is not None and hx.shape[-1] != cx.shape[-1] else 0
    )
    proj = hx.shape[-1] if cx is not None and hx.shape[-1] != cx.shape[-1] else 0
    hidden = cx.shape[-1] if cx is not None else hx.shape[-1]
    buf = params[0].detach().reshape(-1)
    return torch.ops.aten._cudnn_rnn(
        input,
        list(params),
        stride,
        buf,
        hx,
        cx,
        MODES[mode],
        hidden,
        proj,
        num_layers,
        bf,
        float(dropout),
        bool(train),
        bool(bidir),
        [],
        None,
    )


def _lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    out, hy, cy, _, _ = _cudnn(
        "lstm",
        input,
        hx[0],
        hx[1],
        params,
        has_biases,
        num_layers,
        dropout,
        train,
        bidirectional,
        batch_first,
    )
    return out, hy, cy


def _single(mode: str):
    def kernel(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, bf):
        out, hy, _, _, _ = _cudnn(
            mode,
            input,
            hx,
            None,
            params,
            has_biases,
            num_layers,
            dropout,
            train,
            bidirectional,
            bf,
        )
        return out, hy

    return kernel


def _override_meta(lib: torch.library.Library, op: str, fn) -> None:
    """Register `fn` as aten::`op`'s Meta kernel over torch's own (torch/_meta_registrations.py
    registers one from Python, which torch releases before 2.12 refuse to override unless
    told; destroying `lib` restores torch's kernel)."""
    try:
        lib.impl(op, fn, "Meta", allow_override=True)
    except TypeError:  # a torch whose Library.impl has no allow_override
        torch.library._impls.discard(f"aten/{op}/Meta")
        lib.impl(op, fn, "Meta")


@contextlib.contextmanager
def cuda_rnn() -> Iterator[None]:
    """Within this context nn.LSTM / GRU / RNN on CPU tensors run cuDNN's fused `_cudnn_rnn`,
    as on a CUDA GPU (cuDNN is used for every floating dtype there; `torch.backends.cudnn.
    enabled = False` keeps the CPU's path, as it keeps CUDA's native cells)."""
    if not torch.backends.cudnn.enabled:
        yield
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
            warnings.simplefilter("ignore")
            _override_meta(lib, "_cudnn_rnn", _rnn_meta)
            _override_meta(lib, "_cudnn_rnn_backward", _rnn_backward_meta)
        with contextlib.ExitStack() as stack:
            stack.enter_context(cpu_composite("lstm.input", _lstm))
            for mode in ("gru", "rnn_tanh", "rnn_relu"):
                stack.enter_context(cpu_composite(f"{mode}.input", _single(mode)))
            yield
    finally:
        lib._destroy()
