"""`gobrrr profile --parallel` under torchrun on the CPU (gloo, 2 processes): per-rank JSON for
DDP and FSDP2, and no rank left hanging when one fails or waits; the NCCL-kernel attribution
and interval arithmetic of `profile.comm` against hand-derived values and a brute-force
reference."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gobrrr.cli import main
from gobrrr.profile import comm

ROOT = Path(__file__).resolve().parents[1]
PYTHON = Path(sys.executable)
TORCHRUN = PYTHON.parent / "torchrun"
HARD_TIMEOUT_S = 120

WORKLOAD = """
import os, time
import torch
from torch import nn
from gobrrr import Workload

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
    def forward(self, x):
        return x + torch.relu(self.fc(x))

class Net(nn.Module):  # the root holds the input layer: its gradients come last
    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.head = nn.Linear(d, 4)
    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)

def workload(batch_size=8):
    if os.environ.get("BUILD_FAILS_ON") == os.environ["RANK"]:
        raise ValueError("no data shard on this rank")
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, 16), torch.randn(batch_size, 4)
    wl = Workload(model=Net(), batch=(x,), loss=lambda out, b: ((out - y) ** 2).mean())
    calls = [0]
    def third_forward(m, args):  # warm-up 1, timed 1, timed 2: the third forward
        calls[0] += 1
        if calls[0] == 3 and os.environ.get("STEP_FAILS_ON") == os.environ["RANK"]:
            raise RuntimeError("bad sample in step 3")
        if calls[0] == 3 and os.environ.get("STEP_SLEEPS_ON") == os.environ["RANK"]:
            time.sleep(6)
    wl.model.head.register_forward_pre_hook(third_forward)
    return wl
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GOBRRR_DEBUG"}
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("wl") / "tiny_dp.py"
    path.write_text(WORKLOAD)
    return f"{path}:workload"


