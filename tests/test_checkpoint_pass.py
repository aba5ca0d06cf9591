"""The checkpoint pass against the step it predicts, traced afresh with the blocks checkpointed.

The reference is PyTorch itself: `capture(..., checkpoint=policies)` runs torch.utils.
checkpoint (non-reentrant, selective contexts for "selective") on the fake step and records
what it does. The pass, from the plain graph alone, must give the same graph: the same ops in
the same order with the same phases, modules and views, and every storage created and freed
at the same op (storage ids may be numbered differently). Predicted peak, reserved peak, saved
activations and step time then agree exactly. A real CPU step checks apply_checkpointing
itself: each policy gives the loss and gradients of the plain step.
"""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from torch import nn

from gobrrr.capture import capture
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import predict, saved_activations
from gobrrr.hardware import find_calibration, get_gpu
from gobrrr.memory.replay import step_memory
from gobrrr.models.registry import get_workload
from gobrrr.passes.checkpoint import checkpoint
from gobrrr.training.checkpointing import (
    SELECTIVE_SAVE,
    apply_checkpointing,
    block_names,
    checkpointed,
    remove_checkpointing,
)

WORKLOADS = {
    # dropout in every block: the recomputation draws the same masks again
    "gpt2": (
        lambda: get_workload(
            "gpt2",
            batch_size=4,
            seq_len=128,
            n_layer=4,
            n_embd=128,
            n_head=4,
            vocab_size=512,
            dropout=0.1,
        ),
        "bf16-mixed",
    ),
    "llama": (
        lambda: get_workload(
            "llama3-1b",
            batch_size=2,
            seq_len=128,
            n_layer=4,
            dim=128,
            n_head=4,
            n_kv_head=2,
            ffn_dim=256,
            vocab_size=512,
        ),
        "fp32",
    ),
    "convnet": (lambda: get_workload("convnet", batch_size=8, width=8, image_size=64), "fp32"),
}
# the same Llama with as many K/V heads as query heads: fp32 grouped-query attention runs the
# math path on CUDA (a composite of bmm and softmax), one K/V head per query head the
# memory-efficient kernel, a single op whose recomputation the attention asserts count
WORKLOADS["llama-mha"] = (
    lambda: get_workload(
        "llama3-1b",
        batch_size=2,
        seq_len=128,
        n_layer=4,
        dim=128,
        n_head=4,
        n_kv_head=4,
        ffn_dim=256,
        vocab_size=512,
    ),
    "fp32",
)


def _hf_llama():
    from zoo import hf

    # eager attention: torch.matmul on 4-D tensors, a C++ composite whose temporaries
    # (expanded copies) autograd saves
    return hf.causal_lm(
        2,
        64,
        config_cls="LlamaConfig",
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=False,
        attn="eager",
    )


def _resnet():
    from zoo import vision

    return vision.torchvision_model(2, None, arch="resnet18", channels_last=True)


WORKLOADS["hf-llama"] = (_hf_llama, "bf16-mixed")
WORKLOADS["resnet18"] = (_resnet, "bf16-mixed")

POLICIES = {
    "full": lambda blocks: dict.fromkeys(blocks, "full"),
    "every-2nd": lambda blocks: dict.fromkeys(blocks[::2], "full"),
    "selective": lambda blocks: dict.fromkeys(blocks, "selective"),
    "mixed": lambda blocks: {blocks[0]: "selective", blocks[1]: "full"},
}
CASES = [(m, p) for m in ("gpt2", "llama", "convnet", "hf-llama") for p in POLICIES] + [
    ("resnet18", "full"),
    ("resnet18", "mixed"),
]


@functools.cache
def plain(model: str):
    make, precision = WORKLOADS[model]
    if model == "hf-llama":
        pytest.importorskip("transformers", exc_type=ImportError)
    if model == "resnet18":
        pytest.importorskip("torchvision", exc_type=ImportError)
    return capture(make, precision=precision)


