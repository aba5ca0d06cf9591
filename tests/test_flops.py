"""cost.flops against independent references: torch.utils.flop_counter.FlopCounterMode on the
same ops (matmuls, convolutions), and hand-derived values (attention, optimizers, bytes)."""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from fake_tensors import contiguous as _t
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from gobrrr.cost._ops_attention import causal_fraction
from gobrrr.cost._ops_optim import mta_launches
from gobrrr.cost.flops import UNKNOWN_OPS, OpCost, graph_costs, op_cost, register_cost
from gobrrr.graph.ir import OpNode, StepGraph, TensorInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.precision import Precision

aten = torch.ops.aten


# -- a tiny recorder: each dispatched op becomes an OpNode ---------------------------------
class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[OpNode] = []
        self._sid: dict[int, int] = {}

    def _info(self, t: torch.Tensor) -> TensorInfo:
        sid = self._sid.setdefault(t.untyped_storage()._cdata, len(self._sid))
        return TensorInfo(
            tuple(t.shape), tuple(t.stride()), str(t.dtype)[6:], sid, t.storage_offset()
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs: list[TensorInfo] = []
        refs: dict[int, int] = {}

        def enc(x):
            if isinstance(x, torch.Tensor):
                if id(x) not in refs:
                    refs[id(x)] = len(inputs)
                    inputs.append(self._info(x))
                return {"t": refs[id(x)]}
            if isinstance(x, (list, tuple)):
                return [enc(y) for y in x]
            if isinstance(x, (bool, int, float, str)) or x is None:
                return x
            return str(x)  # dtypes, devices, profiler handles: JSON-able, as capture does

        a = tuple(enc(x) for x in args)
        k = {name: enc(v) for name, v in kwargs.items()}
        outs = tuple(self._info(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        self.nodes.append(
            OpNode(len(self.nodes), str(func), "forward", "", tuple(inputs), outs, a, k)
        )
        return out


def record(make, count_flops: bool = True):
    """Run make()() on fake tensors; returns (nodes, FlopCounterMode counts per op)."""
    with FakeTensorMode():
        step = make()
        counter = FlopCounterMode(display=False)
        # FlopCounterMode misreads the (B, S, H, D) layout of the low-level attention ops
        with counter if count_flops else contextlib.nullcontext(), Recorder() as rec:
            step()
    theirs = {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return rec.nodes, theirs


def packet(op: str) -> str:
    return ".".join(op.split(".")[:2])


def only(nodes, name):
    found = [n for n in nodes if packet(n.op) == name]
    assert found, f"{name} not recorded"
    return found


# -- matmuls and convolutions: exactly FlopCounterMode --------------------------------------
def _mm():
    a, b = torch.randn(33, 17), torch.randn(17, 9)
    return lambda: a @ b


def _bmm():
    a, b = torch.randn(3, 5, 7), torch.randn(3, 7, 11)
    return lambda: torch.bmm(a, b)


def _addmm():
    bias, a, b = torch.randn(9), torch.randn(33, 17), torch.randn(17, 9)
    return lambda: torch.addmm(bias, a, b)


def _baddbmm():
    c, a, b = torch.randn(3, 5, 11), torch.randn(3, 5, 7), torch.randn(3, 7, 11)
    return lambda: torch.baddbmm(c, a, b)


def _einsum():
    a, b = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 16, 8)
    return lambda: torch.einsum("bhqd,bhdk->bhqk", a, b)


def _linear_backward():
    lin = nn.Linear(24, 40)
    x = torch.randn(6, 10, 24, requires_grad=True)
    return lambda: lin(x).sum().backward()


def _conv(module, shape):
    def make():
        m = module()
        x = torch.randn(*shape, requires_grad=True)
        return lambda: m(x).square().sum().backward()

    return make


def _mlp_step():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.AdamW(m.parameters(), foreach=True)
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))

    def step():
        F.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step


FLOP_COUNTER_CASES = {
    "mm": _mm,
    "bmm": _bmm,
    "addmm": _addmm,
    "baddbmm": _baddbmm,
    "einsum": _einsum,
    "linear_backward": _linear_backward,
    "mlp_step": _mlp_step,
    "conv2d_strided": _conv(lambda: nn.Conv2d(4, 8, 3, stride=2, padding=1), (2, 4, 15, 15)),
    "conv2d_grouped_dilated": _conv(
        lambda: nn.Conv2d(8, 12, 3, groups=4, dilation=2), (2, 8, 13, 11)
    ),
    "conv1d_no_bias": _conv(lambda: nn.Conv1d(3, 5, 4, stride=3, bias=False), (4, 3, 20)),
    "conv_transpose2d_grouped": _conv(
        lambda: nn.ConvTranspose2d(8, 6, 3, stride=2, groups=2, output_padding=1), (2, 8, 7, 9)
    ),
    "conv3d": _conv(lambda: nn.Conv3d(2, 4, (2, 3, 3), padding=1), (1, 2, 5, 6, 7)),
}


GROUPED = {"conv2d_grouped_dilated": 4, "conv_transpose2d_grouped": 2}


def _ours(nodes) -> dict[str, float]:
    mine: dict[str, float] = defaultdict(float)
    for n in nodes:
        c = op_cost(n)
        if c.kind in ("matmul", "conv", "attention"):
            mine[packet(n.op)] += c.flops
    return dict(mine)


@pytest.mark.parametrize("case", sorted(FLOP_COUNTER_CASES))
def test_flops_match_flop_counter_mode(case):
    nodes, theirs = record(FLOP_COUNTER_CASES[case])
    assert theirs, "FlopCounterMode counted nothing: the case is broken"
    mine = _ours(nodes)
    if case in GROUPED:  # see test_grouped_conv_backward_counts_each_group_once
        mine.pop("aten.convolution_backward")
        theirs = {k: v for k, v in theirs.items() if k != "aten.convolution_backward"}
    assert mine == pytest.approx(theirs, rel=0, abs=0)


@pytest.mark.parametrize("case", sorted(GROUPED))
def test_grouped_conv_backward_counts_each_group_once(case):
    """grad_input and grad_weight each do the forward's multiply-adds, so backward = 2 x
    forward. FlopCounterMode counts grad_weight over all channel pairs, not per group:
    forward x (1 + groups)."""
    nodes, theirs = record(FLOP_COUNTER_CASES[case])
    mine = _ours(nodes)
    fwd = theirs["aten.convolution"]
    assert mine["aten.convolution"] == fwd
    assert mine["aten.convolution_backward"] == 2 * fwd
    assert theirs["aten.convolution_backward"] == fwd * (1 + GROUPED[case])


def test_conv_backward_output_mask():
    """An input that needs no gradient: convolution_backward computes grad_weight only."""

    def make():
        m = nn.Conv2d(3, 6, 3)
        x = torch.randn(2, 3, 10, 10)
        return lambda: m(x).sum().backward()

    nodes, theirs = record(make)
    (bwd,) = only(nodes, "aten.convolution_backward")
    assert bwd.args[10][0] is False
    # grad_weight alone: 2 · N · Cout · Cin · k² · out spatial
    assert op_cost(bwd).flops == 2 * 2 * 6 * 3 * 9 * 8 * 8 == theirs["aten.convolution_backward"]
    assert op_cost(bwd).launches == 2  # grad_weight + grad_bias


def test_matmul_math_and_bytes():
    def make():
        a = torch.randn(64, 32, dtype=torch.bfloat16)
        b = torch.randn(32, 16, dtype=torch.bfloat16)
        bias = torch.randn(16, dtype=torch.bfloat16)
        c, d = torch.randn(8, 8), torch.randn(8, 8)
        return lambda: (torch.addmm(bias, a, b), c @ d)

    nodes, _ = record(make)
    addmm = op_cost(only(nodes, "aten.addmm")[0])
    assert addmm.math == "bf16" and addmm.kind == "matmul" and addmm.launches == 1
    assert addmm.bytes == 2 * (64 * 32 + 32 * 16 + 16 + 64 * 16)
    mm = only(nodes, "aten.mm")[0]
    assert op_cost(mm).math == "fp32" and op_cost(mm, tf32=True).math == "tf32"


# -- attention: hand values (FlashAttention convention, causal halved) ------------------------
B, H, S, D = 2, 4, 64, 16
FWD = 4 * B * H * S * S * D  # two matmuls of B·H·S·S·D multiply-adds


def _sdpa_cpu(causal: bool, kv_heads: int = H, dtype=torch.float32):
    def make():
        q = torch.randn(B, H, S, D, dtype=dtype, requires_grad=True)
        k = torch.randn(B, kv_heads, S, D, dtype=dtype, requires_grad=True)
        v = torch.randn(B, kv_heads, S, D, dtype=dtype, requires_grad=True)
        dout = torch.randn(B, H, S, D, dtype=dtype)  # a real gradient, not an expanded scalar

        def step():
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, enable_gqa=kv_heads != H
            )
            out.backward(dout)

        return step

    return make


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_cpu_flops(causal):
    nodes, _ = record(_sdpa_cpu(causal))
    (fwd,) = only(nodes, "aten._scaled_dot_product_flash_attention_for_cpu")
    (bwd,) = only(nodes, "aten._scaled_dot_product_flash_attention_for_cpu_backward")
    half = 0.5 if causal else 1.0
    assert op_cost(fwd).flops == FWD * half
    assert op_cost(bwd).flops == 2.5 * FWD * half
    # non-causal equals torch's own sdpa formula (FlopCounterMode does not cover the CPU op)
    assert op_cost(fwd).flops / half == sdpa_flop_count((B, H, S, D), (B, H, S, D), (B, H, S, D))
    assert op_cost(fwd).kind == "attention" and op_cost(fwd).math == "fp32"
    assert op_cost(fwd, tf32=True).math == "tf32"


