"""Windowed pooling timed from a measured grid (calibrate.sections.pools, cost.measured_ops)."""

import math

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.calibrate.sections import pools as sec
from gobrrr.capture import capture
from gobrrr.cost.flops import op_cost
from gobrrr.cost.measured_ops import op_seconds, pool_coords, pool_key
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.hardware import Calibration, get_gpu

H100 = get_gpu("h100")
B, C, S = 2, 16, 12  # the traced map: batch, channels, side


class _Pools(nn.Module):
    """Inception's branch pool (3x3, stride 1, pad 1) then ResNet's stem pool (3x3/2, pad 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.avg = nn.AvgPool2d(3, stride=1, padding=1)
        self.max = nn.MaxPool2d(3, stride=2, padding=1)

    def forward(self, x):
        return self.max(self.avg(x * self.w)).square().mean()


def _nodes(channels_last=False, dtype=torch.bfloat16):
    x = torch.randn(B, C, S, S, dtype=dtype, requires_grad=False)
    model = _Pools()
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    precision = "bf16" if dtype == torch.bfloat16 else "fp32"
    g = capture(lambda: gobrrr.Workload(model=model, batch=(x,), loss=None), precision=precision)
    return {n.name: n for n in g.nodes if "pool" in n.name}


@pytest.fixture(scope="module")
def nodes():
    return _nodes()


MAP = B * C * S * S * 2  # bytes of the bf16 map every pooling op here reads or writes


def test_coords_read_the_window_layout_and_map(nodes):
    assert pool_coords(nodes["avg_pool2d"]) == ((3, 1, 1), "bf16", "channels_first", MAP)
    assert pool_coords(nodes["avg_pool2d_backward"]) == ((3, 1, 1), "bf16", "channels_first", MAP)
    # the max pool's backward writes the full map's gradient, not the pooled one
    assert pool_coords(nodes["max_pool2d_with_indices_backward"])[::3] == ((3, 2, 1), MAP)
    cl = _nodes(channels_last=True)
    assert pool_coords(cl["avg_pool2d_backward"])[2] == "channels_last"
    assert pool_coords(_nodes(dtype=torch.float32)["avg_pool2d"])[1:] == (
        "fp32",
        "channels_first",
        2 * MAP,
    )


def _cal(make_cal, grid):
    return make_cal(pool_grid=grid)


def test_reading_interpolates_the_rate_in_log_bytes(make_cal, nodes):
    bwd = nodes["avg_pool2d_backward"]
    # points at MAP/100 and MAP*10: the call sits 2/3 of the way in log bytes,
    # so its rate is 1e9 + 2/3 * (4e9 - 1e9) = 3e9 bytes/s
    grid = {"avg_pool2d_backward:k3s1p1:bf16:channels_first": [[MAP / 100, 1e9], [MAP * 10, 4e9]]}
    cal = _cal(make_cal, grid)
    assert op_seconds(cal, bwd) == pytest.approx(MAP / 3e9)
    # the scheduler's time is the grid's, not bytes at the reduction bandwidth
    t = time_op(bwd, op_cost(bwd), Rates(H100, cal))
    assert t.device_s == pytest.approx(MAP / 3e9)
    # beyond the measured bytes the rate is the nearest end's
    edge = {"avg_pool2d_backward:k3s1p1:bf16:channels_first": [[MAP * 2, 5e8], [MAP * 4, 9e9]]}
    assert op_seconds(_cal(make_cal, edge), bwd) == pytest.approx(MAP / 5e8)
    # the forward has its own key: absent, it is not timed from the backward's
    assert op_seconds(cal, nodes["avg_pool2d"]) is None


def test_reading_takes_the_nearest_layout_dtype_and_window(make_cal, nodes):
    fwd = nodes["max_pool2d_with_indices"]  # 3x3, stride 2, pad 1, bf16, channels-first
    pts = {r: [[MAP, r]] for r in (1e9, 2e9, 3e9, 4e9, 5e9)}
    grid = {
        "max_pool2d_with_indices:k3s2p1:bf16:channels_last": pts[1e9],  # another kernel
        "max_pool2d_with_indices:k3s2p1:fp32:channels_first": pts[2e9],  # another dtype
        "max_pool2d_with_indices:k3s1p1:bf16:channels_first": pts[3e9],  # another stride
        "max_pool2d_with_indices:k2s2p0:bf16:channels_first": pts[4e9],  # the nearest
        "avg_pool2d:k3s2p1:bf16:channels_first": pts[5e9],  # another op
    }
    assert op_seconds(_cal(make_cal, grid), fwd) == pytest.approx(MAP / 4e9)
    exact = {**grid, "max_pool2d_with_indices:k3s2p1:bf16:channels_first": [[MAP, 6e9]]}
    assert op_seconds(_cal(make_cal, exact), fwd) == pytest.approx(MAP / 6e9)
    # the layout outranks the dtype: an fp32 channels-first point before a bf16 channels-last
    two = {k: grid[k] for k in list(grid)[:2]}
    assert op_seconds(_cal(make_cal, two), fwd) == pytest.approx(MAP / 2e9)
    only_cl = {"max_pool2d_with_indices:k3s2p1:bf16:channels_last": pts[1e9]}
    assert op_seconds(_cal(make_cal, only_cl), fwd) == pytest.approx(MAP / 1e9)


def test_without_the_section_pooling_keeps_its_roofline(make_cal, nodes):
    plain = make_cal()
    other = make_cal(pool_grid={"avg_pool2d:k3s1p1:bf16:channels_first": [[MAP, 1e6]]})
    for name in ("max_pool2d_with_indices", "max_pool2d_with_indices_backward"):
        node = nodes[name]
        assert op_seconds(plain, node) is None and op_seconds(other, node) is None
        cost = op_cost(node)
        t = time_op(node, cost, Rates(H100, plain))
        # bytes at the calibration's reduction bandwidth, plus one kernel's latency
        assert t.device_s == pytest.approx(cost.bytes / plain.reduction_bandwidth + 1e-6)
        assert time_op(node, cost, Rates(H100, other)).device_s == t.device_s
    assert op_seconds(None, nodes["avg_pool2d"]) is None
    # an empty section is not written: a file saved without it reads back the same
    assert "pool_grid" not in plain.to_dict()
    assert Calibration(**{**plain.to_dict(), "pool_grid": {}}) == plain


def test_section_times_each_op_and_keys_it_as_the_reader_does(monkeypatch, nodes):
    seen = []

    def fake_time(fn, dev, reps, flush=None):
        out = fn()  # the op runs once, as it would be timed
        y = out[0] if isinstance(out, tuple) else out
        seen.append(y.is_contiguous(memory_format=torch.channels_last) and y.shape[1] > 1)
        return 1e-3

    monkeypatch.setattr(sec, "time_op", fake_time)
    windows, sizes = ((3, 1, 1), (2, 2, 0)), ((S, C, MAP), (6, 8, 1e3))
    grid = sec.pool_grid(torch.device("cpu"), reps=1, windows=windows, sizes=sizes)
    want = {
        pool_key(op, w, d, lay)
        for op in (
            "avg_pool2d",
            "avg_pool2d_backward",
            "max_pool2d_with_indices",
            "max_pool2d_with_indices_backward",
        )
        for w in windows
        for d in ("bf16", "fp32")
        for lay in ("channels_first", "channels_last")
    }
    assert set(grid) == want
    # the traced Inception-style pool reads the section's own key at the traced map's size
    window, dtype, layout, nbytes = pool_coords(nodes["avg_pool2d_backward"])
    points = grid[pool_key("avg_pool2d_backward", window, dtype, layout)]
    assert points[-1][:2] == [nbytes, nbytes / 1e-3]  # batch 2 of 16 x 12 x 12: the map
    assert points[-1][2:] == [S, C, B]
    # 1 kB of 8 x 6 x 6 bf16 maps: batch round(1000 / 576) = 2, 576 bytes each
    assert points[0][:3] == [2 * 8 * 36 * 2, 2 * 8 * 36 * 2 / 1e-3, 6]
    fp32 = grid[pool_key("avg_pool2d_backward", window, "fp32", layout)]
    assert [p[4] for p in fp32] == [1, 1]  # half the batch in fp32: max(1, round(...))
    assert math.isclose(fp32[-1][0], 4 * C * S * S * 1)
    # each configuration in both layouts, the channels-last half returning channels-last
    assert sum(seen) == len(seen) // 2
