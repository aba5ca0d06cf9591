"""gobrrr.kernels.attention against an fp32 PyTorch reference, under the Triton interpreter.

Reference: softmax(q kᵀ · scale + causal mask) v in fp32 with K/V repeated per query head (GQA),
gradients by autograd. Tolerances (atol = rtol, on outputs and every gradient): fp16 5e-3, bf16
3e-2 (bf16 keeps 8 bits of mantissa: P and dS are rounded to it before their matmuls), fp32 1e-4.
"""

import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported anywhere

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gobrrr.errors import GobrrrError  # noqa: E402
from gobrrr.kernels import _attention_bwd, _attention_fwd  # noqa: E402
from gobrrr.kernels._attention_fwd import cfg  # noqa: E402
from gobrrr.kernels.attention import attention  # noqa: E402

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


def reference(q, k, v, causal, scale):
    """fp32 softmax attention; GQA by repeating K/V heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (q @ k.transpose(-1, -2)) * scale  # (B, H, S_q, S_k)
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return torch.softmax(s, dim=-1) @ v, s


def make(shape_q, shape_kv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in (shape_q, shape_kv, shape_kv)]


def check_against_reference(q, k, v, causal, scale=None, dq_mode=None):
    """Run ours (forward + backward) and the fp32 reference; assert outputs and grads agree."""
    d = q.shape[-1]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    if dq_mode is None:
        out = attention(q, k, v, causal=causal, scale=scale)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    else:
        scale_ = scale or 1.0 / math.sqrt(d)
        out, lse = torch.ops.gobrrr.attention_fwd(q, k, v, causal, scale_)
        grads = _attention_bwd.attention_backward(
            dout, q.detach(), k.detach(), v.detach(), out, lse, causal, scale_, dq_mode=dq_mode
        )
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, _ = reference(q32, k32, v32, causal, scale or 1.0 / math.sqrt(d))
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout.float())
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    for name, got, want in zip(
        "out dq dk dv".split(), (out, *grads), (ref, *ref_grads), strict=True
    ):
        assert got.shape == want.shape, name
        err = (got.float() - want).abs().max().item()
        assert torch.allclose(got.float(), want, atol=tol, rtol=tol), f"{name}: max err {err:.3g}"


# (B, H, Hkv, S_q, S_k, D, causal): odd lengths, D 40/64/96/128, GQA (H=4 over Hkv=2 and 1)
CASES = [
    (2, 2, 2, 1, 1, 64, False),
    (1, 2, 2, 1, 1, 64, True),
    (1, 2, 2, 17, 17, 128, True),
    (2, 4, 2, 17, 17, 64, False),
    (1, 4, 1, 130, 130, 40, True),
    (1, 2, 2, 130, 130, 96, False),
    (1, 4, 2, 130, 130, 64, True),
    (1, 2, 1, 17, 130, 128, False),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: "B{}H{}kv{}S{}x{}D{}{}".format(*c[:6], "c" if c[6] else "")
)
def test_matches_reference(case, dtype):
    b, h, hkv, s_q, s_k, d, causal = case
    q, k, v = make((b, h, s_q, d), (b, hkv, s_k, d), dtype)
    check_against_reference(q, k, v, causal)


def test_fp32_inputs_and_explicit_scale():
    q, k, v = make((1, 2, 33, 64), (1, 2, 33, 64), torch.float32)
    check_against_reference(q, k, v, causal=True, scale=0.3)


def test_noncontiguous_inputs():
    b, s, h, d = 2, 33, 4, 64
    g = torch.Generator().manual_seed(3)
    q = torch.randn(b, s, h, d, generator=g).to(torch.bfloat16).transpose(1, 2)  # (B, H, S, D)
    k = torch.randn(b, s, 2, d, generator=g).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(b, 2, s, 2 * d, generator=g).to(torch.bfloat16)[..., d:]  # row stride 2D
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check_against_reference(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_logsumexp(causal):
    q, k, v = make((2, 4, 70, 64), (2, 2, 70, 64), torch.float16)
    scale = 0.2
    out, lse = torch.ops.gobrrr.attention_fwd(q, k, v, causal, scale)
    _, scores = reference(q.float(), k.float(), v.float(), causal, scale)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 70)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), atol=2e-3, rtol=2e-3)


def test_other_block_shapes():
    """Block shapes the GPU autotuner may pick (BLOCK_N > BLOCK_M, and the reverse) agree."""
    q, k, v = make((1, 2, 75, 32), (1, 1, 75, 32), torch.float32)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    for causal in (False, True):
        scale = 32**-0.5
        q32, k32, v32 = (t.clone().requires_grad_() for t in (q, k, v))
        ref, _ = reference(q32, k32, v32, causal, scale)
        ref_grads = torch.autograd.grad(ref, (q32, k32, v32), dout)
        for bm, bn in ((16, 32), (32, 16), (16, 16)):
            out, lse = _attention_fwd.attention_forward(q, k, v, causal, scale, cfg(bm, bn, 4, 1))
            dq, delta = _attention_bwd.bwd_dq(
                dout, q, k, v, out, lse, causal, scale, config=cfg(bm, bn, 4, 1)
            )
            torch.testing.assert_close(delta, (dout * out).sum(-1), atol=1e-5, rtol=1e-5)
            dk, dv = _attention_bwd.bwd_dkdv(
                dout, q, k, v, lse, delta, causal, scale, config=cfg(bm, bn, 4, 1)
            )
            for got, want in zip((out, dq, dk, dv), (ref, *ref_grads), strict=True):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_atomic_dq_mode():
    q, k, v = make((1, 4, 40, 64), (1, 2, 40, 64), torch.float16)
    check_against_reference(q, k, v, causal=True, dq_mode="atomic")


def _bad(shape_q=(1, 2, 8, 16), shape_kv=(1, 2, 8, 16), dtype=torch.float16, **over):
    q, k, v = (torch.zeros(s, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    return dict(dict(q=q, k=k, v=v), **over)


@pytest.mark.parametrize(
    "args,match",
    [
        (_bad(shape_q=(2, 8, 16)), "must be 4-D"),
        (_bad(dtype=torch.int32), "dtype is torch.int32"),
        (_bad(v=torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16)), "dtypes must match"),
        (_bad(k=torch.zeros(1, 2, 8, 16, dtype=torch.float16, device="meta")), "one device"),
        (_bad(shape_q=(1, 2, 8, 160), shape_kv=(1, 2, 8, 160)), "D=160"),
        (_bad(shape_q=(1, 3, 8, 16)), "multiple of key/value heads"),
        (_bad(shape_kv=(1, 2, 9, 16), causal=True), "S_q=8, S_k=9"),
        (_bad(v=torch.zeros(1, 2, 9, 16, dtype=torch.float16)), "k and v shapes"),
        (_bad(shape_kv=(2, 2, 8, 16)), "batch and head_dim"),
        (_bad(scale=-1.0), "scale=-1.0"),
    ],
)
def test_input_validation(args, match):
    with pytest.raises(GobrrrError, match=match):
        attention(**args)


def test_cpu_without_interpreter_says_so(monkeypatch):
    monkeypatch.setattr(_attention_fwd, "INTERPRET", False)
    q, k, v = make((1, 1, 4, 16), (1, 1, 4, 16), torch.float16)
    with pytest.raises(GobrrrError, match="CUDA GPU.*TRITON_INTERPRET=1"):
        attention(q, k, v)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func._schema.name, out))
        return out


def test_fake_tensor_trace_records_the_ops():
    b, h, hkv, s, d = 2, 8, 2, 4096, 128  # large: fake tensors allocate nothing
    with FakeTensorMode():
        q = torch.empty(b, h, s, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(b, hkv, s, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(b, hkv, s, d, dtype=torch.bfloat16, requires_grad=True)
        with _OpRecorder() as rec:
            out = attention(q, k, v, causal=True)
            out.sum().backward()
    ops = {name: result for name, result in rec.calls if name.startswith("gobrrr::")}
    assert set(ops) == {"gobrrr::attention_fwd", "gobrrr::attention_bwd"}
    o, lse = ops["gobrrr::attention_fwd"]
    assert o.shape == (b, h, s, d) and o.dtype == torch.bfloat16
    assert lse.shape == (b, h, s) and lse.dtype == torch.float32
    dq, dk, dv = ops["gobrrr::attention_bwd"]
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_torch_compile_fullgraph_matches_eager():
    """Dynamo traces the autograd.Function and both ops without a graph break."""
    q, k, v = (t.requires_grad_() for t in make((1, 2, 17, 32), (1, 1, 17, 32), torch.float32))

    def loss(q, k, v):
        return (attention(q, k, v, causal=True) ** 2).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    try:
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    finally:
        torch._dynamo.reset()
    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_eager_calls_skip_the_dispatcher_but_traces_keep_the_ops(monkeypatch):
    """Plain eager calls launch the kernels directly (less host time); under a dispatch mode the
    same call goes through gobrrr::attention_fwd/bwd, with the same gradients."""
    mod = sys.modules["gobrrr.kernels.attention"]  # the module (the package exports the function)
    q, k, v = (t.requires_grad_() for t in make((1, 2, 9, 16), (1, 1, 9, 16), torch.float32))
    with _OpRecorder() as rec:
        traced = torch.autograd.grad(attention(q, k, v, causal=True).sum(), (q, k, v))
    assert {"gobrrr::attention_fwd", "gobrrr::attention_bwd"} <= {n for n, _ in rec.calls}

    def no_dispatch(*args):
        raise AssertionError("the op dispatcher ran for a plain eager call")

    monkeypatch.setattr(mod, "_FWD", no_dispatch)
    monkeypatch.setattr(mod, "_BWD", no_dispatch)
    eager = torch.autograd.grad(attention(q, k, v, causal=True).sum(), (q, k, v))
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