def same_step(a, b) -> list[str]:
    """Where graphs a and b differ, storages paired by where they occur; [] if nowhere."""
    out, fwd, back = [], {}, {}

    def pair(x, y, where):
        if fwd.setdefault(x, y) != y or back.setdefault(y, x) != x:
            out.append(f"{where}: storage {x} paired with {fwd[x]} and {y}")

    if len(a.nodes) != len(b.nodes):
        return [f"{len(a.nodes)} nodes vs {len(b.nodes)}"]
    addr = lambda x: re.sub("0x[0-9a-f]+", "", repr(x))  # noqa: E731 (profiler handles)
    for n, m in zip(a.nodes, b.nodes, strict=True):
        if (n.op, n.phase, n.module, addr(n.args), addr(n.kwargs)) != (
            m.op,
            m.phase,
            m.module,
            addr(m.args),
            addr(m.kwargs),
        ):
            out.append(
                f"op {n.index}: {n.op} {n.phase} {n.module!r} vs {m.op} {m.phase} {m.module!r}"
            )
        for s, t in zip(n.inputs + n.outputs, m.inputs + m.outputs, strict=True):
            if (s.shape, s.stride, s.dtype, s.offset) != (t.shape, t.stride, t.dtype, t.offset):
                out.append(f"op {n.index}: view {s} vs {t}")
            pair(s.storage, t.storage, f"op {n.index}")
    for s in a.storages:
        if s.created < 0 and s.id not in fwd:
            pair(s.id, s.id, "state")
    for x, y in fwd.items():
        s, t = a.storages[x], b.storages[y]
        if (s.nbytes, s.kind, s.created, s.freed, s.label) != (
            t.nbytes,
            t.kind,
            t.created,
            t.freed,
            t.label,
        ):
            out.append(f"storage {s} vs {t}")
    for n, m in zip(a.nodes, b.nodes, strict=True):
        if sorted(fwd.get(x, -1) for x in n.allocs) != sorted(m.allocs) or sorted(
            fwd.get(x, -1) for x in n.frees
        ) != sorted(m.frees):
            out.append(f"op {n.index}: allocs/frees {n.allocs}/{n.frees} vs {m.allocs}/{m.frees}")
    if not len(a.storages) == len(b.storages) == len(fwd):
        out.append(f"{len(a.storages)} storages vs {len(b.storages)}, {len(fwd)} paired")
    return out


@pytest.mark.parametrize(("model", "policy"), CASES)
def test_pass_is_the_step_traced_with_checkpointing(model, policy):
    g0 = plain(model)
    make, precision = WORKLOADS[model]
    policies = POLICIES[policy](g0.meta.blocks)
    fresh = capture(make, precision=precision, checkpoint=policies)
    passed = checkpoint(g0, policies)
    assert same_step(fresh, passed) == []
    gpu = get_gpu("h100")
    cal = find_calibration(gpu)
    m_fresh, m_pass = step_memory(fresh, gpu, cal), step_memory(passed, gpu, cal)
    assert (m_pass.peak, m_pass.reserved) == (m_fresh.peak, m_fresh.reserved)
    assert saved_activations(passed) == saved_activations(fresh) < saved_activations(g0)
    t_fresh, t_pass = predict(fresh, gpu, cal).step_s, predict(passed, gpu, cal).step_s
    assert t_pass == pytest.approx(t_fresh, rel=0.005)
    assert passed.meta.checkpoint == fresh.meta.checkpoint
    assert passed.meta.checkpointed_blocks == fresh.meta.checkpointed_blocks


def _recomputed(model, policy, op):
    g0 = plain(model)
    block = g0.meta.blocks[1]
    g = checkpoint(g0, {block: policy})
    return [
        n.module.removeprefix(block + ".")
        for n in g.nodes
        if n.phase == "recompute" and n.name == op
    ]


def test_recomputation_stops_after_the_last_saved_tensor():
    """Hand-derived. A Llama block ends down_proj(silu(gate(x)) * up(x)), residual add: its
    last saved tensor is down_proj's input, saved before that matmul runs, so "full" runs 6 of
    its 7 matmuls again. A GPT-2 block with dropout ends c_proj, dropout (which saves its
    mask, an output): all 4 matmuls run again, and each dropout draws its mask again."""
    assert _recomputed("llama", "full", "mm") == [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
    ]
    assert _recomputed("gpt2", "full", "addmm") == [
        "attn.c_attn",
        "attn.c_proj",
        "mlp.c_fc",
        "mlp.c_proj",
    ]
    # (attention's own dropout is inside the attention op)
    assert _recomputed("gpt2", "full", "native_dropout") == ["attn.resid_dropout", "mlp.dropout"]


