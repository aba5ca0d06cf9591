"""CUDA graphs as a knob: the JSON, the one predicate, the pass against hand-derived times and
bytes, the planner's choice, and apply's capture (CUDA only)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from gobrrr.capture import capture
from gobrrr.cost.flops import op_cost
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.memory.replay import round_alloc
from gobrrr.models.mlp import DeepMLP, MLPConfig
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.cudagraph import cuda_graph
from gobrrr.plan import applicable
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import plan
from gobrrr.training.cudagraph import capture_error
from gobrrr.workload import Workload

H100 = Target.resolve("h100")
# a test calibration's graph replay: 4 us per launch, 10 ns per node on the host; each node
# as long on the GPU as an eager kernel's latency (a graph saves host time only)
RATES = {
    "launch_host_s": 4e-6,
    "node_host_s": 1e-8,
    "node_device_s": H100.cal.kernel_latency,
    "launch_device_s": 0.0,
}
GRAPHED = Target(H100.gpu, dataclasses.replace(H100.cal, cudagraph=RATES))
# a calibration measured before the section existed
BARE = Target(H100.gpu, dataclasses.replace(H100.cal, cudagraph=None))


def mlp(batch_size: int = 8, width: int = 64, layers: int = 4, optimizer=None) -> Workload:
    x, y = torch.randn(batch_size, width), torch.randn(batch_size, width)
    return Workload(
        model=DeepMLP(MLPConfig(layers, width)), batch=(x, y), optimizer=optimizer, name="mlp"
    )


@functools.cache
def traced(batch_size: int = 8, width: int = 64):
    return capture(functools.partial(mlp, batch_size, width), precision="bf16-mixed")


# -- the knob ---------------------------------------------------------------------------------
def test_knob_json_round_trips_and_old_plans_read_false():
    k = Knobs(micro_batch=4, accumulation=2, cuda_graph=True)
    assert k.to_dict()["cuda_graph"] is True
    assert Knobs.from_dict(k.to_dict()) == k
    assert "cuda_graph" not in Knobs(micro_batch=4).to_dict()  # as plans wrote it before
    assert Knobs.from_dict({"micro_batch": 4}).cuda_graph is False
    with pytest.raises(GobrrrError, match="cuda_graph=1"):
        Knobs(micro_batch=1, cuda_graph=1)


# -- the predicate ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "precision", "words"),
    [
        ({"parallel": "ddp"}, "bf16-mixed", "parallel='ddp' with cuda_graph"),
        ({"offload": True}, "bf16-mixed", "offload"),
        ({"optimizer_states": "8bit"}, "bf16-mixed", "8-bit optimizer states"),
        ({"compile": "model"}, "bf16-mixed", "cuda_graph with compile"),
        ({"checkpoint": (("layers.0", "full"),)}, "bf16-mixed", "with checkpoint"),
        ({}, "fp16-mixed", "GradScaler reads found_inf"),
    ],
)
def test_refusals_name_the_reason(changes, precision, words):
    knobs = Knobs(micro_batch=8, cuda_graph=True, **changes)
    why = applicable.refusal(mlp(), knobs, precision)
    assert why is not None and words in why and "cuda_graph" in why


def test_refuses_a_sync_and_an_optimizer_without_capturable():
    knobs = Knobs(micro_batch=8, cuda_graph=True)
    why = applicable.cuda_graph_refusal(mlp(), knobs, "bf16-mixed", ["aten._local_scalar_dense"])
    assert "after aten._local_scalar_dense" in why
    adagrad = mlp(optimizer=lambda ps: torch.optim.Adagrad(ps))
    assert "Adagrad has no capturable=True" in applicable.refusal(adagrad, knobs, "bf16-mixed")


@pytest.mark.parametrize("optimizer", [None, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)])
def test_adamw_and_sgd_steps_are_capturable(optimizer):
    knobs = Knobs(micro_batch=8, cuda_graph=True)
    assert applicable.refusal(mlp(optimizer=optimizer), knobs, "bf16-mixed") is None


def test_apply_refuses_before_changing_anything():
    w = mlp()
    with pytest.raises(GobrrrError, match="GradScaler"):
        apply(w, Knobs(micro_batch=8, cuda_graph=True), "fp16-mixed")
    with pytest.raises(GobrrrError, match="on a CUDA GPU"):  # the model is on the CPU
        apply(w, Knobs(micro_batch=8, cuda_graph=True), "bf16-mixed")
    assert not hasattr(w.model, "_gobrrr_applied")


# -- the pass ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
def test_replayed_step_against_hand_derived_times(n):
    """Eagerly every op's host time is paid; replayed, the host pays the batch's two copies
    (eager ops) and one launch (4 us + 10 ns per kernel run), then the GPU runs every captured
    kernel back to back: the step is that host time plus their device time."""
    g = accumulate(traced(), n)
    eager = evaluate(g, GRAPHED)
    c = cuda_graph(g)
    got = evaluate(c, GRAPHED).time
    assert (
        c.meta.cuda_graph.start == 2 and [x.op for x in c.nodes[:2]] == ["aten.copy_.default"] * 2
    )
    copies = got.ops[:2]
    weights = c.weights()
    captured = [(o, w) for o, w in zip(got.ops, weights, strict=True)][2:]
    kernels = sum(op_cost(c.nodes[o.index]).launches * w for o, w in captured if o.device_s > 0)
    host = sum(o.host_s for o in copies) + RATES["launch_host_s"] + RATES["node_host_s"] * kernels
    device = sum(o.device_s * w for o, w in captured)
    assert all(o.host_s == 0 for o, _ in captured[1:])
    assert got.step_s == pytest.approx(host + device, rel=1e-9)
    # the same kernels' device time as eager (node cost = kernel latency in this calibration),
    # but for the power limit: back to back, the matmuls take a larger share of the GPU's time
    assert device == pytest.approx(eager.time.device_s, rel=1e-2)
    assert got.step_s < eager.time.step_s  # this tiny step is host-bound eagerly


def test_a_captured_matmul_costs_the_measured_gap_against_its_eager_figure():
    """A section with matmul gaps (-2 us at 1 MFLOP, -1 us at 100 MFLOP): a replayed matmul's
    device time is its eager figure plus the gap at its FLOPs, interpolated in log FLOPs
    (held past the ends), never under a node's; the other kernels keep eager less the
    latency plus a node's (here equal); the interpolation by hand."""
    from gobrrr.cost.cudagraph import GraphRates

    gaps = {**RATES, "matmul_gap_s": -2e-6, "matmul_gaps": [[1e6, -2e-6], [1e8, -1e-6]]}
    rates = GraphRates.of(gaps)
    assert rates.matmul_gap(1e5) == -2e-6 and rates.matmul_gap(1e9) == -1e-6
    assert rates.matmul_gap(1e7) == pytest.approx(-1.5e-6)  # halfway in log FLOPs
    one = GraphRates.of({**RATES, "matmul_gap_s": -2e-6})  # measured at one size: held
    assert one.matmul_gap(1e5) == one.matmul_gap(1e9) == -2e-6
    assert GraphRates.of(RATES).matmul_gap(1e7) == 0.0  # not measured
    target = Target(H100.gpu, dataclasses.replace(H100.cal, cudagraph=gaps))
    c = cuda_graph(traced())
    plain, gapped = evaluate(c, GRAPHED).time.ops, evaluate(c, target).time.ops
    mms = [o for o in plain[c.meta.cuda_graph.start :] if o.kind == "matmul" and o.device_s]
    assert mms
    for o in mms:
        want = max(o.device_s + rates.matmul_gap(o.flops), RATES["node_device_s"])
        # (the power limit rescales the matmuls after: within half a percent)
        assert gapped[o.index].device_s == pytest.approx(want, rel=5e-3)
    others = [o for o in plain[c.meta.cuda_graph.start :] if o.kind != "matmul"]
    assert all(gapped[o.index].device_s == o.device_s for o in others)


