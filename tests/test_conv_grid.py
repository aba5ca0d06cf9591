"""The convolution grid by layout, shape class and direction: how a traced convolution is
classified, the rate the cost model reads for it (against hand-derived interpolations), the
fallbacks (a missing class, a missing layout, a calibration from before layouts), and the
calibration code that measures the grid producing the keys the lookup reads."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.calibrate.sections import conv as cc
from gobrrr.capture import capture
from gobrrr.cost import conv
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.cost.shapes import conv_class, conv_directions, conv_layout, gemm_dims
from gobrrr.hardware import Calibration, get_gpu

H100 = get_gpu("h100")
OLD_CAL = Path(__file__).parent / "fixtures" / "calibration_h100_channels_first.json"

# (in, out, kernel, stride, groups) of each layer, the class the calibration measures it in;
# a 2 x 3 x 32 x 32 input, the stem halving the plane to 16 x 16
LAYERS = (
    ((3, 16, 7, 2, 1), "stem"),
    ((16, 64, 1, 1, 1), "1x1-expand"),
    ((64, 16, 1, 1, 1), "1x1-reduce"),
    ((16, 16, 1, 1, 1), "1x1"),
    ((16, 16, 3, 1, 1), "3x3"),
    ((16, 32, 3, 2, 1), "3x3-s2"),
    ((32, 32, 3, 1, 4), "grouped"),
)


def _graph(channels_last: bool, precision: str = "bf16-mixed"):
    def make():
        model = nn.Sequential(
            *(nn.Conv2d(i, o, k, s, k // 2, groups=g, bias=False) for (i, o, k, s, g), _ in LAYERS)
        )
        x = torch.randn(2, 3, 32, 32)
        if channels_last:
            model, x = (
                model.to(memory_format=torch.channels_last),
                x.to(memory_format=torch.channels_last),
            )
        return gobrrr.Workload(model=model, batch=(x,), loss=lambda y, b: y.float().sum())

    return capture(make, precision=precision)


def _convs(g, backward=False):
    """The graph's convolutions in layer order."""
    nodes = [
        n for n in g.nodes if n.name == ("convolution_backward" if backward else "convolution")
    ]
    return nodes[::-1] if backward else nodes


def _corners(lo_mn, hi_mn, lo_k, hi_k, rates):
    """A 2 x 2 grid [[mn, k, rate]], rates in the order (lo, lo), (lo, hi), (hi, lo), (hi, hi)."""
    return [
        [lo_mn, lo_k, rates[0]],
        [lo_mn, hi_k, rates[1]],
        [hi_mn, lo_k, rates[2]],
        [hi_mn, hi_k, rates[3]],
    ]


@pytest.mark.parametrize("channels_last", [False, True])
def test_traced_convolutions_get_their_class_layout_and_directions(channels_last):
    g = _graph(channels_last)
    fwd, bwd = _convs(g), _convs(g, backward=True)
    layout = "channels_last" if channels_last else "channels_first"
    assert [conv_class(n) for n in fwd] == [c for _, c in LAYERS]
    assert [conv_class(n) for n in bwd] == [c for _, c in LAYERS]
    assert {conv_layout(n) for n in fwd + bwd} == {layout}
    # the stem's input needs no gradient: its backward computes grad_weight only
    stem_fwd = 2 * (2 * 16 * 16 * 16) * (3 * 7 * 7)
    assert conv_directions(bwd[0], 0.0) == {"backward_weight": stem_fwd}
    f3 = 2 * (2 * 16 * 16 * 16) * (16 * 9)  # the 3x3: each gradient costs one forward
    assert conv_directions(bwd[4], 0.0) == {"backward_input": f3, "backward_weight": f3}
    assert conv_directions(fwd[4], 123.0) == {"forward": 123.0}


def test_one_dimensional_convolutions_are_channels_first():
    def make():
        m = nn.Conv1d(8, 8, 3, padding=1)
        return gobrrr.Workload(model=m, batch=(torch.randn(2, 8, 16),), loss=lambda y, b: y.sum())

    node = _convs(capture(make, precision="bf16-mixed"))[0]
    assert conv_layout(node) == "channels_first" and conv_class(node) == "3x3"


