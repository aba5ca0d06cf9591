"""RMSNorm / LayerNorm kernels vs fp32 references written here: outputs and every gradient."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gobrrr.errors import GobrrrError
from gobrrr.kernels import LayerNorm, RMSNorm, layer_norm, rms_norm

# max |error| / max |reference| allowed, per dtype: fp32 is rounding noise; bf16 / fp16 are
# a few units of the output dtype's last place (2^-8, 2^-11) plus input rounding.
TOLS = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
SHAPES = [(5, 123, 96), (1, 64), (17, 77)]


def ref_rms(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def ref_ln(x, w, b, eps):
    x = x.float()
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + eps) * w.float()
    return y if b is None else y + b.float()


def make_x(shape, dtype, contiguous):
    if contiguous:
        return torch.randn(shape, dtype=dtype)
    # last dim strided and leading dims transposed: both layouts a kernel must not assume away
    wide = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]
    return wide.transpose(0, -2) if len(shape) > 2 else wide


def grads(fn, inputs, dy):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def run_case(close, ours, ref, inputs, dtype):
    dy = torch.randn(ours(*inputs).shape, dtype=dtype)
    y, g = grads(ours, inputs, dy)
    y_ref, g_ref = grads(lambda *a: ref(*[t.float() for t in a]), inputs, dy.float())
    tol = TOLS[dtype]
    assert y.dtype == dtype
    close(y, y_ref, tol, "y")
    for i, (a, e) in enumerate(zip(g, g_ref, strict=True)):
        assert a.dtype == inputs[i].dtype
        close(a, e, tol, f"grad {i}")


@pytest.mark.parametrize("dtype", TOLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("contiguous", [True, False])
def test_rms_norm(close, dtype, shape, contiguous):
    torch.manual_seed(0)
    x = make_x(shape, dtype, contiguous)
    if len(shape) > 2 and not contiguous:
        shape = x.shape
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    run_case(
        close, lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: ref_rms(a, b, 1e-6), [x, w], dtype
    )


@pytest.mark.parametrize("dtype", TOLS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(close, dtype, shape, bias):
    torch.manual_seed(1)
    x = 3 + 2 * torch.randn(shape, dtype=dtype)  # a non-zero mean exercises the centring
    w = (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    if bias:
        b = (0.1 * torch.randn(shape[-1])).to(dtype)
        run_case(
            close,
            lambda a, c, d: layer_norm(a, c, d),
            lambda a, c, d: ref_ln(a, c, d, 1e-5),
            [x, w, b],
            dtype,
        )
    else:
        run_case(
            close,
            lambda a, c: layer_norm(a, c),
            lambda a, c: ref_ln(a, c, None, 1e-5),
            [x, w],
            dtype,
        )


def test_layer_norm_non_contiguous(close):
    torch.manual_seed(2)
    x = make_x((5, 123, 80), torch.float32, contiguous=False)
    w, b = torch.randn(80), torch.randn(80)
    run_case(
        close,
        lambda a, c, d: layer_norm(a, c, d),
        lambda a, c, d: ref_ln(a, c, d, 1e-5),
        [x, w, b],
        torch.float32,
    )


def test_fp32_weight_bf16_input(close):
    torch.manual_seed(3)
    x = torch.randn(17, 96, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(96)
    y = rms_norm(x, w)
    assert y.dtype == torch.bfloat16
    close(y, ref_rms(x, w, 1e-6), TOLS[torch.bfloat16], "y")


def test_reference_matches_torch():
    # the hand-written references themselves agree with torch's own norms
    x, w, b = torch.randn(7, 33), torch.randn(33), torch.randn(33)
    want = torch.nn.functional.layer_norm(x, (33,), w, b)
    torch.testing.assert_close(ref_ln(x, w, b, 1e-5), want)
    rms = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * w
    torch.testing.assert_close(ref_rms(x, w, 1e-6), rms)


def test_modules_match_functional():
    torch.manual_seed(4)
    x = torch.randn(3, 5, 64)
    rms, ln = RMSNorm(64), LayerNorm(64, bias=False)
    assert ln.bias is None and rms.weight.shape == (64,)
    torch.testing.assert_close(rms(x), ref_rms(x, torch.ones(64), 1e-6))
    torch.testing.assert_close(ln(x), ref_ln(x, torch.ones(64), None, 1e-5))


def test_errors():
    x = torch.randn(4, 8)
    with pytest.raises(GobrrrError, match="weight has 7"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(GobrrrError, match="dtype torch.int64"):
        layer_norm(torch.ones(4, 8, dtype=torch.long), torch.ones(8))
    with pytest.raises(GobrrrError, match="bias has 3"):
        layer_norm(x, torch.ones(8), torch.ones(3))


def test_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(GobrrrError, match="TRITON_INTERPRET=1"):
        rms_norm(torch.randn(2, 8), torch.ones(8))


def test_fake_tensor_trace(recorder):
    with FakeTensorMode():
        x = torch.randn(4, 6, 32, requires_grad=True)
        w = torch.randn(32, requires_grad=True)
        b = torch.randn(32, requires_grad=True)
        with recorder() as rec:
            rms_norm(x, w).sum().backward()
            layer_norm(x, w, b).sum().backward()
    ops = dict(rec.ops)
    assert ops["gobrrr::rms_norm_fwd"] == [(4, 6, 32), (4, 6)]
    assert ops["gobrrr::rms_norm_bwd"] == [(4, 6, 32), (32,)]
    assert ops["gobrrr::layer_norm_fwd"] == [(4, 6, 32), (4, 6), (4, 6)]
    assert ops["gobrrr::layer_norm_bwd"] == [(4, 6, 32), (32,), (32,)]


@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_wide_rows(close, norm):
    # rows of >= 8192 take the kernel path that re-reads the weight inside the backward loop
    torch.manual_seed(5)
    x, w, b = torch.randn(3, 9000), 1 + 0.1 * torch.randn(9000), torch.randn(9000)
    _check_fp32(close, norm, x, w, b)


def _check_fp32(close, norm, x, w, b):
    """Outputs and gradients of rms_norm(x, w) or layer_norm(x, w, b) against the fp32
    references."""
    if norm == "rms":
        run_case(
            close,
            lambda a, c: rms_norm(a, c),
            lambda a, c: ref_rms(a, c, 1e-6),
            [x, w],
            torch.float32,
        )
    else:
        run_case(
            close,
            lambda a, c, d: layer_norm(a, c, d),
            lambda a, c, d: ref_ln(a, c, d, 1e-5),
            [x, w, b],
            torch.float32,
        )


@pytest.mark.parametrize("reload", [0, 1])
@pytest.mark.parametrize("shape", [(128, 64), (3, 9000), (2, 16384), (70, 96)])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_backward_paths(close, monkeypatch, reload, shape, norm):
    # both backward paths (tile held in registers / read twice, in column halves) on shapes with
    # and without ragged rows and columns
    from gobrrr.kernels import norms

    monkeypatch.setitem(norms.TUNING, "bwd_reload", reload)
    monkeypatch.setitem(norms.TUNING, "bwd_chunk", 512)
    torch.manual_seed(6)
    x, w, b = 1 + torch.randn(shape), 1 + 0.1 * torch.randn(shape[-1]), torch.randn(shape[-1])
    _check_fp32(close, norm, x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 9000), (2, 16384), (70, 96)])
@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_backward_held16(close, monkeypatch, dtype, shape, norm):
    # the one-read path for 16-bit inputs (the tile held in its own dtype between the row sums
    # and dx), forced on narrow rows too
    from gobrrr.kernels import norms

    monkeypatch.setitem(norms.TUNING, "bwd_reload", 1)
    assert norms._bwd_launch(*shape, norm == "ln", torch.device("cpu"), dtype)["keep16"]
    torch.manual_seed(7)
    x = (1 + torch.randn(shape)).to(dtype)
    w, b = (1 + 0.1 * torch.randn(shape[-1])).to(dtype), torch.randn(shape[-1]).to(dtype)
    if norm == "rms":
        run_case(
            close, lambda a, c: rms_norm(a, c), lambda a, c: ref_rms(a, c, 1e-6), [x, w], dtype
        )
    else:
        run_case(
            close,
            lambda a, c, d: layer_norm(a, c, d),
            lambda a, c, d: ref_ln(a, c, d, 1e-5),
            [x, w, b],
            dtype,
        )


def test_backward_launch_plan(monkeypatch):
    # 4096 one-row tiles on 132 SMs: 128 programs of 32 tiles, not 132 of which 4 take a 32nd
    from gobrrr.kernels import norms

    monkeypatch.setattr(norms, "num_sms", lambda device: 132)
    plan = norms._bwd_launch(4096, 16384, True, torch.device("cpu"))
    assert (plan["tiles"], plan["n_progs"]) == (4096, 128)
    assert plan["reload"] and not plan["mask_m"] and not plan["mask_n"]
    # bf16 rows that wide are read once and held in 16 bits instead
    plan = norms._bwd_launch(4096, 16384, True, torch.device("cpu"), torch.bfloat16)
    assert plan["keep16"] and not plan["reload"] and plan["warps"] == 16


@pytest.mark.parametrize("norm", ["rms", "ln"])
def test_op_path_matches_direct(recorder, norm):
    # under a dispatch mode the public functions run the gobrrr:: ops (so traces see them);
    # otherwise they launch the kernels directly: the same kernels, so the same bits
    torch.manual_seed(8)
    x, w, b = torch.randn(6, 40), 1 + 0.1 * torch.randn(40), torch.randn(40)
    dy = torch.randn(6, 40)
    fn = (lambda a, c, d: rms_norm(a, c)) if norm == "rms" else layer_norm
    direct_out = grads(fn, [x, w, b], dy)
    with recorder() as rec:
        op_out = grads(fn, [x, w, b], dy)
    names = [name for name, _ in rec.ops]
    kind = "rms_norm" if norm == "rms" else "layer_norm"
    assert f"gobrrr::{kind}_fwd" in names and f"gobrrr::{kind}_bwd" in names
    for a, e in zip([direct_out[0], *direct_out[1]], [op_out[0], *op_out[1]], strict=True):
        assert (a is None and e is None) or torch.equal(a, e)
