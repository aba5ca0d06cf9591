"""`gobrrr.apply` of a data-parallel plan in a 2-process job (gloo, CPU): the parameters after
one step equal a one-process reference trained on the concatenation of the ranks' batches
(DDP and FSDP2 average the ranks' gradients), and every plan `gobrrr plan --gpus 2` emits for
a tiny model applies and steps."""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from gobrrr.errors import GobrrrError
from gobrrr.models.registry import get_workload
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import plan
from gobrrr.training.step import split_batch

WORLD, GLOBAL, SEQ, LR = 2, 4, 16, 0.1


def tiny(batch_size: int = GLOBAL, seq_len: int = SEQ):
    """A 2-block GPT-2, seeded: the same weights and batch in every process; SGD, whose
    update (unlike Adam's first, ~lr x sign) shows the gradient's size."""
    torch.manual_seed(0)
    wl = get_workload(
        "gpt2",
        batch_size=batch_size,
        seq_len=seq_len,
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=128,
    )
    wl.optimizer = lambda ps: torch.optim.SGD(ps, lr=LR)
    return wl


def _half(batch, rank: int):
    return split_batch(batch, WORLD)[rank]


def _worker(rank: int, port: int, jobs: list, out: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    try:
        for name, knobs, precision in jobs:
            wl = tiny(knobs.global_batch * WORLD)
            step = apply(wl, knobs, precision=precision)
            loss = step(_half(wl.batch, rank))
            params = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in step.model.named_parameters()
            }
            if rank == 0:
                torch.save({"params": params, "loss": loss.float()}, Path(out) / f"{name}.pt")
    finally:
        if dist.is_initialized():
            dist.barrier()  # neither rank tears gloo down while the other still talks
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(jobs: list, tmp: Path) -> dict:
    """Run `jobs` ((name, knobs, precision), ...) in one 2-process gloo job; rank 0's
    parameters after each step, by name."""
    mp.start_processes(
        _worker, args=(_free_port(), jobs, str(tmp)), nprocs=WORLD, start_method="spawn"
    )
    return {name: torch.load(tmp / f"{name}.pt") for name, _, _ in jobs}


def planned() -> list[Knobs]:
    """Every configuration `plan --gpus 2` costs for the tiny model at one sample per rank
    (one trace per variant; the accumulation is the parity tests')."""
    r = plan(tiny, "h100", global_batch=WORLD, seq=SEQ, gpus=WORLD)
    assert {p.knobs.parallel for p in r.plans} == {"ddp", "fsdp"}
    return [p.knobs for p in r.plans]


DDP = Knobs(micro_batch=1, accumulation=2, parallel="ddp")
FSDP = Knobs(micro_batch=1, accumulation=2, parallel="fsdp")
FSDP_EACH = Knobs(micro_batch=1, accumulation=2, parallel="fsdp", sync_each=True)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    jobs = [("ddp", DDP, "fp32"), ("fsdp", FSDP, "bf16-mixed"), ("each", FSDP_EACH, "bf16-mixed")]
    jobs += [(f"plan{i}", k, "bf16-mixed") for i, k in enumerate(planned())]
    return run_job(jobs, tmp_path_factory.mktemp("dp"))


def ddp_reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch of 4 in one micro-batch, fp32."""
    wl = tiny()
    step = apply(wl, Knobs(micro_batch=GLOBAL), precision="fp32")
    step(wl.batch)
    return {n: p.detach() for n, p in wl.model.named_parameters()}


def fsdp_reference() -> dict[str, torch.Tensor]:
    """FSDP2's arithmetic in one process: each rank's micro-batch run by a bf16 copy of the
    fp32 weights (param_dtype bf16), its bf16 gradients summed in fp32 over the rank's 2
    micro-batches (the unsharded fp32 accumulation under no sync), averaged over the ranks
    in fp32 (reduce_dtype), and SGD on the fp32 weights."""
    wl = tiny()
    master = wl.model
    total = {n: torch.zeros_like(p) for n, p in master.named_parameters()}
    for rank in range(WORLD):
        for mb in split_batch(_half(wl.batch, rank), 2):
            run = copy.copy(wl)
            run.model = copy.deepcopy(master).to(torch.bfloat16)
            (run.compute_loss(mb) / 2).backward()
            for n, p in run.model.named_parameters():
                total[n] += p.grad.float() / WORLD
    with torch.no_grad():
        return {n: p - LR * total[n] for n, p in master.named_parameters()}


def _close(got: dict, want: dict, atol: float) -> None:
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=atol, msg=n)


def test_ddp_step_is_the_whole_batch_step(ran):
    before = {n: p.detach() for n, p in tiny().model.named_parameters()}
    want = ddp_reference()
    _close(ran["ddp"]["params"], want, atol=1e-6)
    moved = max((want[n] - before[n]).abs().max().item() for n in want)
    assert moved > 1e-3  # the step moved the weights well beyond the tolerance


def test_fsdp_step_is_the_whole_batch_step_with_bf16_compute(ran):
    """Each tensor's update against the reference with the same bf16 casts: the matmuls'
    and embeddings' to fp32 rounding (1e-5 of the update); the LayerNorms' within two bf16
    ulps (2^-7) of it: their bf16 weight and bias gradients, sums over every token, round
    differently under fully_shard on the CPU (as the fp32 step's updates differ from the bf16
    one's by ~0.5%). Averaging wrong (one rank's gradient, or the sum) is off by ~50-100%."""
    want = fsdp_reference()
    before = {n: p.detach() for n, p in tiny().model.named_parameters()}
    # "each": the gradients reduce-scattered on both micro-batches and summed as fp32 shards
    # (sync_each, fully_shard's default): the same sum, in another order
    for job in ("fsdp", "each"):
        got = ran[job]["params"]
        assert got.keys() == want.keys()
        for n in want:
            step = (want[n] - before[n]).norm()
            err = (got[n] - want[n]).norm() / step
            assert err < (2**-7 if ".ln_" in n else 1e-5), (job, n, err.item())


def test_every_planned_configuration_applies_and_steps(ran):
    for name, row in ran.items():
        assert torch.isfinite(row["loss"]), name


def test_parallel_knobs_outside_torchrun_are_one_clear_error(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(GobrrrError, match="torchrun") as e:
        apply(tiny(), DDP)
    assert "\n" not in str(e.value)


def test_fsdp_knobs_with_other_numerics_are_refused():
    with pytest.raises(GobrrrError, match="bf16-mixed"):
        apply(tiny(), FSDP, precision="fp32")
