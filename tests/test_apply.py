"""gobrrr.apply: every knob is numerically the same training step as the plain one.

The reference is written here: the workload's loss on the whole batch (under the
precision's autocast), backward, and the gradients read before any optimizer step. Each
knob's step is held against it (loss and every gradient) within its dtype's tolerance, on
small models of each kind: gobrrr's GPT-2, Llama, MLP and ConvNet, a Hugging Face
LlamaForCausalLM and a torchvision ResNet. The optimizer-state knobs are held against
torch's own AdamW after a few steps.
"""

from __future__ import annotations

import collections
import contextlib
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gobrrr.errors import GobrrrError
from gobrrr.models.registry import get_workload
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.training.checkpointing import repeated_blocks
from gobrrr.workload import Workload


class Ops(TorchDispatchMode):
    """Records (op, output shapes) of every ATen (or gobrrr) op run under it."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]))
        return out


B = 4  # samples per global batch: splits into 1, 2 or 4 micro-batches
V = 100  # the language models' vocabulary: no other dimension of theirs is 100
TOL = {"fp32": 2e-5, "bf16-mixed": 3e-2}  # max |error| / max |reference|, per tensor


def _hf_llama() -> Workload:
    pytest.importorskip("transformers", exc_type=ImportError)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    ids = torch.randint(0, V, (B, 12))
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt without targets: ignore_index positions
    return Workload(model=LlamaForCausalLM(cfg), batch={"input_ids": ids, "labels": labels})


def _resnet() -> Workload:
    pytest.importorskip("torchvision", exc_type=ImportError)
    from torchvision.models import resnet18

    return Workload(
        model=resnet18(num_classes=10),
        batch=(torch.randn(B, 3, 32, 32), torch.randint(0, 10, (B,))),
        step=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
    )


BUILD = {
    "gpt2": lambda: get_workload(
        "gpt2", B, 16, n_layer=2, n_embd=32, n_head=2, vocab_size=V, block_size=16
    ),
    "llama": lambda: get_workload(
        "llama3-1b", B, 16, n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=64, vocab_size=V
    ),
    "mlp": lambda: get_workload("mlp", B, layers=3, width=64),
    "convnet": lambda: get_workload("convnet", B, width=8, image_size=32, num_classes=10),
    "hf-llama": _hf_llama,
    "resnet": _resnet,
}
# Batch norm normalises over the micro-batch in training, so a CNN's micro-batches are a
# different step by design; in eval mode (running statistics) they must agree exactly.
EVAL = {"convnet", "resnet"}


def make(name: str, seed: int = 0) -> Workload:
    torch.manual_seed(seed)
    wl = BUILD[name]()
    if name in EVAL:
        wl.model.eval()
    return wl


def _autocast(precision: str):
    if precision == "bf16-mixed":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def reference(name: str, precision: str = "fp32"):
    """The plain step's loss and gradients: the whole batch, no knob."""
    wl = make(name)
    with _autocast(precision):
        loss = wl.compute_loss(wl.batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in wl.model.named_parameters()}


def applied(name: str, knobs: Knobs, precision: str = "fp32", wl: Workload | None = None):
    """The applied step's loss and the gradients its optimizer is handed."""
    wl = wl or make(name)
    step = apply(wl, knobs, precision)
    grads: dict[str, torch.Tensor] = {}

    def grab(opt, args, kwargs):
        grads.update({n: p.grad.clone() for n, p in step.model.named_parameters()})

    step.optimizer.register_step_pre_hook(grab)
    return step(), grads, step


def assert_close(actual, expected, tol: float, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1e-6)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


def assert_same_step(got, want, tol: float) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert_close(loss, ref_loss, tol, "loss")
    assert grads.keys() == ref_grads.keys() and grads
    for n, g in ref_grads.items():
        assert_close(grads[n], g, tol, n)


