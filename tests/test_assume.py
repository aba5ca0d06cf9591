"""Values a fake-tensor trace reads (gobrrr.capture.assume and facts), held against PyTorch
running the same code for real: facts bound what real runs produce, exact reads equal them,
shapes answered under an assumption are the ones the assumption names, each read is
recorded where it happened, and a read no assumption covers is one clear error."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import gobrrr
from gobrrr.capture import assume, capture
from gobrrr.cost.flops import op_cost
from gobrrr.errors import GobrrrError
from gobrrr.report.estimate import estimate_dict
from gobrrr.report.terminal import assumption_lines
from zoo.common import available

ROOT = Path(__file__).resolve().parents[1]


def traced(fn):
    """fn() under fake tensors with gobrrr's value reads: (Values, fn's result)."""
    values = assume.Values()
    with FakeTensorMode(allow_non_fake_inputs=True), assume.ValueMode(values):
        return values, fn()


# -- facts bound real values --------------------------------------------------------------------


def batch_checks():
    labels = torch.randint(1, 32, (8, 100))
    mask = labels >= 0
    return {
        "mask": mask,
        "lengths": mask.sum(-1),
        "total": mask.sum(),
        "too_big": labels.max() >= 32,
        "any_pad": (labels == -100).any(),
        "selected": labels.masked_select(mask),
        "none": labels.masked_select(labels < 0),
        "half": torch.div(mask.sum(-1), 2, rounding_mode="floor"),
        "as_int": mask.long(),
    }


def draws():
    r = torch.rand([])
    p = torch.rand(100)
    return {"never": r < 0.0, "always": r >= 0.0, "some": p < 0.3, "kept": p.clamp(max=0.5)}


def arithmetic():
    a = torch.arange(3, 50, 4)
    return {
        "a": a,
        "clamped": a.clamp(max=30),
        "cat": torch.cat([a, -a]),
        "cumsum": a.cumsum(0),
        "where": torch.where(a > 10, a, -a),
        "affine": torch.ones(4, dtype=torch.long) * 5 - 2,
        "filled": torch.zeros(3).masked_fill(torch.ones(3, dtype=torch.bool), 7.0),
        "perm_max": torch.randperm(10).max(),
        "argmax": torch.randn(5, 7).argmax(dim=1),
    }


def routing():
    ids = torch.topk(torch.randn(64, 8).softmax(-1), 2, dim=-1).indices
    flat = ids.flatten()
    return {
        "ids": ids,
        "one_hot": F.one_hot(ids, 8),
        "counts": torch.bincount(flat, minlength=8),
        "order": torch.sort(flat).indices,
        "hist": torch.histc(flat.float(), 8, 0, 7),
    }


@pytest.mark.parametrize("program", [batch_checks, draws, arithmetic, routing])
def test_facts_bound_what_real_runs_produce(program):
    values, fake = traced(program)
    facts = {k: values.table.get(t) for k, t in fake.items()}
    assert all(f is not None for f in facts.values()), facts
    for seed in range(10):
        torch.manual_seed(seed)
        for name, t in program().items():
            f, x = facts[name], t.double()
            if not x.numel():
                continue
            assert f.lo <= x.min().item() and x.max().item() <= f.hi, (name, f, x)
            if f.exact:
                assert torch.all(x == f.lo), (name, f)
            if f.mean is not None and not f.basis:  # an exact mean over the whole tensor
                assert x.mean().item() == pytest.approx(f.mean), (name, f)


def reads(checks):
    return (
        bool(checks["too_big"]),
        bool(checks["any_pad"]),
        int(checks["total"]),
        checks["lengths"].tolist(),
        tuple(checks["selected"].shape),
        tuple(checks["none"].shape),
    )


def test_exact_reads_are_the_values_real_runs_read():
    values, fake = traced(lambda: reads(batch_checks()))
    assert fake == reads(batch_checks()) == (False, False, 800, [100] * 8, (800,), (0,))
    assert {a.kind for a in values.assumptions()} == {"derived"}


def padded_count():
    labels = torch.randint(0, 32, (4, 16)).masked_fill(torch.arange(16) >= 12, -100)
    return int((labels != -100).sum())


def test_a_count_the_bounds_leave_open_takes_its_upper_bound():
    values, n = traced(padded_count)
    assert n == 64 >= padded_count() == 48  # every element counted: an upper bound
    assert [(a.kind, a.value) for a in values.assumptions()] == [("upper-bound", "64")]


# -- reads in a traced step: where, what, how often -----------------------------------------------


class LayerDrop(nn.Module):
    """BART / wav2vec2's LayerDrop: each layer is skipped when a uniform draw is below p (a
    host tensor there: `torch.rand([])`; `on_device`: drawn beside the activations)."""

    def __init__(self, p: float, n: int = 4, on_device: bool = False):
        super().__init__()
        self.p, self.on_device = p, on_device
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers:
            draw = torch.rand([], device=x.device) if self.on_device else torch.rand([])
            if self.training and draw < self.p:
                continue
            x = layer(x)
        return self.head(x).mean()


def layerdrop(p, on_device=False):
    return lambda: gobrrr.Workload(
        model=LayerDrop(p, on_device=on_device), batch=(torch.randn(4, 8),)
    )


@pytest.mark.parametrize(
    ("p", "kind", "value", "layers"),
    [
        (0.0, "derived", "False", 4),  # a draw in [0, 1) is never below 0
        (0.1, "likely-draw", "False (p=0.10)", 4),
        (0.75, "likely-draw", "True (p=0.75)", 0),
    ],
)
def test_layerdrop_takes_the_likely_branch_and_says_so(p, kind, value, layers):
    g = capture(layerdrop(p), precision="fp32")
    fwd = [n for n in g.nodes if n.phase == "forward" and n.name == "addmm"]
    assert len(fwd) == layers + 1  # the head always runs
    assert list(g.meta.assumptions) == [
        {
            "kind": kind,
            "what": assume.KINDS[kind],
            "op": "aten._local_scalar_dense",
            "module": "",
            "phase": "forward",
            "value": value,
            "count": 4,
        }
    ]
    draws = [n.index for n in g.nodes if n.name == "lt"]
    assert len(draws) == 4 and not set(draws) & set(g.meta.syncs)  # read on the host


def test_a_read_of_a_gpu_tensor_makes_the_host_wait():
    g = capture(layerdrop(0.1, on_device=True), precision="fp32")
    draws = [n.index for n in g.nodes if n.name == "lt"]
    assert len(draws) == 4 and set(draws) <= set(g.meta.syncs)


class Checked(nn.Module):
    """Validity checks as libraries write them: an id range test on the batch, a NaN test on
    an activation."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.lin = nn.Linear(8, 8)

    def forward(self, ids):
        if (ids >= 32).any():
            raise ValueError("id out of range")
        h = self.lin(self.emb(ids))
        if torch.isnan(h).any():
            raise ValueError("nan")
        return h.float().pow(2).mean()


