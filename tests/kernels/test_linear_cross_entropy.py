"""Fused linear + cross-entropy vs an fp32 reference written here: loss, dhidden, dweight, dbias."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from gobrrr.errors import GobrrrError
from gobrrr.kernels import LinearCrossEntropy, linear_cross_entropy
from gobrrr.kernels.linear_cross_entropy import TUNING, default_chunk

# bf16/fp16: the logits and their gradient are rounded to the input dtype (as in an eager
# bf16 model), and dW accumulates in that dtype across chunks: a few last-place units.
TOLS = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def ref_loss(h, w, t, b, ignore_index, reduction, smoothing):
    """Cross-entropy in fp32 from its definition (log-softmax, NLL, uniform smoothing)."""
    logits = h.float() @ w.float().T
    if b is not None:
        logits = logits + b.float()
    logp = logits.log_softmax(-1)
    valid = t != ignore_index
    nll = -logp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    per_row = (1 - smoothing) * nll - smoothing * logp.mean(-1)
    total = torch.where(valid, per_row, 0.0).sum()
    return total / valid.sum() if reduction == "mean" else total


# (lead shape, hidden, vocab, ignore, reduction, smoothing, bias, contiguous, chunk)
CASES = [
    ((17,), 64, 1000, False, "mean", 0.0, False, True, 0),
    ((5, 123), 96, 1031, True, "mean", 0.1, True, True, 0),
    ((1,), 80, 1031, False, "sum", 0.2, False, True, 0),
    ((17,), 96, 1031, True, "sum", 0.0, True, False, 4),
    ((3, 7), 72, 1000, True, "mean", 0.05, False, False, 5),
]


def make_inputs(lead, d, v, ignore, bias, contiguous, dtype):
    n = int(torch.tensor(lead).prod())
    if contiguous:
        h, w = torch.randn(*lead, d), torch.randn(v, d) / d**0.5
    else:  # transposed storage for both: hidden (.., d) and weight (V, d) with unit row stride
        if len(lead) == 1:
            h = torch.randn(d, n).T
        else:
            h = torch.randn(lead[1], lead[0], d).transpose(0, 1)
        w = (torch.randn(d, v) / d**0.5).T
    t = torch.randint(0, v, lead)
    if ignore:
        t.view(-1)[::3] = -100
    b = 0.5 * torch.randn(v) if bias else None
    cast = lambda x: None if x is None else x.to(dtype)
    return cast(h), cast(w), t, cast(b)


@pytest.mark.parametrize("dtype", TOLS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-V{c[2]}-{c[4]}-ls{c[5]}")
def test_against_reference(close, dtype, case):
    lead, d, v, ignore, reduction, smoothing, bias, contiguous, chunk = case
    torch.manual_seed(0)
    inputs = make_inputs(lead, d, v, ignore, bias, contiguous, dtype)
    assert contiguous or not inputs[0].is_contiguous()
    leaves = [
        x.detach().clone().requires_grad_() if x is not None and x.is_floating_point() else x
        for x in inputs
    ]
    h, w, t, b = leaves
    loss = linear_cross_entropy(
        h, w, t, b, reduction=reduction, label_smoothing=smoothing, chunk_size=chunk
    )
    (2.5 * loss).backward()  # grad_output != 1 checks the backward's scaling
    refs = [
        x.detach().float().requires_grad_() if x is not None and x.is_floating_point() else x
        for x in inputs
    ]
    rh, rw, rt, rb = refs
    ref = ref_loss(rh, rw, rt, rb, -100, reduction, smoothing)
    (2.5 * ref).backward()
    tol = TOLS[dtype]
    assert loss.dtype == torch.float32 and loss.shape == ()
    close(loss.detach(), ref.detach(), tol, "loss")
    close(h.grad, rh.grad, tol, "dhidden")
    close(w.grad, rw.grad, tol, "dweight")
    if bias:
        close(b.grad, rb.grad, tol, "dbias")
    assert h.grad.dtype == dtype and w.grad.dtype == dtype


def test_reference_matches_torch():
    torch.manual_seed(1)
    h, w, b = torch.randn(9, 16), torch.randn(50, 16), torch.randn(50)
    t = torch.randint(0, 50, (9,))
    t[2] = -100
    for reduction in ("mean", "sum"):
        want = F.cross_entropy(h @ w.T + b, t, reduction=reduction, label_smoothing=0.3)
        torch.testing.assert_close(ref_loss(h, w, t, b, -100, reduction, 0.3), want)


def test_chunk_size_does_not_change_result():
    torch.manual_seed(2)
    h, w, t = torch.randn(19, 32), torch.randn(100, 32), torch.randint(0, 100, (19,))
    losses = [linear_cross_entropy(h, w, t, chunk_size=c) for c in (1, 7, 19)]
    for x in losses[1:]:
        torch.testing.assert_close(x, losses[0])


def test_all_ignored_and_custom_ignore_index():
    h, w = torch.randn(4, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    t = torch.full((4,), 7)
    loss = linear_cross_entropy(h, w, t, ignore_index=7, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0
    assert h.grad.abs().max() == 0 and w.grad.abs().max() == 0
    mean = linear_cross_entropy(h, w, t, ignore_index=7)  # 0 / 0, as torch gives
    assert torch.isnan(mean) and torch.isnan(F.cross_entropy(h @ w.T, t, ignore_index=7))


def test_autocast_casts_matmuls_to_bf16(close):
    torch.manual_seed(3)
    h = torch.randn(2, 9, 64, requires_grad=True)
    w = (torch.randn(1000, 64) / 8).requires_grad_()
    t = torch.randint(0, 1000, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, t)
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    rh, rw = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref_loss(rh, rw, t, None, -100, "mean", 0.0).backward()
    close(w.grad, rw.grad, TOLS[torch.bfloat16], "dweight")


def test_default_chunk():
    # logits chunk ~ hidden-state size, floored at TUNING["min_chunk"] tokens, capped at N
    assert default_chunk(8192, 4096, 128256) == max(256, TUNING["min_chunk"])
    assert default_chunk(100, 64, 1000) == 100
    assert default_chunk(1 << 20, 4096, 4096) == 1 << 20


def test_module():
    torch.manual_seed(4)
    m = LinearCrossEntropy(32, 77, bias=True)
    h, t = torch.randn(5, 32), torch.randint(0, 77, (5,))
    torch.testing.assert_close(m(h, t), F.cross_entropy(F.linear(h, m.weight, m.bias), t))


def test_errors():
    h, w, t = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    with pytest.raises(GobrrrError, match="target 12"):
        linear_cross_entropy(h, w, torch.tensor([0, 1, 12, 3]))
    with pytest.raises(GobrrrError, match="weight must be"):
        linear_cross_entropy(h, torch.randn(10, 9), t)
    with pytest.raises(GobrrrError, match="targets must be"):
        linear_cross_entropy(h, w, t.float())
    with pytest.raises(GobrrrError, match="reduction='none'"):
        linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(GobrrrError, match="one dtype"):
        linear_cross_entropy(h, w.bfloat16(), t)


def test_out_of_range_target_poisons_row_in_kernel(monkeypatch):
    # on a GPU the host-side check is skipped (it would sync); the kernel then returns NaN
    import sys

    lce = sys.modules["gobrrr.kernels.linear_cross_entropy"]
    monkeypatch.setattr(lce, "_check_targets", lambda *a: None)
    h, w = torch.randn(3, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.tensor([1, 10, -100]), reduction="sum")
    loss.backward()
    assert torch.isnan(loss)
    assert torch.isnan(h.grad[1]).all() and torch.isfinite(h.grad[0]).all()
    assert (h.grad[2] == 0).all()


def test_backward_allocates_no_zero_gradients(recorder):
    # unused outputs (dhidden, dweight) must not get zero-filled gradients: for dweight that
    # would double the peak memory of the loss (V x d zeros next to the V x d gradient)
    h, w = torch.randn(6, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.randint(0, 50, (6,)))
    with recorder() as rec:
        loss.backward()
    allocs = [
        name
        for name, shapes in rec.ops
        if (50, 16) in shapes and "mul_" not in name and "detach" not in name
    ]
    assert allocs == [], allocs


def test_fake_tensor_trace(recorder):
    with FakeTensorMode():
        h = torch.randn(2, 8, 48, requires_grad=True)
        w = torch.randn(300, 48, requires_grad=True)
        b = torch.randn(300, requires_grad=True)
        t = torch.randint(0, 300, (2, 8))
        with recorder() as rec:
            linear_cross_entropy(h, w, t, b).backward()
    ops = dict(rec.ops)
    assert ops["gobrrr::linear_cross_entropy"] == [(), (16, 48), (300, 48), (300,)]


@pytest.mark.parametrize("frozen", ["weight", "weight+bias", "hidden"])
def test_a_frozen_input_gets_no_gradient_and_the_rest_are_unchanged(close, frozen):
    """A frozen head (LoRA: lm_head.weight.requires_grad False) makes no dweight: the op
    returns an empty one and autograd leaves weight.grad None; the gradients that are taken
    equal the fp32 reference's."""
    torch.manual_seed(0)
    h, w, t, b = make_inputs((2, 9), 24, 70, True, True, True, torch.float32)
    leaves = [x.detach().clone().requires_grad_(name not in frozen) for name, x in
              (("hidden", h), ("weight", w), ("bias", b))]  # fmt: skip
    lh, lw, lb = leaves
    loss = linear_cross_entropy(lh, lw, t, lb, chunk_size=7)
    (3.0 * loss).backward()
    rh, rw, rb = (x.detach().clone().requires_grad_() for x in (h, w, b))
    (3.0 * ref_loss(rh, rw, t, rb, -100, "mean", 0.0)).backward()
    close(loss.detach(), ref_loss(h, w, t, b, -100, "mean", 0.0), TOLS[torch.float32], "loss")
    for name, got, want in (("hidden", lh, rh), ("weight", lw, rw), ("bias", lb, rb)):
        if name in frozen:
            assert got.grad is None, name
        else:
            close(got.grad, want.grad, TOLS[torch.float32], name)


def test_a_frozen_weight_makes_no_vocab_sized_gradient(recorder):
    """Traced on fake tensors as gobrrr traces a LoRA step: the op's dweight is (0,), so the
    step's memory holds no (V, d) gradient of the frozen head."""
    with FakeTensorMode():
        h = torch.randn(2, 8, 48, requires_grad=True)
        w = torch.randn(300, 48)  # frozen
        t = torch.randint(0, 300, (2, 8))
        with recorder() as rec:
            linear_cross_entropy(h, w, t).backward()
    assert dict(rec.ops)["gobrrr::linear_cross_entropy"] == [(), (16, 48), (0,), (0,)]
