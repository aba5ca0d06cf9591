"""A checkpointed block's forward costs the host per op and per tensor its ops save.

The checkpoint's saved-tensor hook runs once per saved tensor, and its Python runs once per
op, so a forward op inside a checkpointed block costs the forward rate plus a + b x saved
(`OpNode.saved`), (a, b) fitted by non-negative least squares on the calibration's tiny
steps: GPT-2, Llama and a LoRA'd Llama, whose ops save tensors at different densities.
References: hand-derived host times and fits; PyTorch's own pack-hook calls in a real CPU step.
"""

from __future__ import annotations

import pytest
import torch
from fake_tensors import contiguous as t

from gobrrr.calibrate.sections.host import (
    _fit_workloads,
    _Timed,
    fit_surcharge,
    step_overhead,
    step_overhead_rows,
    summarize,
    tiny_counts,
)
from gobrrr.capture import capture
from gobrrr.cost.rates import Rates
from gobrrr.cost.shapes import checkpointed_modules
from gobrrr.evaluate import predict
from gobrrr.graph.ir import OpNode, StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import get_gpu
from gobrrr.passes.checkpoint import checkpoint
from gobrrr.precision import Precision
from gobrrr.training.checkpointing import block_names

pytestmark = pytest.mark.usefixtures("one_thread")

H100 = get_gpu("h100")
FWD, PER_OP, A, B = 10e-6, 30e-6, 4e-6, 7e-6
FIT = {"checkpointed_fit_per_op": A, "checkpointed_fit_per_saved": B}
PER_PHASE = {"forward": FWD, "backward": 12e-6, "recompute": 20e-6, "checkpointed": PER_OP}


def _graph(saved: tuple) -> StepGraph:
    # two equal adds inside block h.0 (recomputed in backward, so checkpointed), one outside
    x = t((64, 64), "float32")
    nodes = (
        OpNode(0, "aten.add.Tensor", "forward", "h.0", (x, x), (x,), saved=saved[0]),
        OpNode(1, "aten.add.Tensor", "forward", "h.0", (x, x), (x,), saved=saved[1]),
        OpNode(2, "aten.add.Tensor", "forward", "head", (x, x), (x,), saved=saved[2]),
        OpNode(3, "aten.add.Tensor", "recompute", "h.0", (x, x), (x,)),
    )
    meta = StepMeta(tokens=1, precision=Precision.parse("fp32"))
    return StepGraph(nodes=nodes, storages=(), meta=meta)


def _hosts(graph: StepGraph, cal) -> list[float]:
    return [o.host_s for o in predict(graph, H100, cal).ops]


def test_checkpointed_forward_op_costs_forward_rate_plus_per_op_and_per_saved_parts(make_cal):
    cal = make_cal(op_overhead={**PER_PHASE, **FIT})
    # saving 2: 10 + 4 + 2 x 7 us; saving 0: 10 + 4 us; outside a block: the forward's 10 us;
    # the recomputed op its 20 us
    assert _hosts(_graph((2, 0, 2)), cal) == pytest.approx([28e-6, 14e-6, 10e-6, 20e-6])


def test_without_the_fit_or_the_count_the_surcharge_stays_per_op(make_cal):
    old = make_cal(op_overhead=PER_PHASE)  # measured per op only, as shipped calibrations are
    assert _hosts(_graph((2, 0, 2)), old)[:2] == pytest.approx([PER_OP, PER_OP])
    half = make_cal(op_overhead={**PER_PHASE, "checkpointed_fit_per_op": A})  # half a fit
    assert _hosts(_graph((2, 0, 2)), half)[:2] == pytest.approx([PER_OP, PER_OP])
    cal = make_cal(op_overhead={**PER_PHASE, **FIT})  # a graph traced before ops were counted
    assert _hosts(_graph((None, None, None)), cal)[:2] == pytest.approx([PER_OP, PER_OP])


def test_selective_blocks_fall_back_to_the_full_policys_fit(make_cal):
    r = Rates(H100, make_cal(op_overhead={"forward": FWD, **FIT}))
    assert r.host("checkpointed_selective", 1, saved=3) == pytest.approx(FWD + A + 3 * B)
    sel = {"checkpointed_selective_fit_per_op": 1e-6, "checkpointed_selective_fit_per_saved": 2e-6}
    r = Rates(H100, make_cal(op_overhead={"forward": FWD, **FIT, **sel}))
    assert r.host("checkpointed_selective", 1, saved=3) == pytest.approx(FWD + 1e-6 + 6e-6)
    # selective measured per op only: its own per-op figure, not the full policy's fit
    r = Rates(H100, make_cal(op_overhead={"forward": FWD, **FIT, "checkpointed_selective": 9e-5}))
    assert r.host("checkpointed_selective", 1, saved=3) == pytest.approx(9e-5)


