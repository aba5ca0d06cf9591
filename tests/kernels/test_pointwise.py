"""SwiGLU / GELU kernels vs fp32 references written here: outputs and gradients."""

import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gobrrr.errors import GobrrrError
from gobrrr.kernels import SwiGLU, gelu, swiglu

TOLS = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
SHAPES = [(5, 123, 64), (1,), (17, 1031)]


def ref_swiglu(g, u):
    g, u = g.float(), u.float()
    return g / (1 + torch.exp(-g)) * u


def ref_gelu(x, approximate):
    x = x.float()
    if approximate == "tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def make(shape, dtype, contiguous):
    if contiguous:
        return 3 * torch.randn(shape, dtype=dtype)
    return 3 * torch.randn(*shape, 2, dtype=dtype)[..., 0]  # stride 2 everywhere


def check(close, ours, ref, inputs, dtype):
    dy = torch.randn(inputs[0].shape, dtype=dtype)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = ours(*leaves)
    y.backward(dy)
    ref_leaves = [t.detach().float().requires_grad_() for t in inputs]
    y_ref = ref(*ref_leaves)
    y_ref.backward(dy.float())
    tol = TOLS[dtype]
    assert y.dtype == dtype and y.shape == inputs[0].shape
    close(y, y_ref, tol, "y")
    for i, (a, e) in enumerate(zip(leaves, ref_leaves, strict=True)):
        assert a.grad.dtype == dtype
        close(a.grad, e.grad, tol, f"grad {i}")


@pytest.mark.parametrize("dtype", TOLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_swiglu(close, dtype, shape, contiguous):
    torch.manual_seed(0)
    g, u = make(shape, dtype, contiguous), make(shape, dtype, True)
    check(close, swiglu, ref_swiglu, [g, u], dtype)


@pytest.mark.parametrize("dtype", TOLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(close, dtype, shape, approximate):
    torch.manual_seed(1)
    x = make(shape, dtype, contiguous=shape != (1,))
    check(close, lambda a: gelu(a, approximate), lambda a: ref_gelu(a, approximate), [x], dtype)


def test_reference_matches_torch():
    x = torch.linspace(-6, 6, 101)
    for approx in ("none", "tanh"):
        want = torch.nn.functional.gelu(x, approximate=approx)
        torch.testing.assert_close(ref_gelu(x, approx), want)
    torch.testing.assert_close(ref_swiglu(x, x.flip(0)), torch.nn.functional.silu(x) * x.flip(0))


def test_gelu_hand_values():
    # GELU(0) = 0, GELU'(0) = 1/2; GELU(x) -> x for large x, GELU(-x) -> 0
    x = torch.tensor([0.0, 10.0, -10.0], requires_grad=True)
    y = gelu(x)
    y.sum().backward()
    torch.testing.assert_close(y.detach(), torch.tensor([0.0, 10.0, 0.0]))
    torch.testing.assert_close(x.grad, torch.tensor([0.5, 1.0, 0.0]))


def test_swiglu_module():
    torch.manual_seed(2)
    m = SwiGLU(16, 40)
    x = torch.randn(3, 16)
    torch.testing.assert_close(m(x), m.down(ref_swiglu(m.gate(x), m.up(x))))


def test_errors():
    with pytest.raises(GobrrrError, match="shapes must match"):
        swiglu(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(GobrrrError, match="cast them to one dtype"):
        swiglu(torch.randn(3, 4), torch.randn(3, 4, dtype=torch.bfloat16))
    with pytest.raises(GobrrrError, match="approximate='fast'"):
        gelu(torch.randn(3), approximate="fast")


def test_fake_tensor_trace(recorder):
    with FakeTensorMode():
        g = torch.randn(2, 9, 48, requires_grad=True)
        u = torch.randn(2, 9, 48, requires_grad=True)
        with recorder() as rec:
            swiglu(g, u).sum().backward()
            gelu(g, "tanh").sum().backward()
    ops = dict(rec.ops)
    assert ops["gobrrr::swiglu_fwd"] == [(2, 9, 48)]
    assert ops["gobrrr::swiglu_bwd"] == [(2, 9, 48), (2, 9, 48)]
    assert ops["gobrrr::gelu_fwd"] == [(2, 9, 48)]
    assert ops["gobrrr::gelu_bwd"] == [(2, 9, 48)]


@pytest.mark.parametrize("op", ["swiglu", "gelu"])
def test_op_path_matches_direct(recorder, op):
    # under a dispatch mode the public functions run the gobrrr:: ops (so traces see them);
    # otherwise they launch the kernels directly: the same kernels, so the same bits
    torch.manual_seed(9)
    a, b, dy = torch.randn(7, 33), torch.randn(7, 33), torch.randn(7, 33)

    def run():
        leaves = [t.clone().requires_grad_() for t in (a, b)]
        y = swiglu(*leaves) if op == "swiglu" else gelu(leaves[0], "tanh")
        y.backward(dy)
        return [y.detach(), leaves[0].grad, leaves[1].grad]

    direct_out = run()
    with recorder() as rec:
        op_out = run()
    names = [name for name, _ in rec.ops]
    assert f"gobrrr::{op}_fwd" in names and f"gobrrr::{op}_bwd" in names
    for x, e in zip(direct_out, op_out, strict=True):
        assert (x is None and e is None) or torch.equal(x, e)
