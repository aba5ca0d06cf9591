"""DDP as a graph pass (gobrrr.passes.ddp) against PyTorch's own DDP on the gloo backend in
one process: its buckets, the buffers it keeps, the collectives it runs; and the comm stream's
schedule (gobrrr.schedule.scheduler) on hand-built steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.cost.roofline import OpTime
from gobrrr.errors import GobrrrError
from gobrrr.estimate import estimate, shard
from gobrrr.evaluate import evaluate
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.ddp import ALL_REDUCE, MIB, bucket_assignment, ddp, gradients
from gobrrr.schedule.scheduler import comm_waits, exposed_comm, place
from gobrrr.schedule.streams import COMM, COMPUTE

WIDTHS = (256, 512, 1024, 1024, 8)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(WIDTHS, WIDTHS[1:], strict=False)]
    return nn.Sequential(*layers)


def _graph():
    w = Workload(
        _model(),
        torch.randn(4, 256),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss=lambda out, batch: out.square().sum(),
    )
    return capture(w, precision="fp32")


@pytest.fixture(scope="module")
def gloo():
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _ours(first_mb: float, cap_mb: float) -> list[list[str]]:
    g = _graph()
    grads = gradients(g)
    limits = [int(first_mb * MIB), int(cap_mb * MIB)]
    buckets = bucket_assignment([(x.dtype, x.nbytes) for x in grads], limits)
    return [[g.storages[grads[i].storage].label.removesuffix(".grad") for i in b] for b in buckets]


@pytest.mark.parametrize("cap_mb", [1, None])
def test_buckets_are_pytorchs(gloo, cap_mb):
    """Our buckets (gradients in ready order) = `_compute_bucket_assignment_by_size` over the
    parameters in the order their gradients are ready, and = the sizes the reducer rebuilt
    its buckets to after a real first step. DDP's default (bucket_cap_mb None): a first
    bucket of 1 MiB, then 25 MiB; a bucket_cap_mb given: every bucket that size."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else cap_mb * MIB
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    ready = list(reversed(range(len(params))))  # a chain of Linears: last layer's first
    indices, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready],
        [first, 25 * MIB if cap_mb is None else cap_mb * MIB],
        [False] * len(params),
        ready,
    )
    theirs = [[names[i] for i in b] for b in indices]
    assert _ours(first / MIB, cap_mb or 25) == theirs
    d = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap_mb)
    for _ in range(3):  # rebuilt after the first step, logged from a later one
        d(torch.randn(4, 256)).square().sum().backward()
        d.zero_grad(set_to_none=True)
    rebuilt = d._get_ddp_logging_data()["rebuilt_bucket_sizes"]
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    assert [sum(sizes[n] for n in b) for b in theirs] == [int(s) for s in rebuilt.split(", ")]


def test_reducer_work_is_pytorchs(gloo):
    """What a real DDP backward runs on gloo: one mul_out into the bucket per gradient, an
    all-reduce per bucket, one copy back per gradient (gradient_as_bucket_view=False): the
    pass inserts the same."""
    model = _model()
    d = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1)
    counts = {}
    for _ in range(2):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            d(torch.randn(4, 256)).square().sum().backward()
        names = [e.name for e in prof.events()]
        counts = {
            k: names.count(k)
            for k in (
                "torch::distributed::reducer::mul_out",
                "c10d::allreduce_",
                "torch.distributed.ddp.reducer::copy_bucket_to_grad",
            )
        }
        d.zero_grad(set_to_none=True)
    g = ddp(_graph(), 4, bucket_cap_mb=1)
    ours = [n.op for n in g.nodes]
    assert counts == {
        "torch::distributed::reducer::mul_out": ours.count("aten.mul.out"),
        "c10d::allreduce_": ours.count(ALL_REDUCE),
        "torch.distributed.ddp.reducer::copy_bucket_to_grad": ours.count("aten.copy_.default")
        - [n.op for n in _graph().nodes].count("aten.copy_.default"),
    }