# -- micro-batches and accumulation ---------------------------------------------------------


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("accumulation", [1, 2, 4])
def test_accumulation_is_the_full_batch_step(name, accumulation):
    knobs = Knobs(micro_batch=B // accumulation, accumulation=accumulation)
    loss, grads, _ = applied(name, knobs)
    assert_same_step((loss, grads), reference(name), TOL["fp32"])


@pytest.mark.parametrize("name", ["gpt2", "hf-llama"])
def test_accumulation_under_bf16_autocast(name):
    loss, grads, _ = applied(name, Knobs(micro_batch=2, accumulation=2), "bf16-mixed")
    assert_same_step((loss, grads), reference(name, "bf16-mixed"), TOL["bf16-mixed"])


def test_token_mean_loss_over_unequal_valid_tokens_is_the_mean_of_micro_means():
    """Documented in gobrrr.training.step: each micro-batch averages over its own valid tokens."""
    wl = make("hf-llama")
    wl.batch["labels"][:2, :10] = -100  # the first micro-batch keeps far fewer targets
    loss, _, _ = applied("hf-llama", Knobs(micro_batch=2, accumulation=2), wl=wl)
    wl2 = make("hf-llama")
    wl2.batch["labels"][:2, :10] = -100
    with torch.no_grad():
        halves = [wl2.compute_loss({k: v[i : i + 2] for k, v in wl2.batch.items()}) for i in (0, 2)]
        whole = wl2.compute_loss(wl2.batch)
    assert torch.allclose(loss, (halves[0] + halves[1]) / 2, rtol=1e-5)
    assert not torch.allclose(loss, whole, rtol=1e-3)


# -- activation checkpointing ---------------------------------------------------------------


def _block_names(wl: Workload) -> list[str]:
    ids = {id(m) for m in repeated_blocks(wl.model)}
    return [n for n, m in wl.model.named_modules() if id(m) in ids]


PATTERNS = {
    "every": lambda names: every_kth(names, 1),
    "every-2nd": lambda names: every_kth(names, 2),
    "selective": lambda names: every_kth(names, 1, "selective"),
}


@pytest.mark.parametrize("name", list(BUILD))
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_checkpointing_is_the_same_step(name, pattern):
    plan = PATTERNS[pattern](_block_names(make(name)))
    knobs = Knobs(micro_batch=B, checkpoint=plan)
    loss, grads, _ = applied(name, knobs)
    assert_same_step((loss, grads), reference(name), TOL["fp32"])
    plain, ckpt = _ops(name, Knobs(micro_batch=B)), _ops(name, knobs)
    assert ckpt.total() > plain.total(), "nothing was recomputed in backward"


def _ops(name: str, knobs: Knobs) -> collections.Counter:
    """How often each ATen op ran in one applied step."""
    step = apply(make(name), knobs)
    with Ops() as rec:
        step()
    return collections.Counter(op.split(".")[1] for op, _ in rec.ops)


def _train(name: str, states: str, steps: int = 5, precision: str = "fp32"):
    """Parameters before and after `steps` AdamW steps on one batch, and the step."""
    wl = make(name)
    before = {n: p.detach().float().clone() for n, p in wl.model.named_parameters()}
    step = apply(wl, Knobs(micro_batch=B, optimizer_states=states), precision)
    for _ in range(steps):
        step()
    return before, {n: p.detach().float() for n, p in wl.model.named_parameters()}, step


def assert_same_updates(got, want, tol: float) -> None:
    """Each parameter's change over the steps, against the reference's change."""
    (b0, a0, _), (b1, a1, _) = want, got
    for n in b0:
        assert torch.equal(b0[n], b1[n])
        assert_close(a1[n] - b1[n], a0[n] - b0[n], tol, n)


@pytest.mark.parametrize("name", ["gpt2", "mlp"])
def test_bf16_states_follow_fp32_adamw(name):
    got = _train(name, "bf16")
    states = got[2].optimizer.state
    assert states and all(
        s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
        for s in states.values()
    )
    assert_same_updates(got, _train(name, "as-is"), 1e-2)


def test_adamw_bf16_arithmetic_is_torch_adamw_with_fp32_states(monkeypatch):
    """With its moments kept in fp32 the update is torch's AdamW to rounding: the bf16
    tolerance above is only the moments' storage. Small buckets: slices and runs of tensors."""
    from gobrrr.training.optimizers import AdamWBF16

    monkeypatch.setattr(AdamWBF16, "state_dtype", torch.float32)
    monkeypatch.setattr(AdamWBF16, "bucket", 1000)  # gpt2's 100 x 32 embedding in 4 slices
    assert_same_updates(_train("gpt2", "bf16"), _train("gpt2", "as-is"), 1e-5)


def test_adam_with_l2_weight_decay_keeps_it_coupled():
    def adam(params):
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.1)

    runs = []
    for states in ("as-is", "bf16"):
        torch.manual_seed(0)
        wl = make("mlp")
        wl.optimizer = adam
        before = {n: p.detach().clone() for n, p in wl.model.named_parameters()}
        step = apply(wl, Knobs(micro_batch=B, optimizer_states=states))
        for _ in range(3):
            step()
        runs.append((before, {n: p.detach() for n, p in wl.model.named_parameters()}, step))
    assert not runs[1][2].optimizer.param_groups[0]["decoupled"]
    assert_same_updates(runs[1], runs[0], 3e-2)