def _row(ops: int, saved: int, a: float, b: float) -> dict:
    return {"checkpointed": ops, "saved": saved, "extra_s": a * ops + b * saved}


def _alone(x: tuple, rows: list[dict]) -> float:
    """The one-coefficient least squares of extra_s over `x` (ops or saved per row)."""
    y = [r["extra_s"] for r in rows]
    return sum(a * b for a, b in zip(x, y, strict=True)) / sum(a * a for a in x)


def test_fit_recovers_both_parts_from_two_densities():
    rows = [_row(100, 90, A, B), _row(400, 160, A, B)]
    assert fit_surcharge(rows) == pytest.approx((A, B), rel=1e-9)
    # a third row on the same plane changes nothing
    assert fit_surcharge([*rows, _row(450, 140, A, B)]) == pytest.approx((A, B), rel=1e-9)


def test_fit_clamps_a_negative_part_to_zero_and_refits_the_other():
    ops, saved = (100, 400), (90, 160)
    # extra = -2 us an op + 10 us a saved tensor: the free fit's a < 0, so a = 0 and b alone
    rows = [_row(n, s, -2e-6, 10e-6) for n, s in zip(ops, saved, strict=True)]
    assert fit_surcharge(rows) == (0.0, pytest.approx(_alone(saved, rows), rel=1e-12))
    # 20 us an op - 3 us a saved tensor: b = 0, a alone
    rows = [_row(n, s, 20e-6, -3e-6) for n, s in zip(ops, saved, strict=True)]
    assert fit_surcharge(rows) == (pytest.approx(_alone(ops, rows), rel=1e-12), 0.0)
    # a checkpoint that made the forward faster: no surcharge at all
    assert fit_surcharge([_row(100, 90, -1e-6, -1e-6), _row(400, 160, -1e-6, 0)]) == (0, 0)


def test_fit_of_one_density_is_all_per_op():
    rows = [_row(100, 50, 3e-6, 8e-6), _row(200, 100, 3e-6, 8e-6)]
    assert fit_surcharge(rows) == pytest.approx((3e-6 + 0.5 * 8e-6, 0.0), rel=1e-9)
    assert fit_surcharge([]) is None


def _timed(name: str, policy: str, counts: dict, rate: float) -> _Timed:
    """A tiny model "timed" by hand: its forward `rate` s an op, plus A + B x saved for each
    op inside a checkpointed block; backward and optimizer at 2x and 3x the rate."""
    fwd = counts["forward"] * rate
    if policy != "none":
        fwd += A * counts["checkpointed"] + B * counts["saved"]
    times = {"forward": [fwd], "backward": [2 * rate * counts["backward"]]}
    times["optimizer"] = [3 * rate * counts["optimizer"]]
    return _Timed(None, None, policy, counts, times, name)


@pytest.fixture(scope="module")
def counts() -> dict:
    """{(model, policy): tiny_counts}: the ops each tiny model runs, as traced."""
    return {
        (name, policy): tiny_counts(make, policy)
        for name, make in _fit_workloads()
        for policy in ("none", "full", "selective")
    }


def test_summary_fits_the_surcharge_the_steps_were_timed_with(counts):
    # each model's own forward rate differs: the fit holds each checkpointed forward against
    # the same model's plain one
    rates = {"gpt2": 10e-6, "llama3": 12e-6, "llama3-lora": 8e-6}
    out, rows = summarize([_timed(m, p, c, rates[m]) for (m, p), c in counts.items()])
    for policy in ("", "_selective"):
        assert out[f"checkpointed{policy}_fit_per_op"] == pytest.approx(A, rel=1e-6)
        assert out[f"checkpointed{policy}_fit_per_saved"] == pytest.approx(B, rel=1e-6)
    pairs = {(m, p) for m in rates for p in ("full", "selective")}
    assert {(r["model"], r["policy"]) for r in rows} == pairs
    density = {r["model"]: r["saved"] / r["checkpointed"] for r in rows if r["policy"] == "full"}
    assert density["llama3-lora"] < 0.35 < density["llama3"] < 0.5 < density["gpt2"]


