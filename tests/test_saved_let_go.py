"""When a saved temporary of a C++ composite would have died had autograd not saved it.

fp32 grouped-query attention runs PyTorch's math path, a C++ composite: its first matmul
(at::matmul, itself a composite) saves its two operands, the scaled key and its own copy of
the query, and without autograd C++ frees them as that matmul returns, well before the
attention does. The reference is a real CPU run of the same op without grad.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import gobrrr
from gobrrr.capture import capture

B, S, H, KV, D = 2, 16, 4, 2, 8


class _FreesOfFirstBmm(TorchDispatchMode):
    """Numbers the ops; notes after which op the first bmm's input storages die."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.bmm = -1
        self.freed: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(func._opname)
        if func._opname == "bmm" and self.bmm < 0:
            self.bmm = len(self.names) - 1
            for t in args:
                weakref.finalize(
                    t.untyped_storage(), lambda: self.freed.append(len(self.names) - 1)
                )
        return out


def test_real_math_attention_frees_the_first_matmuls_operands_as_it_returns():
    q = torch.randn(B, S, H, D).transpose(1, 2)  # as a model lays heads out: matmul copies it
    k, v = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D)
    with torch.no_grad(), _FreesOfFirstBmm() as mode:
        torch.ops.aten._scaled_dot_product_attention_math(
            q, k, v, None, 0.0, True, None, scale=None, enable_gqa=True
        )
    assert mode.names[mode.bmm + 1] == "_unsafe_view"  # at::matmul's last op
    assert mode.freed == [mode.bmm + 1, mode.bmm + 1]
    assert len(mode.names) > mode.bmm + 4  # the attention runs on after them


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(H * D, H * D)
        self.kv = nn.Linear(H * D, 2 * KV * D)

    def forward(self, x):
        q = self.q(x).view(B, S, H, D).transpose(1, 2)
        k, v = self.kv(x).view(B, S, 2, KV, D).transpose(1, 3).unbind(2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def test_capture_lets_go_of_a_composites_saved_temporaries_where_cpp_does():
    """The trace keeps them (bmm saved them), and records them let go of after the op that
    ends the inner matmul, as the real run above frees them."""

    def wl():
        return gobrrr.Workload(
            model=_Attention(), batch=(torch.randn(B, S, H * D),), loss=lambda y, b: y.sum()
        )

    g = capture(wl, precision="fp32")
    fwd = [n for n in g.nodes if n.phase == "forward"]
    bmm = next(n for n in fwd if n.name == "bmm")
    assert g.nodes[bmm.index + 1].name == "_unsafe_view"
    saved = {r.storage for r in g.meta.autograd.saved if r.op == bmm.index}
    assert saved == {t.storage for t in bmm.inputs}
    projections = max(n.index for n in fwd if n.name == "addmm")
    assert all(g.storages[s].created > projections for s in saved)  # made by the attention
    let_go = dict(g.meta.autograd.unreferenced)
    assert [let_go[s] for s in saved] == [bmm.index + 1] * 2
    second = [n.index for n in fwd if n.name == "bmm"][1]  # the attention goes on
    assert second > bmm.index + 4
