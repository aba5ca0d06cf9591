"""Recurrent layers traced as cuDNN runs them (gobrrr.capture.rnn, cost._ops_rnn) and the
measured grids that time them and a segmentation head's pixel-wise ops (cost.measured_ops)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.capture.rnn import reserve_bytes
from gobrrr.cost._ops_rnn import algorithm
from gobrrr.cost.flops import op_cost
from gobrrr.cost.measured_ops import op_seconds, rnn_issue
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.hardware import get_gpu

H100 = get_gpu("h100")
T, N, I, H, L = 10, 4, 32, 64, 2


class _Rnn(nn.Module):
    def __init__(self, cell, i=I, h=H, layers=L) -> None:
        super().__init__()
        self.rnn = cell(i, h, num_layers=layers, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0].pow(2).mean()


def _graph(cell=nn.LSTM, precision="fp32"):
    return capture(
        lambda: gobrrr.Workload(model=_Rnn(cell), batch=(torch.randn(N, T, I),), loss=None),
        precision=precision,
    )


def _fp16_lstm(layers, width=256, batch=8):
    """An LSTM under bf16-mixed, `width` wide, `batch` sequences of T steps."""
    return capture(
        lambda: gobrrr.Workload(
            model=_Rnn(nn.LSTM, width, width, layers),
            batch=(torch.randn(batch, T, width),),
            loss=None,
        ),
        precision="bf16-mixed",
    )


def _ops(g, name):
    return [n for n in g.nodes if n.name == name]


@pytest.mark.parametrize("cell, per", [(nn.LSTM, 6), (nn.GRU, 7)])
def test_an_rnn_is_one_cudnn_op_with_its_reserve(cell, per):
    g = _graph(cell)
    (fwd,), (bwd,) = _ops(g, "_cudnn_rnn"), _ops(g, "_cudnn_rnn_backward")
    assert not _ops(g, "mkldnn_rnn_layer")  # the CPU's per-layer op is gone
    ref = cell(I, H, num_layers=L, batch_first=True)(torch.randn(N, T, I))
    assert fwd.outputs[0].shape == tuple(ref[0].shape)  # the module's own output, on the CPU
    # the reserve: per (step, sequence, hidden unit) `per` fp32 elements a layer, but the last
    # layer's output (the op's output) -- as cuDNN 9 sized it on an H100 (rnn_grid "reserve:*")
    assert (
        fwd.outputs[3].numel
        == (L * per - 1) * T * N * H * 4
        == reserve_bytes("lstm" if per == 6 else "gru", L, 1, T, N, H, 4)
    )
    # kept for backward: the reserve stays alive until _cudnn_rnn_backward has run
    by_size = [s for s in g.storages if s.nbytes == fwd.outputs[3].numel]
    assert any(s.created == fwd.index and (s.freed or 0) >= bwd.index for s in by_size)
    # one gradient per weight of every layer
    assert len(bwd.outputs) == 3 + 4 * L


def test_rnn_flops_are_the_gemms_of_every_layer():
    g = _graph()
    (fwd,), (bwd,) = _ops(g, "_cudnn_rnn"), _ops(g, "_cudnn_rnn_backward")
    hand = 2 * T * N * 4 * H * ((I + H) + (H + H))  # layer 0 reads I wide, layer 1 H wide
    assert op_cost(fwd).flops == hand
    assert op_cost(bwd).flops == 2 * hand


def test_measured_rnn_grid_times_the_call_and_its_absence_keeps_the_roofline(make_cal):
    g = _graph()
    (fwd,) = _ops(g, "_cudnn_rnn")
    # 1 ms per 2 layers x 100 steps at hidden 64 and 128, batch 4 and 16
    pts = [[h, b, 2, 100, 1e-3 * (1 + (h == 128))] for h in (64, 128) for b in (4, 16)]
    pts += [[64, 4, 1, 100, 9.0]]  # at another layer count: not the nearest to 2
    cal = make_cal(rnn_grid={"lstm:forward:fp32": pts})
    want = 1e-3 / 200 * L * T  # seconds per layer-step x this call's layers x steps
    assert op_seconds(cal, fwd) == pytest.approx(want)
    t = time_op(fwd, op_cost(fwd), Rates(H100, cal))
    assert t.device_s == pytest.approx(want)
    plain = time_op(fwd, op_cost(fwd), Rates(H100, make_cal()))
    assert op_seconds(make_cal(), fwd) is None and plain.device_s != pytest.approx(want)


def test_bf16_mixed_runs_the_rnn_in_fp16():
    # AutocastRNN.cpp casts _cudnn_rnn to fp16 whatever autocast's dtype (an H100 profile of a
    # bf16-mixed LSTM step: fp16 GEMMs and elemWiseRNNcell<__half>)
    for precision in ("bf16-mixed", "fp16-mixed"):
        (fwd,) = _ops(_graph(precision=precision), "_cudnn_rnn")
        assert fwd.inputs[0].dtype == "float16" and fwd.outputs[0].dtype == "float16"


def _dims(**kw):
    d = dict(mode="lstm", layers=1, dirs=1, hidden=1024, input=1024, batch=32, proj=0)
    return {**d, "dtype": "float16", "direction": "forward", **kw}


def test_cudnn_algorithm_follows_pytorchs_get_algo():
    # RNN.cpp get_algo: fp16, one layer, one direction, hidden <= 1024 and input multiples of
    # 128, batch a multiple of 8 up to 128, sm80+ with >= 98 SMs; GRU never
    assert algorithm(_dims(), True) == "persist"
    assert algorithm(_dims(), False) == "standard"  # the GPU fails the device test
    for kw in (
        dict(dtype="bfloat16"),
        dict(dtype="float32"),
        dict(layers=2),
        dict(dirs=2),
        dict(hidden=1152, input=1152),
        dict(input=1000),
        dict(batch=12),
        dict(batch=136),
        dict(mode="gru"),
        dict(mode="rnn_tanh", batch=96),  # plain RNN: not at batch >= 96 and hidden >= 896
        dict(proj=512),
    ):
        assert algorithm(_dims(**kw), True) == "standard", kw
    assert algorithm(_dims(mode="rnn_tanh", batch=96, hidden=768, input=768), True) == "persist"
    # small hidden: PERSIST_STATIC_SMALL_H, any dtype; backward's limit is lower
    assert algorithm(_dims(hidden=192, dtype="float32"), True) == "small_h"
    assert algorithm(_dims(hidden=192, direction="backward"), True) == "standard"


def _grid(persist: float) -> dict:
    """Seconds per layer-step: 1 us at the persistent points (one layer, hidden <= 1024), 5 us
    at one layer hidden 2048 (standard there), 3 us at two layers; host 20 us everywhere."""
    pts, host = [], []
    for h in (256, 1024, 2048):
        for b in (8, 64):
            for layers, steps in ((1, 64), (1, 256), (2, 64), (2, 256)):
                us = 3 if layers == 2 else (1 if h <= 1024 else 5)
                pts.append([h, b, layers, steps, us * 1e-6 * layers * steps])
                host.append([h, b, layers, steps, 20e-6 * layers * steps])
    return {
        "lstm:forward:fp16": pts,
        "host:lstm:forward:fp16": host,
        "device:persist": [[persist]],
    }


def test_rnn_grid_reads_the_points_of_the_calls_algorithm_and_the_hosts_time(make_cal):
    cal = make_cal(rnn_grid=_grid(1.0))
    (one,) = _ops(_fp16_lstm(1), "_cudnn_rnn")  # persistent: hidden 256, batch 8
    (two,) = _ops(_fp16_lstm(2), "_cudnn_rnn")  # standard: two layers
    (odd,) = _ops(_fp16_lstm(1, batch=6), "_cudnn_rnn")  # standard: batch not a multiple of 8
    assert op_seconds(cal, one) == pytest.approx(1e-6 * T)  # the persistent points only
    assert op_seconds(cal, two) == pytest.approx(3e-6 * 2 * T)
    # standard at one layer: hidden 2048 alone measured it there, so the two-layer points
    assert op_seconds(cal, odd) == pytest.approx(3e-6 * T)
    # a GPU that fails the device test: every one-layer point is standard, read at one layer
    flat = make_cal(rnn_grid=_grid(0.0))
    assert op_seconds(flat, one) == pytest.approx(1e-6 * T)  # one layer, hidden 256
    assert op_seconds(flat, odd) == pytest.approx(1e-6 * T)

    # the host's seconds to issue the per-step kernels become the op's host cost, and its
    # kernels run as they are issued: it ends no sooner than its issue plus one layer-step
    t = time_op(two, op_cost(two), Rates(H100, cal))
    assert t.host_s == pytest.approx(20e-6 * 2 * T) and t.device_s == pytest.approx(6e-6 * T)
    assert t.streamed_s == pytest.approx(3e-6)
    no_host = make_cal(rnn_grid={"lstm:forward:fp16": _grid(1)["lstm:forward:fp16"]})
    assert rnn_issue(no_host, two) is None
    assert time_op(two, op_cost(two), Rates(H100, no_host)).streamed_s == 0.0


def test_an_fp16_call_reads_a_grid_measured_before_the_fp16_key(make_cal):
    (fwd,) = _ops(_fp16_lstm(2), "_cudnn_rnn")
    pts = [[h, b, 2, 100, 2e-3] for h in (128, 512) for b in (4, 16)]
    cal = make_cal(rnn_grid={"lstm:forward:bf16": pts})
    assert op_seconds(cal, fwd) == pytest.approx(2e-3 / 200 * 2 * T)


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(3, 150, 1)

    def forward(self, x, y):
        z = F.interpolate(self.c(x), size=(64, 64), mode="bilinear", align_corners=False)
        return F.cross_entropy(z, y)


def test_pixel_grid_times_upsampling_and_the_pixel_loss(make_cal):
    g = capture(
        lambda: gobrrr.Workload(
            model=_Head(),
            batch=(torch.randn(2, 3, 16, 16), torch.randint(0, 150, (2, 64, 64))),
            loss=None,
        ),
        precision="fp32",
    )
    (up_b,) = _ops(g, "upsample_bilinear2d_backward")
    (ls,) = _ops(g, "_log_softmax")
    (nll,) = _ops(g, "nll_loss2d_backward")
    n = 2 * 150 * 64 * 64
    grid = {
        "upsample_bilinear2d_backward:fp32": [[1e5, 2, 1e9], [1e5, 8, 1e9], [1e7, 2, 2e9]]
        + [[1e7, 8, 2e9]],
        "_log_softmax:fp32": [[1e5, 19, 4e9], [1e5, 150, 4e9], [1e7, 19, 4e9], [1e7, 150, 4e9]],
        "nll_loss2d_backward:fp32": [[1e3, 19, 5e8], [1e3, 150, 5e8], [1e5, 19, 5e8]]
        + [[1e5, 150, 5e8]],
    }
    cal = make_cal(pixel_grid=grid)
    # gradient elements over the rate at that size (log-interpolated: 1e9 -> 2e9), scale 4
    rate = 1e9 + (2e9 - 1e9) * (torch.tensor(n / 1e5).log() / torch.tensor(100.0).log()).item()
    assert op_seconds(cal, up_b) == pytest.approx(n / rate)
    assert op_seconds(cal, ls) == pytest.approx(n / 4e9)
    assert op_seconds(cal, nll) == pytest.approx(2 * 64 * 64 / 5e8)
    assert all(op_seconds(make_cal(), x) is None for x in (up_b, ls, nll))


def test_rnn_section_records_device_and_host_points_per_kernel_dtype(monkeypatch):
    """The section's bookkeeping, run on the CPU with CUDA's timing calls stubbed (its timing
    itself needs a GPU): keys by the dtype cuDNN ran, one point per configuration."""
    from gobrrr.calibrate.sections import rnn as sec

    class _Event:
        def __init__(self, **kw) -> None:
            pass

        def record(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, other) -> float:
            return 2.0  # ms

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(sec, "device_persist", lambda dev: True)
    monkeypatch.setattr(sec, "QUICK", {**sec.QUICK, "hidden": (16,), "steps": (4,)})
    monkeypatch.setattr(sec, "BATCH", (2,))
    grid = sec.rnn_grid(torch.device("cpu"), quick=True)
    # on the CPU autocast("cuda") does nothing: the "fp16" module runs fp32, and is keyed so
    assert grid["device:persist"] == [[1.0]]
    assert {k for k in grid if k.startswith("lstm:")} == {"lstm:forward:fp32", "lstm:backward:fp32"}
    fwd = grid["lstm:forward:fp32"]
    assert [p[:4] for p in fwd] == [[16, 2, 1, 4], [16, 2, 2, 4]] * 2  # fp16 and fp32 runs
    assert all(p[4] == pytest.approx(2e-3) for p in fwd)
    assert all(p[4] == 0.0 for p in grid["lstm:backward:fp32"])  # both - forward
    assert len(grid["host:lstm:forward:fp32"]) == 4