def test_the_rate_follows_the_ops_layout(make_cal):
    """The 3x3 (mn = 2·16·16·16 = 2^13, depth 16·9 = 144) sits at the log-midpoint of a grid
    over mn 2^12..2^14 and depth 72..288: its rate is the mean of the four corners."""
    cf = _corners(2**12, 2**14, 72, 288, (1e12, 2e12, 3e12, 6e12))
    cl = _corners(2**12, 2**14, 72, 288, (4e12, 8e12, 12e12, 16e12))
    rates = Rates(
        H100,
        make_cal(
            conv_grid={"bf16": {"channels_first:3x3:forward": cf, "channels_last:3x3:forward": cl}}
        ),
    )
    first, last = _convs(_graph(False))[4], _convs(_graph(True))[4]
    assert gemm_dims(first) == gemm_dims(last) == (2**13, 144)
    assert rates.conv(first, op_cost(first)) == pytest.approx(3e12)
    assert rates.conv(last, op_cost(last)) == pytest.approx(10e12)
    c = op_cost(last)
    assert time_op(last, c, rates).compute_s == pytest.approx(c.flops / 10e12)
    assert time_op(first, op_cost(first), rates).device_s > time_op(last, c, rates).device_s


def test_a_backward_sums_its_gradients_times_at_their_own_rates(make_cal):
    flat = lambda r: _corners(2**12, 2**14, 72, 288, (r,) * 4)  # noqa: E731
    table = {
        "channels_last:3x3:backward_input": flat(2e12),
        "channels_last:3x3:backward_weight": flat(5e11),
        "channels_last:stem:backward_weight": flat(1e12),
        "channels_last:stem:backward_input": flat(1e9),
    }  # never asked for
    rates = Rates(H100, make_cal(conv_grid={"bf16": table}))
    bwd = _convs(_graph(True), backward=True)
    f3 = 2.0 * 2**13 * 144
    c = op_cost(bwd[4])
    assert c.flops == 2 * f3
    assert time_op(bwd[4], c, rates).compute_s == pytest.approx(f3 / 2e12 + f3 / 5e11)
    stem = op_cost(bwd[0])
    assert time_op(bwd[0], stem, rates).compute_s == pytest.approx(2.0 * 2**13 * 147 / 1e12)
    # both gradients measured in one call (one grad_output copy, as they run): that rate
    table["channels_last:3x3:backward"] = flat(3e12)
    table["channels_last:stem:backward"] = flat(3e12)  # the stem asks for grad_weight only
    both = Rates(H100, make_cal(conv_grid={"bf16": table}))
    assert time_op(bwd[4], c, both).compute_s == pytest.approx(2 * f3 / 3e12)
    assert time_op(bwd[0], stem, both).compute_s == pytest.approx(2.0 * 2**13 * 147 / 1e12)


def test_missing_classes_and_layouts_fall_back(make_cal):
    """3x3-s2 and the stem read the 3x3 grid when theirs was not measured, 1x1-reduce the
    1x1's; a channels_last op reads the channels-first grid when its layout's is missing."""
    cf3 = _corners(2**10, 2**16, 8, 2048, (1e12,) * 4)
    cl3 = _corners(2**10, 2**16, 8, 2048, (7e12,) * 4)
    cf1 = _corners(2**10, 2**16, 8, 2048, (3e12,) * 4)
    rates = Rates(
        H100,
        make_cal(
            conv_grid={
                "bf16": {
                    "channels_first:3x3:forward": cf3,
                    "channels_last:3x3:forward": cl3,
                    "channels_first:1x1:forward": cf1,
                }
            }
        ),
    )
    cl = _convs(_graph(True))
    for i in (0, 5):  # stem, 3x3-s2: the channels_last 3x3's
        assert rates.conv(cl[i], op_cost(cl[i])) == pytest.approx(7e12)
    assert rates.conv(cl[2], op_cost(cl[2])) == pytest.approx(3e12)  # 1x1-reduce
    assert rates.conv(cl[6], op_cost(cl[6])) is None  # grouped: nothing near it measured


