"""Elementwise kernels by the path CUDA takes, torch's foreach list kernels and softmax by row
width: the classifier against the kernels an H100 ran (instep_bandwidth_h100.json), the
rates read from the calibration, and the shipped calibration against a separate GPU run."""

import json
from pathlib import Path

import pytest
import torch

from gobrrr.calibrate.sections.paths import _path_cases
from gobrrr.calibrate.sections.step import _record
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.cost.shapes import cat_path, elementwise_path
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.hardware import find_calibration, get_gpu

RESULTS = Path(__file__).resolve().parent / "fixtures"
H100 = get_gpu("h100")
# the kernel template each path runs (ATen's CUDALoops.cuh)
KERNEL_OF = {
    "vector": "vectorized_elementwise_kernel",
    "cast_down": "vectorized_elementwise_kernel",
    "dyncast": "unrolled_elementwise_kernel",
    "generic_cast": "elementwise_kernel:cast",
    "cat_strided": "CatArrayBatchedCopy",
}


def _kernel_family(name: str) -> str:
    """The kernel template; the generic one as it casts each operand or not
    (gpu_kernel_impl's dynamic casting against gpu_kernel_impl_nocast)."""
    for family in (
        "vectorized_elementwise_kernel",
        "unrolled_elementwise_kernel",
        "elementwise_kernel",
        "CatArrayBatchedCopy",
    ):
        if family in name:
            if family == "elementwise_kernel" and "gpu_kernel_impl_nocast" not in name:
                return "elementwise_kernel:cast"
            return family
    return name


def test_each_path_is_the_kernel_the_gpu_ran():
    """Every calibration case, recorded on the CPU and classified, names the kernel template
    the H100 ran for it: vectorized for dense same-dtype operands, unrolled-with-casts for a
    dtype that differs, the generic offset-computing kernel for every other layout, and that
    kernel casting each operand when a broadcast also mixes dtypes; a stack of non-contiguous
    inputs CUDA's batched cat kernel, which reads them by their strides
    (instep_paths_h100.json)."""
    doc = json.loads((RESULTS / "instep_paths_h100.json").read_text())
    ran = {}
    for row in doc["paths"]:
        if row["path"] != "foreach":
            ran.setdefault(row["path"], set()).add(_kernel_family(row["kernels"][0][0]))
    assert len(ran) == 13
    seen = set()
    for key, op, fn in _path_cases(torch.device("cpu"), 2**14):
        node = _record(fn, op)
        kind, path = key.split(":")
        assert elementwise_path(node, op_cost(node).kind) == path, key
        assert ran[key] == {KERNEL_OF.get(path, "elementwise_kernel")}, key
        seen.add(key)
    assert seen == set(ran)


def _t(shape, stride=None, dtype="bfloat16", storage=0):
    if stride is None:
        stride, acc = [], 1
        for s in reversed(shape):
            stride.insert(0, acc)
            acc *= s
    return TensorInfo(tuple(shape), tuple(stride), dtype, storage)


def _node(name, inputs, out, kind_args=()):
    return OpNode(
        index=0,
        op=f"aten.{name}.default",
        phase="forward",
        module="",
        inputs=tuple(inputs),
        outputs=(out,),
        args=kind_args,
    )


@pytest.mark.parametrize(
    "inputs, out, kind, path",
    [
        ([_t((8, 1024)), _t((8, 1024))], _t((8, 1024)), "pointwise", "vector"),
        (
            [_t((8, 1024)), _t((8, 1024), dtype="float32")],
            _t((8, 1024), dtype="float32"),
            "pointwise",
            "dyncast",
        ),
        ([_t((8, 1024)), _t((1024,))], _t((8, 1024)), "pointwise", "bcast"),
        ([_t((8, 1024)), _t((8, 1))], _t((8, 1024)), "pointwise", "bcast_inner"),
        # a bf16 activation times an fp32 per-channel scale of its batch row (ConvNeXt-V2's global
        # response norm): broadcast and dtypes that differ
        (
            [_t((2, 7, 7, 384)), _t((2, 1, 1, 384), dtype="float32")],
            _t((2, 7, 7, 384), dtype="float32"),
            "pointwise",
            "generic_cast",
        ),
        (
            [_t((8, 1024), dtype="float32"), _t((8, 1))],
            _t((8, 1024), dtype="float32"),
            "pointwise",
            "generic_cast",
        ),
        ([_t((8, 1024)), _t((1,), dtype="float32")], _t((8, 1024)), "pointwise", "vector"),
        (
            [_t((2, 4, 8, 64), (2048, 64, 256, 1)), _t((2, 4, 8, 64))],
            _t((2, 4, 8, 64)),
            "pointwise",
            "strided",
        ),
        ([_t((64, 32), (1, 64)), _t((64, 32))], _t((64, 32)), "pointwise", "transposed"),
        ([_t((8, 1024), (1024, 1), "float32")], _t((8, 1024)), "copy", "cast_down"),
        ([_t((8, 1024))], _t((8, 1024), dtype="float32"), "copy", "dyncast"),
        ([_t((8, 64, 32), (32, 256, 1), "bfloat16")], _t((8, 64, 32)), "copy", "strided"),
        # channels_last tensors of one layout are dense: the vectorized kernel
        (
            [_t((2, 8, 4, 4), (128, 1, 32, 8)), _t((2, 8, 4, 4), (128, 1, 32, 8))],
            _t((2, 8, 4, 4), (128, 1, 32, 8)),
            "pointwise",
            "vector",
        ),
    ],
)
def test_elementwise_path_by_hand(inputs, out, kind, path):
    name = "add" if kind == "pointwise" else "_to_copy"
    assert elementwise_path(_node(name, inputs, out), kind) == path


