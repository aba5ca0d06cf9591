"""Roofline: per-op time and regime, misalignment, the host/device queues, model FLOPs."""

import math

import pytest
from fake_tensors import contiguous as t

from gobrrr.cost.curves import grid_value
from gobrrr.cost.flops import OpCost, op_cost
from gobrrr.cost.rates import MISALIGNED_FRACTION, Rates
from gobrrr.cost.roofline import time_op
from gobrrr.cost.shapes import misaligned, misaligned_nt, outer_sum_columns, wave_efficiency
from gobrrr.evaluate import predict
from gobrrr.graph.ir import OpNode, StepGraph
from gobrrr.graph.meta import OptimizerInfo, StepMeta
from gobrrr.hardware import get_gpu
from gobrrr.precision import Precision

H100 = get_gpu("h100")


def mm(m, k, n, dtype="bfloat16"):
    return OpNode(
        index=0,
        op="aten.mm.default",
        phase="forward",
        module="lin",
        inputs=(t((m, k), dtype, 0), t((k, n), dtype, 1)),
        outputs=(t((m, n), dtype, 2),),
        args=({"t": 0}, {"t": 1}),
    )


def test_large_matmul_is_compute_bound_at_the_efficient_peak():
    node = mm(8192, 8192, 8192)
    flops = 2 * 8192**3
    nbytes = 3 * 8192 * 8192 * 2
    o = time_op(node, OpCost(flops, nbytes, "bf16", "matmul", 1), Rates(H100, None))
    rate = H100.peak("bf16") * H100.matmul_efficiency * wave_efficiency(node, H100.sms)
    assert o.regime == "compute"
    assert o.device_s == pytest.approx(flops / rate + H100.kernel_latency)
    assert o.intensity == pytest.approx(flops / nbytes)


def test_wave_quantization_hand_count():
    # 1024x1024 output in 128x128 tiles = 64 tiles on 132 SMs: one wave, 64/132 busy
    assert wave_efficiency(mm(1024, 64, 1024), 132) == pytest.approx(64 / 132)
    # 133 tiles need two waves
    assert wave_efficiency(mm(128 * 133, 64, 128), 132) == pytest.approx(133 / 264)


def test_pointwise_is_memory_bound_and_tiny_ops_overhead_bound():
    r = Rates(H100, None)
    n = 1 << 28
    add = OpNode(0, "aten.add.Tensor", "forward", "", (t((n,), "float32"),), (t((n,), "float32"),))
    o = time_op(add, OpCost(n, 8 * n, "vector", "pointwise", 1), r)
    assert o.regime == "memory"
    assert o.device_s == pytest.approx(
        8 * n / (H100.bandwidth * H100.bandwidth_efficiency) + H100.kernel_latency
    )
    tiny = time_op(add, OpCost(16, 128, "vector", "pointwise", 1), r)
    assert tiny.regime == "overhead" and tiny.host_s == H100.launch_overhead


def test_views_cost_no_device_time():
    view = OpNode(0, "aten.view.default", "forward", "", (t((4, 4)),), (t((16,)),))
    o = time_op(view, OpCost(0, 0, "vector", "view", 0), Rates(H100, None))
    assert o.device_s == 0 and o.regime == "none" and o.host_s > 0


def test_misaligned_leading_dimension():
    assert misaligned(mm(16384, 768, 50257))  # GPT-2's vocabulary: 50257 * 2 B % 16 != 0
    assert not misaligned(mm(16384, 768, 50304))
    aligned = time_op(
        mm(16384, 768, 50304),
        OpCost(2 * 16384 * 768 * 50304, 1e9, "bf16", "matmul", 1),
        Rates(H100, None),
    )
    odd = time_op(
        mm(16384, 768, 50257),
        OpCost(2 * 16384 * 768 * 50304, 1e9, "bf16", "matmul", 1),
        Rates(H100, None),
    )
    assert odd.compute_s / aligned.compute_s == pytest.approx(1 / MISALIGNED_FRACTION, rel=0.02)


def _graph(nodes, **meta):
    return StepGraph(
        nodes=tuple(nodes),
        storages=(),
        meta=StepMeta.from_dict({"tokens": 1, "precision": "fp32", **meta}),
    )