def test_selective_runs_again_all_but_matmuls_and_attention():
    """Selective: the matmuls and the attention come from the checkpoint's cache; the norms,
    the activation and the rotary embedding run again."""
    assert _recomputed("llama", "selective", "mm") == []
    efficient = "_scaled_dot_product_efficient_attention"
    assert _recomputed("llama-mha", "selective", efficient) == []
    assert _recomputed("llama", "selective", "rsqrt") == [
        "input_layernorm",
        "post_attention_layernorm",
    ]
    assert _recomputed("llama", "selective", "silu") == ["mlp"]
    assert len(_recomputed("llama-mha", "full", efficient)) == 1
    # grouped-query fp32 attention (the math path): its matmuls come from the cache too
    assert _recomputed("llama", "selective", "bmm") == []
    assert len(_recomputed("llama", "full", "bmm")) == 2
    assert _recomputed("gpt2", "selective", "addmm") == []
    assert _recomputed("gpt2", "selective", "gelu") == ["mlp.gelu"]


def test_meta_records_the_pass():
    g0 = plain("gpt2")
    blocks = g0.meta.blocks
    g = checkpoint(g0, dict.fromkeys(blocks, "full"))
    assert g.meta.checkpoint == "full" and g.meta.checkpointed_blocks == len(blocks)
    assert g.meta.passes == ({"pass": "checkpoint", "policies": dict.fromkeys(blocks, "full")},)
    g = checkpoint(g0, {blocks[2]: "selective"})
    assert g.meta.checkpoint == {blocks[2]: "selective"}
    assert checkpoint(g0, {}) is g0
    assert g0.meta.passes is None and g0.meta.checkpoint == "none"  # not changed


def test_bad_input_is_one_clear_error():
    g0 = plain("gpt2")
    with pytest.raises(GobrrrError, match="unknown policy 'some'"):
        checkpoint(g0, {"transformer.h.0": "some"})
    with pytest.raises(GobrrrError, match="no forward op ran in module 'transformer.h.9'"):
        checkpoint(g0, {"transformer.h.9": "full"})
    with pytest.raises(GobrrrError, match="overlap"):
        checkpoint(g0, {"transformer.h.0": "full", "transformer.h.0.attn": "full"})
    done = checkpoint(g0, {"transformer.h.0": "full"})
    with pytest.raises(GobrrrError, match="already checkpointed"):
        checkpoint(done, {"transformer.h.1": "full"})
    old = type(g0)(nodes=g0.nodes, storages=g0.storages, meta=g0.meta.replace(autograd=None))
    with pytest.raises(GobrrrError, match="capture it again"):
        checkpoint(old, {"transformer.h.0": "full"})


def test_capture_records_blocks_and_saved_tensors():
    g0 = plain("llama")
    assert list(g0.meta.blocks) == [f"layers.{i}" for i in range(4)]
    # the input RMSNorm's x * rsqrt(...) saves both operands, before it runs
    mul = next(
        n for n in g0.nodes if n.module == "layers.0.input_layernorm" and n.op == "aten.mul.Tensor"
    )
    rows = [r for r in g0.meta.autograd.saved if r[0] == mul.index]
    assert sorted(r[1] for r in rows) == sorted(t.storage for t in mul.inputs)
    assert not any(r[2] for r in rows)  # inputs: saved before the op ran
    spans = {r[0]: r[1:] for r in g0.meta.autograd.node_spans}
    first, last = spans[mul.index]
    assert g0.nodes[first].phase == "backward" and first <= last


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_apply_checkpointing_keeps_loss_and_gradients(policy):
    """A real CPU step: each policy on every block, and mixed, against the plain step."""
    torch.manual_seed(0)
    wl = get_workload(
        "llama3-1b",
        batch_size=2,
        seq_len=16,
        n_layer=3,
        dim=64,
        n_head=4,
        n_kv_head=2,
        ffn_dim=128,
        vocab_size=97,
    )
    ref = copy.deepcopy(wl.model)

    def step(model):
        model.zero_grad()
        loss = model(*wl.batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss0, grads0 = step(ref)
    names = block_names(wl.model)
    for policies in (dict.fromkeys(names, policy), {names[0]: policy, names[2]: "full"}):
        model = copy.deepcopy(ref)
        apply_checkpointing(model, policies)
        assert checkpointed(model) == policies
        loss, grads = step(model)
        assert torch.equal(loss, loss0)
        for n, g in grads0.items():
            torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-6)