def _old_rate(points, mn, k):
    """Bilinear in (log mn, log k) on a rectangular grid, clamped at its edges, and falling in
    proportion below its smallest mn and k: how a grid without layouts was read."""
    mns, ks = sorted({p[0] for p in points}), sorted({p[1] for p in points})
    at = {(p[0], p[1]): p[2] for p in points}

    def bracket(xs, x):
        x = min(max(x, xs[0]), xs[-1])
        i = max(j for j in range(len(xs)) if xs[j] <= x) if x < xs[-1] else len(xs) - 2
        t = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
        return xs[i], xs[i + 1], t

    m0, m1, tm = bracket(mns, mn)
    k0, k1, tk = bracket(ks, k)
    lo = at[m0, k0] + tk * (at[m0, k1] - at[m0, k0])
    hi = at[m1, k0] + tk * (at[m1, k1] - at[m1, k0])
    return (lo + tm * (hi - lo)) * min(1.0, mn / mns[0]) * min(1.0, k / ks[0])


def test_a_calibration_without_layouts_loads_and_reads_as_before():
    """The H100 calibration as shipped before layouts (channels-first grid, forward and
    backward): every convolution of either layout reads its direction's grid."""
    data = json.loads(OLD_CAL.read_text())
    assert set(data["conv_grid"]["bf16"]) == {"forward", "backward"}
    cal = Calibration.load(OLD_CAL)
    rates = Rates(H100, cal)
    for channels_last in (False, True):
        g = _graph(channels_last)
        for backward in (False, True):
            for node in _convs(g, backward):
                mn, k = gemm_dims(node)
                grid = cal.conv_grid["bf16"]["backward" if backward else "forward"]
                assert rates.conv(node, op_cost(node)) == pytest.approx(
                    _old_rate(grid, mn, k), rel=1e-9
                )
        # workspace: the one fraction per direction, whatever the layout
        bwd = _convs(g, True)[4]
        assert conv.workspace(bwd, cal, "bf16") == int(
            cal.conv_workspace["bf16"]["backward"] * conv.io_bytes(bwd)
        )


def test_workspace_fraction_follows_the_layout(make_cal):
    cal = make_cal(
        conv_workspace={"bf16": {"forward": 0.5, "backward": 0.25, "channels_last:forward": 2.0}}
    )
    f_cf, f_cl = _convs(_graph(False))[4], _convs(_graph(True))[4]
    assert conv.workspace(f_cf, cal, "bf16") == int(0.5 * conv.io_bytes(f_cf))
    assert conv.workspace(f_cl, cal, "bf16") == int(2.0 * conv.io_bytes(f_cl))
    b_cl = _convs(_graph(True), True)[4]  # no channels_last backward measured: the plain one
    assert conv.workspace(b_cl, cal, "bf16") == int(0.25 * conv.io_bytes(b_cl))


def test_without_a_calibration_only_channels_first_16bit_pays_layout_copies():
    """The transposes around a channels-first 16-bit convolution: its activations (input and
    output, 2 · (2·16·16·16 + 2·16·16·16) bf16 elements) read and written once more, at the
    copy bandwidth, plus two kernels; channels_last runs none, and allocates none where its
    operands are channels-last."""
    rates = Rates(H100, None)
    first, last = _convs(_graph(False))[4], _convs(_graph(True))[4]
    t_cf, t_cl = (time_op(n, op_cost(n), rates) for n in (first, last))
    copies = 2.0 * 2 * (2 * 16 * 16 * 16) * 2
    assert t_cf.device_s - t_cl.device_s == pytest.approx(
        copies / rates.bandwidth("copy") + 2 * rates.latency
    )
    assert conv.layout_scratch(first) > 0
    assert conv.layout_scratch(last) == 0
    *inner, top = _convs(_graph(True), True)
    for node in inner:
        assert conv.layout_scratch(node) == 0
    # the top layer's grad_output comes from the loss channels-first: only it is copied, by
    # PyTorch before the call (`.to()` the input's channels-last format)
    assert conv.layout_scratch(top) == 0
    assert conv.copy_blocks(top) == (2 * 32 * 8 * 8 * 2,)


