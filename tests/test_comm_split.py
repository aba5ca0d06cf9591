"""NCCL kernels split into waiting for other ranks and transfer (`profile.comm`), across
hand-built ranks with known skew, against hand-derived values and a unit-cell count; the
split in `gobrrr profile --parallel`'s summary, comparison and table, in
`benchmarks/multigpu/steps.py`'s and `compare.py`'s figures; the ranks' exchange of starts
over gloo (2 processes)."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from gobrrr.profile import comm
from gobrrr.profile import distributed as pd
from gobrrr.profile.show import print_parallel

ROOT = Path(__file__).resolve().parents[1]
MS = 1e-3
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
RS = "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
TODAY = {"comm_busy_s", "comm_exposed_s", "compute_busy_s", "nccl_kernels", "span_s"}


def skewed(late_ms: float = 3.0, ranks: int = 4) -> list[list[comm.Kernel]]:
    """One all-gather 10-15 ms on every rank but the last, which enters it `late_ms` late
    (its kernel 10+late-15 ms): the collective transfers from then on, on every rank."""
    out = [[(AG, 10 * MS, 15 * MS)] for _ in range(ranks - 1)]
    return out + [[(AG, (10 + late_ms) * MS, 15 * MS)]]


def test_a_late_rank_leaves_its_peers_waiting_and_the_transfer_is_the_common_tail():
    r = comm.ranks_communication(skewed(3.0))
    for early in r[:3]:
        assert early["comm_wait_s"] == pytest.approx(3 * MS)
        assert early["comm_transfer_busy_s"] == pytest.approx(2 * MS)
        assert early["comm_busy_s"] == pytest.approx(5 * MS)  # today's figure, unchanged
    assert r[3]["comm_wait_s"] == 0 and r[3]["comm_transfer_busy_s"] == pytest.approx(2 * MS)
    # nothing else runs: all of it is exposed, the transfer 2 ms on every rank
    assert [x["comm_transfer_exposed_s"] for x in r] == pytest.approx([2 * MS] * 4)
    assert [x["comm_exposed_s"] for x in r] == pytest.approx([5 * MS] * 3 + [2 * MS])
    assert r[0]["collectives"]["all_gather"] == pytest.approx(
        {
            "kernels": 1,
            "busy_s": 5 * MS,
            "exposed_s": 5 * MS,
            "wait_s": 3 * MS,
            "transfer_busy_s": 2 * MS,
            "transfer_exposed_s": 2 * MS,
        }
    )
    assert r[0]["comm_split"] == "matched 1 NCCL kernels per rank over 4 ranks"


def test_overlap_with_compute_splits_exposed_into_transfer_and_waiting():
    # rank 0: all-gathers 0-6 and 20-24 ms, a reduce-scatter 30-40; compute 4-7 and 21-35.
    # rank 1: enters them at 2, 23 and 30 ms (the last, both at once: no wait).
    ranks = [
        [(AG, 0, 6 * MS), (AG, 20 * MS, 24 * MS), (RS, 30 * MS, 40 * MS)],
        [(AG, 2 * MS, 6 * MS), (AG, 23 * MS, 24 * MS), (RS, 30 * MS, 40 * MS)],
    ]
    ranks[0] += [("gemm", 4 * MS, 7 * MS), ("Memcpy DtoD", 21 * MS, 35 * MS)]
    r0, r1 = comm.ranks_communication(ranks)
    # rank 0 waits 0-2 and 20-23; transfers 2-6, 23-24, 30-40 (15 ms), of which compute
    # covers 4-6, 23-24 and 30-35: 2 + 5 = 7 ms exposed; waiting exposed 0-2 only (20-23
    # is under the memcpy from 21, and 20-21 is bare: 2 + 1 = 3 ms)
    assert r0["comm_wait_s"] == pytest.approx(5 * MS)
    assert r0["comm_transfer_busy_s"] == pytest.approx(15 * MS)
    assert r0["comm_transfer_exposed_s"] == pytest.approx(7 * MS)
    assert r0["comm_wait_exposed_s"] == pytest.approx(3 * MS)
    assert r0["comm_exposed_s"] == pytest.approx(10 * MS)  # = 7 + 3
    ag, rs = r0["collectives"]["all_gather"], r0["collectives"]["reduce_scatter"]
    assert (ag["wait_s"], ag["transfer_busy_s"]) == pytest.approx((5 * MS, 5 * MS))
    assert ag["transfer_exposed_s"] == pytest.approx(2 * MS)
    assert (rs["wait_s"], rs["transfer_exposed_s"]) == pytest.approx((0, 5 * MS))
    assert r1["comm_wait_s"] == 0 and r1["comm_transfer_exposed_s"] == pytest.approx(15 * MS)
    # per kernel, in start order from rank 0's first kernel (0 ms): the same split
    assert [(k["op"], k["k"]) for k in r0["kernels"]] == [
        ("all_gather", 0),
        ("all_gather", 1),
        ("reduce_scatter", 0),
    ]
    times = [[k[x] for x in ("start_s", "wait_s", "transfer_s")] for k in r0["kernels"]]
    assert sum(times, []) == pytest.approx(
        [0, 2 * MS, 4 * MS, 20 * MS, 3 * MS, MS, 30 * MS, 0, 10 * MS]
    )
    assert [k["transfer_exposed_s"] for k in r0["kernels"]] == pytest.approx([2 * MS, 0, 5 * MS])


def test_the_kth_kernel_of_each_collective_is_matched_whatever_the_interleaving():
    # rank 0 runs its reduce-scatter before its second all-gather, rank 1 after: matched by
    # collective, the order between collectives does not matter
    ranks = [
        [(AG, 0, 2 * MS), (RS, 3 * MS, 5 * MS), (AG, 6 * MS, 8 * MS)],
        [(AG, 1 * MS, 2 * MS), (AG, 6.5 * MS, 8 * MS), (RS, 9 * MS, 11 * MS)],
    ]
    r0, r1 = comm.ranks_communication(ranks)
    assert r0["collectives"]["all_gather"]["wait_s"] == pytest.approx(1.5 * MS)
    # rank 0's reduce-scatter ended (5 ms) before rank 1 entered it (9 ms): all waiting,
    # which a clock's error can produce; never a negative transfer
    assert r0["collectives"]["reduce_scatter"]["wait_s"] == pytest.approx(2 * MS)
    assert r0["collectives"]["reduce_scatter"]["transfer_busy_s"] == 0
    assert r1["comm_wait_s"] == 0


def test_ranks_on_shifted_clocks_are_aligned_by_their_clock_ns():
    shared = skewed(3.0, ranks=2)
    # rank 1's profiler started 7 ms after rank 0's: its times count from there
    shift_ns = 7_000_000
    own = [shared[0], [(n, s - 7 * MS, e - 7 * MS) for n, s, e in shared[1]]]
    aligned = comm.ranks_communication(own, [0, shift_ns])
    for a, b in zip(aligned, comm.ranks_communication(shared), strict=True):
        assert a["comm_wait_s"] == pytest.approx(b["comm_wait_s"], abs=1e-12)
        assert a["comm_transfer_busy_s"] == pytest.approx(b["comm_transfer_busy_s"], abs=1e-12)
    assert aligned[0]["comm_wait_s"] == pytest.approx(3 * MS)


def test_mismatched_counts_say_so_and_keep_each_ranks_own_figures():
    ranks = skewed(3.0, ranks=3)
    ranks[1] = ranks[1] + [(AG, 20 * MS, 21 * MS)]
    r = comm.ranks_communication(ranks)
    for rank, kernels in zip(r, ranks, strict=True):
        assert "all_gather: 1/2/1" in rank["comm_split"] and "not split" in rank["comm_split"]
        assert all(rank[k] is None for k in comm.SPLIT_KEYS)
        assert rank["collectives"]["all_gather"]["wait_s"] is None
        alone = comm.communication(kernels)
        assert {k: rank[k] for k in TODAY} == {k: alone[k] for k in TODAY}


def test_a_collective_on_one_rank_only_is_a_mismatch():
    ranks = skewed(1.0, ranks=2)
    ranks[0] = ranks[0] + [(RS, 20 * MS, 21 * MS)]
    assert "reduce_scatter: 1/0" in comm.ranks_communication(ranks)[0]["comm_split"]


def test_without_the_other_ranks_the_summary_is_todays():
    (kernels,) = skewed(3.0, ranks=1)
    c = comm.communication(kernels)
    assert set(c) == TODAY | {"collectives"}
    assert set(c["collectives"]["all_gather"]) == {"kernels", "busy_s", "exposed_s"}


def test_exchange_is_called_once_with_this_ranks_starts():
    ranks = skewed(3.0, ranks=3)
    sent = []
    payloads = [comm.starts(k) for k in ranks]

    def exchange(mine):
        sent.append(mine)
        return payloads

    got = comm.rank_communication(ranks[0], exchange)
    assert sent == [{"clock_ns": 0, "starts": {"all_gather": [10 * MS]}}]
    assert got == comm.ranks_communication(ranks)[0]


def test_split_matches_a_unit_cell_count():
    """Integer times on 2-4 ranks: waiting, transfer and exposure equal counts of unit cells,
    each kernel's cells before the latest start over the ranks of its collective's k-th
    kernel waiting, the rest transfer."""
    rng = random.Random(1)
    for _ in range(150):
        world = rng.randint(2, 4)
        counts = {AG: rng.randint(1, 3), RS: rng.randint(0, 2)}
        ranks = []
        for _ in range(world):
            ks = []
            for name, n in counts.items():
                t = rng.randint(0, 10)
                for _ in range(n):
                    t += rng.randint(0, 12)
                    ks.append((name, t, t + rng.randint(1, 9)))
            for _ in range(rng.randint(0, 5)):
                s = rng.randint(0, 60)
                ks.append(("gemm", s, s + rng.randint(1, 10)))
            ranks.append(ks)
        got = comm.ranks_communication(ranks)
        for r in range(len(ranks)):
            cells = _cells(ranks, r)
            assert got[r]["comm_wait_s"] == len(cells["wait"])
            assert got[r]["comm_transfer_busy_s"] == len(cells["transfer"])
            assert got[r]["comm_transfer_exposed_s"] == len(cells["transfer"] - cells["compute"])
            bare = cells["wait"] - cells["transfer"] - cells["compute"]
            assert got[r]["comm_wait_exposed_s"] == len(bare)
            assert got[r]["comm_exposed_s"] == len(bare) + len(cells["transfer"] - cells["compute"])


def _cells(ranks: list[list], r: int) -> dict[str, set[int]]:
    """Rank r's unit cells: waiting, transfer, compute (the reference of the count test)."""
    out: dict[str, set[int]] = {"wait": set(), "transfer": set(), "compute": set()}
    for name in (AG, RS):
        mine = sorted(k[1:] for k in ranks[r] if k[0] == name)
        every = [sorted(k[1] for k in ks if k[0] == name) for ks in ranks]
        for k, (s, e) in enumerate(mine):
            cut = max(starts[k] for starts in every)
            for t in range(s, e):
                out["wait" if t < cut else "transfer"].add(t)
    out["compute"] = {t for n, s, e in ranks[r] if n == "gemm" for t in range(s, e)}
    return out


