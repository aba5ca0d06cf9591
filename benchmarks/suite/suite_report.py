"""Markdown tables of the recorded estimate suite: measured vs predicted, per case.

    PYTHONPATH=src python benchmarks/suite/suite_report.py

Reads tests/fixtures/estimate_suite_h100.json (written on an H100 by
bench_estimate_suite.py), recomputes gobrrr's predictions on this machine with the shipped H100
calibration, and prints the tables of
docs/investigations/2026-11-22-built-in-suite-against-the-h100.md. PyTorch's RuntimeEstimator
column is what it predicted in the same GPU run.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from gobrrr.estimate import estimate
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Calibration, Target

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30


def rows() -> list[dict]:
    data = json.loads((ROOT / "tests/fixtures/estimate_suite_h100.json").read_text())
    cal = Calibration.load(ROOT / "src/gobrrr/data/calibration/h100-sxm.json")
    out = []
    for c in data["cases"]:
        m = c.get("measured", {})
        if "peak_allocated" not in m:
            continue
        est = estimate(
            c["model"],
            "h100",
            batch=c["batch"],
            seq=c["seq"],
            precision=c["precision"],
            checkpoint=c["checkpoint"],
            calibration=False,
            compile=c["compile"],
            loop="drops-output",  # the suite measured gobrrr's TrainStep
        )
        out.append(
            {
                "case": f"{c['model']} b{c['batch']}"
                + (f" s{c['seq']}" if c["seq"] else "")
                + f" {c['precision']}"
                + (" ckpt" if c["checkpoint"] == "full" else "")
                + (" compile" if c["compile"] else ""),
                "compile": c["compile"],
                "peak": m["peak_allocated"],
                "step": m["step_s"],
                "pred_peak": (
                    cal_est := evaluate(est.graph, Target(est.gpu, cal), compiled=c["compile"])
                ).memory.peak,
                "pred_step_sheet": est.time.step_s,
                "pred_step_cal": cal_est.time.step_s,
                "re_step": c.get("runtime_estimator_s"),
                "re_error": c.get("runtime_estimator_s_error"),
            }
        )
    return out


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def main() -> None:
    rs = rows()
    print(
        "| case | peak measured | predicted | error | step measured | datasheet | error "
        "| calibrated | error | RuntimeEstimator | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rs:
        mem_err = "n/a (compile)" if r["compile"] else _pct(r["pred_peak"] / r["peak"] - 1)
        re = (
            f"{r['re_step'] * 1e3:.1f} ms | {_pct(r['re_step'] / r['step'] - 1)}"
            if r["re_step"]
            else ("failed¹ | –" if r["re_error"] else "– | –")
        )
        print(
            f"| {r['case']} | {r['peak'] / GiB:.3f} GiB | {r['pred_peak'] / GiB:.3f} GiB | "
            f"{mem_err} | {r['step'] * 1e3:.1f} ms | {r['pred_step_sheet'] * 1e3:.1f} ms | "
            f"{_pct(r['pred_step_sheet'] / r['step'] - 1)} | {r['pred_step_cal'] * 1e3:.1f} ms | "
            f"{_pct(r['pred_step_cal'] / r['step'] - 1)} | {re} |"
        )
    mem = [abs(r["pred_peak"] / r["peak"] - 1) for r in rs if not r["compile"]]
    sheet = [abs(r["pred_step_sheet"] / r["step"] - 1) for r in rs]
    cal = [abs(r["pred_step_cal"] / r["step"] - 1) for r in rs]
    re = [abs(r["re_step"] / r["step"] - 1) for r in rs if r["re_step"]]
    print()
    print(
        f"Median |error|: peak memory {statistics.median(mem):.2%} (max {max(mem):.2%}, "
        f"{len(mem)} eager cases); step time calibrated {statistics.median(cal):.1%} "
        f"(max {max(cal):.1%}), datasheet {statistics.median(sheet):.1%} "
        f"(max {max(sheet):.1%}); RuntimeEstimator {statistics.median(re):.1%} "
        f"(max {max(re):.1%}) over the {len(re)} cases it could estimate."
    )
    errors = {r["re_error"] for r in rs if r["re_error"]}
    if errors:
        print(f"\n¹ RuntimeEstimator raised on every autocast case: {'; '.join(errors)}")


if __name__ == "__main__":
    main()