def test_bf16_states_on_bf16_weights_run():
    before, after, step = _train("mlp", "bf16", steps=2, precision="bf16")
    assert all(p.dtype == torch.bfloat16 for p in step.model.parameters())
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_8bit_states_follow_fp32_adamw():
    """torchao's AdamW8bit with the workload's hyper-parameters. Per element, 8-bit moments
    are not a tolerance: an exp_avg_sq 1e-7 below its block's largest rounds to 0 and the
    element steps by lr * m / eps (the MLP here sees a step 64x AdamW's). So the changes are
    held in norm, per tensor, on GPT-2, whose 4096-element MLP matrices are quantised."""
    pytest.importorskip("torchao", reason="8-bit states need torchao: pip install 'gobrrr[optim]'")
    from torchao.optim.subclass_8bit import OptimState8bit

    got, want = _train("gpt2", "8bit", steps=3), _train("gpt2", "as-is", steps=3)
    opt, user = got[2].optimizer, want[2].optimizer
    quantised = [
        n
        for n, p in got[2].model.named_parameters()
        if isinstance(opt.state[p]["exp_avg"], OptimState8bit)
    ]
    assert len(quantised) == 4 and all("mlp.c_" in n for n in quantised), quantised
    for k in ("lr", "betas", "eps", "weight_decay"):  # torchao keeps lr as an fp32 tensor
        assert torch.tensor(opt.param_groups[0][k]).tolist() == pytest.approx(
            torch.tensor(user.param_groups[0][k]).tolist(), rel=1e-6
        ), k
    (b0, a0, _), (b1, a1, _) = want, got
    for n in b0:
        d0, d1 = a0[n] - b0[n], a1[n] - b1[n]
        assert (d1 - d0).norm() <= 3e-2 * d0.norm(), n


def test_8bit_without_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    with pytest.raises(GobrrrError, match=r"not installed: pip install 'gobrrr\[optim\]'") as e:
        apply(make("mlp"), Knobs(micro_batch=B, optimizer_states="8bit"))
    assert "\n" not in str(e.value)


def test_optimizer_states_refused_for_sgd():
    wl = make("mlp")
    wl.optimizer = lambda params: torch.optim.SGD(params, lr=0.1)
    with pytest.raises(GobrrrError, match="only be changed for Adam or AdamW.*SGD") as e:
        apply(wl, Knobs(micro_batch=B, optimizer_states="bf16"))
    assert "\n" not in str(e.value)


def test_offload_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: offload runs (benchmarks/ measures it)")
    with pytest.raises(GobrrrError, match="offload moves optimizer states from a CUDA GPU"):
        apply(make("mlp"), Knobs(micro_batch=B, offload=True))


# -- fused linear + cross-entropy -----------------------------------------------------------

FUSED = ["gpt2", "llama", "hf-llama"]


@pytest.mark.parametrize("name", FUSED)
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_fused_loss_reference_path_on_the_cpu(monkeypatch, name, precision):
    """On a CPU without the Triton interpreter the loss takes the torch reference path; the
    kernel itself is held against the plain step in tests/kernels/test_apply_fused.py."""
    import gobrrr.training.fused_loss as fl

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    calls = []
    real = fl.fused_linear_cross_entropy
    monkeypatch.setattr(
        fl, "fused_linear_cross_entropy", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k)
    )
    loss, grads, _ = applied(name, Knobs(micro_batch=B, fused_loss=True), precision)
    assert calls, "the model's loss did not go through the fused loss"
    assert_same_step((loss, grads), reference(name, precision), TOL[precision])


def test_fused_hf_model_without_labels_still_returns_its_logits():
    wl = make("hf-llama")
    ids = wl.batch["input_ids"]
    with torch.no_grad():
        before = wl.model(input_ids=ids).logits
        apply(wl, Knobs(micro_batch=B, fused_loss=True))
        after = wl.model(input_ids=ids).logits
        with_labels = wl.model(**wl.batch)
    assert torch.equal(before, after)
    assert with_labels.logits is None and with_labels.loss.dim() == 0


def test_fused_loss_refuses_what_it_cannot_take_over():
    pytest.importorskip("transformers", exc_type=ImportError)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    ids = torch.randint(0, 64, (B, 8))
    soft_capped = Workload(model=Gemma2ForCausalLM(cfg), batch={"input_ids": ids, "labels": ids})
    gpt2 = make("gpt2")
    stepped = Workload(model=gpt2.model, batch=gpt2.batch, step=lambda m, b: m(*b))
    cases = [
        (make("mlp"), "neither gobrrr's GPT2/Llama nor a Hugging Face causal LM"),
        (make("resnet"), "ResNet is neither gobrrr's GPT2/Llama"),
        (stepped, r"computes its loss in Workload\(step=...\)"),
        (soft_capped, "Gemma2ForCausalLM transforms the logits"),
    ]
    for wl, why in cases:
        with pytest.raises(GobrrrError, match=why) as e:
            apply(wl, Knobs(micro_batch=B, fused_loss=True))
        assert "\n" not in str(e.value) and "fused_loss=False" in str(e.value)


