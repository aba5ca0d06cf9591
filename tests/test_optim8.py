"""8-bit optimizer states in the planner: the traced optimizer against torchao's AdamW8bit
itself (state layout, numerics), the update's cost, and the planner choosing 8-bit states."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gobrrr.cli import main
from gobrrr.cost._ops_optim import adam8bit_bytes, adam8bit_scratch
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.evaluate import evaluate
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.hardware import Target
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import BASE, Planner, _persistent, plan
from gobrrr.training.optim_trace import Adam8bitTrace, dynamic_map, state_bytes
from gobrrr.workload import Workload

MiB = 2**20
EIGHT = Knobs(micro_batch=1, optimizer_states="8bit")  # the traced 8-bit variant
RESULTS = Path(__file__).resolve().parent / "fixtures" / "optim8_h100.json"
# the optim8 section as shipped: measured over both layouts (profile.calibrate_optim)
SECTION = RESULTS.parent / "calibration_sections_h100_run18.json"
SHAPES = [(64, 256), (100,), (4100,)]  # quantised; small; >= 4096 but not a multiple of 256


def _pair(cls_name: str, steps: int, shapes=SHAPES, **hyper):
    """torchao's optimizer and Adam8bitTrace over copies of the same parameters, `steps`
    steps on the same gradients."""
    ao = pytest.importorskip("torchao.optim")
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    a = getattr(ao, cls_name)(ps, lr=1e-2, **hyper)
    b = Adam8bitTrace(qs, lr=1e-2, decoupled=cls_name == "AdamW8bit", **hyper)
    for _ in range(steps):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step()
        b.step()
    return a, ps, b, qs


@pytest.fixture(scope="module")
def adamw():
    return _pair("AdamW8bit", 3, weight_decay=0.1)


def _flat(state: dict) -> list[tuple]:
    """(dtype, shape, bytes, device) of each state tensor in order, torchao's 8-bit subclass
    opened into its codes, scale and code book."""
    out = []
    for v in state.values():
        parts = [v.codes, v.scale, v.qmap] if hasattr(v, "codes") else [v]
        out += [
            (t.dtype, tuple(t.shape), t.numel() * t.element_size(), t.device.type) for t in parts
        ]
    return out


def test_state_layout_is_torchaos(adamw):
    a, ps, b, qs = adamw
    for p, q in zip(ps, qs, strict=True):
        assert _flat(b.state[q]) == _flat(a.state[p])
        assert sum(x[2] for x in _flat(a.state[p])[1:]) == state_bytes(p.numel(), 4)
    kinds = [[type(v).__name__ for v in a.state[p].values()] for p in ps]
    assert kinds[0] == ["Tensor", "OptimState8bit", "OptimState8bit"]  # the first is quantised
    assert kinds[1] == kinds[2] == ["Tensor"] * 3
    assert dynamic_map(True) == a.state[ps[0]]["exp_avg"].qmap.tolist()
    assert dynamic_map(False) == a.state[ps[0]]["exp_avg_sq"].qmap.tolist()


def _same_update(a, ps, b, qs):
    for p, q in zip(ps, qs, strict=True):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6)
        sa, sb = a.state[p], b.state[q]
        assert float(sb["step"]) == float(sa["step"])
        for m in ("exp_avg", "exp_avg_sq"):
            if hasattr(sa[m], "codes"):  # the same codes; scales within float rounding
                assert torch.equal(sb[m], sa[m].codes)
                torch.testing.assert_close(sb[f"{m}_scale"], sa[m].scale, rtol=1e-6, atol=0)
            else:
                # Inductor fuses the lerp and square: a few fp32 roundings apart
                torch.testing.assert_close(sb[m], sa[m], rtol=1e-5, atol=1e-8)


def test_adamw_update_is_torchaos(adamw):
    _same_update(*adamw)


def test_adam_with_l2_weight_decay_is_torchaos():
    _same_update(*_pair("Adam8bit", 2, SHAPES[:2], weight_decay=0.05))  # fewer compiles


# -- the traced step and its cost ------------------------------------------------------------
def _stack(batch_size: int = 4, seq_len=None, layers: int = 4, width: int = 1024):
    """`layers` bias-free width x width fp32 linears: hand-countable bytes."""
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return Workload(
        model=model, batch=torch.randn(batch_size, width), loss=lambda out, b: out.square().mean()
    )


@pytest.fixture(scope="module")
def planner():
    return Planner(
        _stack,
        "h100",
        global_batch=4,
        allow=["8bit-states"],
        memory_budget=128 * MiB,
        calibration=None,
    )


def test_the_trace_has_one_update_per_parameter_and_torchaos_states(planner):
    g = planner.steps.at(EIGHT, 4)
    ups = [n for n in g.nodes if n.op == "gobrrr.adam8bit_update.default"]
    assert len(ups) == 4 and all(n.phase == "optimizer" for n in ups)
    assert not [n for n in g.nodes if n.phase == "optimizer" and n.op.startswith("aten.")]
    states = [s for s in g.storages if s.kind == "optimizer_state"]
    assert sum(s.nbytes for s in states) == 4 * state_bytes(2**20, 4)
    assert _persistent(planner.steps.at(BASE, 4), EIGHT) == 4 * (8 * MiB) + sum(
        s.nbytes for s in states
    )
    # in place: the compiled update allocates nothing on the GPU (recorded: "transient")
    assert not [s for s in g.storages if s.created in {n.index for n in ups}]
    assert all(not n.outputs for n in ups)


def test_the_recorded_updates_allocate_by_layout():
    """torchao's compiled update on the H100: for rows of one 256-element block, the allocated
    peak over a step of updates stayed at the bytes allocated before it at every size (the
    trace's op allocates nothing, above); for any other row width, the update allocated and
    freed exactly adam8bit_scratch's blocks (two fp32 buffers of the block count, two of the
    parameter's size; each at least the allocator's 512 bytes), to the byte where the width
    divides 2**22 and within 2 KiB at 768."""
    from gobrrr.memory.allocator import round_size

    rec = json.loads(SECTION.read_text())["sections"]["optim8"]
    assert [n for n, _ in rec["transient"]] == [1024, 4096, 65536, 2**20, 2**22, 2**24, 2**26]
    assert all(b == 0 for _, b in rec["transient"])

    def rule(shape):
        node = OpNode(
            index=0,
            op="gobrrr.adam8bit_update.default",
            phase="optimizer",
            module="",
            inputs=(TensorInfo(shape, (shape[-1], 1), "float32", 0),),
            outputs=(),
            args=(),
            kwargs={},
            allocs=(),
        )
        return sum(round_size(b) for b in adam8bit_scratch(node))

    assert len(rec["transient_rows"]) == 6
    for n, measured in rec["transient_rows"]:
        assert rule((n // 4096, 4096)) == measured
    for width, measured in rec["row_widths"]:  # 768 rows: measured 2 KiB over the rule
        assert rule((2**22 // width, width)) == pytest.approx(measured, abs=4096)
    assert rule((2**22 // 256, 256)) == 0


def test_update_cost_is_the_bytes_it_must_move(planner):
    g = planner.steps.at(EIGHT, 4)
    node = next(n for n in g.nodes if n.op == "gobrrr.adam8bit_update.default")
    n = 2**20
    minimal = n * (2 * 4 + 4) + 2 * (2 * (n + 4 * n // 256) + 4 * 256)
    assert adam8bit_bytes(n, 4, 4) == minimal
    assert op_cost(node).bytes == minimal and op_cost(node).launches == 1
    small = 1000  # moments in fp32: read and written like the parameter
    assert adam8bit_bytes(small, 4, 4) == small * 12 + 2 * 2 * small * 4


def test_a_measured_section_sets_the_updates_time(planner):
    """Device seconds read log-log between measured points, scaled by bytes past them; the
    host's per update as measured."""
    g = planner.steps.at(EIGHT, 4)
    node = next(n for n in g.nodes if n.op == "gobrrr.adam8bit_update.default")
    cal = Target.resolve("h100").cal
    nbytes = op_cost(node).bytes
    sec = {"device": [[nbytes / 4, 1e-5], [nbytes * 4, 4e-5]], "host": 3e-5}
    rates = Rates(planner.target.gpu, replace(cal, optim8=sec))
    assert rates.adam8bit(node, nbytes) == pytest.approx((2e-5, 3e-5))
    distinct = Rates(planner.target.gpu, replace(cal, optim8={**sec, "host_distinct": 5e-5}))
    assert distinct.adam8bit(node, nbytes)[1] == 5e-5  # a model's shapes are distinct
    assert rates.adam8bit(node, nbytes * 8)[0] == pytest.approx(8e-5)
    assert rates.adam8bit(node, nbytes / 8)[0] == pytest.approx(1e-5)
    assert Rates(planner.target.gpu, None).adam8bit(node, nbytes) is None


