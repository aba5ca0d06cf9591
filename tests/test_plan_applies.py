"""Every plan the planner emits, `gobrrr.apply` accepts and runs.

For each family of workload a CPU can train at a tiny size (gobrrr's GPT-2, Llama, MLP and
ConvNet; the examples' own language model written the README's way; a Hugging Face Llama
whose loss is read off its output with Workload(loss=lambda out, b: out.loss) and one that
returns it; a torchvision ResNet with step=), the planner runs at a global batch of 2 under a
budget between the step as given and the step with every block checkpointed (so that
checkpointing is planned), and every plan it ranks, fitting or not, is applied to a fresh
model and runs one optimizer step on the CPU with a finite loss. What the planner leaves out
it says in a note, in the words apply refuses it with.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gobrrr.errors import GobrrrError
from gobrrr.models.registry import get_workload
from gobrrr.plan import applicable
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import Planner, plan
from gobrrr.workload import Workload

G = 2  # the global batch: micro-batches 1 and 2
V = 64  # the language models' vocabulary
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _gpt2(batch_size: int = G, seq_len: int = 8) -> Workload:
    return get_workload(
        "gpt2", batch_size, seq_len, n_layer=2, n_embd=32, n_head=2, vocab_size=V, block_size=8
    )


def _llama(batch_size: int = G, seq_len: int = 8) -> Workload:
    return get_workload(
        "llama3-1b", batch_size, seq_len, n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=64,
        vocab_size=V,
    )  # fmt: skip


def _mlp(batch_size: int = G) -> Workload:
    return get_workload("mlp", batch_size, layers=3, width=32)


def _convnet(batch_size: int = G) -> Workload:
    return get_workload("convnet", batch_size, width=4, image_size=64, num_classes=10)


def _example_lm(batch_size: int = G, seq_len: int = 8) -> Workload:
    """examples/custom_workload.py's TinyLM at a tiny size, written as the README writes a
    workload (loss=None: model(*batch) returns the loss)."""
    spec = importlib.util.spec_from_file_location("custom", ROOT / "examples/custom_workload.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    idx = torch.randint(0, V, (batch_size, seq_len))
    return Workload(
        model=mod.TinyLM(vocab=V, d=16, layers=2, heads=2),
        batch=(idx, torch.roll(idx, -1, dims=1)),
        loss=None,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
        seq_len=seq_len,
    )


def _hf_llama(loss, batch_size: int = G) -> Workload:
    pytest.importorskip("transformers", exc_type=ImportError)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
    )
    ids = torch.randint(0, V, (batch_size, 8))
    return Workload(LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, loss=loss)


def _resnet(batch_size: int = G) -> Workload:
    pytest.importorskip("torchvision", exc_type=ImportError)
    from torchvision.models import resnet18

    return Workload(
        model=resnet18(num_classes=10),
        batch=(torch.randn(batch_size, 3, 64, 64), torch.randint(0, 10, (batch_size,))),
        step=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )


#: name -> (the workload's function, what the plan may add beyond the user's numerics). Each
#: allowed knob doubles the traces, so bf16 states and weights are planned on the MLP and one
#: language model; compile and 8-bit states are left out (seconds of Inductor per step on a
#: CPU), and offload (CUDA only).
FAMILIES = {
    "gpt2": (_gpt2, ("bf16-weights",)),
    "llama": (_llama, ()),
    "mlp": (_mlp, ("bf16-states", "bf16-weights")),
    "convnet": (_convnet, ()),
    "example-lm": (_example_lm, ()),
    "hf-loss=out.loss": (
        lambda batch_size=G: _hf_llama(lambda out, b: out.loss, batch_size),
        ("bf16-states",),
    ),
    "hf-returns-loss": (lambda batch_size=G: _hf_llama(None, batch_size), ()),
    "resnet": (_resnet, ()),
}
FUSED = {"gpt2", "llama", "hf-loss=out.loss", "hf-returns-loss"}


def squeezed(source, allow) -> Planner:
    """A planner whose budget the plain step at micro-batch 1 exceeds by a byte, so that
    checkpointing is planned at every micro-batch (the tiny models' activations are a few
    allocator blocks: no budget between the plain and the checkpointed step need exist)."""
    p = Planner(source, "h100", global_batch=G, allow=allow)
    if p.blocks:
        plain = p.cost(Knobs(micro_batch=1, accumulation=G))
        p.req = p.search.req = dataclasses.replace(p.req, budget=plain.reserved_bytes - 1)
    return p


@pytest.mark.parametrize("name", FAMILIES)
def test_every_plan_applies_and_steps(name):
    source, allow = FAMILIES[name]
    r = squeezed(source, allow).run()
    assert r.plans
    if name in FUSED:
        assert any(p.knobs.fused_loss for p in r.plans), r.notes
    if r.blocks:
        assert any(p.knobs.checkpoint for p in r.plans), "the budget did not ask for any"
    for p in r.plans:
        torch.manual_seed(0)
        step = apply(source(), p.knobs, r.precision)
        loss = step()
        assert math.isfinite(loss.item()), f"{p.knobs}: loss {loss.item()}"


def test_every_data_parallel_plan_passes_the_check_apply_makes():
    """Over two GPUs (DDP, FSDP2) apply runs inside torchrun; the check it makes before it
    joins the job is the one that can refuse a plan, and it refuses none of the planner's."""
    from gobrrr.training.checkpointing import block_names

    r = plan(_gpt2, "h100", global_batch=2 * G, gpus=2, allow=["compile", "bf16-states"])
    parallel = {p.knobs.parallel for p in r.plans}
    assert parallel == {"ddp", "fsdp"}
    wl = _gpt2()
    for p in r.plans:
        assert applicable.refusal(wl, p.knobs, r.precision, block_names(wl.model)) is None
    assert any(n.startswith("DDP: torch.compile(model) not planned:") for n in r.notes)
    assert any(n.startswith("FSDP2: optimizer states in bf16 not planned:") for n in r.notes)