def test_sdpa_gqa_flops_follow_query_heads_bytes_read_kv_once():
    nodes, _ = record(_sdpa_cpu(True, kv_heads=2))
    (fwd,) = only(nodes, "aten._scaled_dot_product_flash_attention_for_cpu")
    (bwd,) = only(nodes, "aten._scaled_dot_product_flash_attention_for_cpu_backward")
    assert op_cost(fwd).flops == FWD / 2  # query heads, causal
    q_bytes, kv_bytes, lse_bytes = B * H * S * D * 4, B * 2 * S * D * 4, B * H * S * 4
    # read q, k, v (K/V at 2 heads), write out (= q's size) and lse
    assert op_cost(fwd).bytes == q_bytes + 2 * kv_bytes + q_bytes + lse_bytes
    # read dout, q, k, v, out, lse; write dq, dk, dv
    assert op_cost(bwd).bytes == 3 * q_bytes + 2 * kv_bytes + lse_bytes + q_bytes + 2 * kv_bytes
    assert op_cost(bwd).flops == 2.5 * FWD / 2


def _cuda_qkv(dtype=torch.bfloat16, sq=S, sk=S, bshd=False):
    shape = (lambda s: (B, s, H, D)) if bshd else (lambda s: (B, H, s, D))
    return (
        torch.randn(shape(sq), device="cuda", dtype=dtype),
        torch.randn(shape(sk), device="cuda", dtype=dtype),
        torch.randn(shape(sk), device="cuda", dtype=dtype),
    )


