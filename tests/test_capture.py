"""Capture: phases, modules, CUDA autocast dtypes, the optimizer CUDA would run, errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.models.registry import get_workload


def tiny_gpt(**kw):
    return lambda: get_workload("gpt2", batch_size=2, seq_len=32, n_layer=2, vocab_size=96, **kw)


def outputs_of(g, name, phase="forward"):
    return [n.outputs[0] for n in g.nodes if n.name == name and n.phase == phase]


def test_phases_modules_and_round_trip():
    g = capture(tiny_gpt(), precision="fp32")
    phases = {n.phase for n in g.nodes}
    assert phases == {"forward", "backward", "optimizer"}
    # forward matmuls are attributed to the Linear that ran them
    fwd_mm = [n.module for n in g.nodes if n.name == "addmm" and n.phase == "forward"]
    assert "transformer.h.0.attn.c_attn" in fwd_mm and "transformer.h.1.mlp.c_proj" in fwd_mm
    # backward ops are attributed to modules too, not all to the top level
    bwd_modules = {n.module for n in g.nodes if n.phase == "backward"}
    assert any(m.startswith("transformer.h.1") for m in bwd_modules)
    assert StepGraph.from_json(g.to_json()) == g


def test_bf16_mixed_follows_cuda_autocast_rules():
    """CUDA autocast: matmuls in bf16, layer_norm and nll_loss in fp32 (CPU autocast would keep
    layer_norm in bf16). cross_entropy passes log_softmax its input dtype explicitly, so that
    stays bf16 on CUDA too."""
    g = capture(tiny_gpt(), precision="bf16-mixed")
    assert {t.dtype for t in outputs_of(g, "addmm")} == {"bfloat16"}
    assert {t.dtype for t in outputs_of(g, "native_layer_norm")} == {"float32"}
    assert {t.dtype for t in outputs_of(g, "_log_softmax")} == {"bfloat16"}
    assert {t.dtype for t in outputs_of(g, "nll_loss_forward")} == {"float32"}
    # weights stay fp32; their bf16 casts are made once per forward (autocast's cache)
    casts = [
        n
        for n in g.nodes
        if n.name == "_to_copy"
        and n.phase == "forward"
        and n.outputs[0].dtype == "bfloat16"
        and n.inputs[0].shape == (2304, 768)
    ]
    assert len(casts) == 2  # c_attn weight of each of the 2 blocks, cast once


def test_autocast_rules_do_not_leak_outside_capture():
    capture(tiny_gpt(), precision="bf16-mixed")
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.layer_norm(x.bfloat16(), (8,)).dtype == torch.bfloat16  # CPU's own rule


def test_pure_bf16_and_fp16_scaler():
    g = capture(tiny_gpt(), precision="bf16")
    params = [s for s in g.storages if s.kind == "parameter"]
    n_params = sum(
        p.numel()
        for p in get_workload(
            "gpt2", batch_size=1, seq_len=8, n_layer=2, vocab_size=96
        ).model.parameters()
    )
    assert sum(s.nbytes for s in params) == 2 * n_params
    g16 = capture(tiny_gpt(), precision="fp16-mixed")
    assert any("non_finite_check_and_unscale" in n.op for n in g16.nodes)


def test_default_adamw_runs_foreach_as_on_cuda_and_fused_when_asked():
    g = capture(tiny_gpt(), precision="fp32")
    opt_ops = {n.name for n in g.nodes if n.phase == "optimizer"}
    assert "_foreach_addcdiv_" in opt_ops or "_foreach_addcdiv" in opt_ops

    def fused():
        w = tiny_gpt()()
        w.optimizer = lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)
        return w

    g = capture(fused, precision="fp32")
    assert "_fused_adamw_" in {n.name for n in g.nodes if n.phase == "optimizer"}


def test_checkpoint_full_recomputes_every_block():
    g = capture(tiny_gpt(), precision="fp32", checkpoint="full")
    assert g.meta.checkpointed_blocks == 2
    rec = [n for n in g.nodes if n.phase == "recompute"]
    assert {n.module.split(".")[2] for n in rec if n.module.startswith("transformer.h.")} == {
        "0",
        "1",
    }
    fwd_mm = [n for n in g.nodes if n.phase == "forward" and n.name == "addmm"]
    rec_mm = [n.module for n in rec if n.name == "addmm"]
    # each block runs again up to its last op whose output backward needs (torch stops early)
    assert 0 < len(rec_mm) <= len(fwd_mm)
    assert {"transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"} <= set(rec_mm)


def test_checkpoint_without_blocks_is_a_clear_error():
    def flat():
        return gobrrr.Workload(
            model=nn.Linear(4, 4), batch=(torch.randn(2, 4),), loss=lambda y, b: y.sum()
        )

    with pytest.raises(GobrrrError, match="no repeated blocks"):
        capture(flat, checkpoint="full")


def test_a_workload_that_raises_is_one_clear_error():
    def boom():
        raise ValueError("bad config")

    with pytest.raises(GobrrrError, match="building the workload raised ValueError: bad config"):
        capture(boom)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return (y * 2 if y.sum().item() > 0 else y).sum()  # a branch on an activation's value


def test_data_dependent_op_names_the_op_and_module():
    """A read no assumption covers (tests/test_assume.py has the ones that are covered)."""
    wl = lambda: gobrrr.Workload(model=nn.Sequential(DataDependent()), batch=(torch.randn(3, 4),))
    with pytest.raises(GobrrrError, match="no assumption about them is sound") as e:
        capture(wl, precision="fp32")
    assert "aten._local_scalar_dense of a tensor made by aten.sum" in str(e.value)
    assert "in module '0', phase forward" in str(e.value)


def test_a_real_workload_is_traced_without_touching_its_tensors():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    w = gobrrr.Workload(model=model, batch=(torch.randn(4, 8),), loss=lambda y, b: y.mean())
    before = [p.detach().clone() for p in model.parameters()]
    g = capture(w, precision="fp32")
    assert sum(s.nbytes for s in g.storages if s.kind == "parameter") == (8 * 8 + 8 + 8 + 1) * 4
    assert g.meta.params == 8 * 8 + 8 + 8 + 1
    # the user's own parameters: still real, the same values, no gradient, and the model
    # holds the same Parameter objects (the trace ran a fake copy's step)
    for p, b in zip(model.parameters(), before, strict=True):
        assert not isinstance(p, torch._subclasses.FakeTensor)
        assert torch.equal(p, b) and p.grad is None
    assert all(not isinstance(x, torch._subclasses.FakeTensor) for x in w.batch)


def test_a_workload_function_may_convert_its_model():
    """Module.to(dtype), .half(), .to(memory_format=...) inside the workload function: under
    fake tensors PyTorch's in-place swap of parameters fails; gobrrr replaces them instead and
    leaves Module._apply as it was."""
    apply_before = nn.Module._apply

    def workload():
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, bias=False), nn.Flatten(), nn.Linear(8 * 36, 8), nn.Linear(8, 8)
        )
        model = model.to(memory_format=torch.channels_last).to(torch.bfloat16)
        x = torch.randn(2, 3, 8, 8, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
        return gobrrr.Workload(model=model, batch=(x,), loss=lambda y, b: y.float().sum())

    g = capture(workload, precision="bf16")
    assert nn.Module._apply is apply_before
    conv = next(n for n in g.nodes if n.name == "convolution")
    assert conv.inputs[1].dtype == "bfloat16"
    assert conv.inputs[1].stride == (27, 1, 9, 3)  # channels-last weight (8, 3, 3, 3)
    params = [s for s in g.storages if s.kind == "parameter"]
    assert sum(s.nbytes for s in params) == 2 * (8 * 27 + 8 * 8 * 36 + 8 + 8 * 8 + 8)