# -- what is not planned: the note and apply's refusal say the same ------------------------


def _logits_loss() -> Workload:
    """A Hugging Face Llama whose loss the user computes from the logits: not the model's own
    loss, so the fused loss (which never makes the logits) does not apply."""

    def loss(out, b):
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten())

    return _hf_llama(loss)


def test_a_loss_the_fused_loss_cannot_replace_is_a_note_and_a_refusal():
    r = plan(_logits_loss, "h100", global_batch=1)
    why = applicable.fused_loss_refusal(_logits_loss())
    assert "Workload(loss=...)" in why and "fused_loss=False" in why
    assert f"fused linear + cross-entropy not planned: {why}" in r.notes
    assert r.plans and not any(p.knobs.fused_loss for p in r.plans)
    with pytest.raises(GobrrrError) as e:
        apply(_logits_loss(), Knobs(micro_batch=G, fused_loss=True))
    assert str(e.value) == why


@pytest.mark.parametrize(
    "loss, own",
    [
        (lambda out, b: out.loss, True),
        (lambda out, b: out["loss"], True),
        (lambda out, b: out[0], True),
        (lambda out, b: out, True),
        (lambda out, b: out.loss * 2, False),
        (lambda out, b: out.loss + out.aux_loss, False),
        (lambda out, b: F.cross_entropy(out.logits, b["labels"]), False),
        (lambda out, b: out.logits.sum(), False),
    ],
)
def test_the_models_own_loss_is_told_from_a_loss_of_its_own(loss, own):
    assert applicable.reads_models_loss(loss, {"labels": torch.zeros(2)}) is own


def test_the_fused_loss_read_off_the_output_is_the_models_loss():
    """loss=lambda out, b: out.loss with the fused loss: the same loss and gradients as the
    plain step (the fused loss's torch reference path on the CPU)."""

    def run(fused: bool):
        torch.manual_seed(0)
        wl = _hf_llama(lambda out, b: out.loss)
        step = apply(wl, Knobs(micro_batch=G, fused_loss=fused), "fp32")
        grads = {}
        step.optimizer.register_step_pre_hook(
            lambda *a: grads.update({n: p.grad.clone() for n, p in wl.model.named_parameters()})
        )
        return step(), grads

    (loss, grads), (ref, ref_grads) = run(True), run(False)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6)