def test_checks_take_their_common_branch():
    w = lambda: gobrrr.Workload(model=Checked(), batch=(torch.randint(0, 32, (4, 16)),))
    g = capture(w, precision="fp32")
    kinds = {(a["kind"], a["value"], a["phase"]) for a in g.meta.assumptions}
    assert kinds == {("derived", "False", "forward"), ("check-passes", "False", "forward")}


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y[y > 0].sum()  # boolean indexing: the shape depends on the values


def test_boolean_indexing_selects_every_element_an_upper_bound():
    g = capture(
        lambda: gobrrr.Workload(model=Gather(), batch=(torch.randn(3, 4),)), precision="fp32"
    )
    index = next(n for n in g.nodes if n.name == "index" and n.phase == "forward")
    assert index.outputs[0].shape == (12,)
    assert g.meta.assumptions[0] | {"what": ""} == {
        "kind": "all-selected",
        "what": "",
        "op": "aten.index.Tensor",
        "module": "",
        "phase": "forward",
        "value": "12 of 12",
        "count": 1,
    }


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if h.sum().item() > 0 else h  # a branch on an activation's value


def test_a_read_no_assumption_covers_is_one_error_naming_op_module_and_fix():
    model = nn.Sequential(Gate(), nn.Linear(4, 1))
    with pytest.raises(GobrrrError) as e:
        capture(
            lambda: gobrrr.Workload(
                model=model, batch=(torch.randn(3, 4),), loss=lambda y, b: y.mean()
            ),
            precision="fp32",
        )
    msg = str(e.value)
    for part in (
        "aten._local_scalar_dense",
        "made by aten.sum",
        "module '0'",
        "phase forward",
        "move the read out of the training step",
    ):
        assert part in msg, msg


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))


