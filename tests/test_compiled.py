"""Compiled steps: `capture(compile=True)` and the Inductor pass, against torch itself.

The reference for what a compiled forward keeps is PyTorch running it: the model compiled by
torch.compile with Inductor (its CPU code generation) on real tensors, and the tensors its
autograd node saved (`CompiledFunctionBackward.saved_tensors`). The rest is hand-derived on
small models: which activations an MLP keeps, which intermediates take no memory.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import extern, fuse, regions
from gobrrr.evaluate import evaluate
from gobrrr.models.registry import get_workload

needs_cxx = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="Inductor's CPU code generation needs a C++ compiler",
)


class Halves(nn.Module):
    """Linear-GELU-LayerNorm, then (after an optional graph break) Linear-Tanh."""

    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128))
        self.b = nn.Sequential(nn.Linear(128, 64), nn.Tanh())
        self.graph_break = graph_break

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.graph_break:
            torch._dynamo.graph_break()
        return self.b(h)


def _key(shape, dtype) -> tuple:
    return tuple(int(s) for s in shape), str(dtype).removeprefix("torch.")


def inductor_saved(model: nn.Module, x: torch.Tensor) -> Counter:
    """(shape, dtype) of what the compiled forward saves for backward, as torch runs it:
    Inductor on the CPU, real tensors; parameters and the input left out."""
    torch._dynamo.reset()
    out = torch.compile(model)(x).sum()
    own = {p.data_ptr() for p in model.parameters()} | {x.data_ptr()}
    saved, stack, seen = Counter(), [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if "CompiledFunction" in fn.name():
            saved.update(
                _key(t.shape, t.dtype) for t in fn.saved_tensors if t.data_ptr() not in own
            )
        stack.extend(f for f, _ in fn.next_functions)
    torch._dynamo.reset()
    return saved


def traced_saved(g) -> Counter:
    """(shape, dtype) of the activations the traced compiled forwards create (allocated)."""
    out = Counter()
    for kind, first, last in g.meta.compiled_regions:
        if kind != "forward":
            continue
        for n in g.nodes[first : last + 1]:
            for t in n.outputs:
                s = g.storages[t.storage]
                if s.kind == "activation" and s.nbytes and s.created == n.index:
                    out[_key(t.shape, t.dtype)] += 1
    return out


def _workload(model: nn.Module) -> gobrrr.Workload:
    return gobrrr.Workload(
        model=model, batch=(torch.randn(32, 64),), step=lambda m, b: m(b[0]).sum()
    )


@needs_cxx
@pytest.mark.parametrize("graph_break", [False, True])
def test_the_compiled_forward_saves_what_inductor_saves(graph_break):
    """A GELU and a LayerNorm between matmuls, in one graph and split by a graph break: the
    tensors the traced forward keeps for backward are those Inductor's compiled forward
    saves (its partition recomputes the GELU, keeps the LayerNorm's statistics)."""
    want = inductor_saved(Halves(graph_break), torch.randn(32, 64))
    g = capture(_workload(Halves(graph_break)), precision="fp32", compile=True)
    assert traced_saved(g) == want
    graphs = 2 if graph_break else 1
    assert g.meta.compiled_graphs == {"forward": graphs, "backward": graphs}
    eager = capture(_workload(Halves(graph_break)), precision="fp32")
    assert _activation_bytes(eager) > _activation_bytes(g)  # eager keeps the GELU's input too


def _activation_bytes(g) -> int:
    return sum(s.nbytes for s in g.storages if s.kind == "activation")


def _mlp(compile: bool, layers: int = 3):
    return capture(
        lambda: get_workload("mlp", 64, layers=layers, width=256),
        precision="bf16-mixed",
        compile=compile,
    )


def test_an_mlp_keeps_each_relu_output_but_the_last_layer_s_matmul_output():
    """DeepMLP (Linear without bias, ReLU; MSE) in bf16 autocast, L = 3, B = 64, width 256,
    by hand: the forward keeps each layer's ReLU output but the last (the next matmul's
    input; ReLU's backward reads its mask from it), the last layer's matmul output instead
    (its ReLU is recomputed in backward, fused into the MSE gradient), the bf16 copy of the
    input (weight 1's gradient reads it), the bf16 copies of weights 2 and 3 (the gradients
    of layers 2 and 3's inputs read them; nothing needs layer 1's input gradient, so weight
    1's copy is not kept), and the loss. Nothing else: the MSE's difference and square live
    in one fused kernel. Each is freed by the backward, once it has used it."""
    g = _mlp(compile=True)
    kept = Counter()
    optimizer = next(n.index for n in g.nodes if n.phase == "optimizer")
    for kind, first, last in g.meta.compiled_regions:
        for n in g.nodes[first : last + 1] if kind == "forward" else ():
            for sid in n.allocs:
                s = g.storages[sid]
                if s.kind == "activation" and s.nbytes:
                    kept[(n.name, s.nbytes)] += 1
                    assert s.freed is not None and s.freed < optimizer
                    assert g.nodes[s.freed].phase == "backward"
    act, weight = 64 * 256 * 2, 256 * 256 * 2
    assert kept == Counter(
        {
            ("relu", act): 2,
            ("mm", act): 1,
            ("convert_element_type", act): 1,
            ("convert_element_type", weight): 2,
            ("mean", 4): 1,
        }
    )


def test_what_fused_kernels_make_takes_no_memory():
    """In the compiled MLP, the MSE's intermediates (difference, square, fp32 copy) are
    0-byte storages with their shapes kept for the time model; every input of an extern
    kernel (the matmuls) is allocated; the peak is at most the eager step's."""
    g = _mlp(compile=True)
    costs = graph_costs(g)
    for n in g.nodes:
        if extern(n, costs[n.index]) and regions(g)[n.index] >= 0:
            assert all(g.storages[t.storage].nbytes > 0 for t in (*n.inputs, *n.outputs))
    fwd = next(r for r in g.meta.compiled_regions if r[0] == "forward")
    sub = next(n for n in g.nodes[fwd[1] : fwd[2] + 1] if n.name == "sub")
    assert g.storages[sub.outputs[0].storage].nbytes == 0
    assert sub.outputs[0].shape == (64, 256) and sub.outputs[0].dtype == "float32"
    assert g.meta.inductor["unallocated"] > 0
    assert evaluate(g).memory.peak <= evaluate(_mlp(compile=False)).memory.peak


def test_fused_groups_stay_inside_compiled_regions():
    """A loss computed outside the model (and the optimizer) runs eagerly: no fused group
    takes an op outside a compiled region, and none spans two regions."""
    g = capture(_workload(Halves(graph_break=True)), precision="fp32", compile=True)
    region = regions(g)
    groups = fuse(g, graph_costs(g))
    assert groups
    for grp in groups:
        assert len({region[i] for i in grp.nodes}) == 1 and region[grp.nodes[0]] >= 0
    loss = [n for n in g.nodes if n.phase == "forward" and n.name == "sum"]
    assert loss and all(region[n.index] == -1 for n in loss)
    est = evaluate(g)
    assert est.compiled and all(est.time.ops[n.index].host_s > 0 for n in loss)


def test_a_compiled_step_is_a_steady_state_one():
    """The compiled model is warmed up before the recorded step: no recompile in it (one
    forward and one backward graph), and micro-batches 2 and 3 of an accumulated step run
    the same ops as micro-batch 1."""
    g = capture(
        lambda: get_workload("mlp", 6, layers=2, width=64),
        precision="bf16-mixed",
        compile=True,
        accumulation=3,
    )
    assert g.meta.compiled_graphs == {"forward": 1, "backward": 1}
    runs = [r for r in g.meta.compiled_regions if r[0] == "forward"]
    assert len(runs) == 3
    ops = [[n.op for n in g.nodes[a : b + 1]] for _, a, b in runs]
    assert ops[0] == ops[1] == ops[2]