def test_replayed_memory_holds_the_static_inputs_and_a_pool_of_its_own():
    g = traced()
    eager, c = evaluate(g, GRAPHED).memory, evaluate(cuda_graph(g), GRAPHED).memory
    batch = sum(round_alloc(s.nbytes) for s in g.storages if s.kind == "input")
    assert c.peak - eager.peak == batch  # the batch as given, beside the static copy
    assert c.reserved > eager.reserved  # the capture's segments are the graph's own


def test_no_section_no_replayed_time():
    with pytest.raises(GobrrrError, match="cudagraph_grid"):
        evaluate(cuda_graph(traced()), BARE)


# -- the planner ------------------------------------------------------------------------------
def test_planner_chooses_graphs_where_host_bound_only():
    small = plan(functools.partial(mlp, width=64), GRAPHED, global_batch=8, allow=["cudagraphs"])
    assert small.plans[0].knobs.cuda_graph
    assert "the whole step as one CUDA graph (replayed)" in small.plans[0].changes
    big = plan(
        functools.partial(mlp, width=8192, layers=2),  # 6.6 TFLOP a step: the GPU's time
        GRAPHED,
        global_batch=4096,
        allow=["cudagraphs"],
    )
    assert not any(p.knobs.cuda_graph for p in big.plans)  # no faster where the GPU is busy
    assert big.plans