def test_overhead_bound_step_is_the_host_time():
    # 100 tiny kernels: the host needs 100 launches, the device 100 latencies
    nodes = [
        OpNode(i, "aten.add.Tensor", "forward", "", (t((4,), "float32"),), (t((4,), "float32"),))
        for i in range(100)
    ]
    p = predict(_graph(nodes), H100)
    assert p.step_s == pytest.approx(100 * H100.launch_overhead + p.ops[-1].device_s)
    assert p.regime_share()["overhead"] > 0.9


def test_device_bound_step_is_the_device_time():
    nodes = [
        OpNode(
            i,
            "aten.mm.default",
            "forward",
            "",
            mm(4096, 4096, 4096).inputs,
            mm(4096, 4096, 4096).outputs,
            ({"t": 0}, {"t": 1}),
        )
        for i in range(3)
    ]
    p = predict(_graph(nodes, precision="bf16-mixed"), H100)
    assert p.step_s == pytest.approx(H100.launch_overhead + sum(o.device_s for o in p.ops))
    assert p.regime_share()["compute"] > 0.9


def test_model_flops_6n_plus_attention():
    from gobrrr.capture import capture
    from gobrrr.cost.roofline import model_flops_6n
    from gobrrr.models.registry import get_workload

    L, d, S, B, V = 2, 768, 64, 2, 96
    g = capture(lambda: get_workload("gpt2", B, S, n_layer=L, vocab_size=V), precision="fp32")
    n = g.meta.trainable_params - g.meta.embedding_params
    # 6·N·tokens with the position table excluded and the tied head counted, plus
    # 12·L·d·S per token for attention (not halved for causal)
    assert g.meta.embedding_params == 1024 * d  # wpe only: wte is tied to lm_head
    assert model_flops_6n(g) == pytest.approx(6 * n * B * S + 12 * L * d * S * B * S)
    assert math.isclose(predict(g, H100).backward_forward_ratio(), 2.0, rel_tol=0.1)


def test_gobrrr_kernel_ops_cost_their_measured_host_time(make_cal):
    # a gobrrr kernel op costs the host what the calibration measured for it (kernel_host), in
    # place of an ordinary op's per-op cost and launches; other ops are unchanged
    x, r = t((8, 256), "bfloat16"), t((8,), "float32")
    norm = OpNode(
        0,
        "gobrrr.rms_norm_bwd.default",
        "backward",
        "ln",
        (x, x, t((256,), "bfloat16"), r),
        (x, t((256,), "bfloat16")),
    )
    add = OpNode(1, "aten.add.Tensor", "backward", "", (x, x), (x,))
    cal = make_cal(
        op_overhead={"forward": 10e-6, "backward": 12e-6, "optimizer": 50e-6},
        kernel_host={"rms_norm_bwd": 310e-6},
    )
    rates = Rates(get_gpu("h100"), cal)
    assert time_op(norm, op_cost(norm), rates).host_s == pytest.approx(310e-6)
    assert time_op(add, op_cost(add), rates).host_s == pytest.approx(12e-6)
    without = Rates(get_gpu("h100"), make_cal(op_overhead=cal.op_overhead))
    assert time_op(norm, op_cost(norm), without).host_s < 100e-6


def test_ragged_grid_interpolates_each_row_over_its_own_depths():
    # the calibration leaves out the largest matmuls, so big outputs lack the deepest k: each
    # output size interpolates (linear in log k) over the depths measured for it, then clamps
    pts = [
        [1e6, 1024, 100.0],
        [1e6, 4096, 200.0],
        [1e6, 16384, 400.0],
        [1e8, 1024, 600.0],
        [1e8, 4096, 700.0],
    ]
    assert grid_value(pts, 1e6, 8192) == pytest.approx(300.0)  # halfway in log k
    assert grid_value(pts, 1e8, 16384) == pytest.approx(700.0)  # clamped: row has no 16384
    assert grid_value(pts, 1e7, 16384) == pytest.approx((400.0 + 700.0) / 2)  # halfway in log mn
    assert grid_value(pts, 1e6, 65536) == pytest.approx(400.0)