def test_adafactor_reads_its_norms_and_runs_the_ops_a_real_step_runs():
    adafactor = lambda ps: torch.optim.Adafactor(ps, lr=1e-2)
    g = capture(
        lambda: gobrrr.Workload(
            model=small_mlp(),
            batch=(torch.randn(4, 16),),
            loss=lambda y, b: y.mean(),
            optimizer=adafactor,
        ),
        precision="fp32",
    )
    traced = Counter(n.op for n in g.nodes if n.phase == "optimizer")
    model = small_mlp()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, foreach=True)  # CUDA's default
    for step in range(2):  # the second step, as the trace records it
        model(torch.randn(4, 16)).mean().backward()
        with OpCounter() if step else contextlib.nullcontext() as counter:
            opt.step()
            opt.zero_grad(set_to_none=True)
    real = Counter({k: v for k, v in counter.counts.items() if "_local_scalar_dense" not in k})
    assert traced == real
    assert {(a["kind"], a["phase"], a["count"]) for a in g.meta.assumptions} == {
        ("optimizer-scale", "warm-up", 8),
        ("optimizer-scale", "optimizer", 8),
    }


# -- mixture-of-experts routing: balanced, as uniform routing is on average -----------------------


def old_style_moe(tokens=256, experts=8, k=2):
    """Routing as older Hugging Face MoE layers wrote it: nonzero per expert of a one-hot
    mask, and the per-expert counts read to the host to split the tokens."""
    ids = torch.topk(torch.randn(tokens, experts), k, dim=-1).indices
    mask = F.one_hot(ids, experts).permute(2, 1, 0)  # (E, k, T)
    per_expert = [torch.where(mask[e])[1].shape[0] for e in range(experts)]
    sizes = torch.bincount(ids.flatten(), minlength=experts).tolist()
    parts = torch.randn(tokens * k, 4).split(sizes)
    return per_expert, sizes, [p.shape[0] for p in parts]


def test_routing_is_taken_as_balanced_the_mean_of_uniform_routing():
    values, (per_expert, sizes, parts) = traced(old_style_moe)
    assert per_expert == sizes == parts == [64] * 8  # 256 tokens x top-2 over 8 experts
    assert {a.kind for a in values.assumptions()} == {"balanced", "derived"}  # derived: bins
    torch.manual_seed(0)
    real = torch.tensor([old_style_moe()[0] for _ in range(200)], dtype=torch.float)
    assert real.mean(0).tolist() == pytest.approx([64] * 8, rel=0.05)  # each expert, on average


# -- the build: small tensors real, large ones fake, the user's things untouched -------------------