# -- compile --------------------------------------------------------------------------------


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None,
    reason="torch.compile on the CPU needs a C compiler (none on PATH)",
)
def test_compile_is_the_same_step():
    loss, grads, step = applied("mlp", Knobs(micro_batch=2, accumulation=2, compile=True))
    assert step.compiled is not None and step.compiled is not step.model
    assert_same_step((loss, grads), reference("mlp"), 1e-4)


# -- precisions the step owns ---------------------------------------------------------------


def test_fp16_mixed_scales_the_loss_and_unscales_the_gradients():
    loss, grads, step = applied("mlp", Knobs(micro_batch=2, accumulation=2), "fp16-mixed")
    assert step._step.scaler is not None and step._step.scaler.get_scale() > 1
    with torch.autocast("cpu", dtype=torch.float16):
        want = make("mlp")
        ref = want.compute_loss(want.batch)
    ref.backward()
    assert_close(loss, ref.detach(), 1e-2, "loss")
    for n, p in want.model.named_parameters():
        assert_close(grads[n], p.grad, 1e-2, n)


def test_pure_bf16_casts_the_model_and_the_batch():
    loss, grads, step = applied("mlp", Knobs(micro_batch=B), "bf16")
    assert all(p.dtype == torch.bfloat16 for p in step.model.parameters())
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    assert loss.dtype == torch.bfloat16


def test_the_workloads_own_batch_is_cast_and_moved_once():
    """step() reuses the batch it prepared on its first call (a per-step host-to-device copy
    of the workload's batch is a cost a hand loop with its batch on the GPU never pays);
    a batch passed in is prepared on every call, as a loop prepares each loader batch."""
    w = make("mlp")
    step = apply(w, Knobs(micro_batch=B), "bf16")
    casts = Ops()
    with casts:
        step()
        step()
    floating = sum(1 for t in w.batch if t.is_floating_point())
    assert floating >= 1

    def batch_casts():
        return sum(1 for op, shapes in casts.ops if "_to_copy" in op and shapes[0][0] == B)

    assert batch_casts() == floating  # the batch cast to bf16 on the first step only
    with casts:
        step(w.batch)
    assert batch_casts() == 2 * floating


# -- bad input: one GobrrrError line --------------------------------------------------------


def _one_line(fn, match: str) -> None:
    with pytest.raises(GobrrrError, match=match) as e:
        fn()
    assert "\n" not in str(e.value)


def test_batches_that_do_not_fit_the_plan():
    step = apply(make("mlp"), Knobs(micro_batch=2, accumulation=2))
    x, y = make("mlp").batch
    _one_line(
        lambda: step((torch.cat([x, x[:2]]), torch.cat([y, y[:2]]))),
        "a batch of 6 samples, but the plan's global batch is micro_batch 2 x accumulation 2 = 4",
    )
    _one_line(lambda: step((x, y[:3])), r"do not share a leading .*batch\[0\] 4, batch\[1\] 3")
    small = apply(make("mlp"), Knobs(micro_batch=3, accumulation=1))
    _one_line(lambda: small(), "a batch of 4 samples, but the plan's global batch is")


def test_knobs_that_do_not_exist():
    _one_line(
        lambda: apply(make("mlp"), {"micro_batch": 4, "accumulaton": 1}),
        "unknown knob 'accumulaton' \\(did you mean 'accumulation'\\?\\)",
    )
    _one_line(
        lambda: apply(make("mlp"), {"micro_batch": 4, "optimizer_states": "4bit"}),
        "unknown optimizer_states '4bit'",
    )
    _one_line(
        lambda: apply(make("mlp"), Knobs(micro_batch=4, checkpoint=(("layers.9", "full"),))),
        "checkpoint block 'layers.9' is not a module of DeepMLP",
    )
    _one_line(
        lambda: apply(make("mlp"), Knobs(micro_batch=4), precision="fp8"), "unknown precision 'fp8'"
    )


# -- weights in bf16 --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "hf-llama"])
def test_bf16_weights_is_the_pure_bf16_step(name):
    """weights="bf16" on a bf16-mixed workload runs the step as precision "bf16" does: the
    model's parameters (and so its gradients) in bfloat16, no autocast. Reference: the model
    cast by hand, its loss computed without autocast."""
    loss, grads, step = applied(name, Knobs(micro_batch=B, weights="bf16"), "bf16-mixed")
    assert step.precision == "bf16"
    assert {p.dtype for p in step.model.parameters()} == {torch.bfloat16}
    wl = make(name)
    wl.model.to(torch.bfloat16)
    ref = wl.compute_loss(wl.batch)
    ref.backward()
    want = {n: p.grad.clone() for n, p in wl.model.named_parameters()}
    assert {g.dtype for g in grads.values()} == {torch.bfloat16}
    assert_same_step((loss, grads), (ref.detach(), want), 1e-6)
