"""Rates that depend on an op's shape: small copies and pointwise kernels (the calibration's
curve over size) and matmuls by the alignment of their leading dimensions."""

import pytest

from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.cost.shapes import alignment
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.hardware import get_gpu


def _mm(n_out: int, dtype: str = "bfloat16", nt: bool = False) -> OpNode:
    a = TensorInfo((4096, 4096), (4096, 1), dtype, 0)
    b = (
        TensorInfo((4096, n_out), (1, 4096), dtype, 1)
        if nt
        else TensorInfo((4096, n_out), (n_out, 1), dtype, 1)
    )
    out = TensorInfo((4096, n_out), (n_out, 1), dtype, 2)
    return OpNode(
        index=0,
        op="aten.mm.default",
        phase="forward",
        module="",
        inputs=(a, b),
        outputs=(out,),
        args=({"t": 0}, {"t": 1}),
    )


@pytest.mark.parametrize(
    "n, dtype, expected",
    [
        (4096, "bfloat16", 16),
        (50257, "bfloat16", 2),
        (30522, "bfloat16", 4),
        (50260, "bfloat16", 8),
        (50257, "float32", 4),
        (50258, "float32", 8),
        (50304, "float32", 16),
    ],
)
def test_alignment_is_the_largest_power_of_two_dividing_the_leading_dims(n, dtype, expected):
    assert alignment(_mm(n, dtype)) == expected


def test_misaligned_matmuls_take_the_fraction_measured_at_their_alignment(make_cal):
    from gobrrr.cost.flops import op_cost

    cal = make_cal(
        matmul_misaligned={
            "bf16": 0.2,
            "nt:bf16": 0.1,
            "bf16@4": 0.5,
            "nt:bf16@4": 0.4,
            "bf16@8": 0.9,
        }
    )
    rates = Rates(get_gpu("h100"), cal)

    def t(n, nt=False):
        node = _mm(n, nt=nt)
        return time_op(node, op_cost(node), rates).device_s

    base = t(4096) * 50257 / 4096  # the aligned rate at this size, scaled to the work
    # 2-byte aligned: the old keys; 4 and 8 bytes: their own
    assert t(50257) == pytest.approx(base / 0.2, rel=0.02)
    assert t(30522) == pytest.approx(t(4096) * 30522 / 4096 / 0.5, rel=0.02)
    assert t(30522, nt=True) == pytest.approx(t(4096) * 30522 / 4096 / 0.4, rel=0.02)
    assert t(50260) == pytest.approx(t(4096) * 50260 / 4096 / 0.9, rel=0.02)
    # a calibration without alignment keys gives the old answer
    old = Rates(get_gpu("h100"), make_cal(matmul_misaligned={"bf16": 0.2}))
    assert old.misaligned_fraction("bf16", False, 4) == 0.2


def test_copies_and_pointwise_read_the_size_curve(make_cal):
    cal = make_cal(
        size_bandwidth={
            "copy": [[1e5, 0.5e12], [1e8, 2.5e12]],
            "pointwise": [[1e5, 1e12], [1e8, 3e12]],
        },
        op_bandwidth={"native_layer_norm": 2e12},
    )
    rates = Rates(get_gpu("h100"), cal)
    assert rates.sized("copy", "_to_copy", 1e5) == pytest.approx(0.5e12)
    assert rates.sized("copy", "_to_copy", 1e8) == pytest.approx(2.5e12)
    mid = rates.sized("pointwise", "add", 10**6.5)  # halfway in log size
    assert mid == pytest.approx(2e12)
    assert rates.sized("copy", "_to_copy", 1e12) == pytest.approx(2.5e12)  # clamped
    assert rates.sized("norm", "native_layer_norm", 1e6) is None  # its own bandwidth
    assert Rates(get_gpu("h100"), make_cal()).sized("copy", "_to_copy", 1e6) is None


def test_batch_norm_reads_its_grid_over_channels_and_rows(make_cal):
    from gobrrr.graph.ir import OpNode, TensorInfo

    def bn(c, n, cl):
        stride = (c * 28 * 28, 1, 28 * c, c) if cl else (c * 28 * 28, 28 * 28, 28, 1)
        x = TensorInfo((n, c, 28, 28), stride, "bfloat16", 0)
        return OpNode(
            index=0,
            op="aten.native_batch_norm_backward.default",
            phase="backward",
            module="",
            inputs=(x, x),
            outputs=(),
        )

    grid = [
        [1024.0, 3136.0, 1e11],
        [1024.0, 50176.0, 1e12],
        [64.0, 3136.0, 4e11],
        [64.0, 50176.0, 8e11],
    ]
    cal = make_cal(
        batch_norm_grid={"backward:bf16:channels_last": grid},
        batch_norm_bandwidth={"backward:bf16": [[64.0, 5e10], [1024.0, 5e10]]},
    )
    rates = Rates(get_gpu("h100"), cal)
    assert rates.batch_norm(bn(1024, 4, cl=True)) == pytest.approx(1e11)  # 3136 rows
    assert rates.batch_norm(bn(1024, 64, cl=True)) == pytest.approx(1e12)  # 50176 rows
    assert rates.batch_norm(bn(64, 16, cl=True)) == pytest.approx(6e11)  # halfway in log rows
    assert rates.batch_norm(bn(1024, 64, cl=False)) == pytest.approx(5e10)  # no grid: the curve