# -- a second apply, and knobs that cannot be ---------------------------------------------


@pytest.mark.parametrize(
    "knobs",
    [
        Knobs(micro_batch=G, weights="bf16"),
        Knobs(micro_batch=G, fused_loss=True),
        Knobs(micro_batch=1, accumulation=G, checkpoint=(("transformer.h.0", "full"),)),
    ],
)
def test_a_model_apply_changed_is_not_applied_again(knobs):
    wl = _gpt2()
    apply(wl, knobs)
    with pytest.raises(GobrrrError, match=r"already changed by apply\(Knobs\(") as e:
        apply(wl, Knobs(micro_batch=G))
    assert "build a fresh model" in str(e.value) and "\n" not in str(e.value)


def test_a_plan_that_changes_nothing_can_be_applied_again():
    wl = _gpt2()
    apply(wl, Knobs(micro_batch=1, accumulation=G))
    apply(wl, Knobs(micro_batch=G, optimizer_states="bf16"))()


def test_a_refused_plan_leaves_the_model_as_it_was():
    wl = _hf_llama(None)
    wl.optimizer = lambda ps: torch.optim.SGD(ps, lr=0.1)
    with pytest.raises(GobrrrError, match="only be changed for Adam or AdamW"):
        apply(wl, Knobs(micro_batch=G, weights="bf16", fused_loss=True, optimizer_states="bf16"))
    assert {p.dtype for p in wl.model.parameters()} == {torch.float32}
    assert not hasattr(wl.model, "_gobrrr_applied") and not hasattr(wl.model, "_gobrrr_fused_loss")
    apply(wl, Knobs(micro_batch=G, fused_loss=True))()


@pytest.mark.parametrize(
    "kwargs, said",
    [
        (dict(micro_batch=2.5), r"Knobs\(micro_batch=2.5\): give a whole number of samples"),
        (dict(micro_batch=0), r"Knobs\(micro_batch=0\): give a whole number"),
        (dict(micro_batch=True), r"Knobs\(micro_batch=True\)"),
        (dict(micro_batch=2, accumulation=-1), r"Knobs\(accumulation=-1\): give a whole number"),
        (dict(micro_batch=2, compile="no"), "unknown compile 'no': choose none, model, blocks"),
        (dict(micro_batch=2, compile=1), "unknown compile 1: choose none, model, blocks"),
        (dict(micro_batch=2, offload=1), r"Knobs\(offload=1\) is not a bool"),
        (dict(micro_batch=2, checkpoint=True), r"Knobs\(checkpoint=True\): give \(block, policy\)"),
        (dict(micro_batch=2, checkpoint="h.0"), r"Knobs\(checkpoint='h.0'\): give"),
        (dict(micro_batch=2, checkpoint=(("h.0", "some"),)), "unknown checkpoint policy 'some'"),
        (dict(micro_batch=2, checkpoint=(("h.0", "full"), ("h.0", "selective"))), "'h.0' twice"),
        (dict(micro_batch=2, optimizer_states="fp8"), "unknown optimizer_states 'fp8': choose"),
        (dict(micro_batch=2, weights=None), "unknown weights None: choose as-is, bf16"),
        (dict(micro_batch=2, parallel="tp"), "unknown parallel 'tp': choose none, ddp, fsdp"),
    ],
)
def test_knobs_that_cannot_be_are_one_line_at_construction(kwargs, said):
    with pytest.raises(GobrrrError, match=said) as e:
        Knobs(**kwargs)
    assert "\n" not in str(e.value)


def test_knobs_take_checkpoint_pairs_in_any_plain_form():
    want = Knobs(micro_batch=2, checkpoint=(("h.0", "full"), ("h.1", "selective")))
    assert Knobs(micro_batch=2, checkpoint=[["h.0", "full"], ["h.1", "selective"]]) == want
    assert Knobs(micro_batch=2, checkpoint={"h.0": "full", "h.1": "selective"}) == want
    assert hash(Knobs(micro_batch=2, checkpoint=[("h.0", "full"), ("h.1", "selective")]))