class Scheduled(nn.Module):
    """A constructor that reads what it computes (timm / torchvision stochastic depth), with a
    parameter far too large to allocate for real in a test."""

    def __init__(self):
        super().__init__()
        self.rates = torch.linspace(0, 0.3, 4).tolist()
        self.kinds = torch.unique(torch.tensor([3, 1, 3, 2])).tolist()
        self.big = nn.Parameter(torch.empty(1 << 30))  # 4 GiB in fp32
        nn.init.trunc_normal_(self.big, std=0.02)
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x).mean() + self.big[:1].sum()


def test_a_constructor_reads_its_schedule_while_large_tensors_stay_fake():
    built = []

    def workload():
        built.append(Scheduled())
        return gobrrr.Workload(model=built[0], batch=(torch.randn(2, 4),))

    state = torch.get_rng_state()
    g = capture(workload, precision="fp32")
    model = built[0]
    assert model.rates == torch.linspace(0, 0.3, 4).tolist() and model.kinds == [1, 2, 3]
    assert all(isinstance(p, FakeTensor) for p in model.parameters())
    assert sum(s.nbytes for s in g.storages if s.kind == "parameter") == (4 + 1 + (1 << 30)) * 4
    assert torch.equal(torch.get_rng_state(), state)  # the user's random stream is untouched


def test_a_model_from_outside_the_workload_function_is_left_untouched():
    model = nn.Linear(4, 1)
    before = model.weight
    values = model.weight.detach().clone()
    g = capture(
        lambda: gobrrr.Workload(
            model=model, batch=(torch.randn(2, 4),), loss=lambda y, b: y.mean()
        ),
        precision="fp32",
    )
    assert g.meta.params == 5
    assert model.weight is before and not isinstance(model.weight, FakeTensor)
    assert torch.equal(model.weight, values)


# -- grouped matmuls (mixture-of-experts experts) --------------------------------------------------


class Experts(nn.Module):
    """Hugging Face's grouped experts: rows sorted by expert, `_grouped_mm` with offsets, the
    input cast to the weight's dtype (fp32 under autocast, which has no rule for it)."""

    def __init__(self, experts=4, d=16, f=32):
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.up = nn.Parameter(torch.randn(experts, d, f) * 0.02)
        self.down = nn.Parameter(torch.randn(experts, f, d) * 0.02)

    def forward(self, x):
        ids = self.router(x).topk(1, dim=-1).indices.flatten()
        order = ids.argsort()
        counts = torch.histc(ids.float(), bins=self.up.shape[0], min=0, max=self.up.shape[0] - 1)
        offs = counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(x[order].to(self.up.dtype), self.up, offs=offs)
        return torch._grouped_mm(F.silu(h), self.down, offs=offs).float().pow(2).mean()


@pytest.mark.parametrize(
    ("precision", "dtype", "syncs"), [("bf16-mixed", "float32", 5), ("bf16", "bfloat16", 0)]
)
def test_grouped_mm_runs_cuda_fallback_in_fp32_under_autocast(precision, dtype, syncs):
    g = capture(
        lambda: gobrrr.Workload(model=Experts(), batch=(torch.randn(64, 16),)), precision=precision
    )
    grouped = [n for n in g.nodes if n.name == "_grouped_mm"]
    # 2 forward; backward: both weight gradients, one input gradient (the batch needs none)
    assert len(grouped) == 5
    assert {n.outputs[0].dtype for n in grouped} == {dtype}
    assert sum(n.index in g.meta.syncs for n in grouped) == syncs  # fallback: offs to host
    torch_dtype = getattr(torch, dtype)
    x, w = torch.randn(64, 16, dtype=torch_dtype), torch.randn(4, 16, 32, dtype=torch_dtype)
    real = torch._grouped_mm(x, w, offs=torch.tensor([16, 32, 48, 64], dtype=torch.int32))
    assert grouped[0].outputs[0].shape == tuple(real.shape)