def test_summary_pools_per_op_figures_over_gpt2_and_llama_only(counts):
    rates = {"gpt2": 10e-6, "llama3": 12e-6, "llama3-lora": 99e-6}
    out, _ = summarize([_timed(m, p, c, rates[m]) for (m, p), c in counts.items()])
    g, ll = counts["gpt2", "none"], counts["llama3", "none"]
    fwd = (g["forward"] * 10e-6 + ll["forward"] * 12e-6) / (g["forward"] + ll["forward"])
    assert out["forward"] == pytest.approx(fwd, rel=1e-12)
    # "checkpointed": the checkpointed forward beyond its outside ops at the pooled rate
    g, ll = counts["gpt2", "full"], counts["llama3", "full"]
    total = sum(
        c["forward"] * r + A * c["checkpointed"] + B * c["saved"] - c["outside"] * fwd
        for c, r in ((g, 10e-6), (ll, 12e-6))
    )
    assert out["checkpointed"] == pytest.approx(total / (g["checkpointed"] + ll["checkpointed"]))


def test_section_runs_on_the_cpu():
    # the real section on the CPU, each step timed once: every figure and row is there
    out, rows = step_overhead_rows(torch.device("cpu"), reps=1, rounds=1, warmup=0)
    for key in ("forward", "checkpointed", "checkpointed_selective", *FIT):
        assert out[key] >= 0
    assert len(rows) == 6 and all(r["checkpointed"] > r["saved"] > 0 for r in rows)


def test_gobrrr_calibrate_keeps_the_surcharge_per_op():
    # the two-part fit is not adopted: a calibration `gobrrr calibrate` makes must not carry
    # it (rates.host would charge it), and its pooled figures are all there
    out = step_overhead(torch.device("cpu"), reps=1, rounds=1, warmup=0)
    assert not [k for k in out if "_fit_" in k]
    for key in ("forward", "backward", "recompute", "checkpointed", "checkpointed_selective"):
        assert out[key] >= 0


def _real_pack_calls(make) -> dict[str, int]:
    """{block: tensors autograd packed while the block ran} in a real CPU step of `make`'s
    model, without checkpointing: what a checkpoint's hook would run on."""
    wl = make()
    model, here, out = wl.model, [], {}

    def pack(x):
        if here:
            out[here[-1]] = out.get(here[-1], 0) + 1
        return x

    def enter(name):
        return lambda m, a: here.append(name)

    def leave(m, a, o):
        here.pop()

    handles = []
    for name in block_names(model):
        m = model.get_submodule(name)
        handles += [m.register_forward_pre_hook(enter(name)), m.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        wl.compute_loss(wl.batch)
    for h in handles:
        h.remove()
    return out


def _traced_per_block(graph: StepGraph, blocks: list[str]) -> dict[str, int]:
    under = checkpointed_modules(graph)
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.phase == "forward" and n.module in under:
            b = next(b for b in blocks if n.module == b or n.module.startswith(b + "."))
            out[b] = out.get(b, 0) + n.saved
    return out


@pytest.mark.parametrize("model", ["llama3", "llama3-lora"])
def test_traced_and_pass_counts_match_pytorchs_pack_calls(model):
    # the calibration's tiny Llama, plain and LoRA'd (its frozen linears save their weight
    # alone, its adapters' scale is a Python number autograd saves without the hooks): traced
    # with its blocks checkpointed (the hooks packed what each op saved), and checkpointed by
    # the pass from a plain trace, each block's ops save what PyTorch packs for that block in
    # a real CPU step, op for op the same
    make = dict(_fit_workloads())[model]
    blocks = block_names(make().model)
    traced = capture(make, precision="fp32", checkpoint="full")
    passed = checkpoint(capture(make, precision="fp32"), dict.fromkeys(blocks, "full"))
    real = _real_pack_calls(make)
    assert set(real) == set(blocks) and all(v > 0 for v in real.values())
    if model == "llama3-lora":
        # but the first LoRA'd block: its k and v need no gradient (frozen weights over the
        # frozen embedding's output), where the trace's attention (SDPA's math path) saves 4
        # tensors and the CPU's fused kernel 5
        real["layers.0"] -= 1
    assert _traced_per_block(traced, blocks) == real
    assert _traced_per_block(passed, blocks) == real
    fwd = [(n.name, n.saved) for n in traced.nodes if n.phase == "forward"]
    assert fwd == [(n.name, n.saved) for n in passed.nodes if n.phase == "forward"]