def test_batch_norm_and_depthwise_read_their_layouts_curves(make_cal):
    def make(channels_last):
        def workload():
            m = nn.Sequential(nn.Conv2d(16, 16, 5, 2, 2, groups=16, bias=False), nn.BatchNorm2d(16))
            x = torch.randn(2, 16, 16, 16)
            if channels_last:
                m, x = (
                    m.to(memory_format=torch.channels_last),
                    x.to(memory_format=torch.channels_last),
                )
            return gobrrr.Workload(model=m, batch=(x,), loss=lambda y, b: y.float().sum())

        return capture(workload, precision="fp32")

    flat = lambda v: [[1.0, v], [1e9, v]]  # noqa: E731
    cal = make_cal(
        batch_norm_bandwidth={"forward:fp32": flat(1e11), "forward:fp32:channels_last": flat(9e11)},
        depthwise_bandwidth={
            "forward:fp32": flat(2e11),
            "forward:fp32:channels_last:5x5": flat(5e11),
            "forward:fp32:channels_first:3x3": flat(3e11),
        },
    )
    rates = Rates(H100, cal)
    bn = {
        cl: next(n for n in make(cl).nodes if n.name == "native_batch_norm") for cl in (False, True)
    }
    assert rates.batch_norm(bn[False]) == pytest.approx(1e11)
    assert rates.batch_norm(bn[True]) == pytest.approx(9e11)
    dw = {cl: _convs(make(cl))[0] for cl in (False, True)}
    # 5x5-s2: channels_last has its 5x5 curve; channels-first only a 3x3 one
    assert rates.depthwise(dw[True], 1e6) == pytest.approx(5e11)
    assert rates.depthwise(dw[False], 1e6) == pytest.approx(3e11)
    old = Rates(H100, make_cal(depthwise_bandwidth={"forward:fp32": flat(2e11)}))
    assert old.depthwise(dw[True], 1e6) == pytest.approx(2e11)


def test_every_grid_shape_is_recorded_in_the_class_and_dims_it_is_measured_for():
    """Each convolution the calibration measures, as the cost model sees it: its class, its
    layout, and output elements N·plane^dims·C_out at depth C_in/groups·k^dims (forward);
    1-D ones channels-first only (PyTorch has no channels-last 1-D layout)."""
    dev = torch.device("cpu")
    classes = set()
    for s in cc.conv_shapes():
        for layout in cc.LAYOUTS if s.dims == 2 else ("channels_first",):
            calls = cc._calls(*cc._tensors(s, 1, torch.float32, layout, dev))
            fwd, bwd = (
                cc._record(fn, name) for name, fn in (calls["forward"], calls["backward_weight"])
            )
            for node in (fwd, bwd):
                assert (conv_class(node), conv_layout(node)) == (s.cls, layout), s
            assert gemm_dims(fwd) == (
                s.plane**s.dims * s.c_out,
                s.c_in // s.groups * math.prod(s.kernels),
            )
        classes.add(s.cls)
    assert classes == {
        "1x1",
        "1x1-reduce",
        "1x1-expand",
        "3x3",
        "1xk",
        "kx1",
        "3x3-s2",
        "stem",
        "grouped",
        "grouped-1d",
        "patchify",
        "stem-patchify",
    }


@pytest.mark.parametrize("kernel,cls", [((1, 7), "1xk"), ((7, 1), "kx1"), ((3, 1), "kx1")])
def test_asymmetric_kernels_read_the_3x3_class_until_their_own_is_measured(make_cal, kernel, cls):
    """Inception's 1x7, 7x1 and 3x1 kernels have classes of their own; a calibration that did
    not measure them reads the 3x3 class for them, rate and inside bytes, as it always did;
    one that did reads theirs."""
    s = cc.ConvShape(cls, 16, 16, kernel[0], 1, 1, 8, kernel_w=kernel[1])
    calls = cc._calls(*cc._tensors(s, 2, torch.bfloat16, "channels_first", torch.device("cpu")))
    fn_name, fn = calls["forward"]
    node = cc._record(fn, fn_name)
    assert conv_class(node) == cls
    cost = op_cost(node)
    dims = gemm_dims(node)
    assert dims == (2 * 8 * 8 * 16, 16 * kernel[0] * kernel[1])

    def cal(c, rate, frac):
        pts = [[d0, d1, rate] for d0 in (1.0, 1e9) for d1 in (1.0, 1e6)]
        return make_cal(
            conv_grid={"bf16": {f"channels_first:{c}:forward": pts}},
            conv_workspace={"bf16": {f"inside:channels_first:{c}:forward": frac}},
        )

    old = cal("3x3", 1e14, 0.5)
    assert Rates(H100, old).conv(node, cost) == pytest.approx(1e14)
    assert conv.class_inside(node, old, "bf16") == int(0.5 * conv.io_bytes(node))
    own = cal(cls, 2e14, 4.0)
    assert Rates(H100, own).conv(node, cost) == pytest.approx(2e14)
    assert conv.class_inside(node, own, "bf16") == int(4.0 * conv.io_bytes(node))