def test_attention_rate_by_direction_where_measured_apart(make_cal):
    # forward and backward kernels run at different rates; a calibration that measured them
    # apart is read per direction, an older one (fwd+bwd only) for both
    both = {"bf16": [[256.0, 100e12], [4096.0, 300e12]]}
    apart = {
        **both,
        "forward:bf16": [[256.0, 150e12], [4096.0, 450e12]],
        "backward:bf16": [[256.0, 80e12], [4096.0, 240e12]],
    }
    old = Rates(H100, make_cal(attention_curve=both))
    new = Rates(H100, make_cal(attention_curve=apart))
    assert old.attention("bf16", 1024, "forward") == pytest.approx(200e12)  # halfway in log S
    assert old.attention("bf16", 1024, "backward") == pytest.approx(200e12)
    assert new.attention("bf16", 1024, "forward") == pytest.approx(300e12)
    assert new.attention("bf16", 1024, "backward") == pytest.approx(160e12)
    assert new.attention("bf16", 1024) == pytest.approx(200e12)


def test_attention_rate_by_kernel_variant_where_measured(make_cal):
    # a variant's own curve where the calibration has it; the same mask at the nearest
    # measured head dim where it has only another; the direction's base curve otherwise
    curves = {
        "forward:bf16": [[256.0, 100e12], [4096.0, 100e12]],
        "forward:bf16:causal+dropout:d64": [[256.0, 50e12], [4096.0, 50e12]],
        "forward:bf16:full:d128": [[256.0, 70e12], [4096.0, 70e12]],
    }
    r = Rates(H100, make_cal(attention_curve=curves))
    assert r.attention("bf16", 1024, "forward", "causal+dropout:d64") == pytest.approx(50e12)
    assert r.attention("bf16", 1024, "forward", "causal+dropout:d128") == pytest.approx(50e12)
    assert r.attention("bf16", 1024, "forward", "full:d64") == pytest.approx(70e12)
    assert r.attention("bf16", 1024, "forward", "mask:d64") == pytest.approx(100e12)
    assert r.attention("bf16", 1024, "backward", "full:d64") == r.attention("bf16", 1024)


def test_a_sum_over_tokens_costs_the_measured_outer_reduction_bandwidth(make_cal):
    # a bias gradient sums over leading dims (its kernel strides across rows, and its output
    # size sets its parallelism); a sum over the last dim is an ordinary reduction
    g2, g3 = t((16384, 1024), "bfloat16"), t((16, 1024, 1024), "bfloat16")

    def sum_node(x, dims):
        shape = tuple(s for i, s in enumerate(x.shape) if i not in {d % len(x.shape) for d in dims})
        return OpNode(
            0,
            "aten.sum.dim_IntList",
            "backward",
            "fc",
            (x,),
            (t(shape, "bfloat16"),),
            args=(x, dims),
        )

    assert outer_sum_columns(sum_node(g2, [0])) == 1024
    assert outer_sum_columns(sum_node(g3, [0, 1])) == 1024
    assert outer_sum_columns(sum_node(g2, [-1])) is None
    assert outer_sum_columns(sum_node(g3, [0, 2])) is None
    node = sum_node(g2, [0])
    curve = {"sum:bf16": [[256.0, 0.5e12], [4096.0, 2e12]]}
    rates = Rates(H100, make_cal(outer_sum_bandwidth=curve))
    assert rates.outer_sum(node) == pytest.approx(1.25e12)  # 1024: halfway in log columns
    assert time_op(node, op_cost(node), rates).memory_s == pytest.approx(
        op_cost(node).bytes / 1.25e12
    )
    assert rates.outer_sum(sum_node(g2, [-1])) is None


def test_recomputed_ops_cost_their_own_host_time_where_calibrated(make_cal):
    # a recomputed op carries the checkpoint machinery: its calibrated host cost where measured,
    # the forward's otherwise
    x = t((64, 64), "float32")
    node = OpNode(0, "aten.add.Tensor", "recompute", "h.0", (x, x), (x,))
    with_rc = make_cal(op_overhead={"forward": 10e-6, "backward": 12e-6, "recompute": 25e-6})
    without = make_cal(op_overhead={"forward": 10e-6, "backward": 12e-6})
    assert time_op(node, op_cost(node), Rates(H100, with_rc)).host_s == pytest.approx(25e-6)
    assert time_op(node, op_cost(node), Rates(H100, without)).host_s == pytest.approx(10e-6)