def test_persistent_bytes_and_all_reduces():
    """By hand: the buckets hold every fp32 gradient once more (8 parameters, 1 + 2 + 3
    buckets' worth), allocated before the step and never freed; one all-reduce a bucket of
    its whole bucket's bytes, after the op that makes its last gradient ready."""
    g = _graph()
    params = sum(a * b + b for a, b in zip(WIDTHS, WIDTHS[1:], strict=False)) * 4
    d = ddp(g, 4, bucket_cap_mb=1)
    buckets = [s for s in d.storages if s.label.startswith("ddp.bucket")]
    assert sum(s.nbytes for s in buckets) == params
    assert all(s.created == -1 and s.freed is None for s in buckets)
    assert [s.nbytes for s in buckets] == [
        32 + 32768 + 4096 + 4194304,
        4096 + 2097152,
        2048 + 524288,
    ]
    reduces = [n for n in d.nodes if n.op == ALL_REDUCE]
    assert [n.stream for n in reduces] == [COMM] * 3
    assert [n.inputs[0].nbytes for n in reduces] == [s.nbytes for s in buckets]
    est = evaluate(d, "h100")
    assert (
        est.memory.persistent.get("buffer", 0)
        - evaluate(g, "h100").memory.persistent.get("buffer", 0)
        >= params
    )
    assert d.meta.parallel.world == 4 and d.meta.passes[-1]["pass"] == "ddp"


def test_schedule_orders_comm():
    """Each all-reduce starts after the copy of its last gradient into the bucket; the copies
    back (and so the optimizer) wait for every all-reduce."""
    d = ddp(_graph(), 4, bucket_cap_mb=1)
    t = evaluate(d, "h100").time.timeline
    spans = {s.index: s for s in t.ops}
    opt = min(n.index for n in d.nodes if n.phase == "optimizer")
    for n in d.nodes:
        if n.op != ALL_REDUCE:
            continue
        copy_in = n.index - 1
        assert d.nodes[copy_in].op == "aten.mul.out"
        assert spans[n.index].start >= spans[copy_in].end
        assert spans[opt].issue_start >= 0
        first_out = next(
            m.index
            for m in d.nodes[n.index + 1 :]
            if m.op == "aten.copy_.default" and m.inputs[1].storage == n.inputs[0].storage
        )
        assert spans[first_out].start >= spans[n.index].end
        assert first_out < opt


def test_accumulated_reduces_once():
    """no_sync: an accumulated step all-reduces each bucket once, never inside the segment
    standing for several runs: in the first micro-batch's backward, where the last one's
    hooks fall (each after its gradients are ready there), so they overlap one backward as
    in PyTorch; the copies back into the gradients after every micro-batch."""
    g = accumulate(_graph(), 3)
    d = ddp(g, 2, bucket_cap_mb=1)
    start, end, times = d.repeat
    reduces = [n.index for n in d.nodes if n.op == ALL_REDUCE]
    assert len(reduces) == 3 and all(i < start for i in reduces)
    assert all(d.nodes[i].phase == "backward" for i in reduces)
    backward_after = [
        any(m.phase == "backward" and m.stream == COMPUTE for m in d.nodes[i + 1 : start])
        for i in reduces
    ]
    assert backward_after[0]  # the first bucket's all-reduce overlaps backward compute
    outs = [n.index for n in d.nodes if n.op == "aten.copy_.default" and n.index >= end]
    assert len(outs) == len(gradients(g))
    assert times == 2 and d.nodes[start].op == g.nodes[g.repeat[0]].op


def test_two_micro_batches_reduce_in_the_last_ones_backward():
    """Over two micro-batches the repeated segment runs once and is the last micro-batch:
    each bucket is copied in and all-reduced inside it, right after its gradients' last
    reference there (PyTorch's hooks in the last backward), so the last buckets' all-reduces
    end the step instead of overlapping the next micro-batch's forward."""
    g = accumulate(_graph(), 2)
    d = ddp(g, 2, bucket_cap_mb=1)
    start, end, times = d.repeat
    assert times == 1
    reduces = [n.index for n in d.nodes if n.op == ALL_REDUCE]
    # in the last micro-batch (the last bucket's right after its final backward op, which
    # ends the segment)
    opt = next(n.index for n in d.nodes if n.phase == "optimizer")
    assert len(reduces) == 3 and all(start <= i < opt for i in reduces)
    ready = {x.storage: x.ready for x in gradients(g)}  # last references: in the segment
    assert all(g.repeat[0] <= r < g.repeat[1] for r in ready.values())
    for i in reduces:  # each right after the op that made its bucket's last gradient ready
        k = i - 1
        while d.nodes[k].op in (ALL_REDUCE, "aten.mul.out"):
            k -= 1
        assert d.nodes[k].phase == "backward" and d.nodes[k].stream == COMPUTE
    # no reducer work in the first micro-batch
    assert not any(n.op in (ALL_REDUCE, "aten.mul.out") for n in d.nodes[:start])


