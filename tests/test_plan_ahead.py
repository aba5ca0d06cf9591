"""Tracing and costing in forked processes (`plan.trace.Ahead`, `forked_map`): the plan is the
one a single process makes, bit for bit; a child that fails is done again here; its warnings
reach this process; nothing is left behind."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest

from gobrrr.models.registry import get_workload
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.plan.search import Planner
from gobrrr.plan.trace import forked_map, processes_to_spare

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def tiny_gpt2(batch_size: int = 8, seq_len: int = 64):
    return get_workload(
        "gpt2", batch_size=batch_size, seq_len=seq_len, n_layer=2, n_embd=64, n_head=4,
        vocab_size=256,
    )  # fmt: skip


def _leftovers(where) -> list[str]:
    return glob.glob(os.path.join(str(where), "gobrrr-trace-*"))


WORKLOAD = """
import os
from gobrrr.models.registry import get_workload

def tiny(batch_size: int = 8, seq_len: int = 64):
    with open(os.environ["BUILDS"], "a") as f:  # which process built it
        f.write(f"{os.getpid()}\\n")
    return get_workload("gpt2", batch_size=batch_size, seq_len=seq_len, n_layer=2, n_embd=64,
                        n_head=4, vocab_size=256)
"""


HANGS = """
import os, time
from gobrrr.models.registry import get_workload

def tiny(batch_size: int = 8, seq_len: int = 64):
    with open(os.environ["BUILDS"], "a+") as f:  # the first build is the planner's (the probe)
        f.seek(0)
        first = f.read().split()
        f.write(f"{os.getpid()}\\n")
    if first and first[0] != str(os.getpid()):
        time.sleep(3600)  # a worker's build never returns
    return get_workload("gpt2", batch_size=batch_size, seq_len=seq_len, n_layer=2, n_embd=64,
                        n_head=4, vocab_size=256)