def test_a_bool_condition_is_not_a_cast():
    """where and masked_fill take their bool operand as bool (no per-element cast): a
    broadcast mask keeps the plain generic kernel, a dense one the vectorized kernel; the same
    bool operand to an add is cast."""
    x, mask = _t((2, 4, 16, 16)), _t((2, 1, 16, 16), dtype="bool")
    dense_mask = _t((2, 4, 16, 16), dtype="bool")
    assert elementwise_path(_node("where", [mask, x, x], x), "pointwise") == "bcast"
    assert elementwise_path(_node("masked_fill", [x, mask], x), "pointwise") == "bcast"
    assert elementwise_path(_node("where", [dense_mask, x, x], x), "pointwise") == "vector"
    assert elementwise_path(_node("add", [x, mask], x), "pointwise") == "generic_cast"


def test_ops_with_kernels_of_their_own_have_no_path():
    x = _t((8, 1024))
    assert elementwise_path(_node("native_dropout", [x], x), "pointwise") is None
    assert elementwise_path(_node("cat", [x, x], _t((16, 1024))), "copy") is None


def test_paths_and_foreach_read_their_own_curves(make_cal):
    """A path measured slower takes that rate; the vectorized paths keep the size curves; a
    foreach op reads the foreach curve."""
    cal = make_cal(
        path_bandwidth={
            "copy:dyncast:fp32": [[1e3, 1e12], [1e10, 1e12]],
            "foreach": [[1e3, 2e12], [1e10, 2e12]],
        }
    )
    rates = Rates(H100, cal)
    up = _node("_to_copy", [_t((4096, 4096))], _t((4096, 4096), dtype="float32"))
    cost = op_cost(up)
    assert time_op(up, cost, rates).memory_s == pytest.approx(cost.bytes / 1e12)
    down = _node("_to_copy", [_t((4096, 4096), dtype="float32")], _t((4096, 4096)))
    assert time_op(down, op_cost(down), rates).memory_s == pytest.approx(op_cost(down).bytes / 3e12)
    lists = [_t((1024, 1024), dtype="float32", storage=i) for i in range(4)]
    fe = OpNode(
        index=0,
        op="aten._foreach_mul_.Scalar",
        phase="optimizer",
        module="",
        inputs=tuple(lists),
        outputs=tuple(lists),
        args=([{"t": i} for i in range(4)], 0.9),
    )
    c = op_cost(fe)
    assert c.kind == "optimizer"
    assert time_op(fe, c, rates).memory_s == pytest.approx(c.bytes / 2e12)


def test_softmax_reads_the_grid_at_its_width(make_cal):
    grid = [[1024, 1024, 3e12], [1024, 65536, 3e12], [131072, 8, 1e12], [131072, 512, 1e12]]
    rates = Rates(H100, make_cal(softmax_grid={"_log_softmax:fp32": grid}))

    def t(width, rows):
        n = _node(
            "_log_softmax",
            [_t((rows, width), dtype="float32")],
            _t((rows, width), dtype="float32"),
            ({"t": 0}, 1, False),
        )
        return time_op(n, op_cost(n), rates).memory_s, op_cost(n).bytes

    narrow, wide = t(1024, 4096), t(131072, 32)
    assert narrow[0] == pytest.approx(narrow[1] / 3e12)
    assert wide[0] == pytest.approx(wide[1] / 1e12)


@pytest.mark.parametrize("case", ["add bf16", "cast bf16->fp32"])
def test_shipped_calibration_times_kernels_of_another_run(case):
    """The H100 calibration against kernels timed in another run (instep_bandwidth_h100.json,
    64 Mi elements): within 5%; the cast runs the unrolled kernel, ~1.6x the add's time for
    the same bytes."""
    doc = json.loads((RESULTS / "instep_bandwidth_h100.json").read_text())
    row = next(r for r in doc["settings"] if r["case"] == case)
    n = 2**26
    x, y = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    if case == "add bf16":
        node = _record(lambda: torch.ops.aten.add(x, y), "add")
    else:
        node = _record(lambda: torch.ops.aten._to_copy(x, dtype=torch.float32), "_to_copy")
    rates = Rates(H100, find_calibration(H100))
    assert time_op(node, op_cost(node), rates).device_s == pytest.approx(row["alone"], rel=0.05)


def test_a_cat_of_inputs_not_contiguous_is_strided():
    """cat and stack: contiguous inputs (in the output's layout) copy at a copy's bandwidth
    (no path); one that is not (a transposed view, a slice) makes the kernel read every
    element by its strides."""
    x, heads = _t((4, 8, 16)), _t((4, 8, 16), (128, 1, 8))
    out2, out3 = _t((8, 8, 16)), _t((2, 4, 8, 16))
    assert cat_path(_node("cat", [x, x], out2)) is None
    assert cat_path(_node("stack", [x, x], out3)) == cat_path(_node("add", [x, heads], x)) is None
    assert cat_path(_node("stack", [x, heads], out3)) == "cat_strided"
    assert cat_path(_node("cat", [_t((4, 8, 8), (128, 16, 1)), x], _t((4, 8, 24)))) == "cat_strided"