def test_a_measured_grid_is_read_by_the_lookup(make_cal):
    """conv_grid on the CPU at tiny sizes: the keys it writes are the ones the lookup reads
    (each traced convolution's rate interpolates its own class's measurement)."""
    shapes = (cc.ConvShape("3x3", 16, 16, 3, 1, 1, 16),)
    grid, spaces = cc.conv_grid(torch.device("cpu"), outputs=(2**12, 2**14), shapes=shapes)
    assert set(grid) == {"bf16", "tf32", "fp32"}
    assert set(grid["bf16"]) == {
        f"{lay}:3x3:{d}"
        for lay in cc.LAYOUTS
        for d in ("forward", "backward_input", "backward_weight", "backward")
    }
    assert set(spaces["bf16"]) == {
        "forward",
        "backward",
        "channels_last:forward",
        "channels_last:backward",
        *(f"inside:{lay}:3x3:{d}" for lay in cc.LAYOUTS for d in ("forward", "backward")),
    }
    rates = Rates(H100, make_cal(conv_grid=grid))
    for channels_last in (False, True):
        node = _convs(_graph(channels_last))[4]  # 2^13 outputs, depth 144: on the grid's row
        layout = "channels_last" if channels_last else "channels_first"
        bwd = _convs(_graph(channels_last), True)[4]
        for n, direction in ((node, "forward"), (bwd, "backward")):
            lo, hi = (p[2] for p in sorted(grid["bf16"][f"{layout}:3x3:{direction}"]))
            assert rates.conv(n, op_cost(n)) == pytest.approx((lo + hi) / 2)


def test_channels_last_strides_agree_with_pytorchs_own_test():
    """Against torch._prims_common (PyTorch's Python mirror of suggest_memory_format's
    stride test) on layouts with the ambiguous cases: size-1 planes and channels, 1x1
    weights, slices, transposes."""
    import types

    from gobrrr.cost.shapes import channels_last_strides

    like_cl = getattr(torch._prims_common, "are_strides_like_channels_last_or_false", None)
    if like_cl is None:
        pytest.skip("this torch has no are_strides_like_channels_last_or_false")
    cl = torch.channels_last
    tensors = [
        torch.empty(s)
        for s in ((2, 3, 4, 5), (8, 16, 1, 1), (1, 16, 1, 1), (2, 1, 4, 4), (4, 4, 1, 5))
    ]
    tensors += [t.contiguous(memory_format=cl) for t in tensors]
    tensors += [
        torch.empty(2, 8, 6, 6)[:, ::2],
        torch.empty(2, 8, 6, 6).transpose(2, 3),
        torch.empty(2, 6, 6, 8).permute(0, 3, 1, 2),
        torch.empty(2, 6, 6, 8).permute(0, 3, 1, 2)[..., :3],
        torch.empty(4, 1, 1, 1),
        torch.empty(4, 1, 1, 6)[..., :1],
        torch.empty(64).as_strided((1, 4, 2, 2), (16, 1, 8, 2)),
    ]
    seen = set()
    for t in tensors:
        info = types.SimpleNamespace(shape=tuple(t.shape), stride=tuple(t.stride()))
        ours = channels_last_strides(info)
        assert ours == bool(like_cl(t.shape, t.stride())), (t.shape, t.stride())
        seen.add(ours)
    assert seen == {True, False}