def test_forward_ops_under_checkpointing_cost_the_checkpointed_host_time(make_cal):
    # a forward op in a block that is recomputed in the backward ran under checkpointing (its
    # saved-tensor hooks): it costs the "checkpointed" host time; one outside costs the forward's
    x = t((64, 64), "float32")
    nodes = [
        OpNode(0, "aten.add.Tensor", "forward", "h.0", (x, x), (x,)),
        OpNode(1, "aten.add.Tensor", "forward", "head", (x, x), (x,)),
        OpNode(2, "aten.add.Tensor", "recompute", "h.0", (x, x), (x,)),
    ]
    meta = StepMeta(tokens=1, precision=Precision.parse("fp32"))
    graph = StepGraph(nodes=tuple(nodes), storages=(), meta=meta)
    cal = make_cal(
        op_overhead={"forward": 10e-6, "backward": 12e-6, "recompute": 20e-6, "checkpointed": 30e-6}
    )
    hosts = [o.host_s for o in predict(graph, H100, cal).ops]
    assert hosts == pytest.approx([30e-6, 10e-6, 20e-6])
    plain = make_cal(op_overhead={"forward": 10e-6, "backward": 12e-6})
    assert [o.host_s for o in predict(graph, H100, plain).ops] == pytest.approx([10e-6] * 3)


def test_odd_output_of_a_transposed_weight_has_its_own_misaligned_rate(make_cal):
    # x @ w.t() with an odd output width (a language model's head over GPT-2's vocabulary)
    # runs slower than other misaligned matmuls; the calibration measures it apart
    from gobrrr.graph.ir import TensorInfo

    x, w_t = t((16384, 768), "bfloat16", 0), TensorInfo((768, 50257), (1, 768), "bfloat16", 1)
    fwd = OpNode(
        0, "aten.mm.default", "forward", "lm_head", (x, w_t), (t((16384, 50257), "bfloat16", 2),)
    )
    dx = OpNode(
        1,
        "aten.mm.default",
        "backward",
        "lm_head",
        (t((16384, 50257), "bfloat16", 3), t((50257, 768), "bfloat16", 4)),
        (t((16384, 768), "bfloat16", 5),),
    )
    assert misaligned(fwd) and misaligned_nt(fwd)
    assert misaligned(dx) and not misaligned_nt(dx)  # the odd dimension is an input's
    assert not misaligned_nt(mm(16384, 768, 50257))  # odd output, but a row-major operand
    rates = Rates(H100, make_cal(matmul_misaligned={"bf16": 0.2, "nt:bf16": 0.1}))
    cost = OpCost(2 * 16384 * 768 * 50257, 1e9, "bf16", "matmul", 1)
    slow, plain = time_op(fwd, cost, rates), time_op(dx, cost, rates)
    assert slow.compute_s / plain.compute_s == pytest.approx(2.0, rel=0.05)


def test_embedding_backward_costs_the_fitted_fill_and_tokens(make_cal):
    from gobrrr.calibrate.sections.step import fit_embedding_backward

    # seconds = V·D·s / 2e12 + T·D / 1e11 + 20 µs, recovered from its own grid
    truth = {"fill_Bps": 2e12, "token_values_per_s": 1e11, "fixed_s": 20e-6}
    pts = [
        [v, t, d, s, v * d * s / 2e12 + t * d / 1e11 + 20e-6]
        for v in (32000, 128256)
        for t in (4096, 32768)
        for d in (1024, 4096)
        for s in (2, 4)
    ]
    fit = fit_embedding_backward(pts)
    for k, want in truth.items():
        assert fit[k] == pytest.approx(want, rel=1e-6)
    node = OpNode(
        index=0,
        op="aten.embedding_dense_backward.default",
        phase="backward",
        module="wte",
        inputs=(t((16384, 2048), "float32", 0), t((16384,), "int64", 1)),
        outputs=(t((128256, 2048), "float32", 2),),
        args=({"t": 0}, {"t": 1}, 128256, -1, False),
    )
    r = Rates(H100, make_cal(embedding_backward=fit))
    want = 128256 * 2048 * 4 / 2e12 + 16384 * 2048 / 1e11 + 20e-6
    assert r.embedding_backward(node) == pytest.approx(want)
    assert time_op(node, op_cost(node), r).memory_s == pytest.approx(want)
    assert Rates(H100, make_cal()).embedding_backward(node) is None