def test_the_plans_memory_chart_follows_a_captured_plan():
    """`plan --json`'s memory chart replays the graph the search costed, the captured step's
    input copies included (it had rebuilt the graph without the CUDA graph pass: a timeline
    longer than the graph, and an IndexError)."""
    from gobrrr.plan.search import Planner
    from gobrrr.report.charts import plan_charts

    planner = Planner(
        functools.partial(mlp, width=64), GRAPHED, global_batch=8, allow=["cudagraphs"]
    )
    result = planner.run()
    best = result.plans[0]
    assert best.knobs.cuda_graph
    mem = plan_charts(planner, result)["memory"]["chosen"]
    assert mem["ops"] == len(planner.search.step_graph(best.knobs).nodes)
    assert max(mem["total"]) == best.peak_bytes


def test_planner_without_the_section_says_so():
    r = plan(functools.partial(mlp, width=64), BARE, global_batch=8, allow=["cudagraphs"])
    assert not any(p.knobs.cuda_graph for p in r.plans)
    assert any("CUDA graphs not planned" in n and "cudagraph_grid" in n for n in r.notes)


# -- apply's capture (CUDA only) --------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures on a CUDA GPU")
def test_captured_step_trains_as_eager():
    torch.manual_seed(0)
    a, b = mlp(), mlp()
    b.model.load_state_dict(a.model.state_dict())
    b.batch = tuple(t.clone() for t in a.batch)  # the same samples: the same losses
    for w in (a, b):
        w.model.cuda()
        w.batch = tuple(t.cuda() for t in w.batch)
    eager = apply(a, Knobs(micro_batch=4, accumulation=2), "fp32")
    graphed = apply(b, Knobs(micro_batch=4, accumulation=2, cuda_graph=True), "fp32")
    for _ in range(3):
        le, lg = eager(), graphed()
        torch.testing.assert_close(lg, le)
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        torch.testing.assert_close(q, p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures on a CUDA GPU")
def test_a_sync_in_the_step_is_one_line():
    w = mlp()
    w.model.cuda()
    w.batch = tuple(t.cuda() for t in w.batch)
    w.step = lambda model, batch: model(*batch) * (1 + 0 * model(*batch).item())
    step = apply(w, Knobs(micro_batch=8, cuda_graph=True), "fp32")
    with pytest.raises(GobrrrError, match="cannot be captured as a CUDA graph at .*test_cudagraph"):
        step()


def test_the_capture_error_reports_the_steps_own_exception():
    """torch.cuda.graph's exit raises over the step's error; the step's line is reported."""

    def step():
        raise RuntimeError("operation not permitted when stream is capturing")

    try:
        try:
            step()
        finally:
            raise RuntimeError("operation failed due to a previous error during capture")
    except RuntimeError as e:
        line = capture_error(e)
    assert "operation not permitted when stream is capturing" in line
    assert "previous error" not in line
    assert "test_cudagraph.py" in line


def test_the_sections_fit_by_hand():
    """Tiny chains of N nodes: host 5 us + 10 ns x N, device 2 us + 1.2 us x N; matmul chains
    at two sizes: 2.6 us a node against 5 us timed alone (256), 20 us against 21 us (2048)."""
    from gobrrr.calibrate.sections.cudagraph import fit

    pts = [
        {"kind": "tiny", "nodes": n, "host_s": 5e-6 + 1e-8 * n, "device_s": 2e-6 + 1.2e-6 * n}
        for n in (10, 100, 1000)
    ]
    for size, node, alone in ((256, 2.6e-6, 5e-6), (2048, 20e-6, 21e-6)):
        pts += [
            {
                "kind": "matmul",
                "nodes": n,
                "host_s": 0.0,
                "device_s": 3e-6 + node * n,
                "size": size,
                "flops": 2.0 * size**3,
                "eager_kernel_s": alone,
            }
            for n in (10, 100, 1000)
        ]
    f = fit(pts)
    assert f["launch_host_s"] == pytest.approx(5e-6) and f["node_host_s"] == pytest.approx(1e-8)
    assert f["launch_device_s"] == pytest.approx(2e-6)
    assert f["node_device_s"] == pytest.approx(1.2e-6)
    assert f["matmul_gap_s"] == pytest.approx(-2.4e-6)
    assert sum(f["matmul_gaps"], []) == pytest.approx([2.0 * 256**3, -2.4e-6, 2.0 * 2048**3, -1e-6])


def test_a_captured_step_is_traced_with_its_optimizer_capturable():
    """apply makes the optimizer capturable before capturing; the planner traces the captured
    variant so: AdamW's bias corrections become device tensors, and its two divisions of
    every state by a 0-dim tensor leave multi_tensor_apply for a kernel per parameter (ATen's
    fast-route rule: the lists' i-th tensors share shape), as a profile of a captured GPT-2
    step shows (2 x 148 division kernels, benchmarks/results/cudagraph_profile_h100.json)."""
    from gobrrr.plan.search import variant_of
    from gobrrr.plan.trace import Tracer

    knobs = Knobs(micro_batch=8, cuda_graph=True)
    assert variant_of(knobs).cuda_graph  # traced apart from the eager step
    kw = dict(seq=None, precision="bf16-mixed", target=H100)
    eager = Tracer(mlp, variant=Knobs(micro_batch=1), **kw).trace(8)
    graphed = Tracer(mlp, variant=variant_of(knobs), **kw).trace(8)
    ops = [n.op for n in graphed.nodes if n.phase == "optimizer"]
    assert ops.count("aten._foreach_div_.List") == 2
    assert "aten._foreach_div_.List" not in [n.op for n in eager.nodes]
    params = len(list(mlp().model.parameters()))
    divs = [n for n in graphed.nodes if n.op == "aten._foreach_div_.List"]
    assert [op_cost(n).launches for n in divs] == [params, params]
    # the forward and backward are the eager step's
    fwd = [n.op for n in eager.nodes if n.phase != "optimizer"]
    assert [n.op for n in graphed.nodes if n.phase != "optimizer"] == fwd


def test_foreach_fast_route_by_hand():
    """ATen's rule for a foreach op over tensor lists: the i-th tensors share shape, dtype and
    strides, a size-1 dimension's stride aside (a depthwise weight (96, 1, 7, 7) and its
    gradient differ only there: fast); a 0-dim divisor or a transposed twin: a kernel each."""
    from gobrrr.cost._ops_optim import slow_route
    from gobrrr.graph.ir import TensorInfo

    def t(shape, stride, dtype="float32"):
        return TensorInfo(shape, stride, dtype, 0)

    w = t((96, 1, 7, 7), (49, 49, 7, 1))
    assert not slow_route([w], [[w], [t((96, 1, 7, 7), (49, 1, 7, 1))]])
    assert slow_route([w], [[w], [t((), ())]])
    m = t((4, 8), (8, 1))
    assert slow_route([m], [[m], [t((4, 8), (1, 4))]])
    assert slow_route([m], [[m], [t((4, 8), (8, 1), "bfloat16")]])
    assert not slow_route([m], [[m], [t((4, 8), (8, 1)), t((4, 8), (8, 1))]])  # other lengths