# -- gobrrr profile --parallel: the summary, the comparison, the table --------------------------


def _ranks(comms: list[dict | None]) -> list[dict]:
    """Per-rank results as `measure_rank` gives them, with these communication summaries."""
    return [
        {
            "rank": i,
            "device": "NVIDIA H100 80GB HBM3",
            "step_s": [0.1 + i * 0.01],
            "median_s": 0.1 + i * 0.01,
            "peak_allocated": 2**30,
            "peak_reserved": 2**31,
            "comm": c,
        }
        for i, c in enumerate(comms)
    ]


PREDICTED = {
    "gpu": "h100-sxm",
    "calibrated": True,
    "peak_allocated": 2**30,
    "peak_reserved": 2**31,
    "step_s": 0.1,
    "comm_busy_s": 2 * MS,
    "comm_exposed_s": 1.5 * MS,
}


def test_the_summary_carries_the_split_and_the_prediction_meets_the_transfer():
    out = pd.summarize(_ranks(comm.ranks_communication(skewed(3.0))), pd.ParallelRun("fsdp"), "w")
    json.dumps(out)  # all of it JSON
    m = out["measured"]
    assert m["comm_wait_s"] == pytest.approx({"min": 0, "median": 3 * MS, "max": 3 * MS})
    assert m["comm_transfer_exposed_s"] == pytest.approx({"min": 2 * MS, "median": 2 * MS,
                                                          "max": 2 * MS})  # fmt: skip
    assert m["comm_exposed_s"]["max"] == pytest.approx(5 * MS)  # today's keys stay
    assert m["comm_split"].startswith("matched 1 NCCL kernels per rank over 4 ranks")
    assert out["ranks"][0]["comm"]["comm_wait_s"] == pytest.approx(3 * MS)
    err = pd.errors(m, PREDICTED)
    assert err["comm_exposed_s"] == pytest.approx(1.5 * MS - 2 * MS)
    assert err["comm_exposed_against"] == "comm_transfer_exposed_s median"


