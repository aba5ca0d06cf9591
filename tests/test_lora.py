"""LoRA (peft) and other partly frozen models: what trains, what is frozen, and the planner's
plans for a LoRA step.

The split (`Estimate.trainable`, read off the step graph: a parameter trains when the optimizer
steps it) is held against closed forms from the model itself: LoRA's r x (in + out) elements
per adapted linear, the base model's parameter count, a frozen backbone's tensors by dtype,
AdamW's two fp32 moments per trained element. The planner's plans for a LoRA step (micro-batch,
accumulation, checkpointing through peft's wrapped layers, the fused loss on a frozen head) are
each applied and run on the CPU, and the adapters' gradients held against an unchanged step's.
"""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import gobrrr
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import Planner
from gobrrr.report.estimate import estimate_dict
from gobrrr.report.terminal import print_estimate
from gobrrr.workload import Workload

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

V, G, R = 64, 2, 8  # vocabulary, global batch, LoRA rank
CONFIG = dict(
    vocab_size=V,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=16,
)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def lora_llama(batch_size: int = G, random_b: bool = False) -> Workload:
    """A tiny Llama with LoRA adapters on q_proj and v_proj, its loss read off its output.
    random_b: the adapters' B matrices random (peft starts them at zero, which leaves A's
    gradient zero: nothing to compare)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=R, target_modules=["q_proj", "v_proj"], init_lora_weights=not random_b)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), lora)
    ids = torch.randint(0, V, (batch_size, 8))
    return Workload(model, {"input_ids": ids, "labels": ids}, loss=lambda out, b: out.loss)


def lora_elements(model: nn.Module) -> int:
    """LoRA's closed form: r x (in_features + out_features) for each adapted linear."""
    return sum(
        R * (m.in_features + m.out_features)
        for m in model.modules()
        if isinstance(m, peft.tuners.lora.Linear)
    )


@pytest.fixture(scope="module")
def lora_estimate():
    torch.manual_seed(0)
    return gobrrr.estimate(lora_llama, "h100")


def test_a_lora_step_trains_the_adapters_and_leaves_the_base_model_frozen(lora_estimate):
    split = lora_estimate.trainable
    model = lora_llama().model
    base = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**CONFIG)).parameters())
    n = lora_elements(model)
    assert n == 2 * (R * (16 + 16) + R * (16 + 8))  # q: 16 -> 16, v: 16 -> 8 (one kv head)
    assert split.what == "LoRA adapters"
    assert split.trained_elements == n == lora_estimate.graph.meta.trainable_params
    assert split.frozen_elements == base
    # bf16-mixed: fp32 weights; gradients as the weights; AdamW's two fp32 moments
    assert [(p.dtype, p.tensors) for p in split.trained] == [("float32", 4 * 2)]
    assert [(p.dtype, p.bytes) for p in split.frozen] == [("float32", 4 * base)]
    assert split.trained_bytes == split.gradients_bytes == 4 * n
    assert split.optimizer_states_bytes == 2 * 4 * n
    assert split.optimizer == "AdamW"
    assert split.trained_share == pytest.approx(n / (n + base))


def test_the_split_is_in_the_json_and_the_terminal(lora_estimate):
    data = json.loads(json.dumps(estimate_dict(lora_estimate)))["trainable"]
    split = lora_estimate.trainable
    assert data["trained"]["elements"] == split.trained_elements
    assert data["trained"]["by_dtype"] == {
        "float32": {"elements": split.trained_elements, "bytes": split.trained_bytes, "tensors": 8}
    }
    assert data["frozen"]["bytes"] == split.frozen_bytes
    assert data["gradients_bytes"] == split.gradients_bytes
    assert data["optimizer_states_bytes"] == split.optimizer_states_bytes
    out = io.StringIO()
    print_estimate(lora_estimate, Console(file=out, width=200), top=1)
    line = next(s for s in out.getvalue().splitlines() if s.startswith("trains "))
    kib = 4 * split.trained_elements / 1024
    assert line == (
        f"trains {split.trained_elements} parameters ({split.trained_share:.2%}: LoRA adapters, "
        f"{kib:.2f} KiB fp32) + their gradients {kib:.2f} KiB + AdamW states {2 * kib:.2f} KiB;"
        f" frozen {split.frozen_elements / 1e3:.2f}k ({split.frozen_bytes / 1024:.2f} KiB fp32)"
    )


class FrozenBackbone(nn.Module):
    """A bf16 embedding and an fp32 trunk, both frozen; a trainable fp32 head."""

    def __init__(self, vocab: int = 50, d: int = 24, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d).to(torch.bfloat16).requires_grad_(False)
        self.trunk = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.trunk.requires_grad_(False)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.trunk(self.embed(ids).float()).mean(1))


