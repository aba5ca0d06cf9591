"""The recorded CUDA-graph measurements re-predicted with the calibration as it is now.

    PYTHONPATH=src:. python benchmarks/plan/cudagraph_repredict.py \
        [--out benchmarks/results/cudagraph_h100_repredicted.json]

Reads `results/cudagraph_h100.json` (`plan/cudagraph.py`: the applied graph of four host-bound
steps) and `results/plan_cudagraphs_h100.json` (`plan/plan_cudagraphs.py`: three plans made with
`--allow cudagraphs`), costs each recorded configuration again (`Planner.cost`, the H100 and its
shipped calibration) and writes, per step, the measured replay, the prediction recorded with
it and the one now, with their errors (predicted / measured - 1); and the captured convnet's
predicted device time per kind of kernel beside its profile (`cudagraph_profile_h100.json`).
CPU, about a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(HERE))

import cudagraph as bench  # noqa: E402

from gobrrr.hardware import Target  # noqa: E402
from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.plan.knobs import Knobs  # noqa: E402
from gobrrr.plan.search import Planner  # noqa: E402


def _row(measured: float, recorded: float, now: float) -> dict:
    return {
        "measured_s": measured,
        "recorded_prediction_s": recorded,
        "recorded_error": recorded / measured - 1,
        "prediction_s": now,
        "error": now / measured - 1,
    }


def applied(target: Target) -> dict:
    """The four steps of cudagraph_h100.json, replayed."""
    data = json.loads((RESULTS / "cudagraph_h100.json").read_text())
    out = {}
    for case, row in data["cases"].items():
        make, batch, _ = bench.workload_fn(case, False)
        planner = Planner(make, target, global_batch=batch, precision="bf16-mixed", allow=[])
        knobs = dataclasses.replace(Knobs(**row["knobs"]), cuda_graph=True)
        now = planner.cost(knobs).step_s
        out[case] = _row(row["measured_s"]["graphed"], row["predicted"]["graphed"]["step_s"], now)
    return out


def planned(target: Target) -> dict:
    """The three plans of plan_cudagraphs_h100.json."""
    data = json.loads((RESULTS / "plan_cudagraphs_h100.json").read_text())
    out = {}
    for c in data["cases"]:
        make = functools.partial(get_workload, c["case"], c["batch"], c["seq"])
        planner = Planner(make, target, global_batch=c["batch"], allow=["cudagraphs"])
        now = planner.cost(Knobs(**c["best"])).step_s
        m, p = c["measured"]["plan"]["step_s"], c["predicted"]["plan"]["step_s"]
        out[c["case"]] = _row(m, p, now)
    return out


#: the convnet's kernels by what they do: (name, the predicted ops' ATen names, a test on a
#: profiled kernel's name)
CATEGORIES = (
    (
        "batch norm",
        ("native_batch_norm", "native_batch_norm_backward"),
        lambda k: "batch_norm" in k or "bn_" in k,
    ),
    (
        "ReLU, add, max pool",
        (
            "relu",
            "threshold_backward",
            "add",
            "max_pool2d_with_indices",
            "max_pool2d_with_indices_backward",
        ),  # fmt: skip
        lambda k: any(x in k for x in ("threshold", "clamp_min", "CUDAFunctor_add", "max_pool")),
    ),
)


def by_category(target: Target) -> dict:
    """The captured convnet's predicted device seconds per category beside its profiled
    kernels' (`cudagraph_profile_h100.json`, per step)."""
    from gobrrr.evaluate import evaluate

    prof = json.loads((RESULTS / "cudagraph_profile_h100.json").read_text())
    kernels = prof["cases"]["convnet-graph"]["kernels"]
    make = functools.partial(get_workload, "convnet", 32, None)
    planner = Planner(make, target, global_batch=32, allow=["cudagraphs"])
    knobs = Knobs(micro_batch=32, cuda_graph=True)
    ops = evaluate(planner.search.step_graph(knobs), target).time.ops
    out = {}
    for name, aten, test in CATEGORIES:
        predicted = sum(o.device_s for o in ops if o.op.split(".")[1] in aten)
        measured = sum(v["us_per_step"] for k, v in kernels.items() if test(k)) / 1e6
        out[name] = {"predicted_s": predicted, "measured_s": measured}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "cudagraph_h100_repredicted.json"))
    args = ap.parse_args()
    target = Target.resolve("h100")
    doc = {
        "calibration_cudagraph": {k: v for k, v in target.cal.cudagraph.items() if k != "points"},
        "applied": applied(target),
        "planned": planned(target),
        "convnet_captured_by_category": by_category(target),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for group in ("applied", "planned"):
        for case, r in doc[group].items():
            print(
                f"{group:8s} {case:10s} measured {r['measured_s'] * 1e3:7.3f} ms, predicted "
                f"{r['recorded_prediction_s'] * 1e3:7.3f} ({r['recorded_error']:+.1%}) -> "
                f"{r['prediction_s'] * 1e3:7.3f} ({r['error']:+.1%})"
            )
    for name, r in doc["convnet_captured_by_category"].items():
        print(
            f"convnet captured, {name}: {r['measured_s'] * 1e3:.2f} ms profiled, "
            f"{r['predicted_s'] * 1e3:.2f} predicted"
        )


if __name__ == "__main__":
    main()