def test_unmatched_ranks_leave_the_split_out_and_compare_with_the_min_exposed():
    ranks = skewed(3.0, ranks=2)
    ranks[1] = ranks[1] + [(AG, 20 * MS, 21 * MS)]
    out = pd.summarize(_ranks(comm.ranks_communication(ranks)), pd.ParallelRun("ddp"), "w")
    m = out["measured"]
    assert m["comm_wait_s"] is None and m["comm_transfer_exposed_s"] is None
    assert "differ across the ranks" in m["comm_split"]
    err = pd.errors(m, PREDICTED)
    assert err["comm_exposed_s"] == pytest.approx(1.5 * MS - m["comm_exposed_s"]["min"])
    assert err["comm_exposed_against"] == "comm_exposed_s min"


def test_the_table_shows_transfer_beside_the_prediction_and_waiting_unpredicted():
    out = pd.summarize(_ranks(comm.ranks_communication(skewed(3.0))), pd.ParallelRun("fsdp"), "w")
    out["predicted"], out["error"] = PREDICTED, pd.errors(out["measured"], PREDICTED)
    buf = io.StringIO()
    print_parallel(out, Console(file=buf, width=250))
    text = buf.getvalue()
    (transfer,) = [ln for ln in text.splitlines() if "comm transfer exposed" in ln]
    assert "1.5 ms" in transfer and "-0.50 ms vs median" in transfer
    (waiting,) = [ln for ln in text.splitlines() if "comm waiting for other ranks" in ln]
    assert "not predicted" in waiting and "3 ms" in waiting
    assert "waiting for other ranks" in text.splitlines()[2]  # the per-rank table's column


