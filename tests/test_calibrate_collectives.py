"""`gobrrr calibrate --collectives`: the merge into a GPU's calibration (points of the run's
rank count replaced, the others kept, written atomically, loadable), and on the CPU under
torchrun the one line that says it needs CUDA GPUs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_profile_distributed import rank_exit_codes, rank_log, torchrun

from gobrrr.calibrate import merge
from gobrrr.calibrate.sections import collectives as cs
from gobrrr.cli import main
from gobrrr.errors import GobrrrError
from gobrrr.hardware import Calibration, calibration_dirs

SHIPPED = calibration_dirs()[1] / "h100-sxm.json"


def measured(ranks: int, seconds: float) -> dict:
    """A `sections.collectives` result of `ranks` ranks, every point taking `seconds`."""
    points = [
        {"op": op, "dtype": "bf16", "bytes": b, "ranks": ranks, "iters": 20, "seconds": seconds,
         "min_s": seconds, "max_s": seconds, "bus_bytes_per_s": 1.0}
        for op in cs.OPS
        for b in cs.QUICK_SIZES
    ]  # fmt: skip
    meta = {"date": "2026-01-01", "device": "NVIDIA H100 80GB HBM3", "world_size": ranks}
    return {"version": 1, "kind": "collectives", "meta": meta, "points": points, "overlap": []}


def test_merge_replaces_only_the_points_of_the_same_rank_count(tmp_path):
    path = tmp_path / "h100-sxm.json"
    shutil.copy(SHIPPED, path)
    before = json.loads(path.read_text())
    kept = [p for p in before["collectives"] if p["ranks"] != 2]
    assert kept and len(kept) < len(before["collectives"])  # ships both 2 and 4 ranks

    cal = merge.base_calibration("NVIDIA H100 80GB HBM3", path)
    merge.write_calibration(merge.merge_collectives(cal, measured(2, 1e-3), "test"), path)

    after = Calibration.load(path)
    twos = [p for p in after.collectives if p["ranks"] == 2]
    assert len(twos) == len(cs.OPS) * len(cs.QUICK_SIZES)
    assert all(p["seconds"] == 1e-3 and "bus_bytes_per_s" not in p for p in twos)
    assert [p for p in after.collectives if p["ranks"] != 2] == kept
    origins = after.meta["collectives"]["from"]
    assert [o["world_size"] for o in origins if o["world_size"] == 2] == [2]
    assert origins[-1]["file"] == "test"
    # everything else as it was
    assert after.matmul_flops == before["matmul_flops"]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left


def test_merge_contention_replaces_the_grid_and_the_file_loads_and_reads_it(tmp_path):
    from gobrrr.cost.contention import Contention

    path = tmp_path / "h100-sxm.json"
    shutil.copy(SHIPPED, path)
    point = {
        "op": "all_reduce", "dtype": "fp32", "bytes": 2**25, "ranks": 4, "kernel": "mm",
        "class": "matmul", "kernel_flops": 1, "kernel_alone_s": 1e-3, "kernel_beside_s": 1.5e-3,
        "collective_alone_s": 2e-4, "collective_beside_s": 6e-4,
    }  # fmt: skip
    grid = {"meta": {"device": "NVIDIA H100 80GB HBM3", "world_size": 4}, "points": [point]}
    cal = merge.base_calibration("NVIDIA H100 80GB HBM3", path)
    merge.write_calibration(merge.merge_contention(cal, grid, "test"), path)
    after = Calibration.load(path)
    assert after.contention == [{k: v for k, v in point.items() if k != "kernel_flops"}]
    assert after.meta["contention"]["from"] == "test"
    c = Contention.from_points(after.contention)
    assert c.compute_slowdown("all_reduce", 2**25, "matmul") == pytest.approx(0.5)
    assert c.collective_stretch("all_reduce", 2**25) == pytest.approx(3.0)


def test_base_is_the_shipped_calibration_when_the_user_has_none(tmp_path):
    cal = merge.base_calibration("NVIDIA H100 80GB HBM3", tmp_path / "none.json")
    assert cal["matmul_flops"] == json.loads(SHIPPED.read_text())["matmul_flops"]


def test_no_calibration_to_merge_into_is_one_clear_error(tmp_path):
    with pytest.raises(GobrrrError, match="run `gobrrr calibrate` on this GPU first"):
        merge.base_calibration("Some Unknown GPU", tmp_path / "x.json")


def test_a_broken_merge_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "cal.json"
    shutil.copy(SHIPPED, path)
    text = path.read_text()
    with pytest.raises(GobrrrError):
        merge.write_calibration({"version": 1}, path)  # not a calibration: refused
    assert path.read_text() == text and list(tmp_path.iterdir()) == [path]


def test_target_path_is_the_output_or_the_users_file(tmp_path, monkeypatch):
    monkeypatch.setenv("GOBRRR_HOME", str(tmp_path))
    assert merge.target_path("NVIDIA H100 80GB HBM3", None) == Path(
        tmp_path, "calibration", "h100-sxm.json"
    )
    assert merge.target_path("NVIDIA H100 80GB HBM3", "x.json") == Path("x.json")


def test_outside_torchrun_it_says_how_to_run_it(capsys):
    assert main(["calibrate", "--collectives", "--quick"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "not started by torchrun" in err and "torchrun --nproc-per-node N" in err


def test_quick_without_collectives_is_an_error(capsys):
    assert main(["calibrate", "--quick", "--no-save"]) == 2
    assert "--quick sets the grid of --collectives" in capsys.readouterr().err


def test_on_cpu_ranks_it_needs_cuda_one_line_exit_2(tmp_path):
    proc = torchrun(["calibrate", "--collectives", "--quick", "--no-save"], tmp_path)
    assert rank_exit_codes(proc.stderr) == {0: 2, 1: 2}
    (line,) = rank_log(tmp_path, 0, "stderr").splitlines()
    assert "calibrate --collectives measures NCCL between CUDA GPUs" in line
    assert rank_log(tmp_path, 1, "stderr") == ""  # one rank speaks for all


def test_small_messages_are_measured_in_sweeps_and_their_median_kept(monkeypatch):
    """Below SWEEP_BELOW each point is measured once a sweep (alternating direction) and its
    median sweep kept with every sweep's figure; the larger points once."""
    calls = []
    fig = {0: 5e-5, 1: 9e-5, 2: 4e-5, 3: 6e-5, 4: 7e-5}  # sweep -> seconds: median 6e-5

    def fake(op, dtype, nbytes, rounds, stream, max_iters=100):
        sweep = sum(c[:3] == (op, dtype, nbytes) for c in calls)
        calls.append((op, dtype, nbytes, sweep))
        t = fig[sweep] if nbytes < cs.SWEEP_BELOW else 1e-3
        return {"op": op, "dtype": dtype, "bytes": nbytes, "ranks": 4, "iters": 1,
                "seconds": t, "min_s": t / 2, "max_s": t * 2}  # fmt: skip

    monkeypatch.setattr(cs, "measure_op", fake)
    monkeypatch.setattr(cs.torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(cs, "environment", lambda: {})
    small, big = 2**20, cs.SWEEP_BELOW
    r = cs.measure_all([small, 2 * small, big], ("bf16",), overlap=False, sweeps=5)
    pts = {(p["op"], p["bytes"]): p for p in r["points"]}
    assert len(pts) == 3 * len(cs.OPS)
    p = pts[("all_reduce", small)]
    assert p["seconds"] == 6e-5 and p["sweeps_s"] == [fig[k] for k in range(5)]
    assert p["min_s"] == 2e-5 and p["max_s"] == 18e-5  # over every sweep
    q = pts[("all_reduce", big)]
    assert q["seconds"] == 1e-3 and "sweeps_s" not in q
    assert sum(c[2] == big for c in calls) == len(cs.OPS)  # once each
    # the second sweep runs the sizes downwards
    second = [c[2] for c in calls if c[3] == 1 and c[0] == "all_reduce"]
    assert second == [2 * small, small]
    assert r["meta"]["sweeps"] == 5


def test_each_round_sleeps_three_times_its_queuing_within_bounds():
    # 100 calls at 45 us each take the host 4.5 ms to queue: the GPU sleeps 13.5 ms first
    assert cs.ahead_for(45e-6, 100) == pytest.approx(13.5e-3)
    assert cs.ahead_for(1e-6, 4) == 1e-3  # at least 1 ms
    assert cs.ahead_for(1e-3, 100) == 0.2  # a host stalled in the warm-up: capped