def test_layer_norm_reads_the_grid_at_its_width_rows_and_dtype(make_cal):
    grid = {
        "native_layer_norm:fp32": [
            [768.0, 2048.0, 1e12],
            [768.0, 32768.0, 2e12],
            [4096.0, 2048.0, 2e12],
            [4096.0, 32768.0, 3e12],
        ],
        "native_layer_norm_backward:bf16": [[768.0, 8192.0, 5e11]],
    }
    r = Rates(H100, make_cal(layer_norm_grid=grid, op_bandwidth={"native_layer_norm": 9e12}))

    def ln(rows, width, dtype, backward=False):
        x = t((rows, width), dtype, 0)
        if backward:
            return OpNode(
                index=0,
                op="aten.native_layer_norm_backward.default",
                phase="backward",
                module="ln",
                inputs=(t((rows, width), dtype, 1), x),
                outputs=(t((rows, width), dtype, 2),),
            )
        return OpNode(
            index=0,
            op="aten.native_layer_norm.default",
            phase="forward",
            module="ln",
            inputs=(x,),
            outputs=(t((rows, width), dtype, 2),),
        )

    assert r.layer_norm(ln(2048, 768, "float32")) == pytest.approx(1e12)
    assert r.layer_norm(ln(8192, 768, "float32")) == pytest.approx(1.5e12)  # halfway, log rows
    assert r.layer_norm(ln(8192, 768, "bfloat16", True)) == pytest.approx(5e11)
    assert r.layer_norm(ln(8192, 768, "bfloat16")) is None  # not measured: op_bandwidth
    node = ln(2048, 768, "float32")
    assert time_op(node, op_cost(node), r).memory_s == pytest.approx(op_cost(node).bytes / 1e12)


def test_the_optimizer_step_host_is_per_parameter_tensor():
    """With the calibration's `optimizer_host` for the traced optimizer, the optimizer phase's
    host seconds are, by hand: small tensors x the small size's seconds per tensor at that
    count + large ones x the large size's (interpolated in the count), shared among the
    phase's ops as their per-op costs were."""
    import dataclasses

    from gobrrr.capture import capture
    from gobrrr.hardware import find_calibration
    from gobrrr.models.registry import get_workload

    g = capture(lambda: get_workload("gpt2", batch_size=1, seq_len=16, n_layer=2), precision="fp32")
    info = g.meta.optimizer
    assert info == OptimizerInfo(key="AdamW:foreach", tensors=28, large=10)  # wte, wpe, 4 x 2
    gpu = get_gpu("h100")
    cal = find_calibration(gpu)
    curves = {
        "64": [[16.0, 16 * 10e-6], [64.0, 64 * 6e-6]],
        "1048576": [[16.0, 16 * 20e-6], [64.0, 64 * 12e-6]],
    }
    with_curve = dataclasses.replace(cal, optimizer_host={"AdamW:foreach": curves})
    without = dataclasses.replace(cal, optimizer_host={})
    t = (28 - 16) / (64 - 16)
    small, large = 10e-6 + t * (6e-6 - 10e-6), 20e-6 + t * (12e-6 - 20e-6)
    want = 18 * small + 10 * large

    def host(c):
        p = predict(g, gpu, c)
        return [o.host_s for o in p.ops if o.phase == "optimizer"]

    got, before = host(with_curve), host(without)
    assert sum(got) == pytest.approx(want, rel=1e-9)
    assert [a / b for a, b in zip(got, before, strict=True)] == pytest.approx(
        [want / sum(before)] * len(got)
    )
