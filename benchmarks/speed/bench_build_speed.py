"""How long two CPU-side steps take on this machine: the checkpointing pass over a 32-block
Llama's graph, and building Llama-3 405B under FakeTensorMode.

    PYTHONPATH=src python benchmarks/speed/bench_build_speed.py OUT.json [--repeats 3]

Targets (on an unloaded CPU core): the pass, per policy ("full", "selective"), over every block
of llama3-8b at batch 1, seq 256 (about 7,600 ops) under 0.5 s; llama3-405b at seq 4096 built
under FakeTensorMode under 5 s. The median of `--repeats` runs is reported in seconds, with
whether each target was met. These were timed asserts in tests/test_checkpoint_pass.py and
tests/test_models.py, which failed on a loaded machine; here they are measured, not asserted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2] / "src"))

import torch  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from gobrrr.capture import capture  # noqa: E402
from gobrrr.models import get_workload  # noqa: E402
from gobrrr.passes.checkpoint import checkpoint  # noqa: E402

PASS_TARGET_S = 0.5  # the checkpointing pass over every block, per policy
BUILD_TARGET_S = 5.0  # llama3-405b under FakeTensorMode


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    """Median and every wall time of `repeats` calls of fn(), in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def pass_rows(repeats: int) -> list[dict]:
    """The checkpointing pass over every block of a 32-block Llama's graph, per policy."""
    g0 = capture(
        lambda: get_workload("llama3-8b", batch_size=1, seq_len=256), precision="bf16-mixed"
    )
    blocks = g0.meta["blocks"]
    rows = []
    for policy in ("full", "selective"):
        med, times = _median_s(lambda p=policy: checkpoint(g0, dict.fromkeys(blocks, p)), repeats)
        rows.append(
            {
                "case": f"checkpoint pass, llama3-8b, {policy}",
                "ops": len(g0.nodes),
                "median_s": med,
                "times_s": times,
                "target_s": PASS_TARGET_S,
                "met": med < PASS_TARGET_S,
            }
        )
    return rows


def build_rows(repeats: int) -> list[dict]:
    """llama3-405b at seq 4096 built under FakeTensorMode."""

    def build():
        with FakeTensorMode():
            get_workload("llama3-405b", seq_len=4096)

    med, times = _median_s(build, repeats)
    return [
        {
            "case": "llama3-405b under FakeTensorMode",
            "median_s": med,
            "times_s": times,
            "target_s": BUILD_TARGET_S,
            "met": med < BUILD_TARGET_S,
        }
    ]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the results JSON to write")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    rows = pass_rows(args.repeats) + build_rows(args.repeats)
    for r in rows:
        print(
            f"{r['case']:40s} {r['median_s']:7.3f} s  target < {r['target_s']} s"
            f"{'' if r['met'] else '  MISSED'}"
        )
    result = {
        "version": 1,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_1min": os.getloadavg()[0],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cases": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
