"""Dropout traced as CUDA runs it (gobrrr.capture.dropout): the fused native_dropout, whose
mask is one byte an element, not the CPU path's noise tensor in the input's dtype."""

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture


def _graph(p: float, train: bool = True, precision: str = "fp32"):
    def make():
        model = nn.Sequential(nn.Linear(256, 256), nn.Dropout(p), nn.Linear(256, 1))
        model.train(train)
        return gobrrr.Workload(
            model=model, batch=(torch.randn(64, 256),), loss=lambda out, batch: out.mean()
        )

    return capture(make, precision=precision)


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_dropout_keeps_a_one_byte_mask_as_on_cuda(precision):
    g = _graph(0.1, precision=precision)
    ops = [n.op for n in g.nodes]
    assert "aten.native_dropout.default" in ops and "aten.native_dropout_backward.default" in ops
    assert not any("bernoulli" in o for o in ops)
    saved = [s for s in g.storages if s.kind == "activation" and s.module == "1"]
    # what the dropout layer leaves for backward: its output (the next Linear's input) and
    # its bool mask, one byte for each of the 64 x 256 elements (the CPU's own path would keep
    # a noise tensor of 2 or 4 bytes each instead)
    out = 64 * 256 * (4 if precision == "fp32" else 2)
    assert sorted(s.nbytes for s in saved) == sorted([out, 64 * 256])


def test_dropout_in_eval_or_at_zero_is_the_identity():
    for g in (_graph(0.1, train=False), _graph(0.0)):
        assert not any("dropout" in n.op or "bernoulli" in n.op for n in g.nodes)