def test_apply_checkpointing_is_idempotent_and_reversible():
    wl = get_workload(
        "gpt2", batch_size=1, seq_len=8, n_layer=3, n_embd=32, n_head=2, vocab_size=50
    )
    model = wl.model
    plain_forward = type(model.transformer.h[0]).forward
    names = block_names(model)
    assert names == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    blocks = apply_checkpointing(model)
    again = apply_checkpointing(model)
    assert blocks == again and all(b._gobrrr_checkpointed == "full" for b in blocks)
    inner = model.transformer.h[0]._gobrrr_inner
    apply_checkpointing(model, {names[0]: "selective"})  # re-wrapped around the original
    assert model.transformer.h[0]._gobrrr_inner == inner
    assert checkpointed(model) == {names[0]: "selective", names[1]: "full", names[2]: "full"}
    assert remove_checkpointing(model) == 3 and checkpointed(model) == {}
    assert model.transformer.h[0].forward.__func__ is plain_forward
    with pytest.raises(GobrrrError, match="no module 'transformer.h.7'"):
        apply_checkpointing(model, {"transformer.h.7": "full"})
    with pytest.raises(GobrrrError, match="unknown checkpoint policy"):
        apply_checkpointing(model, {names[0]: "half"})


def test_selective_saves_matmuls_convolutions_and_attention():
    """The constant names ops as the graph does, and every name is an op this torch has."""
    for name in SELECTIVE_SAVE - {"gobrrr.attention_fwd.default"}:
        ns, op, overload = name.split(".")
        assert str(getattr(getattr(getattr(torch.ops, ns), op), overload)) == name
    assert {"aten.mm.default", "aten.addmm.default", "aten.convolution.default"} <= SELECTIVE_SAVE


def test_hf_layer_with_kv_cache_checkpoints_without_it():
    """transformers builds a KV cache in training unless told not to; a checkpointed layer that
    wrote it would write it again while recomputing, and a selective checkpoint would fail.
    Each policy runs a real step and gives the plain step's gradients."""
    tf = pytest.importorskip("transformers", exc_type=ImportError)
    cfg = tf.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=True,
    )
    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 97, (2, 12))

    def grads(model):
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}

    want = grads(ref)
    for policy in ("full", "selective"):
        model = copy.deepcopy(ref)
        model.zero_grad()
        apply_checkpointing(model, dict.fromkeys(block_names(model), policy))
        for n, g in grads(model).items():
            torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-6)


def test_module_without_saved_tensors_is_left_alone():
    """A block whose nodes save nothing (here: only a scale) is never recomputed."""

    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, x):
            return x * 2 + self.w

    import gobrrr

    def wl():
        model = nn.Sequential(Scale(), Scale(), nn.Linear(4, 4))
        return gobrrr.Workload(model=model, batch=(torch.randn(3, 4),), loss=lambda y, b: y.sum())

    g0 = capture(wl, precision="fp32")
    fresh = capture(wl, precision="fp32", checkpoint={"0": "full"})
    passed = checkpoint(g0, {"0": "full"})
    assert same_step(fresh, passed) == []
    assert not any(n.phase == "recompute" for n in passed.nodes)


class _Keeps(nn.Module):
    """Saves y for sin's backward and keeps a view of it on itself past the step."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kept = None

    def forward(self, x):
        y = self.lin(x)
        self.kept = y[0]  # Python holds y's storage through this view
        return y.sin()


def test_capture_notes_when_python_lets_go_of_a_saved_tensor():
    """Hand-derived. Each block's y is saved (by sin) and Python keeps a view of it on the
    module: it is never let go of. Block 0's output sin(y) is saved by block 1's linear; Python
    lets go of it when the Sequential moves on, after block 1's forward."""
    import gobrrr

    def wl():
        return gobrrr.Workload(
            model=nn.Sequential(_Keeps(), _Keeps()),
            batch=(torch.randn(4, 8),),
            loss=lambda y, b: y.sum(),
        )

    g0 = capture(wl, precision="fp32")
    let_go = dict(g0.meta.autograd.unreferenced)
    fwd = [n for n in g0.nodes if n.phase == "forward"]
    ys = [n.outputs[0].storage for n in fwd if n.name == "addmm"]
    sin0 = next(n for n in fwd if n.name == "sin" and n.module == "0")
    assert len(ys) == 2 and not set(ys) & set(let_go)
    last_of_1 = max(n.index for n in fwd if n.module.startswith("1"))
    assert let_go[sin0.outputs[0].storage] == last_of_1
