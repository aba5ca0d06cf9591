"""Regional compilation, `compile="blocks"`: each repeated block's forward compiled on its own.

The references: the model's own structure (which ops belong to which block, by
`named_modules`), the eager trace of the same step (what the compiled blocks may not exceed),
and PyTorch running the applied step for real on the CPU (the same loss and gradients as the
eager step). Inductor's CPU code generation is slow to compile, so the applied runs use
torch's "aot_eager" backend (AOTAutograd's partitioned graphs run eagerly: the same
forward/backward split and the same checkpoint nesting, without Inductor's kernels).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from gobrrr.capture import capture
from gobrrr.cli.app import build_parser, compile_arg
from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import fuse
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import evaluate
from gobrrr.models.registry import get_workload
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.training.checkpointing import block_names
from gobrrr.workload import Workload

LAYERS = 3


def tiny_gpt2(batch_size: int = 2, seq_len: int = 128) -> Workload:
    """Activations, not weights, decide this GPT-2's peak (vocabulary 128, width 64)."""
    return get_workload(
        "gpt2",
        batch_size,
        seq_len,
        n_layer=LAYERS,
        n_embd=64,
        n_head=2,
        vocab_size=128,
        block_size=seq_len,
    )


def tiny_llama(batch_size: int = 2, seq_len: int = 64) -> Workload:
    return get_workload(
        "llama3-1b",
        batch_size,
        seq_len,
        n_layer=LAYERS,
        dim=64,
        n_head=4,
        n_kv_head=2,
        ffn_dim=128,
        vocab_size=128,
    )


def hf_llama() -> Workload:
    """A tiny Hugging Face Llama trained without a KV cache (use_cache=False: a cache
    written by each layer makes dynamo recompile the block for every layer index)."""
    pytest.importorskip("transformers", exc_type=ImportError)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
    )
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (2, 16))
    return Workload(model=LlamaForCausalLM(cfg), batch={"input_ids": ids, "labels": ids})


def block_of(module: str, blocks: list[str]) -> str | None:
    return next((b for b in blocks if module == b or module.startswith(b + ".")), None)


def assert_one_region_per_block(g, blocks: list[str]) -> None:
    """One forward and one backward run per block, backward in reverse order, each run's ops
    all the block's own; every op outside the runs that computes something belongs to no
    block (runs eagerly). (AOTAutograd's runtime wrapper detaches what the compiled forward
    saves, outside the graph: views, no memory.)"""
    runs = g.meta.compiled_regions
    for kind, order in (("forward", blocks), ("backward", blocks[::-1])):
        ran = [r for r in runs if r.kind == kind]
        assert len(ran) == len(blocks)
        for r, block in zip(ran, order, strict=True):
            owners = {block_of(n.module, blocks) for n in g.nodes[r.first : r.last + 1]}
            assert owners == {block}, (kind, block, owners)
    inside = {i for r in runs for i in range(r.first, r.last + 1)}
    for n in g.nodes:
        if n.index not in inside and n.phase in ("forward", "backward") and n.allocs:
            assert block_of(n.module, blocks) is None, (n.index, n.name, n.module)


@pytest.fixture(scope="module")
def gpt2_graphs():
    return {
        how: capture(tiny_gpt2, precision="bf16-mixed", compile=how) for how in ("none", "blocks")
    }


def test_each_block_of_gpt2_is_a_compiled_region_of_its_own(gpt2_graphs):
    g = gpt2_graphs["blocks"]
    blocks = list(g.meta.blocks)
    assert blocks == [f"transformer.h.{i}" for i in range(LAYERS)]
    # dynamo compiles the block's code once: one forward and one backward graph for all
    assert g.meta.compiled_graphs == {"forward": 1, "backward": 1}
    assert_one_region_per_block(g, blocks)
    outside = {n.module for n in g.nodes if n.phase == "forward" and block_of(n.module, blocks)}
    assert outside  # the blocks' ops are recorded with their full module names
    eager_mods = {
        n.module for n in g.nodes if n.phase == "forward" and block_of(n.module, blocks) is None
    }
    assert {"transformer.wte", "transformer.ln_f", "lm_head"} <= eager_mods


def test_compiled_blocks_peak_no_higher_than_eager(gpt2_graphs):
    """Inside the blocks Inductor fuses the pointwise chains (GELU, the residual adds, the
    LayerNorms' elementwise parts): those intermediates take no memory, and the peak is at
    most the eager step's; outside them nothing is fused."""
    g, eager = gpt2_graphs["blocks"], gpt2_graphs["none"]
    assert g.meta.inductor["unallocated"] > 0
    blocks = list(g.meta.blocks)
    groups = fuse(g, graph_costs(g))
    assert groups
    for grp in groups:  # what Inductor fuses (and so never allocates) is the blocks' own
        assert all(block_of(g.nodes[i].module, blocks) for i in grp.nodes)
    assert evaluate(g).memory.peak <= evaluate(eager).memory.peak
    assert evaluate(g).time.step_s < evaluate(eager).time.step_s  # fused, no eager dispatch


