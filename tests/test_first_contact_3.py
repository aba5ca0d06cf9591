"""First contact, round three: a training script written for the GPU traces as that GPU's step
(`.cuda()`, `.to("cuda")`, `device="cuda"`, `torch.cuda.is_available()`), a fixed batch under
four samples plans, and accumulation grows memory by the batch alone. Tiny workloads: the file
runs in seconds."""

from __future__ import annotations

import functools

import pytest
import torch

import gobrrr
from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.microbatch import TRACE_AT, BatchDependentStructure, trace_sizes


class Net(torch.nn.Module):
    """Embedding -> linear; `inside` moves or makes tensors on CUDA in the forward, as GPU
    scripts do."""

    def __init__(self, inside: str = "") -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(100, 16)
        self.l = torch.nn.Linear(16, 16)
        self.inside = inside

    def forward(self, x):
        if self.inside == "to":
            x = x.to("cuda", non_blocking=True)
        h = self.emb(x)
        if self.inside == "factory":
            h = h + torch.zeros(16, device="cuda")
        elif self.inside.startswith("new"):
            device = torch.device("cuda", 0) if self.inside == "new" else None
            h = h + h.new_zeros(16, device=device)
        else:
            h = h + torch.zeros(16, device=h.device)
        return self.l(h)


def _loss(out, batch):
    return out.float().mean()


def _ids(device=None):
    return torch.randint(0, 100, (2, 8), device=device)


# each: (the workload written for the GPU, the same one without the CUDA calls)
FORMS = {
    "model.cuda()": lambda: (Net().cuda(), _ids()),
    "model.cuda(0)": lambda: (Net().cuda(0), _ids()),
    "model.to('cuda')": lambda: (Net().to("cuda"), _ids()),
    "model.to('cuda:0')": lambda: (Net().to("cuda:0"), _ids()),
    "model.to(torch.device('cuda'))": lambda: (Net().to(torch.device("cuda")), _ids()),
    "model.to(0)": lambda: (Net().to(0), _ids()),
    "batch.cuda()": lambda: (Net(), _ids().cuda()),
    "batch.to('cuda', non_blocking=True)": lambda: (Net(), _ids().to("cuda", non_blocking=True)),
    "batch.to(device='cuda')": lambda: (Net(), _ids().to(device="cuda")),
    "torch.randint(device='cuda')": lambda: (Net(), _ids("cuda")),
    "torch.randint(device=torch.device('cuda:0'))": lambda: (Net(), _ids(torch.device("cuda:0"))),
    "with torch.device('cuda')": lambda: _under_cuda_device(),
    "x.to('cuda') in forward": lambda: (Net("to"), _ids()),
    "torch.zeros(device='cuda') in forward": lambda: (Net("factory"), _ids()),
    "new_zeros(device=cuda:0) in forward": lambda: (Net("new"), _ids()),
    "new_zeros() in forward": lambda: (Net("new-here"), _ids()),
}
PLAIN = {"new_zeros(device=cuda:0) in forward": "new_zeros() in forward"}


def _under_cuda_device():
    with torch.device("cuda"):
        return Net(), _ids()


def _workload(form: str | None, batch_size: int = 2) -> Workload:
    torch.manual_seed(0)
    model, batch = FORMS[form]() if form else (Net(), _ids())
    if batch_size != 2:  # built at any batch: the planner's micro-batches
        batch = batch[:1].repeat(batch_size, 1)
    return Workload(model=model, batch=(batch,), loss=_loss)


@functools.cache
def _estimate(form: str | None) -> gobrrr.Estimate:
    return gobrrr.estimate(lambda: _workload(form), calibration=False)


def _same_prediction(a: gobrrr.Estimate, b: gobrrr.Estimate) -> None:
    assert a.memory.peak == b.memory.peak and a.memory.reserved == b.memory.reserved
    assert a.time.step_s == b.time.step_s
    assert a.graph.nodes == b.graph.nodes and a.graph.storages == b.graph.storages


# 1. .cuda(), .to("cuda"), device="cuda": no-ops onto the traced device, bit for bit
@pytest.mark.parametrize("form", [f for f in FORMS if f not in PLAIN.values()])
def test_cuda_calls_predict_as_without_them(form):
    _same_prediction(_estimate(form), _estimate(PLAIN.get(form)))


def test_a_cast_in_the_same_move_still_casts():
    moved = capture(lambda: Workload(Net().to("cuda", torch.bfloat16), (_ids(),), _loss))
    cast = capture(lambda: Workload(Net().to(torch.bfloat16), (_ids(),), _loss))
    assert moved.nodes == cast.nodes and moved.storages == cast.storages
    params = [s for s in moved.storages if s.kind == "parameter"]
    assert sum(s.nbytes for s in params) == 2 * (100 * 16 + 16 * 16 + 16)  # bf16: 2 bytes


def test_two_cuda_devices_are_refused():
    def two():
        return Workload(Net().to("cuda:0"), (_ids().to("cuda:1"),), _loss)

    with pytest.raises(GobrrrError, match="cuda:0 and cuda:1.*one GPU"):
        capture(two)


def test_a_plan_of_a_workload_written_for_the_gpu():
    r = gobrrr.plan(functools.partial(_workload, "model.cuda()"), global_batch=8)
    plain = gobrrr.plan(functools.partial(_workload, None), global_batch=8)
    assert r.best is not None and r.best == plain.best and r.plans == plain.plans