def _op(i: int, device: float) -> OpTime:
    return OpTime(i, "x", "", "backward", "k", "vector", 0, 0, 0, 0, 0, device, 0.0, "memory")


def test_exposed_comm_by_hand():
    """compute a (2 ms) -> all-reduce (3 ms, on comm, waits for a) | compute b (1 ms,
    independent) -> compute c (1 ms, consumes the all-reduce): the all-reduce runs 2..5 ms,
    b 2..3 ms; c waits until 5 ms. Exposed: 2 ms (3..5), overlapped 1 ms."""
    ops = (_op(0, 2e-3), _op(1, 3e-3), _op(2, 1e-3), _op(3, 1e-3))
    streams = [COMPUTE, COMM, COMPUTE, COMPUTE]
    touches = [frozenset({7}), frozenset({7}), frozenset({8}), frozenset({7})]
    waits = comm_waits(streams, touches)
    t = place(ops, streams, waits)
    spans = t.ops
    assert spans[1].start == pytest.approx(2e-3) and spans[1].end == pytest.approx(5e-3)
    assert spans[3].start == pytest.approx(5e-3)
    (busy, exposed), _ = exposed_comm(t, {1: "all_reduce"})
    assert busy == pytest.approx(3e-3) and exposed == pytest.approx(2e-3)
    assert t.step_s == pytest.approx(6e-3)


def test_exposed_comm_counts_the_comm_streams_copies_as_other_kernels():
    """compute a (2 ms) -> a copy-in on the comm stream (1 ms, FSDP2's all-gather copy-in)
    -> the all-gather (2 ms) -> compute b (consumes it): a profile counts NCCL kernels
    against every other kernel, so the copy is not communication: busy 2 ms (the all-gather,
    3..5 ms), all of it exposed; counted by stream, the copy would add 1 ms to both."""
    ops = (_op(0, 2e-3), _op(1, 1e-3), _op(2, 2e-3), _op(3, 1e-3))
    streams = [COMPUTE, COMM, COMM, COMPUTE]
    touches = [frozenset({7}), frozenset({7}), frozenset({7}), frozenset({7})]
    t = place(ops, streams, comm_waits(streams, touches))
    assert t.ops[2].start == pytest.approx(3e-3) and t.ops[2].end == pytest.approx(5e-3)
    total, by = exposed_comm(t, {2: "all_gather"})
    assert total == pytest.approx((2e-3, 2e-3))
    assert by == {"all_gather": {"busy_s": total[0], "exposed_s": total[1]}}
    # counted as communication (as counting the comm stream did), the copy adds 1 ms to both
    assert exposed_comm(t, {1: "copy", 2: "all_gather"})[0] == pytest.approx((3e-3, 3e-3))


@pytest.mark.parametrize(
    ("gpus", "nodes", "parallel", "says"),
    [
        (4, 1, "zero", "parallel=.zero. is unknown: give one of .ddp., .fsdp., .hsdp."),
        (0, 1, "ddp", "gpus=0 is out of range: give a whole number from 1"),
        (4, 3, "ddp", "--nodes 3 must divide --gpus 4"),
    ],
)
def test_estimate_checks_parallel(gpus, nodes, parallel, says):
    """Arguments that describe no job: one GobrrrError line naming the value, before any
    tracing."""
    with pytest.raises(GobrrrError, match=says):
        estimate("gpt2", gpus=gpus, nodes=nodes, parallel=parallel)


def test_fsdp_takes_its_mixed_precision_only():
    """FSDP2 is modelled with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): any
    other precision is refused before tracing, where it would be costed as that one."""
    with pytest.raises(GobrrrError, match="use --precision bf16-mixed"):
        estimate("gpt2", gpus=2, parallel="fsdp", precision="fp32")


def test_shard_ddp_and_hosts():
    """`shard` applies DDP with the hosts; across hosts the all-reduce runs at the hosts'
    link (slower than NVLink's measured curve)."""
    g = _graph()
    one = evaluate(shard(g, "ddp", 4), "h100").time
    two = evaluate(shard(g, "ddp", 4, 2), "h100").time
    assert two.comm_s > one.comm_s > 0
