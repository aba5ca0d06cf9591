"""The profile path end to end on the CPU, and its faults (no GPU, OOM, a workload that
raises, Ctrl-C while writing the trace)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gobrrr.errors import GobrrrError
from gobrrr.profile import ProfileResult, profile, runner
from gobrrr.profile import api as api_mod
from gobrrr.workload import Workload

B, D_IN, D_HID, D_OUT = 8, 16, 32, 4


def tiny(raise_in_forward: bool = False) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.ReLU(), nn.Linear(D_HID, D_OUT))
    if raise_in_forward:

        def boom(m, args):
            raise ValueError("boom")

        model[1].register_forward_pre_hook(boom)
    x, y = torch.randn(B, D_IN), torch.randn(B, D_OUT)
    return Workload(
        model=model, batch=(x,), loss=lambda out, b: ((out - y) ** 2).mean(), name="tiny"
    )


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "step.json"
    return profile(tiny(), device="cpu", precision="fp32", steps=3, warmup=1, trace_path=path), path


def test_cpu_profile_end_to_end(result):
    r, path = result
    assert r.label == "cpu: measured on the CPU, not a GPU" and r.device == "cpu"
    assert len(r.step_times) == 3 and r.step_min_s <= r.step_s <= r.step_max_s
    assert (r.unit, r.units_per_step) == ("samples", B)
    assert r.per_s == pytest.approx(B / r.step_s) and r.tokens_per_s is None
    assert r.mfu is None and r.kernels == 0
    assert {g.name for g in r.phases} == {"forward", "backward", "optimizer"}
    fwd = [o for o in r.ops if o.phase == "forward" and o.family == "matmul"]
    assert [o.module for o in fwd] == ["0", "2"]  # nn.Sequential children
    # FLOPs of the first addmm from the recorded shapes, by hand: 2·B·D_IN·D_HID
    assert fwd[0].flops == 2 * B * D_IN * D_HID
    assert fwd[0].bytes == 4 * (D_HID + B * D_IN + D_IN * D_HID + B * D_HID)
    bwd = [o for o in r.ops if o.phase == "backward" and o.family == "matmul"]
    assert bwd and {o.module for o in bwd} <= {"0", "2"}  # via autograd sequence numbers
    # model FLOPs, by hand: the forward's two matmuls, the backward's two weight gradients
    # and one input gradient (x needs none), 2·B·m·n each; the trace adds the pointwise ops
    matmuls = 2 * B * (2 * D_IN * D_HID + 3 * D_HID * D_OUT)
    assert matmuls < r.model_flops < 1.2 * matmuls
    trace = json.loads(path.read_text())
    assert any(e.get("name") == "gobrrr::forward" for e in trace["traceEvents"])
    assert not list(path.parent.glob("*.tmp")) and len(list(path.parent.iterdir())) == 1


def test_result_json_round_trip(result, tmp_path):
    r, _ = result
    p = tmp_path / "r.json"
    r.save(p)
    assert ProfileResult.load(p) == r
    bad = json.loads(p.read_text())
    bad["version"] = 99
    p.write_text(json.dumps(bad))
    with pytest.raises(GobrrrError, match="version 99"):
        ProfileResult.load(p)


def test_no_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(GobrrrError, match="no CUDA GPU is visible"):
        profile(tiny(), device="cuda")
    from gobrrr.calibrate.api import calibrate

    with pytest.raises(GobrrrError, match="no CUDA GPU"):
        calibrate("cuda", save=False)


def test_bad_arguments():
    with pytest.raises(GobrrrError, match="precision 'fp8'"):
        profile(tiny(), device="cpu", precision="fp8")
    with pytest.raises(GobrrrError, match="steps=0"):
        profile(tiny(), device="cpu", steps=0)
    with pytest.raises(GobrrrError, match="checkpoint='some'"):
        profile(tiny(), device="cpu", checkpoint="some")


def test_oom_says_what_did_not_fit(monkeypatch):
    gib = 1024**3
    freed = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: 30 * gib)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda *a: SimpleNamespace(total_memory=80 * gib)
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(True))

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(api_mod, "measure", oom)
    with pytest.raises(GobrrrError) as e:
        profile(tiny(), device="cuda")
    msg = str(e.value)
    assert "does not fit: needed >= 30.0 GiB of 80.0 GiB" in msg and "\n" not in msg
    assert freed


def test_workload_that_raises():
    with pytest.raises(GobrrrError, match="workload 'tiny' raised ValueError: boom"):
        profile(tiny(raise_in_forward=True), device="cpu", steps=1, warmup=0)


def test_ctrl_c_while_profiling_leaves_no_trace_file(monkeypatch, tmp_path):
    calls = {"n": 0}
    real = runner.run_step

    def step(*a, **k):
        calls["n"] += 1
        if calls["n"] > 3:  # warm-up and timed steps pass, the profiled steps are cut off
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(runner, "run_step", step)
    path = tmp_path / "trace.json"
    with pytest.raises(KeyboardInterrupt):
        profile(tiny(), device="cpu", steps=2, warmup=1, trace_path=path)
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_during_export_leaves_no_file(tmp_path):
    class Prof:
        def export_chrome_trace(self, p):
            with open(p, "w") as f:
                f.write('{"traceEvents": [')  # half written
            raise KeyboardInterrupt

    path = tmp_path / "trace.json"
    with pytest.raises(KeyboardInterrupt):
        runner._export(Prof(), path)
    assert list(tmp_path.iterdir()) == []


def test_run_step_zeroes_grads_and_updates_params():
    wl = tiny()
    opt = wl.make_optimizer()
    before = [p.detach().clone() for p in wl.model.parameters()]
    loss = runner.run_step(wl, opt, "fp32", device_type="cpu")
    assert loss.requires_grad is False and loss.ndim == 0
    assert all(p.grad is None for p in wl.model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, wl.model.parameters(), strict=True))