# 2. torch.cuda answers as the target GPU, to the workload's code, during the trace only
class Branches(torch.nn.Module):
    """Takes a wider layer on the GPU branch, and records what torch.cuda said."""

    def __init__(self, said: list) -> None:
        super().__init__()
        self.cpu = torch.nn.Linear(16, 16)
        self.gpu = torch.nn.Linear(16, 64)
        self.said = said

    def forward(self, x):
        self.said.append(
            (
                torch.cuda.is_available(),
                torch.cuda.device_count(),
                torch.cuda.get_device_capability(),
                torch.cuda.is_bf16_supported(),
            )
        )
        return self.gpu(x) if torch.cuda.is_available() else self.cpu(x)


@pytest.mark.parametrize("gpu, capability", [("H100", (9, 0)), ("A100", (8, 0)), ("V100", (7, 0))])
def test_is_available_answers_as_the_target(gpu, capability):
    said: list = []
    real = torch.cuda.is_available
    g = capture(
        lambda: Workload(Branches(said), (torch.randn(4, 16),), _loss),
        sdpa=target_for(f"NVIDIA {gpu}"),
    )
    assert said and set(said) == {(True, 1, capability, capability >= (8, 0))}
    addmm = [n for n in g.nodes if n.phase == "forward" and n.op == "aten.addmm.default"]
    assert [n.module for n in addmm] == ["gpu"]  # the GPU branch, not the CPU's
    assert torch.cuda.is_available is real  # restored
    assert torch.cuda.is_available() == real()


class Script(torch.nn.Module):
    """Written for the GPU (`gpu`: its batch moved to CUDA, the GPU's layer taken by asking
    torch.cuda) or not (the batch moved to its own device, the GPU's layer taken unasked)."""

    def __init__(self, gpu: bool) -> None:
        super().__init__()
        self.cpu = torch.nn.Linear(16, 16)
        self.gpu = torch.nn.Linear(16, 64)
        self.asks = gpu

    def forward(self, x):
        if self.asks:
            x = x.to("cuda", non_blocking=True)
            return self.gpu(x) if torch.cuda.is_available() else self.cpu(x)
        return self.gpu(x.to(x.device, non_blocking=True))


def test_under_torch_compile_too():
    """torch.compile traces the forward: the move, the branch and torch's own calls while
    compiling (dynamo saves the CUDA RNG state when torch.cuda says a GPU is there)."""
    graphs = [
        capture(lambda gpu=gpu: Workload(Script(gpu), (torch.randn(4, 16),), _loss), compile=True)
        for gpu in (True, False)
    ]
    assert graphs[0].nodes == graphs[1].nodes and graphs[0].storages == graphs[1].storages
    assert any(n.module == "gpu" for n in graphs[0].nodes)


def test_torch_itself_gets_the_real_answer():
    """torch's own callers (the optimizer's graph-capture check, autocast) are not told a
    GPU exists on a machine without one: they would call the driver."""
    from gobrrr.capture.cuda_calls import on_traced_gpu

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    with on_traced_gpu((9, 0)):
        assert torch.cuda.is_available()
        opt.step()  # torch.accelerator asks torch.cuda.is_available(): the real answer


# 3. a Workload whose batch is fixed under four samples plans at the micro-batches it has
@pytest.mark.parametrize("own", [2, 3])
def test_a_small_fixed_batch_plans(own):
    w = Workload(Net(), (torch.randint(0, 100, (own, 8)),), _loss)
    with pytest.raises(BatchDependentStructure):
        trace_sizes(w)
    r = gobrrr.plan(w, global_batch=own, memory_budget=2**30)
    assert r.best.knobs.micro_batch * r.best.knobs.accumulation == own
    one = gobrrr.estimate(w, loop="drops-output")  # the loop apply runs; at its own batch
    assert r.user.knobs.micro_batch == own
    assert r.user.peak_bytes == one.memory.peak and r.user.step_s == one.time.step_s


def test_trace_sizes_of_a_factory_and_a_larger_batch():
    assert trace_sizes(lambda batch_size=2: None) == TRACE_AT
    assert trace_sizes("gpt2") == TRACE_AT
    assert trace_sizes(Workload(Net(), (torch.randint(0, 100, (4, 8)),), _loss)) == TRACE_AT


# 4. accumulation grows memory by the batch held on the device, nothing else
def test_accumulation_grows_memory_by_the_batch_alone():
    g = capture(lambda: _workload(None))
    per_micro_batch = 2 * 8 * 8  # the (2, 8) int64 ids, bytes
    base = accumulate(g, 2)
    h100 = Target.resolve("h100", None)
    before = evaluate(accumulate(g, 4), h100).memory.at_peak
    for n in (4, 12, 1000, 10**12):
        a = accumulate(g, n)
        grown = [s for s, b in zip(a.storages, base.storages, strict=True) if s.nbytes != b.nbytes]
        assert {s.kind for s in grown} == {"input"}
        assert sum(s.nbytes for s in a.storages if s.kind == "input") == n * per_micro_batch
        assert len(a.nodes) == len(base.nodes)  # micro-batches 2..n: one copy, repeated
        at_peak = evaluate(a, h100).memory.at_peak
        assert at_peak.pop("input") == n * per_micro_batch  # 512-byte blocks: 128 n, n >= 4
        assert at_peak == {k: v for k, v in before.items() if k != "input"}