def test_stems_are_image_inputs_under_a_large_kernel():
    """A 1x1 from a few channels (a squeeze-and-excitation block's expand) is a GEMM; an
    image cut into non-overlapping patches (ConvNeXt's 4x4 stem, a ViT's 16x16 patch
    embedding) is a "stem-patchify", a stage's 2x2 downsampling of many channels a
    "patchify", and a padded strided 7x7 on an image a "stem"."""

    class Five(nn.Module):
        def __init__(self):
            super().__init__()
            self.se, self.patch4, self.patch16 = (
                nn.Conv2d(4, 96, 1),
                nn.Conv2d(3, 16, 4, 4),
                nn.Conv2d(3, 8, 16, 16),
            )
            self.down, self.stem = nn.Conv2d(16, 32, 2, 2), nn.Conv2d(3, 8, 7, 2, 3)

        def forward(self, pooled, image):
            return (
                self.se(pooled).sum()
                + self.down(self.patch4(image)).sum()
                + self.patch16(image).sum()
                + self.stem(image).sum()
            )

    def make():
        batch = (torch.randn(2, 4, 1, 1), torch.randn(2, 3, 32, 32))
        return gobrrr.Workload(model=Five(), batch=batch, loss=lambda y, b: y)

    convs = _convs(capture(make, precision="bf16-mixed"))
    assert [conv_class(n) for n in convs] == [
        "1x1-expand",
        "stem-patchify",
        "patchify",
        "stem-patchify",
        "stem",
    ]


def test_each_class_is_measured_on_a_rectangular_grid():
    """Every shape of a class is measured at the same output sizes (grid rows), so the lookup
    interpolates along depth within each row: power-of-two batches put on their rows
    (`snap`: 768 channels are no power of two), and no row that only some shapes of the class
    fit (a 7x7 stem image is 802,816 outputs); at least 3 rows (the 1-D class stops at
    ROW_CAP), 4 for the rest."""
    shapes = tuple(cc.conv_shapes())
    rows: dict[str, set] = {}
    for s in shapes:
        mns = frozenset(
            cc.snap(s.batch(o) * s.plane**s.dims * s.c_out, cc.class_rows(s.cls))
            for o in cc._rows(s, shapes, cc.OUTPUTS)
        )
        assert len(mns) >= (3 if s.cls in cc.ROW_CAP else 4), s
        rows.setdefault(s.cls, set()).add(mns)
    assert all(len(r) == 1 for r in rows.values()), rows
    assert min(next(iter(rows["stem"]))) == 2 * 112 * 112 * 64


def _conv1d_node(length: int = 499):
    """wav2vec2's position convolution as traced: (8, 768, length) bf16, 16 groups, kernel
    128, padding 64."""
    from gobrrr.calibrate.sections.step import _record

    x = torch.empty(8, 768, length, dtype=torch.bfloat16)
    w = torch.empty(768, 48, 128, dtype=torch.bfloat16)
    return _record(
        lambda: torch.ops.aten.convolution(x, w, None, [1], [64], [1], False, [0], 16),
        "convolution",
    )


def test_grouped_1d_convolutions_are_a_class_of_their_own():
    node = _conv1d_node()
    assert conv_class(node) == "grouped-1d" and conv_layout(node) == "channels_first"
    assert gemm_dims(node) == (8 * 768 * 500, 48 * 128)


def test_grid_points_sit_on_their_rows():
    """A 768-channel shape's outputs are no power of two: its points go on the row at or over
    them, so the grid stays read by rows."""
    rows = cc.class_rows("grouped-1d")
    assert rows == [2**19, 2**21, 2**23]
    assert cc.snap(3 * 2**19, rows) == 2**21 and cc.snap(2**21, rows) == 2**21
    assert cc.snap(2**30, rows) == 2**30  # past the last row: as measured
    assert cc.class_rows("stem")[0] == 2 * 112 * 112 * 64  # classes on rows already stay


def test_grouped_1d_convolution_against_a_separate_h100_run():
    """The shipped calibration's grouped-1d class (conv_classes_grouped1d_h100.json) against
    the same convolution timed alone in another run (conv1d_lengths_h100.json, batch 8 at
    499 positions: 12.8 ms forward, cuDNN at 3 TFLOP/s): within 15%. Read as the 3x3
    grouped class it was 0.7 ms."""
    doc = json.loads((Path(__file__).parent / "fixtures" / "conv1d_lengths_h100.json").read_text())
    measured = next(r for r in doc["rows"] if r["length"] == 499)["forward_s"]
    node = _conv1d_node()
    rates = Rates(H100, gobrrr.hardware.find_calibration(H100))
    assert time_op(node, op_cost(node), rates).device_s == pytest.approx(measured, rel=0.15)