def torchrun(args: list[str], logs: Path, **env: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m gobrrr ARGS` with each rank's output in
    logs/<run>/attempt_0/<rank>/std{out,err}.log."""
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(_port())]
    cmd += ["--log-dir", str(logs), "--redirects", "3", "-m", "gobrrr", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT_S, env=_env(**env)
    )


def rank_log(logs: Path, rank: int, stream: str) -> str:
    (path,) = logs.glob(f"*/attempt_0/{rank}/{stream}.log")
    return path.read_text()


def rank_exit_codes(torchrun_stderr: str) -> dict[int, int]:
    """The exit code torchrun reports for each failed rank."""
    found = re.findall(r"rank\s+:\s+(\d+).*?\n\s+exitcode\s+:\s+(-?\d+)", torchrun_stderr)
    return {int(r): int(c) for r, c in found}


def by_hand(rank: int, args: list[str], port: int, **env: str) -> subprocess.Popen:
    """One rank started as torchrun starts it (its environment), but alone: nothing stops it
    when its peer exits, so it must stop itself."""
    rank_env = dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    rank_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    return subprocess.Popen(
        [str(PYTHON), "-m", "gobrrr", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(**rank_env),
    )


def both_by_hand(args: list[str], **env: str) -> list[tuple[int, str, str]]:
    port = _port()
    procs = [by_hand(r, args, port, **env) for r in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=HARD_TIMEOUT_S)
        out.append((p.returncode, stdout, stderr))
    return out


# -- end to end under torchrun ----------------------------------------------------------------


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_profile_parallel_on_cpu_gives_per_rank_json(spec, tmp_path, parallel):
    args = ["profile", spec, "--parallel", parallel, "--device", "cpu", "--batch", "4"]
    args += ["--steps", "3", "--warmup", "1", "--compare", "--gpu", "h100", "--json"]
    proc = torchrun(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(rank_log(tmp_path, 0, "stdout"))
    assert rank_log(tmp_path, 1, "stdout") == ""  # only rank 0 speaks
    assert (out["parallel"], out["world"], out["batch_per_rank"]) == (parallel, 2, 4)
    assert [r["rank"] for r in out["ranks"]] == [0, 1]
    assert all(len(r["step_s"]) == 3 and r["comm"] is None for r in out["ranks"])
    m = out["measured"]
    assert m["step_s"] == max(r["median_s"] for r in out["ranks"])
    assert m["comm"].startswith("no NCCL kernels (CPU)") and m["peak_allocated"] is None
    # the prediction is the one-rank step sharded over the 2 ranks, on an H100
    assert out["predicted"]["gpu"] == "h100-sxm" and out["predicted"]["comm_busy_s"] > 0
    assert out["error"]["step_s"] == pytest.approx(out["predicted"]["step_s"] / m["step_s"] - 1)
    assert out["error"]["peak_allocated"] is None  # nothing measured, no error made up


def test_a_rank_failing_to_build_is_one_line_and_every_rank_exits(spec, tmp_path):
    args = ["profile", spec, "--parallel", "ddp", "--device", "cpu", "--steps", "2"]
    proc = torchrun(args, tmp_path, BUILD_FAILS_ON="1")
    assert proc.returncode != 0
    assert rank_exit_codes(proc.stderr) == {0: 2, 1: 2}
    err = rank_log(tmp_path, 1, "stderr").splitlines()
    assert len(err) == 1 and err[0].startswith("gobrrr: error: rank 1: workload")
    assert "no data shard on this rank" in err[0] and "Traceback" not in err[0]
    assert rank_log(tmp_path, 0, "stderr") == ""  # rank 0 stops without a word


# -- no rank hangs, without torchrun to stop the others -----------------------------------------


def test_a_rank_failing_mid_step_stops_the_other(spec):
    args = ["profile", spec, "--parallel", "fsdp", "--device", "cpu", "--steps", "3"]
    (rc0, _, err0), (rc1, _, err1) = both_by_hand(
        args + ["--warmup", "1", "--timeout", "30"], STEP_FAILS_ON="1"
    )
    assert (rc0, rc1) == (2, 2)
    (line,) = err1.splitlines()
    assert line.startswith("gobrrr: error: rank 1: workload") and "bad sample in step 3" in line
    (line,) = err0.splitlines()  # its peer is gone: it says so, and where it was
    assert "rank 0 stopped in timed step 2: another rank left the job" in line


def test_a_rank_waiting_too_long_times_out_with_one_line(spec):
    args = ["profile", spec, "--parallel", "ddp", "--device", "cpu", "--steps", "3"]
    (rc0, _, err0), (rc1, _, err1) = both_by_hand(
        args + ["--warmup", "1", "--timeout", "2"], STEP_SLEEPS_ON="1"
    )
    assert (rc0, rc1) == (2, 2)
    (line,) = err0.splitlines()
    # rank 1 sleeps inside the same phase, so its watchdog runs out at about the same moment:
    # whichever rank's fires first ends the job, and rank 0 either times out itself or says
    # its peer left, while rank 1 always says it timed out
    assert "rank 1 timed out after 2 s waiting for the others in timed step 2" in err1
    assert (
        "rank 0 timed out after 2 s waiting for the others in timed step 2" in line
        or "rank 0 stopped in timed step 2: another rank left the job" in line
    ), line


def test_parallel_outside_torchrun_says_how_to_start_it(capsys):
    assert main(["profile", "gpt2", "--parallel", "fsdp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "not started by torchrun" in err and "torchrun --nproc-per-node N -m gobrrr" in err
    assert len(err.splitlines()) == 1


# -- profile.comm: NCCL kernels and intervals -------------------------------------------------

#: NCCL kernel names as torch.profiler records them (NCCL 2.18+ and older)
NAMES = {
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_gather",
    "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": (
        "reduce_scatter"
    ),
    "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "all_reduce",
    "ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem, unsigned char*)": "all_reduce",
    "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "broadcast",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "send_recv",
    "ncclDevKernel_Reduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "reduce",
    "ncclDevKernel_Generic_1(ncclDevKernelArgsStorage<4096ul>)": "other",
}


@pytest.mark.parametrize("name", NAMES)
def test_nccl_kernels_are_attributed_to_their_collective(name):
    assert comm.is_nccl(name) and comm.collective_of(name) == NAMES[name]


def test_busy_and_exposed_by_hand():
    # times in us: compute 0-10 and 15-30; all-gather 5-12 (overlaps 5-10: 2 exposed),
    # reduce-scatter 20-35 (overlaps 20-30: 5 exposed), all-reduce 40-44 (all exposed) and a
    # second all-reduce 42-46 on another channel (union 40-46: 6 busy, 6 exposed)
    us = 1e-6
    kernels = [
        ("gemm", 0 * us, 10 * us),
        ("Memcpy DtoD (Device -> Device)", 15 * us, 30 * us),
        ("ncclDevKernel_AllGather_RING_LL(x)", 5 * us, 12 * us),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(x)", 20 * us, 35 * us),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 40 * us, 44 * us),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", 42 * us, 46 * us),
    ]
    c = comm.communication(kernels)
    assert c["comm_busy_s"] == pytest.approx((7 + 15 + 6) * us)
    assert c["comm_exposed_s"] == pytest.approx((2 + 5 + 6) * us)
    assert c["compute_busy_s"] == pytest.approx(25 * us)
    assert c["span_s"] == pytest.approx(46 * us) and c["nccl_kernels"] == 4
    by = c["collectives"]
    assert by["all_gather"] == pytest.approx({"kernels": 1, "busy_s": 7 * us, "exposed_s": 2 * us})
    assert by["reduce_scatter"]["exposed_s"] == pytest.approx(5 * us)
    assert by["all_reduce"] == pytest.approx({"kernels": 2, "busy_s": 6 * us, "exposed_s": 6 * us})


def test_uncovered_matches_a_brute_force_count():
    """Integer intervals: the exposed length equals the number of unit cells covered by a
    communication interval and by no compute interval."""
    rng = random.Random(0)
    for _ in range(200):
        a = [(s, s + rng.randint(1, 8)) for s in (rng.randint(0, 60) for _ in range(6))]
        b = [(s, s + rng.randint(1, 8)) for s in (rng.randint(0, 60) for _ in range(6))]
        cells_a = {t for s, e in a for t in range(s, e)}
        cells_b = {t for s, e in b for t in range(s, e)}
        assert comm.length(comm.union(a)) == len(cells_a)
        assert comm.uncovered(comm.union(a), comm.union(b)) == len(cells_a - cells_b)


def test_steps_py_measures_with_the_same_arithmetic():
    path = ROOT / "benchmarks" / "multigpu" / "steps.py"
    spec = importlib.util.spec_from_file_location("steps_under_test", path)
    steps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(steps)
    kernels = [("gemm", 0.0, 2.0), ("ncclDevKernel_AllGather_RING_LL(x)", 1.0, 4.0)]
    assert steps.comm.communication(kernels) == comm.communication(kernels)
    assert Path(steps.comm.__file__).resolve() == Path(comm.__file__).resolve()