def test_a_checkpointed_block_recomputes_its_compiled_forward(gpt2_graphs):
    """checkpoint(compiled block): in backward each block's forward graph runs again (a
    forward region in the recompute phase) just before that block's backward graph; what
    the blocks keep for backward is their inputs only, so less than without checkpointing."""
    g = capture(tiny_gpt2, precision="bf16-mixed", compile="blocks", checkpoint="full")
    blocks = list(g.meta.blocks)
    runs = g.meta.compiled_regions
    recomputes = [
        r for r in runs if {g.nodes[i].phase for i in range(r.first, r.last + 1)} == {"recompute"}
    ]
    assert [r.kind for r in recomputes] == ["forward"] * LAYERS
    backward = [r for r in runs if r.kind == "backward"]
    for rec, bwd, block in zip(recomputes, backward, blocks[::-1], strict=True):
        assert rec.last < bwd.first
        assert {block_of(g.nodes[i].module, blocks) for i in range(rec.first, rec.last + 1)} == {
            block
        }
    plain = gpt2_graphs["blocks"]
    assert evaluate(g).memory.peak < evaluate(plain).memory.peak
    assert evaluate(g).time.step_s > evaluate(plain).time.step_s  # the recompute


def test_each_block_of_llama_is_a_compiled_region_of_its_own():
    g = capture(tiny_llama, precision="bf16-mixed", compile="blocks")
    assert g.meta.compiled_graphs == {"forward": 1, "backward": 1}
    assert_one_region_per_block(g, list(g.meta.blocks))


def test_each_layer_of_a_hugging_face_llama_is_a_compiled_region_of_its_own():
    g = capture(hf_llama, precision="bf16-mixed", compile="blocks")
    blocks = list(g.meta.blocks)
    assert blocks == [f"model.layers.{i}" for i in range(LAYERS)]
    assert g.meta.compiled_graphs == {"forward": 1, "backward": 1}
    assert_one_region_per_block(g, blocks)


def test_a_model_without_repeated_blocks_is_refused_in_one_line():
    def make() -> Workload:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        return Workload(model=model, batch=(torch.randn(4, 8),), step=lambda m, b: m(b[0]).sum())

    with pytest.raises(GobrrrError, match="no repeated blocks") as e:
        capture(make, precision="fp32", compile="blocks")
    assert "\n" not in str(e.value)
    wl = make()
    with pytest.raises(GobrrrError, match=r"compile='blocks'.*compile='model'"):
        apply(wl, Knobs(micro_batch=4, compile="blocks"), "fp32")
    assert "forward" not in wl.model[0].__dict__  # refused before anything changed


# -- the applied step, run for real ---------------------------------------------------------


def eager_reference(make, precision: str = "fp32"):
    torch.manual_seed(0)
    wl = make()
    loss = wl.compute_loss(wl.batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in wl.model.named_parameters()}


def applied_step(make, knobs: Knobs, monkeypatch):
    """The applied step's loss and gradients (read before the optimizer steps), its blocks
    compiled with the aot_eager backend."""
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda f: real(f, backend="aot_eager"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    wl = make()
    step = apply(wl, knobs, "fp32")
    grads = {}

    def grab(opt, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in wl.model.named_parameters()})

    step.optimizer.register_step_pre_hook(grab)
    loss = step()
    torch._dynamo.reset()
    return loss, grads, wl.model


@pytest.mark.parametrize("make", [tiny_gpt2, hf_llama], ids=["gpt2", "hf-llama"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint-full"])
def test_the_applied_compiled_blocks_are_the_same_step(make, checkpointed, monkeypatch):
    names = block_names(make().model)
    knobs = Knobs(
        micro_batch=2,
        compile="blocks",
        checkpoint=every_kth(names, 1) if checkpointed else (),
    )
    loss, grads, model = applied_step(make, knobs, monkeypatch)
    want_loss, want = eager_reference(make)
    assert torch.allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want.keys()
    for n, g in grads.items():
        assert torch.allclose(g, want[n], rtol=1e-4, atol=1e-6), n
    for name in names:  # checkpoint(compiled forward): the checkpoint wraps compiled code
        block = model.get_submodule(name)
        inner = block.__dict__["_gobrrr_inner"] if checkpointed else block.forward
        assert hasattr(inner, "_torchdynamo_orig_callable"), name
        assert getattr(block, "_gobrrr_checkpointed", None) == ("full" if checkpointed else None)


# -- the knob and the command line ----------------------------------------------------------


def test_the_knob_reads_the_old_boolean_form():
    assert Knobs(micro_batch=1, compile=True).compile == "model"
    assert Knobs(micro_batch=1, compile=False).compile == "none"
    old = {"micro_batch": 2, "accumulation": 1, "checkpoint": [], "compile": True}
    assert Knobs.from_dict(old) == Knobs(micro_batch=2, compile="model")
    k = Knobs(micro_batch=2, compile="blocks")
    assert Knobs.from_dict(k.to_dict()) == k and k.compiled
    assert not Knobs(micro_batch=2).compiled


@pytest.mark.parametrize(
    "argv, mode, workload",
    [
        (["estimate", "--model", "gpt2"], "none", None),
        (["estimate", "--model", "gpt2", "--compile"], "model", None),
        (["estimate", "--model", "gpt2", "--compile", "blocks"], "blocks", None),
        (["estimate", "--compile", "blocks", "my.py:fn"], "blocks", "my.py:fn"),
        (["estimate", "--compile", "my.py:fn"], "model", "my.py:fn"),  # a bare --compile
    ],
)
def test_estimate_compile_option(argv, mode, workload):
    args = build_parser().parse_args(argv)
    assert compile_arg(args) == mode and args.workload == workload


def test_estimate_compile_option_names_a_wrong_mode():
    args = argparse.Namespace(compile="block", workload=None, model="gpt2")
    with pytest.raises(GobrrrError, match="--compile 'block'"):
        compile_arg(args)