# -- the planner -----------------------------------------------------------------------------
def test_8bit_states_are_chosen_when_nothing_else_fits(planner):
    """4 x 4 MiB of fp32 weights. At the 8-bit step's peak: parameters and gradients 32 MiB
    and the 8-bit moments, 4 x 2 x (1 MiB of codes + 4096 fp32 scales + a 256-entry fp32 code
    book); AdamW's fp32 moments would take 32 MiB in their place. Within the 128 MiB budget
    (cuBLAS's workspaces take 64 of it) only with 8-bit states."""
    r = planner.run()
    assert r.best is not None and r.best.knobs.optimizer_states == "8bit"
    assert all(p.knobs.optimizer_states == "8bit" for p in r.plans if p.fits)
    assert any(p.knobs.optimizer_states == "as-is" for p in r.plans)  # tried, did not fit
    states = 4 * 2 * (MiB + 4 * 4096 + 4 * 256)
    eight = evaluate(planner.steps.at(EIGHT, 4), planner.target).memory
    assert eight.at_peak["parameter"] == eight.at_peak["gradient"] == 16 * MiB
    assert eight.at_peak["optimizer_state"] == states
    plain = evaluate(planner.steps.at(BASE, 4), planner.target).memory
    assert plain.at_peak["optimizer_state"] == 32 * MiB
    assert plain.peak - eight.peak >= 32 * MiB - states
    assert "8-bit optimizer states" in r.best.changes
    assert any("without a measured optim8 calibration section" in n for n in r.notes)


