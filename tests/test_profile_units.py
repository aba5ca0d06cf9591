"""Pieces of gobrrr.profile against hand-derived values and PyTorch's own counters."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gobrrr.cost.rates import Rates
from gobrrr.hardware import Calibration, get_gpu
from gobrrr.profile.analyze import cost_split, measured_regime, roofline_fraction
from gobrrr.profile.compare import compare
from gobrrr.profile.diagnose import chain_saving, chains, diagnose
from gobrrr.profile.join import TraceOp, is_composite_implicit, join_trace, op_family
from gobrrr.profile.result import MeasuredOp
from gobrrr.profile.scaling import ScalingPoint, verdict
from gobrrr.profile.shapes import shape_cost

H100 = get_gpu("h100")


def test_op_family_survives_cpu_cuda_renames():
    cpu = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    for name in (
        cpu,
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_flash_attention_forward",
    ):
        assert op_family(name) == "attention"
    assert op_family("aten::_scaled_dot_product_flash_attention_backward") == "attention_backward"
    assert op_family("aten::addmm") == op_family("aten.mm.default") == "matmul"
    assert op_family("aten::add_") == op_family("aten.add.Tensor") == "add"
    assert op_family("aten::_to_copy") == op_family("aten.clone.default") == "copy"


def test_dispatch_level_ops():
    assert is_composite_implicit("aten::linear") and is_composite_implicit("aten::to")
    assert not is_composite_implicit("aten::addmm")
    assert not is_composite_implicit("aten::_to_copy")


def _op(name, dims, types):
    return TraceOp(0, name, "forward", "", 0.0, 0.0, 0, input_dims=dims, input_types=types)


@pytest.mark.parametrize("shape", [(5, 123, 77), (64, 32, 48)])
def test_shape_cost_of_matmuls_equals_flop_counter(shape):
    m, k, n = shape
    a, b, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    bat = torch.randn(3, m, k), torch.randn(3, k, n)
    with FlopCounterMode(display=False) as fc:
        torch.mm(a, b)
    flops, nbytes, math = shape_cost(_op("aten::mm", [[m, k], [k, n]], ["float", "float"]))
    assert flops == fc.get_total_flops() and math == "fp32"
    assert nbytes == 4 * (m * k + k * n + m * n)
    with FlopCounterMode(display=False) as fc:
        torch.addmm(bias, a, b)
    f2, _, _ = shape_cost(
        _op(
            "aten::addmm",
            [[n], [m, k], [k, n], [], []],
            ["float", "float", "float", "Scalar", "Scalar"],
        )
    )
    assert f2 == fc.get_total_flops()
    with FlopCounterMode(display=False) as fc:
        torch.bmm(*bat)
    f3, _, _ = shape_cost(
        _op("aten::bmm", [[3, m, k], [3, k, n]], ["c10::BFloat16", "c10::BFloat16"])
    )
    assert f3 == fc.get_total_flops()


def test_shape_cost_pointwise_and_inplace():
    f, b, _ = shape_cost(_op("aten::cos", [[1000]], ["float"]))
    assert (f, b) == (1000, 8000)  # read 4 B + write 4 B per element
    _, b, _ = shape_cost(
        _op("aten::add_", [[10, 10], [10, 10], []], ["c10::BFloat16", "c10::BFloat16", "Scalar"])
    )
    assert b == 3 * 200  # read both, write the first in place
    assert shape_cost(_op("aten::view", [[4, 4], []], ["float", "ScalarList"]))[:2] == (0, 0)


def test_measured_regime_speaks_the_predictions_vocabulary():
    t = 1e-3  # a 1 ms op
    rates = Rates(H100, None)
    peak, bw = H100.peak("bf16"), H100.bandwidth

    def regime(gap, flops, nbytes, math, kind="matmul", launch=rates.launch):
        split = cost_split(rates, None, None, flops, nbytes, math, kind, "mm")
        return measured_regime(t, gap, *split, launch)

    assert regime(0, 0.9 * peak * t, 1e6, "bf16") == "compute"
    assert regime(0, 1e9, 0.9 * bw * t, "fp32", "pointwise") == "memory"
    # far from both roofs (was "latency"): the cost model's larger time names it
    assert regime(0, 0.35 * peak * t, 0.1 * bw * t, "bf16") == "compute"
    # the GPU idled longer before it than it ran: overhead
    assert regime(2 * t, 0.9 * peak * t, 0, "bf16") == "overhead"
    # shorter than one eager launch: overhead (calibrated launch given explicitly)
    assert measured_regime(3e-6, 0, 1e-6, 1e-6, 5e-6) == "overhead"
    assert regime(0, 0, 0, "") == "none"  # nothing known (was "unknown")
    assert measured_regime(0.0, 0, 1, 1, 1e-5) == "none"
    assert roofline_fraction(t, 0, 0.5 * bw * t, "fp32", H100) == pytest.approx(0.5)
    assert roofline_fraction(t, 0, 0, "", H100) is None


def _m(i, family, kind, t, nbytes, regime="memory", phase="forward", module="m", **kw):
    return MeasuredOp(
        index=i,
        op=f"aten::{family}",
        family=family,
        kind=kind,
        phase=phase,
        module=module,
        kernels=1,
        kernel="k",
        device_s=t,
        host_s=0.0,
        gap_s=0.0,
        bytes=nbytes,
        regime=regime,
        **kw,
    )


def test_fusion_of_cos_cos_saves_half(make_cal):
    gib = 2**30
    t = 2 * gib / 3e12  # each cos reads + writes 1 GiB at 3 TB/s
    ops = [
        _m(0, "cos", "pointwise", t, 2 * gib),
        _m(1, "cos", "pointwise", t, 2 * gib),
        _m(2, "mm", "matmul", 1e-3, 1e6, regime="compute"),
    ]
    runs = chains(ops)
    assert [[o.index for o in r] for r in runs] == [[0, 1]]
    # fused: read x once, write y once = 2 GiB of the 4 GiB: half the time
    assert chain_saving(runs[0], 3e12) == pytest.approx(t)
    f = diagnose(
        ops, H100, step_s=3 * t, idle_share=0.0, calibration=make_cal(pointwise_bandwidth=3e12)
    )
    assert [x.kind for x in f] == ["fusion"] and "2x" in f[0].title


def test_diagnosis_is_ranked_by_saving(make_cal):
    ops = [
        _m(0, "mm", "matmul", 10e-3, 1e6, regime="compute", math="fp32", flops=50e12 * 10e-3),
        _m(1, "cos", "pointwise", 1e-3, 3e9),
        _m(2, "sin", "pointwise", 1e-3, 3e9),
    ]
    f = diagnose(
        ops, H100, step_s=20e-3, idle_share=0.3, calibration=make_cal(pointwise_bandwidth=3e12)
    )
    assert [x.kind for x in f] == ["tensor_cores", "overhead", "fusion"]
    # fp32 matmul: 0.5 TFLOP at the calibrated bf16 800 TFLOP/s takes 0.625 ms of the 10
    assert f[0].saving_s == pytest.approx(10e-3 - 0.5e12 / 800e12)
    assert f[1].saving_s == pytest.approx(0.3 * 20e-3)
    assert diagnose(ops, None, 1.0, 0.9) == ()  # no GPU, no findings


def test_unfused_attention_pattern():
    ops = [
        _m(0, "bmm", "matmul", 1e-3, 1, regime="compute", module="attn"),
        _m(1, "div", "pointwise", 2e-4, 1, module="attn"),
        _m(2, "softmax", "softmax", 3e-4, 1, module="attn"),
        _m(3, "bmm", "matmul", 1e-3, 1, regime="compute", module="attn"),
    ]
    f = {x.kind: x for x in diagnose(ops, H100, 1.0, 0.0)}
    assert f["attention"].saving_s == pytest.approx(5e-4)


def test_scaling_verdicts():
    pts = lambda a, b: [ScalingPoint(1, a, 1 / a), ScalingPoint(2, b, 2 / b)]
    assert verdict(pts(20e-3, 21e-3)).verdict == "overhead-bound"
    assert verdict(pts(10e-3, 20e-3)).verdict == "gpu-bound"
    assert verdict(pts(10e-3, 15e-3)).verdict == "partly overhead-bound"
    assert verdict([ScalingPoint(1, 1e-3, 1.0), ScalingPoint(2, None, None)]).verdict == "unknown"
    assert verdict(pts(20e-3, 21e-3)).ratio == pytest.approx(1.05)


def test_compare_groups_joined_ops():
    pred = SimpleNamespace(
        step_s=0.010,
        ops=[
            SimpleNamespace(
                index=0, kind="matmul", module="h.0.attn", phase="forward", device_s=4e-3
            ),
            SimpleNamespace(
                index=1, kind="pointwise", module="h.0.mlp", phase="forward", device_s=1e-3
            ),
        ],
    )
    ops = (
        _m(0, "mm", "matmul", 5e-3, 1, node=0),
        _m(1, "gelu", "pointwise", 1e-3, 1, node=1),
        _m(2, "cos", "pointwise", 1e-3, 1, node=-1),
    )
    result = SimpleNamespace(step_s=0.008, ops=ops)
    c = compare(pred, result)
    assert c.step.rel_error == pytest.approx(0.25)
    kinds = {r.name: r for r in c.kinds}
    assert kinds["matmul"].rel_error == pytest.approx(-0.2)
    assert kinds["pointwise"].rel_error == pytest.approx(0.0)
    assert c.matched_ops == 2 and c.measured_ops == 3


def test_calibrate_on_cpu_writes_a_loadable_calibration(tmp_path):
    from gobrrr.calibrate.api import calibrate

    path = tmp_path / "cpu.json"
    cal = calibrate("cpu", save=path, sizes=(32, 64), stream_bytes=2**20)
    assert Calibration.load(path) == cal
    assert set(cal.matmul_flops) == {"bf16", "fp16", "tf32", "fp32"}
    for dt, curve in cal.matmul_curve.items():
        assert [f for f, _ in curve] == [2 * 32**3, 2 * 64**3]
        assert max(fr for _, fr in curve) == 1.0  # fractions of the best rate measured
        assert cal.matmul_flops[dt] > 0
    assert cal.copy_bandwidth > 0 and cal.launch_overhead > 0 and cal.blas_workspace is None


def test_join_of_a_hand_made_trace():
    """linear -> addmm -> cudaLaunchKernel -> kernel; the kernel belongs to addmm, in the
    module and phase around it; a kernel with no launching op is counted unattributed."""
    ev = [
        dict(ph="X", cat="user_annotation", name="gobrrr::forward", ts=0, dur=100, pid=1, tid=1),
        dict(ph="X", cat="user_annotation", name="gobrrr.module::fc", ts=1, dur=90, pid=1, tid=1),
        dict(ph="X", cat="cpu_op", name="aten::linear", ts=2, dur=80, pid=1, tid=1),
        dict(ph="X", cat="cpu_op", name="aten::addmm", ts=3, dur=70, pid=1, tid=1),
        dict(
            ph="X",
            cat="cuda_runtime",
            name="cudaLaunchKernel",
            ts=10,
            dur=5,
            pid=1,
            tid=1,
            args={"correlation": 7},
        ),
        dict(
            ph="X", cat="kernel", name="gemm", ts=20, dur=30, pid=0, tid=7, args={"correlation": 7}
        ),
        dict(
            ph="X",
            cat="kernel",
            name="stray",
            ts=60,
            dur=10,
            pid=0,
            tid=7,
            args={"correlation": 99},
        ),
    ]
    j = join_trace({"traceEvents": ev})
    (op,) = j.ops
    assert (op.op, op.module, op.phase) == ("aten::addmm", "fc", "forward")
    assert j.kernels[0].op == 0 and j.kernels[1].op == -1 and j.unattributed == 1
    assert j.kernels[1].gap_before == pytest.approx(10e-6)
    assert j.busy_s() == pytest.approx(40e-6)


def test_cli_profile_on_cpu_prints_json(tmp_path, capsys):
    import argparse

    from gobrrr.cli.measure import add_calibrate_parser, add_profile_parser

    src = tmp_path / "wl.py"
    src.write_text(
        "import torch\nfrom gobrrr import Workload\n"
        "def workload(batch_size=None, seq_len=None):\n"
        "    m = torch.nn.Linear(8, 8)\n"
        "    return Workload(model=m, batch=torch.randn(batch_size or 4, 8),\n"
        "                    loss=lambda o, b: o.square().mean(), name='lin')\n"
    )
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    add_profile_parser(sub)
    add_calibrate_parser(sub)
    args = ap.parse_args(
        [
            "profile",
            f"{src}:workload",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--json",
            "--batch",
            "2",
            "--precision",
            "fp32",
        ]
    )
    assert args.func(args) == 0
    out = json.loads(capsys.readouterr().out)
    r = out["profile"]
    assert r["workload"] == "lin" and (r["unit"], r["units_per_step"]) == ("samples", 2)
    # by hand: the forward addmm and the weight gradient, 2·2·8·8 each (the input needs no
    # gradient); one FLOP per element of the 2×8 output for square and mean forward, mean's
    # div, square's pow, mul, mul backward and the bias gradient's sum; 1 for the loss's seed
    assert r["model_flops"] == 2 * (2 * 2 * 8 * 8) + 7 * 16 + 1
    assert r["flops_source"] == "traced step graph"


def test_scaling_counts_throughput_in_the_workloads_unit():
    from gobrrr.models.registry import get_workload
    from gobrrr.profile.scaling import factory_units

    assert factory_units(lambda b: get_workload("gpt2", b, 64, n_layer=1), 2) == (128, "tokens")
    assert factory_units(lambda b: get_workload("convnet", b), 4) == (4, "samples")