def frozen_backbone(batch_size: int = 4) -> Workload:
    model = FrozenBackbone()
    batch = (torch.randint(0, 50, (batch_size, 6)), torch.randint(0, 5, (batch_size,)))
    return Workload(model, batch, step=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_a_frozen_backbone_is_split_by_dtype():
    split = gobrrr.estimate(frozen_backbone, "h100", precision="fp32").trainable
    model = FrozenBackbone()
    head = sum(p.numel() for p in model.head.parameters())
    trunk = sum(p.numel() for p in model.trunk.parameters())
    assert split.what == "head"
    assert [(p.dtype, p.tensors, p.elements, p.bytes) for p in split.trained] == [
        ("float32", 2, head, 4 * head)
    ]
    assert [(p.dtype, p.tensors, p.elements, p.bytes) for p in split.frozen] == [
        ("float32", 4, trunk, 4 * trunk),
        ("bfloat16", 1, 50 * 24, 2 * 50 * 24),
    ]
    assert split.gradients_bytes == 4 * head
    assert split.optimizer_states_bytes == 8 * head


def test_a_model_that_trains_everything_has_nothing_frozen_and_no_line():
    est = gobrrr.estimate("mlp", "h100", batch=2)
    split = est.trainable
    assert split.what == "all parameters" and split.frozen == ()
    assert split.trained_elements == est.graph.meta.params
    out = io.StringIO()
    print_estimate(est, Console(file=out, width=200), top=1)
    assert "trains " not in out.getvalue()


# -- the planner's LoRA plans, applied ------------------------------------------------------


def squeezed() -> Planner:
    """The planner at a budget the plain step at micro-batch 1 exceeds by a byte, so that
    checkpointing is planned (tests/test_plan_applies.py does the same)."""
    p = Planner(lora_llama, "h100", global_batch=G, precision="fp32")
    plain = p.cost(Knobs(micro_batch=1, accumulation=G))
    p.req = p.search.req = dataclasses.replace(p.req, budget=plain.reserved_bytes - 1)
    return p


def adapter_grads(step_fn, wl: Workload) -> dict[str, torch.Tensor]:
    """Runs one step; the gradients each trained parameter had when the optimizer stepped."""
    grads = {}

    def hook(*_):
        grads.update({n: p.grad.clone() for n, p in wl.model.named_parameters() if p.requires_grad})
        frozen = [n for n, p in wl.model.named_parameters() if not p.requires_grad]
        grads["frozen with a gradient"] = [n for n in frozen if wl.model.get_parameter(n).grad]

    step_fn.optimizer.register_step_pre_hook(hook)
    step_fn()
    return grads


def test_every_lora_plan_applies_and_its_adapter_gradients_are_the_plain_steps():
    planner = squeezed()
    r = planner.run()
    assert not r.notes, r.notes
    knobs = [p.knobs for p in r.plans]
    assert any(k.fused_loss for k in knobs) and any(k.checkpoint for k in knobs)
    assert {k.micro_batch for k in knobs} >= {1}
    torch.manual_seed(0)
    ref = lora_llama(random_b=True)
    ref.model(**ref.batch).loss.backward()
    want = {n: p.grad for n, p in ref.model.named_parameters() if p.requires_grad}
    assert len(want) == 8 and all(g.abs().sum() > 0 for g in want.values())
    for k in knobs:
        torch.manual_seed(0)
        wl = lora_llama(random_b=True)
        got = adapter_grads(apply(wl, k, "fp32"), wl)
        assert got.pop("frozen with a gradient") == [], k
        assert got.keys() == want.keys()
        for n, g in want.items():
            torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-6, msg=f"{k}: {n}")


def test_the_fused_loss_on_a_frozen_head_makes_no_head_gradient():
    """The planner's trace of the fused-loss step: the fused op returns no (V, d) gradient
    for the frozen lm_head, and the step still trains only the adapters."""
    planner = Planner(lora_llama, "h100", global_batch=G)
    g = planner.search.graph(Knobs(micro_batch=G, fused_loss=True))
    (op,) = [n for n in g.nodes if n.op == "gobrrr.linear_cross_entropy.default"]
    assert op.inputs[1].shape == (V, 16)  # the head's weight
    assert op.outputs[1].numel > 0 and op.outputs[2].numel == 0
    split = gobrrr.evaluate(g, "h100").trainable
    assert split.what == "LoRA adapters" and split.trained_elements == 2 * R * (32 + 24)


def test_an_adapted_head_leaves_the_fused_loss_out_saying_why():
    """LoRA on lm_head too: the head is peft's LoRA layer, not an nn.Linear the fused loss can
    take over; the refusal names the wrapped model, and apply refuses with the same words."""
    from peft import LoraConfig, get_peft_model

    from gobrrr.errors import GobrrrError
    from gobrrr.plan import applicable

    lora = LoraConfig(r=R, target_modules=["q_proj", "v_proj", "lm_head"])
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(**CONFIG)), lora)
    ids = torch.randint(0, V, (G, 8))
    wl = Workload(model, {"input_ids": ids, "labels": ids}, loss=lambda out, b: out.loss)
    why = applicable.fused_loss_refusal(wl)
    assert why == (
        "fused_loss needs a model whose output head feeds a cross-entropy gobrrr can take "
        f"over, and LlamaForCausalLM (in peft's {type(model).__name__}) has no nn.Linear "
        "lm_head: set fused_loss=False"
    )
    with pytest.raises(GobrrrError) as e:
        apply(wl, Knobs(micro_batch=G, fused_loss=True))
    assert str(e.value) == why
