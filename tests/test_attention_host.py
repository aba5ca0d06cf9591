"""The fused attention ops' host cost: what SDPA's backends cost the host per call beyond an
ordinary op (`calibrate_host.attention_host_costs`), added to the op's per-op cost where the
trace runs that backend, and the shipped calibration's figures as measured on the H100."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.hardware import find_calibration, get_gpu

RESULTS = Path(__file__).resolve().parent / "fixtures"
H100 = get_gpu("h100")


class _Attention(nn.Module):
    def __init__(self, d=128, heads=2):
        super().__init__()
        self.qkv, self.heads = nn.Linear(d, 3 * d), heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)


def test_fused_attention_ops_add_their_measured_host_cost(make_cal):
    g = capture(
        lambda: gobrrr.Workload(
            model=_Attention(),
            batch=(torch.randn(2, 64, 128),),
            loss=lambda y, b: y.float().pow(2).sum(),
        ),
        precision="bf16-mixed",
    )
    fused = [n for n in g.nodes if n.name.startswith("_scaled_dot_product_")]
    assert {n.phase for n in fused} == {"forward", "backward"}
    extra = {f"{n.name}:bf16": 1e-6 * (i + 5) for i, n in enumerate(fused)}
    cal = make_cal(
        op_overhead={"forward": 10e-6, "backward": 12e-6, "optimizer": 10e-6}, op_host=extra
    )
    rates = Rates(H100, cal)
    for n in fused:
        base = 10e-6 if n.phase == "forward" else 12e-6
        assert time_op(n, op_cost(n), rates).host_s == pytest.approx(base + extra[f"{n.name}:bf16"])
    plain = next(n for n in g.nodes if n.name == "addmm")
    assert time_op(plain, op_cost(plain), rates).host_s == pytest.approx(10e-6)


def test_shipped_attention_host_costs_are_the_h100_measurement():
    """Each backend's forward and backward op, as `calibrate_sections.py --sections
    attention_host` measured them (calibration_sections_h100_attention_host.json): the cuDNN
    backward's variant pack costs the host 25 us beyond an add, its forward 15."""
    measured = json.loads((RESULTS / "calibration_sections_h100_attention_host.json").read_text())[
        "sections"
    ]["attention_host"]
    assert len(measured) == 6
    shipped = find_calibration(H100).op_host
    for key, value in measured.items():
        assert shipped[key] == value
    assert measured["_scaled_dot_product_cudnn_attention_backward:bf16"] == pytest.approx(
        25e-6, rel=0.05
    )


def test_attention_host_costs_times_the_ops_sdpa_dispatches_to():
    """On the CPU only SDPA's CPU flash kernel runs (the CUDA backends are left out): its
    forward and backward ops, each as the op name a trace records, timed."""
    from gobrrr.calibrate.sections.host import attention_host_costs

    got = attention_host_costs(torch.device("cpu"), calls=3)
    assert set(got) == {
        "_scaled_dot_product_flash_attention_for_cpu:bf16",
        "_scaled_dot_product_flash_attention_for_cpu_backward:bf16",
    }
    assert all(v >= 0.0 for v in got.values())