"""


def _cli(
    tmp_path,
    processes: int,
    budget: int,
    source: str = WORKLOAD,
    gpus: int = 1,
    seq: int = 64,
    **env_extra: str,
):
    """`gobrrr plan` of the tiny workload in a fresh process: its JSON (less took_s) and the
    process that made each build of the workload, in order."""
    (tmp_path / "w.py").write_text(source)
    builds = tmp_path / f"builds{processes}"
    env = dict(os.environ, GOBRRR_TRACE_PROCESSES=str(processes), BUILDS=str(builds))
    env |= env_extra
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(tmp_path)  # where the children's result files go
    argv = ["plan", f"{tmp_path / 'w.py'}:tiny", "--global-batch", "8", "--seq", str(seq)]
    argv += ["--memory-budget", str(budget), "--json"]
    argv += ["--gpus", str(gpus), "--top", "100"] if gpus > 1 else []
    proc = subprocess.run(
        [sys.executable, "-m", "gobrrr", *argv], capture_output=True, text=True, env=env,
        timeout=180,  # a planner stuck on its workers fails here instead of hanging the suite
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    out.pop("took_s")
    _cli.stderr = proc.stderr
    return out, builds.read_text().split()


def test_forked_traces_and_costs_give_the_one_process_plan(tmp_path):
    """Under a budget the step as given exceeds (every policy costed in children, the
    knapsack run), every trace made by a child: the same JSON as one process makes, to the
    bit, and no file left behind."""
    free = Planner(tiny_gpt2, "h100", global_batch=8, seq=64)
    user = free.cost(Knobs(micro_batch=8))
    least = free.cost(Knobs(micro_batch=1, accumulation=8, checkpoint=every_kth(free.blocks, 1)))
    budget = (user.reserved_bytes + least.reserved_bytes) // 2
    one, one_pids = _cli(tmp_path, 0, budget)
    many, many_pids = _cli(tmp_path, 2, budget)
    assert any("checkpoint" in " ".join(p["changes"]) for p in one["plans"])
    assert one["traces"] == 6  # micro-batches 1, 2 and 4, with and without the fused loss
    # one build for the probe, then one per trace: all in one process, or in the two workers
    assert len(one_pids) == len(many_pids) == 1 + 6
    assert len(set(one_pids)) == 1 and len(set(many_pids)) == 3
    assert many_pids.count(many_pids[0]) == 1  # the probe's: every trace in a worker
    assert many == one
    assert _leftovers(tmp_path) == []  # every child's file read and removed


def test_forked_fsdp_candidates_give_the_one_process_plan(tmp_path):
    """Over 2 GPUs, under a budget that checkpointing every block meets at micro-batch 1 and
    the plain step does not (the selective and every-other-block candidates then costed in
    a child): the same JSON as one process makes, to the bit."""
    free = Planner(tiny_gpt2, "h100", global_batch=8, seq=1024, gpus=2)
    knobs = Knobs(micro_batch=1, accumulation=4, parallel="fsdp", sync_each=True)
    plain = free.cost(knobs)
    full = free.cost(replace(knobs, checkpoint=every_kth(free.blocks, 1)))
    assert full.reserved_bytes < plain.reserved_bytes  # the premise
    budget = (plain.reserved_bytes + full.reserved_bytes) // 2
    one, _ = _cli(tmp_path, 0, budget, gpus=2, seq=1024)
    many, _ = _cli(tmp_path, 2, budget, gpus=2, seq=1024)
    changes = [" ".join(p["changes"]) for p in one["plans"]]
    assert any("(selective)" in c for c in changes) and any("1 of 2 blocks" in c for c in changes)
    assert many == one
    assert _leftovers(tmp_path) == []


def test_a_failing_child_is_run_again_here():
    parent = os.getpid()

    def only_here() -> int:
        if os.getpid() != parent:
            raise RuntimeError("a child fails")
        return 7

    assert forked_map([lambda: 1, only_here, lambda: 3, only_here], processes=2) == [1, 7, 3, 7]


def test_a_childs_warnings_are_raised_here():
    def warns() -> str:
        warnings.warn("said in the child", UserWarning, stacklevel=1)
        return "done"

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert forked_map([lambda: "first", warns], processes=1) == ["first", "done"]
    assert [str(w.message) for w in caught] == ["said in the child"]


def test_trace_processes_can_be_set(monkeypatch):
    monkeypatch.setenv("GOBRRR_TRACE_PROCESSES", "0")
    assert processes_to_spare() == 0
    monkeypatch.setenv("GOBRRR_TRACE_PROCESSES", "two")
    with pytest.raises(Exception, match="GOBRRR_TRACE_PROCESSES='two'"):
        processes_to_spare()


def test_stuck_workers_are_given_up_and_the_traces_made_here(tmp_path):
    """Workers whose trace never returns: after GOBRRR_TRACE_TIMEOUT seconds without a word
    the planner stops them, says so in one warning, and traces here: the plan is the one a
    single process makes, and no file is left behind."""
    one, _ = _cli(tmp_path, 0, 10**12)
    stuck, pids = _cli(tmp_path, 2, 10**12, source=HANGS, GOBRRR_TRACE_TIMEOUT="3")
    assert stuck == one
    said = [x for x in _cli.stderr.splitlines() if "no trace worker reported" in x]
    assert said == [
        "gobrrr: no trace worker reported in 3 s; tracing in this process instead "
        "(GOBRRR_TRACE_TIMEOUT sets the limit)"
    ]  # one line, no traceback
    assert "Warning" not in _cli.stderr
    assert len(set(pids)) == 3  # the planner's builds, and one stuck build in each worker
    assert _leftovers(tmp_path) == []


def test_trace_timeout_must_be_a_positive_number(monkeypatch):
    from gobrrr.plan.trace import stall_limit_s

    monkeypatch.setenv("GOBRRR_TRACE_TIMEOUT", "0")
    with pytest.raises(Exception, match="GOBRRR_TRACE_TIMEOUT='0': give the seconds"):
        stall_limit_s()
    monkeypatch.setenv("GOBRRR_TRACE_TIMEOUT", "2.5")
    assert stall_limit_s() == 2.5
