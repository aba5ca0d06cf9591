"""A LoRA step under Hugging Face's gradient checkpointing: what the trace holds, against the
real step on the CPU.

peft's recipe for LoRA with checkpointing (`gradient_checkpointing_enable` with
`use_reentrant=False`, `enable_input_require_grads`, `get_peft_model`) on a tiny Qwen2. The
matmul FLOPs of the traced forward and of the traced backward (recompute included) are held
against PyTorch's FlopCounterMode over the real step's forward and backward; the matmuls are
counted by hand per decoder layer: the forward once, the recompute once (not twice: no
no-grad forward beside it, no second recompute), stopping before the layer's last matmul
(non-reentrant checkpointing stops once every saved tensor is rebuilt), and the backward with
no weight gradient for a frozen base weight.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gobrrr.capture import capture
from gobrrr.workload import Workload

pytest.importorskip("peft")
pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

B, S, R = 1, 24, 4  # batch, sequence, LoRA rank: 24 tokens, unlike any weight's dimension
LAYERS = 2
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
MATMULS = ("aten.mm.default", "aten.addmm.default")


def lora_qwen2(gc: bool = True) -> Workload:
    """A tiny Qwen2 with LoRA on every linear of its layers, checkpointed as peft's docs do."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG)).train()
    if gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=2 * R, target_modules=TARGETS))
    ids = torch.randint(0, CONFIG["vocab_size"], (B, S))
    return Workload(
        model,
        {"input_ids": ids, "labels": ids},
        loss=lambda out, b: out.loss,
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    )


@pytest.fixture(scope="module")
def graph():
    return capture(lora_qwen2, precision="fp32")


def _real_matmul_flops() -> tuple[int, int]:
    """(forward, backward) FLOPs of mm and addmm in the real step on the CPU."""
    wl = lora_qwen2()
    counts = []
    with FlopCounterMode(display=False) as fwd:
        loss = wl.compute_loss(wl.batch)
    counts.append(fwd.get_flop_counts()["Global"])
    with FlopCounterMode(display=False) as bwd:
        loss.backward()
    counts.append(bwd.get_flop_counts()["Global"])
    aten = torch.ops.aten
    return tuple(int(c.get(aten.mm, 0) + c.get(aten.addmm, 0)) for c in counts)


def _matmul_flops(graph, phases: tuple[str, ...]) -> int:
    """2·m·n·k of every traced mm / addmm in `phases`."""
    total = 0
    for n in graph.nodes:
        if n.phase in phases and n.op in MATMULS:
            a = n.inputs[1] if n.name == "addmm" else n.inputs[0]
            total += 2 * n.outputs[0].numel * a.shape[-1]
    return total


def _layer_ops(graph, phase: str, layer: int) -> list:
    mark = f"layers.{layer}."
    return [n for n in graph.nodes if n.phase == phase and mark in n.module + "."]


def test_matmul_flops_match_the_real_step(graph):
    forward, backward = _real_matmul_flops()
    assert _matmul_flops(graph, ("forward",)) == forward
    assert _matmul_flops(graph, ("recompute", "backward")) == backward


def test_each_layer_is_recomputed_once(graph):
    # per layer: 7 base linears + 7 adapters of two matmuls each; the recompute stops once
    # down_proj's adapter has saved its input, before lora_B's product (the last one needed)
    for layer in range(LAYERS):
        fwd = [n for n in _layer_ops(graph, "forward", layer) if n.op in MATMULS]
        rec = [n for n in _layer_ops(graph, "recompute", layer) if n.op in MATMULS]
        assert len(fwd) == 7 + 2 * 7
        assert [n.op for n in rec] == [n.op for n in fwd][:-1]
        assert [n.outputs[0].shape for n in rec] == [n.outputs[0].shape for n in fwd][:-1]


def test_backward_has_no_frozen_weight_gradient(graph):
    # per layer: the input's gradient through each of the 7 frozen linears, and 4 matmuls per
    # adapter (A's and B's weight gradient, each one's input gradient); the embedding's output
    # requires grad (enable_input_require_grads), so layer 0 runs all of them too
    wl = lora_qwen2()
    frozen = {tuple(p.shape) for p in wl.model.parameters() if not p.requires_grad and p.ndim == 2}
    frozen |= {s[::-1] for s in frozen}
    for layer in range(LAYERS):
        mms = [n for n in _layer_ops(graph, "backward", layer) if n.op in MATMULS]
        assert len(mms) == 7 + 4 * 7
        assert not [n for n in mms if tuple(n.outputs[0].shape) in frozen]