def test_grouped_mm_flops_are_the_sum_of_the_per_group_matmuls():
    """Against PyTorch's FlopCounterMode on the loop of matmuls the grouped call stands for."""
    g = capture(
        lambda: gobrrr.Workload(model=Experts(), batch=(torch.randn(64, 16),)), precision="bf16"
    )
    x, w = torch.randn(64, 16), torch.randn(4, 16, 32)
    bounds = [(0, 10), (10, 30), (30, 31), (31, 64)]  # any split of the 64 rows
    with FlopCounterMode(display=False) as fc:
        for e, (s, t) in enumerate(bounds):
            x[s:t] @ w[e]
    fwd = next(n for n in g.nodes if n.name == "_grouped_mm")
    assert op_cost(fwd).flops == fc.get_total_flops() == 2 * 64 * 16 * 32
    weight_grads = [
        n
        for n in g.nodes
        if n.name == "_grouped_mm" and len(n.inputs[0].shape) == len(n.inputs[1].shape) == 2
    ]
    assert weight_grads, "the backward computes expert weight gradients with 2-D operands"
    for n in weight_grads:  # (d, rows) @ (rows, f) split over rows: 2·d·f·rows in all
        a, out = n.inputs[0], n.outputs[0]
        assert op_cost(n).flops == 2 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    assert op_cost(fwd).launches == 1 and op_cost(fwd).kind == "matmul"


# -- the report names every read ----------------------------------------------------------------


def test_estimate_and_terminal_name_each_assumption_kind():
    est = gobrrr.estimate(layerdrop(0.1), gpu="h100", precision="fp32")
    d = estimate_dict(est)
    assert d["assumptions"] == list(est.graph.meta.assumptions)
    assert "assumptions" not in d["workload"]
    lines = assumption_lines(
        d["assumptions"] + [dict(d["assumptions"][0], kind="derived", value="False", module="enc")]
    )
    assert len(lines) == 2
    assert "random draw" in lines[0] and "4×" in lines[0] and "False (p=0.10)" in lines[0]
    assert lines[1].startswith("[cyan]read exactly:") and "enc (forward)" in lines[1]


# -- zoo cases: the traced step runs the ops CUDA ran ----------------------------------------------

ZOO_OPS = {  # ops whose count the reads decide, held against the H100's count for one step
    "mixtral-8x-small": [
        "aten._grouped_mm.default",
        "aten.bincount.default",
        "aten.histc.default",
        "aten.index.Tensor",
        "aten.ge.Scalar",
        "aten._scaled_dot_product_cudnn_attention.default",
    ],
    "wav2vec2-base-ctc": [
        "aten._ctc_loss.Tensor",
        "aten._ctc_loss_backward.Tensor",
        "aten.masked_select.default",
        "aten.ge.Scalar",
        "aten.lt.Scalar",
        "aten.index.Tensor",
    ],
    "bart-base": ["aten.lt.Scalar", "aten._scaled_dot_product_cudnn_attention.default"],
}


@pytest.fixture
def transformers_logging():
    """transformers binds its log handler to the stderr of the moment it first logs (here,
    this test's capture); unbound afterwards, so later tests' own capture sees its notices."""
    if not available("transformers"):
        pytest.skip("transformers is not installed: pip install 'gobrrr[zoo]'")
    yield
    from transformers.utils import logging as hf_logging

    hf_logging._reset_library_root_logger()


@pytest.mark.parametrize("name", list(ZOO_OPS))
def test_zoo_steps_that_read_values_run_the_ops_cuda_ran(name, transformers_logging):
    from zoo.cases import get_case

    doc = json.loads((ROOT / "tests" / "fixtures" / "zoo_h100.json").read_text())
    measured = next(r for r in doc["cases"] if r["name"] == name)["aten_ops"]
    case = get_case(name)
    g = capture(case.factory(), precision=case.precision)
    counts = Counter(n.op for n in g.nodes)
    assert {op: counts[op] for op in ZOO_OPS[name]} == {op: measured[op] for op in ZOO_OPS[name]}
    assert g.meta.assumptions, "every value the step read is named"