def test_8bit_states_need_adam():
    def sgd(batch_size: int = 4, seq_len=None):
        w = _stack(batch_size, layers=2, width=64)
        w.optimizer = lambda ps: torch.optim.SGD(ps, lr=0.1)
        return w

    r = plan(sgd, "h100", global_batch=2, allow=["8bit-states"])
    assert {p.knobs.optimizer_states for p in r.plans} == {"as-is"}
    assert any(n.startswith("8bit optimizer states not planned: ") and "SGD" in n for n in r.notes)


def test_planning_8bit_states_without_torchao_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    r = plan(
        lambda batch_size=2, seq_len=None: _stack(batch_size, layers=2, width=64),
        "h100",
        global_batch=2,
        allow=["8bit-states"],
    )
    assert any("pip install 'gobrrr[optim]'" in n for n in r.notes)


def test_an_unknown_allow_names_8bit_states(capsys):
    code = main(
        [
            "plan",
            "--model",
            "gpt2",
            "--seq",
            "64",
            "--global-batch",
            "2",
            "--allow",
            "8bit-state",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 2 and "8bit-states" in out["error"] and "8bit-state:" in out["error"]


def test_knobs_with_8bit_states_are_costed(planner):
    a = planner.cost(Knobs(micro_batch=4, optimizer_states="8bit"))
    b = planner.cost(Knobs(micro_batch=4))
    assert a.peak_bytes < b.peak_bytes and not b.fits


# -- against the H100 recording (benchmarks/calibration/bench_optim_states.py) ---------------
def test_the_shipped_section_is_the_recordings():
    from gobrrr.calibrate.sections.optim import summarize

    rec = json.loads(SECTION.read_text())["sections"]["optim8"]
    assert Target.resolve("h100").cal.optim8 == summarize(
        rec["points"], rec["host_distinct"], rec["row_widths"]
    )


def test_a_gpt2_step_with_8bit_states_as_recorded_on_the_h100():
    """gobrrr's gpt2, batch 1 x 256 tokens, bf16-mixed, torchao's AdamW8bit: a host-bound
    step (148 compiled updates at ~0.5 ms of host each); predicted on the shipped H100
    calibration against the recording: the allocated peak within 0.5%, the step within 10%."""
    from gobrrr.plan.trace import Tracer

    target = Target.resolve("h100")
    g = Tracer("gpt2", seq=256, precision="bf16-mixed", target=target, variant=EIGHT)(1)
    est = evaluate(g, target)
    rec = json.loads(RESULTS.read_text())["cases"]["gpt2-b1-s256:8bit"]
    assert est.memory.peak == pytest.approx(rec["peak_allocated"], rel=0.005)
    assert est.time.step_s == pytest.approx(rec["step_s"], rel=0.10)