def _flash(q, k, v, causal):
    o = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=0.3)
    aten._scaled_dot_product_flash_attention_backward(
        o[0], q, k, v, o[0], o[1], o[2], o[3], o[4], o[5], 0.0, causal, o[6], o[7], scale=0.3
    )


def _efficient(q, k, v, causal):
    o = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    aten._scaled_dot_product_efficient_attention_backward(
        o[0], q, k, v, None, o[0], o[1], o[2], o[3], 0.0, [True, True, True, False], causal
    )


def _cudnn(q, k, v, causal):
    o = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal)
    aten._scaled_dot_product_cudnn_attention_backward(
        o[0], q, k, v, o[0], o[1], o[6], o[7], None, o[2], o[3], o[4], o[5], 0.0, causal
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", [_flash, _efficient, _cudnn])
def test_sdpa_cuda_backends(backend, causal):
    """The CUDA-only SDPA ops, traced on fake CUDA tensors from their real schemas."""

    def make():
        q, k, v = _cuda_qkv()
        return lambda: backend(q, k, v, causal)

    nodes, theirs = record(make)
    fwd, bwd = (n for n in nodes if "attention" in n.op)
    half = 0.5 if causal else 1.0
    assert op_cost(fwd).flops == FWD * half
    assert op_cost(bwd).flops == 2.5 * FWD * half
    # FlopCounterMode covers these ops and never halves for causal
    assert theirs[packet(fwd.op)] == FWD and theirs[packet(bwd.op)] == 2.5 * FWD
    assert (
        sdpa_backward_flop_count((B, H, S, D), (B, H, S, D), (B, H, S, D), (B, H, S, D))
        == 2.5 * FWD
    )
    qkv = 3 * B * H * S * D * 2
    assert op_cost(fwd).bytes == qkv + B * H * S * D * 2 + B * H * S * 4  # + out (bf16), lse
    assert op_cost(fwd).math == "bf16" and op_cost(bwd).kind == "attention"
    assert op_cost(bwd).launches >= 1


def test_low_level_flash_forward_is_bshd():
    def make():
        q, k, v = _cuda_qkv(bshd=True)
        return lambda: aten._flash_attention_forward(q, k, v, None, None, S, S, 0.0, True, False)

    nodes, _ = record(make)
    (fwd,) = only(nodes, "aten._flash_attention_forward")
    assert op_cost(fwd).flops == FWD / 2


def test_causal_fraction_when_lengths_differ():
    # Sq=2, Sk=4. top-left: query i sees keys 0..i -> 1 + 2 of 8; bottom-right: 3 + 4 of 8
    assert causal_fraction(2, 4) == 3 / 8
    assert causal_fraction(2, 4, bottom_right=True) == 7 / 8
    assert causal_fraction(5, 5) == 0.5


def test_efficient_forward_custom_mask_type_bottom_right():
    sq, sk = 16, 64

    def make():
        q, k, v = _cuda_qkv(sq=sq, sk=sk, bshd=True)
        return lambda: aten._efficient_attention_forward(
            q, k, v, None, None, None, None, None, 0.0, 2, True
        )

    nodes, _ = record(make, count_flops=False)
    (fwd,) = only(nodes, "aten._efficient_attention_forward")
    kept = sum(i + 1 + sk - sq for i in range(sq))  # query i sees keys j <= i + 48
    assert op_cost(fwd).flops == 4 * B * H * D * kept


def test_gobrrr_attention_ops():
    q, k, v = _t((B, H, S, D)), _t((B, 1, S, D)), _t((B, 1, S, D))
    out, lse = _t((B, H, S, D)), _t((B, H, S), "float32")
    fwd = OpNode(
        0,
        "gobrrr.attention_fwd.default",
        "forward",
        "",
        (q, k, v),
        (out, lse),
        ({"t": 0}, {"t": 1}, {"t": 2}, True, 0.25),
    )
    bwd = OpNode(
        1,
        "gobrrr.attention_bwd.default",
        "backward",
        "",
        (out, q, k, v, out, lse),
        (q, k, v),
        ({"t": 0}, {"t": 1}, {"t": 2}, {"t": 3}, {"t": 4}, {"t": 5}, False, 0.25),
    )
    assert op_cost(fwd).flops == FWD / 2
    assert op_cost(bwd).flops == 2.5 * FWD
    assert op_cost(fwd).bytes == 2 * (2 * B * H * S * D + 2 * B * S * D) + 4 * B * H * S


# -- optimizers -------------------------------------------------------------------------------
PARAM_SHAPES = [(300, 70), (70,), (5, 3, 3)]


def _fused_adamw(amsgrad: bool):
    def make():
        ps = [torch.randn(s, device="cuda") for s in PARAM_SHAPES]
        gs, ms, vs = ([torch.randn(s, device="cuda") for s in PARAM_SHAPES] for _ in range(3))
        vmax = [torch.randn(s, device="cuda") for s in PARAM_SHAPES] if amsgrad else []
        steps = [torch.zeros((), device="cuda") for _ in PARAM_SHAPES]
        return lambda: aten._fused_adamw_(
            ps,
            gs,
            ms,
            vs,
            vmax,
            steps,
            lr=1e-3,
            beta1=0.9,
            beta2=0.95,
            weight_decay=0.1,
            eps=1e-8,
            amsgrad=amsgrad,
            maximize=False,
        )

    return make


@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adamw_per_element(amsgrad):
    nodes, _ = record(_fused_adamw(amsgrad))
    (node,) = only(nodes, "aten._fused_adamw_")
    n = sum(math.prod(s) for s in PARAM_SHAPES)
    c = op_cost(node)
    assert c.flops == (15 if amsgrad else 14) * n
    states = 3 if amsgrad else 2
    # read param, grad, states, steps; write param, states
    assert c.bytes == 4 * n * (1 + 1 + states) + 4 * len(PARAM_SHAPES) + 4 * n * (1 + states)
    assert c.kind == "optimizer" and c.math == "vector" and c.launches == 1


def test_foreach_adamw_matches_fused_count():
    """torch's foreach AdamW (mul_, lerp_, mul_, addcmul_, sqrt, div_, add_, addcdiv_) sums to
    the same 14 FLOPs per element as the fused count."""

    def make():
        ps = [nn.Parameter(torch.randn(s)) for s in PARAM_SHAPES]
        opt = torch.optim.AdamW(ps, foreach=True, weight_decay=0.1)
        for p in ps:
            p.grad = torch.randn_like(p)
        return opt.step

    nodes, _ = record(make)
    n = sum(math.prod(s) for s in PARAM_SHAPES)
    foreach = [n_ for n_ in nodes if "_foreach_" in n_.op and n_.inputs[0].numel > 1]
    assert len(foreach) == 8
    assert sum(op_cost(x).flops for x in foreach) == 14 * n
    lerp = op_cost(only(nodes, "aten._foreach_lerp_")[0])  # exp_avg.lerp_(grad, 1 - beta1)
    assert lerp.bytes == 4 * n * 3 and lerp.launches == 1


def schema_node(op: str, **values) -> OpNode:
    """An OpNode laid out by the op's real schema: positional arguments in order, keyword-only
    ones as kwargs; TensorInfo values (or lists of them) become {"t": i} references."""
    inputs: list[TensorInfo] = []

    def enc(x):
        if isinstance(x, TensorInfo):
            inputs.append(x)
            return {"t": len(inputs) - 1}
        return [enc(y) for y in x] if isinstance(x, list) else x

    name, overload = op.rsplit(".", 1)
    schema = getattr(getattr(aten, name.split(".")[1]), overload)._schema
    args, kwargs = [], {}
    for a in schema.arguments:
        if a.name in values:
            (
                kwargs.__setitem__(a.name, enc(values[a.name]))
                if a.kwarg_only
                else args.append(enc(values[a.name]))
            )
    return OpNode(0, op, "optimizer", "", tuple(inputs), (), tuple(args), kwargs)


def test_fused_sgd_momentum():
    """_fused_sgd_ has no fake kernel: a node built from its schema."""

    def ts():
        return [_t(s, "float32") for s in PARAM_SHAPES]

    node = schema_node(
        "aten._fused_sgd_.default",
        self=ts(),
        grads=ts(),
        momentum_buffer_list=ts(),
        weight_decay=0.0,
        momentum=0.9,
        lr=0.1,
        dampening=0.0,
        nesterov=False,
        maximize=False,
        is_first_step=False,
    )
    n = sum(math.prod(s) for s in PARAM_SHAPES)
    c = op_cost(node)
    assert c.flops == 5 * n  # p -= lr·buf (2) + buf = 0.9·buf + g (3)
    assert c.bytes == 4 * n * (2 + 1 + 2)  # param r/w, grad r, buffer r/w


def test_multi_tensor_apply_launches():
    # one launch holds at most 320 blocks of 65536 elements
    assert mta_launches([65536 * 320], depth=4) == 1
    assert mta_launches([65536 * 320 + 1], depth=4) == 2
    # and at most 36 tensors at depth 4, 110 at depth 1
    assert mta_launches([10] * 36, depth=4) == 1
    assert mta_launches([10] * 37, depth=4) == 2
    assert mta_launches([10] * 110, depth=1) == 1 and mta_launches([10] * 111, depth=1) == 2
    # a tensor cut by the block limit carries on into the next launch: 3 blocks, 2 tensors
    assert mta_launches([65536 * 319 + 1, 65536 * 2], depth=1) == 2
    assert mta_launches([], depth=1) == 0


# -- pointwise bytes, views, creation ----------------------------------------------------------
def test_broadcast_add_reads_bias_at_its_own_size():
    def make():
        x, b = torch.randn(4, 8, 16), torch.randn(16)
        return lambda: (x + b, x + b.expand(4, 8, 16), x * 2.0, x.add_(b))

    nodes, _ = record(make)
    costs = [op_cost(n) for n in nodes if n.op.startswith(("aten.add", "aten.mul"))]
    assert [c.bytes for c in costs] == [4 * (512 + 16 + 512)] * 2 + [4 * (512 + 512)] + [
        4 * (512 + 16 + 512)
    ]
    assert all(c.flops == 512 and c.kind == "pointwise" and c.launches == 1 for c in costs)


def test_views_cost_nothing():
    def make():
        x = torch.randn(4, 6, 8)
        return lambda: (
            x.view(24, 8),
            x.permute(2, 0, 1),
            x.transpose(0, 1),
            x[0].t(),
            x.expand(2, 4, 6, 8),
            x[:, 1:3],
            x.select(1, 2),
            x.unsqueeze(0),
            x.unsqueeze(0).squeeze(0),
            x.as_strided((2, 2), (1, 1)),
            x.detach(),
            x.reshape(6, 32),
            x.split(2),
            x.chunk(2, dim=2),
            torch.empty(100),
            torch.empty_like(x),
        )

    nodes, _ = record(make)
    assert len(nodes) >= 15
    for n in nodes:
        assert op_cost(n) == OpCost(0.0, 0.0, "vector", "view", 0), n.op


def test_copies_and_fills():
    def make():
        x = torch.randn(4, 6, 8)
        return lambda: (
            x.to(torch.bfloat16),
            x.transpose(0, 1).contiguous(),
            torch.zeros(5, 7),
            x.zero_(),
            torch.cat([x, x[:1]]),
        )

    nodes, _ = record(make)
    got = {packet(n.op): op_cost(n) for n in nodes}
    assert got["aten._to_copy"].bytes == 192 * (4 + 2)
    assert got["aten.clone"].bytes == 192 * 8
    assert got["aten.zeros"].bytes == 35 * 4 and got["aten.zero_"].bytes == 192 * 4
    assert got["aten.cat"].bytes == 4 * (192 + 48) * 2 and got["aten.cat"].kind == "copy"


def test_norm_softmax_embedding_loss_hand_values():
    def make():
        emb, ln = nn.Embedding(50, 16), nn.LayerNorm(16)
        idx = torch.randint(0, 50, (4, 8))
        return lambda: F.cross_entropy(ln(emb(idx)).view(32, 16), idx.view(32) % 16).backward()

    nodes, _ = record(make)
    get = {packet(n.op): op_cost(n) for n in nodes}
    n = 32 * 16
    assert get["aten.embedding"].bytes == 32 * 8 + 2 * n * 4  # indices + gathered rows, written
    assert get["aten.embedding"].flops == 0
    assert get["aten.embedding_dense_backward"].bytes == n * 4 + 32 * 8 + 50 * 16 * 4
    assert get["aten.native_layer_norm"].flops == 7 * n  # 5 + weight + bias per element
    # x, weight, bias read; y, mean, rstd written
    assert get["aten.native_layer_norm"].bytes == 4 * (n + 16 + 16 + n + 32 + 32)
    assert get["aten._log_softmax"].flops == 5 * n and get["aten._log_softmax"].kind == "softmax"
    # one log-probability per target, not the whole (32, 16) input
    assert get["aten.nll_loss_forward"].bytes == 32 * 8 + 32 * 4 + 4 + 4
    assert not UNKNOWN_OPS & {n_.op for n_ in nodes}


# -- gobrrr kernels, unknown ops, registry, whole graphs --------------------------------------
def test_linear_cross_entropy():
    n, d, v = 24, 32, 100
    hidden, weight, targets = _t((n, d)), _t((v, d)), _t((n,), "int64")
    loss, dh, dw = _t((), "float32"), _t((n, d)), _t((v, d))
    node = OpNode(
        0,
        "gobrrr.linear_cross_entropy.default",
        "forward",
        "",
        (hidden, weight, targets),
        (loss, dh, dw),
        ({"t": 0}, {"t": 1}, {"t": 2}, None, -100, "mean", 0.0),
    )
    c = op_cost(node)
    assert c.flops == 2 * n * d * v * 3 + 4 * n * v
    assert c.bytes == 2 * (n * d + v * d) + 8 * n + 4 + 2 * (n * d + v * d)  # no logits
    assert c.math == "bf16" and c.kind == "loss"
    no_grad = OpNode(0, node.op, "forward", "", node.inputs, (loss,), node.args)
    assert op_cost(no_grad).flops == 2 * n * d * v + 4 * n * v


def test_gobrrr_rms_norm():
    x, w, rstd = _t((8, 64)), _t((64,)), _t((8,), "float32")
    node = OpNode(
        0,
        "gobrrr.rms_norm_fwd.default",
        "forward",
        "",
        (x, w),
        (x, rstd),
        ({"t": 0}, {"t": 1}, 1e-6),
    )
    assert op_cost(node) == OpCost(4.0 * 512, 2 * 512 + 128 + 2 * 512 + 32, "vector", "norm", 1)


def test_unknown_op_default_never_crashes():
    x, y = _t((3, 5), "float32"), _t((5, 7), "float32", sid=1)
    node = OpNode(0, "aten.frobnicate.default", "forward", "", (x, y), (_t((2, 7), "float32"),))
    c = op_cost(node)
    assert c == OpCost(14.0, 4 * (15 + 35 + 14), "vector", "other", 1)
    assert "aten.frobnicate.default" in UNKNOWN_OPS
    broken = OpNode(0, "aten.mm.default", "forward", "", (x,), (), ({"t": 0}, {"t": 3}))
    assert op_cost(broken).kind == "other"  # a malformed node falls back, does not raise
    assert "aten.mm.default" in UNKNOWN_OPS
    UNKNOWN_OPS.discard("aten.mm.default")


def test_register_cost_overload_wins():
    x = _t((4,), "float32")
    node = OpNode(0, "mylib.thing.fast", "forward", "", (x,), (x,))
    register_cost("mylib.thing", lambda n, tf32: OpCost(1, 2, "vector", "other", 1))
    register_cost("mylib.thing.fast", lambda n, tf32: OpCost(3, 4, "vector", "other", 1))
    assert op_cost(node).flops == 3
    assert op_cost(OpNode(0, "mylib.thing.slow", "forward", "", (x,), (x,))).flops == 1
    with pytest.raises(ValueError, match="thing"):
        register_cost("thing", lambda n, tf32: None)


def test_graph_costs_tf32_and_json_round_trip():
    nodes, _ = record(_mlp_step)
    for precision, math_ in (("fp32", "fp32"), ("tf32", "tf32")):
        graph = StepGraph(
            nodes=tuple(nodes), storages=(), meta=StepMeta(precision=Precision.parse(precision))
        )
        costs = graph_costs(graph)
        assert {c.math for c in costs if c.kind == "matmul"} == {math_}
        assert graph_costs(StepGraph.from_json(graph.to_json())) == costs
    assert not UNKNOWN_OPS & {n.op for n in nodes}


def test_pooling_and_elementwise_losses_are_known():
    def make():
        x = torch.randn(2, 3, 8, 8, requires_grad=True)
        return lambda: (
            F.mse_loss(F.max_pool2d(x, 2), torch.zeros(2, 3, 4, 4))
            + F.adaptive_avg_pool2d(x, 1).sum()
        ).backward()

    nodes, _ = record(make)
    get = {packet(n.op): op_cost(n) for n in nodes}
    assert get["aten.max_pool2d_with_indices"].flops == 2 * 3 * 4 * 4 * 4  # out × 2×2 window
    assert get["aten.mse_loss"].kind == "loss"
    assert not UNKNOWN_OPS & {n.op for n in nodes}


def test_linear_cross_entropy_chunking_mirrors_the_kernel():
    from gobrrr.cost._ops_gobrrr import _default_chunk

    default_chunk = pytest.importorskip("gobrrr.kernels.linear_cross_entropy").default_chunk
    for n, d, v in [(1, 64, 100), (1000, 768, 50257), (16384, 4096, 128256), (5000, 64, 100)]:
        assert _default_chunk(n, d, v) == default_chunk(n, d, v)


def test_gobrrr_layer_norm_backward_without_bias():
    x, w, stat = _t((8, 64)), _t((64,)), _t((8,), "float32")
    outs = (x, w, _t((0,)))  # dbias comes back empty when the norm has no bias
    node = OpNode(
        0,
        "gobrrr.layer_norm_bwd.default",
        "backward",
        "",
        (x, x, w, stat, stat),
        outs,
        ({"t": 0}, {"t": 1}, {"t": 2}, {"t": 3}, {"t": 4}, False),
    )
    assert op_cost(node).flops == (9 + 2) * 512 and op_cost(node).launches == 3


@pytest.mark.parametrize(
    "name,extra",
    [("gpt2", {"n_layer": 1}), ("llama3-1b", {"n_layer": 1}), ("mlp", {}), ("convnet", {})],
)
def test_built_in_training_steps_have_no_unknown_ops(name, extra):
    """Every op in a captured training step of each built-in model has a cost formula."""
    from gobrrr.capture import capture
    from gobrrr.models.registry import get_workload

    seq = None if name in ("mlp", "convnet") else 64
    graph = capture(lambda: get_workload(name, batch_size=2, seq_len=seq, **extra))
    costs = graph_costs(graph)
    assert not UNKNOWN_OPS & {n.op for n in graph.nodes}
    assert all(c.flops >= 0 and c.bytes >= 0 for c in costs)
    assert sum(c.flops for c in costs if c.kind in ("matmul", "conv")) > 0


def test_gobrrr_kernel_ops_traced_from_their_real_registrations():
    """The gobrrr:: ops through their autograd wrappers on fake tensors: every node is costed by
    its formula (none unknown), attention and linear cross-entropy at hand values."""
    kernels = pytest.importorskip("gobrrr.kernels")
    n, d, v = 64, 32, 50

    def make():
        x = torch.randn(n, d, requires_grad=True)
        w, b = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
        q = torch.randn(B, H, S, D, requires_grad=True)
        kv = torch.randn(B, 2, S, D, requires_grad=True)
        head, targets = torch.randn(v, d, requires_grad=True), torch.randint(0, v, (n,))

        def step():
            h = kernels.rms_norm(x, w) + kernels.layer_norm(x, w, b)
            h = kernels.swiglu(h, kernels.gelu(h, "tanh"))
            att = kernels.attention(q, kv, kv, causal=True)
            (kernels.linear_cross_entropy(h, head, targets) + att.sum()).backward()

        return step

    nodes, _ = record(make)
    ops = {packet(n_.op) for n_ in nodes if n_.op.startswith("gobrrr.")}
    assert ops == {
        f"gobrrr.{k}"
        for k in (
            "rms_norm_fwd",
            "rms_norm_bwd",
            "layer_norm_fwd",
            "layer_norm_bwd",
            "swiglu_fwd",
            "swiglu_bwd",
            "gelu_fwd",
            "gelu_bwd",
            "attention_fwd",
            "attention_bwd",
            "linear_cross_entropy",
        )
    }
    assert not UNKNOWN_OPS & {n_.op for n_ in nodes}
    get = {packet(n_.op): op_cost(n_) for n_ in nodes}
    assert get["gobrrr.attention_fwd"].flops == FWD / 2
    assert get["gobrrr.attention_bwd"].flops == 2.5 * FWD / 2
    assert get["gobrrr.linear_cross_entropy"].flops == 6 * n * d * v + 4 * n * v
    assert get["gobrrr.rms_norm_fwd"].flops == 4 * n * d


def test_scaled_mm_addbmm_and_foreach_norm():
    a, b = _t((64, 32), "float8_e4m3fn"), _t((32, 16), "float8_e4m3fn")
    scale = _t((), "float32")
    node = schema_node(
        "aten._scaled_mm.default",
        self=a,
        mat2=b,
        scale_a=scale,
        scale_b=scale,
        out_dtype=torch.bfloat16,
    )
    node = OpNode(0, node.op, "forward", "", node.inputs, (_t((64, 16)),), node.args)
    c = op_cost(node)
    assert (c.flops, c.math, c.kind) == (2 * 64 * 32 * 16, "fp8", "matmul")
    assert c.bytes == 64 * 32 + 32 * 16 + 2 * 4 + 2 * 64 * 16  # + two fp32 0-dim scales
    # addbmm sums over the batch: 2·B·M·N·K although the output has no batch dim
    add = schema_node(
        "aten.addbmm.default",
        self=_t((5, 11), "float32"),
        batch1=_t((3, 5, 7), "float32"),
        batch2=_t((3, 7, 11), "float32"),
    )
    add = OpNode(0, add.op, "forward", "", add.inputs, (_t((5, 11), "float32"),), add.args)
    assert op_cost(add).flops == 2 * 3 * 5 * 7 * 11

    def make():
        ts = [torch.randn(s) for s in PARAM_SHAPES]
        return lambda: torch._foreach_norm(ts)

    nodes, _ = record(make)
    norm = op_cost(only(nodes, "aten._foreach_norm")[0])
    n = sum(math.prod(s) for s in PARAM_SHAPES)
    assert (norm.flops, norm.kind, norm.launches) == (2 * n, "reduction", 2)
