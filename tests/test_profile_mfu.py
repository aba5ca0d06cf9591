"""`gobrrr profile` counts MFU, HFU and throughput as `gobrrr estimate` does: model FLOPs on the
traced step graph (checked against PyTorch's FlopCounterMode on real tensors and against the
estimate of the same workload), MFU <= HFU, PaLM's 6·N + attention apart, samples/s for
non-sequence workloads; the GPU path on a real H100 trace."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch.utils.flop_counter import FlopCounterMode

import gobrrr
from gobrrr.cost.roofline import model_flops, model_flops_6n
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import get_gpu
from gobrrr.models.registry import get_workload
from gobrrr.profile import ProfileResult, profile
from gobrrr.profile import api as api_mod
from gobrrr.profile.analyze import analyze
from gobrrr.profile.join import join_trace, load_trace
from gobrrr.profile.runner import Measured
from gobrrr.profile.show import print_profile

FIX = Path(__file__).parent / "fixtures" / "traces"
H100 = get_gpu("h100")
GPT = dict(n_layer=2, vocab_size=96)
CASES = [("gpt2", 2, 32, GPT), ("convnet", 2, None, {}), ("mlp", 16, None, {})]


def workload(name, batch, seq, kw):
    torch.manual_seed(0)
    return get_workload(name, batch, seq, **kw)


def real_flops(name, batch, seq, kw) -> int:
    """One forward and backward on real tensors, as PyTorch counts them (matmul-class ops)."""
    w = workload(name, batch, seq, kw)
    with FlopCounterMode(display=False) as counter:
        w.compute_loss(w.batch).backward()
    return counter.get_total_flops()


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def case(request):
    name, batch, seq, kw = request.param
    r = profile(workload(name, batch, seq, kw), device="cpu", precision="fp32", steps=1, warmup=0)
    return request.param, r


def test_model_flops_are_the_traced_forward_and_backward(case):
    (name, batch, seq, kw), r = case
    reference = real_flops(name, batch, seq, kw)
    # PyTorch counts the matmul-class ops; the trace adds the pointwise ops' few FLOPs
    assert reference <= r.model_flops <= 1.05 * reference
    est = gobrrr.estimate(
        lambda: workload(name, batch, seq, kw), "h100", precision="fp32", loop="drops-output"
    )
    assert r.model_flops == pytest.approx(est.time.model_flops, rel=1e-9)
    assert r.executed_flops == pytest.approx(est.time.flops, rel=1e-9)
    assert r.flops_source == "traced step graph"


def test_mfu_at_most_hfu_on_the_cpu(case):
    (name, *_), r = case
    # no matmul peak on the CPU: MFU and HFU are None, their ratio is the FLOPs' ratio
    assert r.mfu is None and r.hfu is None and r.peak_flops == 0 and r.peak == ""
    # the optimizer's FLOPs run too: HFU's count is larger
    assert 0 < r.model_flops < r.executed_flops


def test_throughput_in_the_workloads_unit(case):
    (name, batch, seq, _), r = case
    if name == "gpt2":
        assert (r.unit, r.units_per_step) == ("tokens", batch * seq)
        assert r.tokens_per_s == r.per_s
        assert r.model_flops_6n_attention is not None
    else:
        assert (r.unit, r.units_per_step) == ("samples", batch)
        assert r.tokens_per_s is None and r.model_flops_6n_attention is None
    assert r.per_s == pytest.approx(r.units_per_step / r.step_s)


def test_the_table_states_the_unit_and_labels_palm(case):
    (name, *_), r = case
    c = Console(record=True, width=100)
    print_profile(r, console=c)
    text = c.export_text()
    if name == "gpt2":
        assert "tokens/s" in text and "6·N·T + attention (PaLM)" in text
    else:
        assert "samples/s" in text and "tokens" not in text and "PaLM" not in text
    assert "no matmul peak on the CPU" in text


def test_recomputation_counts_in_hfu_only():
    plain = profile(workload(*CASES[0]), device="cpu", precision="fp32", steps=1, warmup=0)
    ckpt = profile(
        workload(*CASES[0]), device="cpu", precision="fp32", steps=1, warmup=0, checkpoint="full"
    )
    assert ckpt.model_flops == pytest.approx(plain.model_flops, rel=1e-3)
    # about one more forward: at least a fifth more FLOPs run than the model's
    assert ckpt.executed_flops > 1.2 * ckpt.model_flops


def test_gpu_path_on_a_recorded_h100_trace(monkeypatch):
    """A 2-layer GPT-2 (d=128, V=1024, batch 4 x 128, bf16-mixed) measured on an H100: the
    profiled step's device span stands in for the timed step."""
    monkeypatch.setattr(api_mod, "environment", lambda on_gpu, calibrated: {})
    trace = load_trace(FIX / "tiny_gpt_bf16.json.gz")
    graph = StepGraph.from_json(gzip.decompress((FIX / "tiny_gpt_bf16.graph.json.gz").read_bytes()))
    span = analyze(join_trace(trace), H100, "bf16-mixed", graph).span_s
    m = Measured((span,), trace, 0, 0, "NVIDIA H100 80GB HBM3")
    info = api_mod.RunInfo("tiny-gpt", "cuda", "bf16-mixed", "none", False, 1, 0)
    r = api_mod.summarize(m, info, graph=graph, gpu="h100")
    peak = H100.peak("bf16")
    assert r.peak == "dense bf16 matmul peak of h100-sxm" and r.peak_flops == peak
    assert r.mfu == pytest.approx(model_flops(graph) / span / peak)
    assert 0 < r.mfu < r.hfu
    assert r.mfu_6n_attention == pytest.approx(model_flops_6n(graph) / span / peak)
    assert (r.unit, r.units_per_step) == ("tokens", 4 * 128)
    c = Console(record=True, width=120)
    print_profile(r, console=c)
    text = c.export_text()
    assert f"of the dense bf16 matmul peak of h100-sxm ({peak / 1e12:,.0f} TFLOP/s)" in text
    assert f"MFU {r.mfu_6n_attention:.1%}" in text


def test_a_version_1_result_is_refused(case, tmp_path):
    _, r = case
    p = tmp_path / "r.json"
    r.save(p)
    assert ProfileResult.load(p) == r
    old = json.loads(p.read_text())
    old["version"] = 1
    p.write_text(json.dumps(old))
    with pytest.raises(GobrrrError, match="version 1.*profile again"):
        ProfileResult.load(p)


class Untraceable(torch.nn.Module):
    """Reads its input through numpy, which a fake tensor cannot give."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        scale = float(x.detach().numpy().std())  # real data only
        return self.lin(x) * scale


def test_a_step_the_trace_cannot_follow_is_still_profiled():
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    w = gobrrr.Workload(
        model=Untraceable(), batch=(x,), name="numpy", loss=lambda out, b: ((out - y) ** 2).mean()
    )
    r = profile(w, device="cpu", precision="fp32", steps=1, warmup=0)
    assert r.flops_source.startswith("none: the step could not be traced (")
    assert "numpy" in r.flops_source
    assert r.model_flops == r.executed_flops == 0 and r.mfu is None
    assert (r.unit, r.units_per_step) == ("samples", 3)
    c = Console(record=True, width=200)
    print_profile(r, console=c)
    text = c.export_text()
    assert "MFU / HFU" in text and "could not be traced" in text