def test_the_table_sets_each_collectives_exposed_transfer_beside_its_prediction():
    """One all-gather, its transfer 2 ms exposed on every rank (`skewed`): the job's
    per-collective row gives the spread over ranks and the prediction's own all-gather
    figure beside it (0.5 ms under); a prediction without that collective shows a dash."""
    out = pd.summarize(_ranks(comm.ranks_communication(skewed(3.0))), pd.ParallelRun("fsdp"), "w")
    assert out["measured"]["collectives"]["all_gather"]["transfer_exposed_s"] == pytest.approx(
        {"min": 2 * MS, "median": 2 * MS, "max": 2 * MS}
    )
    for by, want in (
        ({"all_gather": {"busy_s": 2 * MS, "exposed_s": 1.5 * MS}}, "-0.50 ms vs median"),
        ({}, " - "),
    ):
        predicted = {**PREDICTED, "comm_by_collective": by}
        out["predicted"], out["error"] = predicted, pd.errors(out["measured"], predicted)
        buf = io.StringIO()
        print_parallel(out, Console(file=buf, width=250))
        (row,) = [ln for ln in buf.getvalue().splitlines() if "all_gather transfer exposed" in ln]
        assert "2 ms" in row and want in row


# -- benchmarks/multigpu ---------------------------------------------------------------------


def _load(name: str):
    path = ROOT / "benchmarks" / "multigpu" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step_ranks(comms: list[dict]) -> list[dict]:
    """Per-rank results as steps.py's `run_one` gives them."""
    return [
        {"rank": i, "median_s": 0.1, "peak_allocated": 1, "peak_reserved": 2, **c}
        for i, c in enumerate(comms)
    ]


def test_steps_and_compare_record_and_compare_the_split():
    steps = _load("steps")
    compare = _load("compare")
    ranks = _step_ranks(comm.ranks_communication(skewed(3.0)))
    job = steps.job(ranks, tokens=1000)
    assert job["comm_wait_s"] == pytest.approx(3 * MS)
    assert job["comm_transfer_exposed_s"] == pytest.approx(2 * MS)
    m = compare.measured({"measured": job, "ranks": ranks})
    assert m["comm_transfer_exposed_s_median"] == pytest.approx(2 * MS)
    assert m["comm_wait_s_median"] == pytest.approx(3 * MS)
    err = compare.errors(m, PREDICTED)
    assert err["comm_exposed_s"] == pytest.approx(-0.5 * MS)
    assert "transfer 2.0, waiting 3.0" in compare.exposed_cell(m, PREDICTED)


def test_old_results_without_the_split_stay_readable():
    compare = _load("compare")
    data = json.loads((ROOT / "benchmarks/results/multigpu_steps_h100_x4.json").read_text())
    case = next(c for c in data["cases"].values() if "ranks" in c)
    m = compare.measured(case)
    assert m["comm_exposed_against"] == "comm_exposed_s_min"
    assert "comm_transfer_exposed_s_median" not in m
    err = compare.errors(m, PREDICTED)
    assert err["comm_exposed_s"] == pytest.approx(1.5 * MS - m["comm_exposed_s_min"])
    steps = _load("steps")
    assert steps.job(case["ranks"], 1000)["comm_wait_s"] is None


# -- the ranks' exchange of starts, over gloo ------------------------------------------------

RANK = """
import json, os, sys, datetime
import torch.distributed as dist
from gobrrr.profile import comm, distributed as pd
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
kernels = json.loads(sys.argv[1])[dist.get_rank()]
print(json.dumps(comm.rank_communication([tuple(k) for k in kernels], pd.exchange)))
dist.destroy_process_group()
"""


def test_the_ranks_swap_their_starts_over_gloo():
    ranks = skewed(3.0, ranks=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "GOBRRR_DEBUG"}
    env.update(
        PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}",
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, json.dumps(ranks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "RANK": str(r)},
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-1500:] + outs[1][1][-1500:]
    got = [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]
    assert got == json.loads(json.dumps(comm.ranks_communication(ranks)))
    assert got[0]["comm_wait_s"] == pytest.approx(3 * MS)
