"""A variant host model, checked on every zoo and held-out case: views charged what a view
costs the host alone, every other op the per-op cost that leaves the calibration's tiny
steps' measured time unchanged.

    python benchmarks/host_view_split.py OUT.json     # on any machine (CPU)

The shipped host model charges every traced ATen op of a phase the same host seconds
(`op_overhead`, the tiny GPT-2 and Llama steps' time over their op count), views included.
`host_op_classes_h100.json` measured a view alone at a third of an elementwise add's host time
(detach at a sixth). Here each op with no kernel (`OpCost.launches == 0`) of a view kind
measured there costs its measured time (forward: with autograd recording; backward: without;
the other no-kernel ops the median of those), scaled by the calibration's launch over that
host's add; the per-op cost of every other op is re-derived so that the tiny steps' phases
keep their measured time: (op_overhead x ops - views' cost) / (ops - views). Each case is
traced once and evaluated with both models against its measured step (the median over its
runs, as the zoo's report takes it).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

RESULTS = HERE.parent / "results"
VIEWS = ("view", "t", "slice", "expand", "squeeze", "as_strided", "detach", "permute")
FILES = ("zoo_h100.json", "zoo_h100_holdout.json")


def main(argv=None) -> int:
    from gobrrr.calibrate.sections.host import _tiny_workloads
    from gobrrr.capture import capture
    from gobrrr.capture.sdpa import target_for
    from gobrrr.cost import rates as rates_mod
    from gobrrr.cost.flops import op_cost
    from gobrrr.evaluate import Target, evaluate
    from gobrrr.hardware import find_calibration, get_gpu
    from gobrrr.kernels.bench import write_json
    from zoo import compare as zc
    from zoo.cases import get_case

    out = (argv or sys.argv[1:])[0]
    spec = get_gpu("h100")
    cal = find_calibration(spec)
    classes = json.loads((RESULTS / "host_op_classes_h100.json").read_text())["per_call_s"]
    scale = cal.launch_overhead / classes["nograd:add"]
    table = {p: {n: classes[f"{k}:{n}"] * scale for n in VIEWS}
             for p, k in (("forward", "grad"), ("backward", "nograd"))}

    def view_s(name: str, phase: str) -> float:
        t = table["forward" if phase in ("forward", "checkpointed", "recompute") else
                  "backward"]
        return t.get(name, statistics.median(t.values()))

    counts = {p: {"ops": 0, "views": 0, "views_s": 0.0} for p in table}
    for make in _tiny_workloads():
        for n in capture(make, precision="fp32", checkpoint="none").nodes:
            if n.phase in counts:
                counts[n.phase]["ops"] += 1
                if op_cost(n).launches == 0:
                    counts[n.phase]["views"] += 1
                    counts[n.phase]["views_s"] += view_s(n.name, n.phase)
    per_op = dict(cal.op_overhead)
    for p, c in counts.items():
        per_op[p] = (cal.op_overhead[p] * c["ops"] - c["views_s"]) / (c["ops"] - c["views"])
    variant = dataclasses.replace(cal, op_overhead=per_op)
    shipped_host = rates_mod.Rates.host

    def host(self, phase, launches, op="", math_mode=""):
        if launches == 0 and self.cal is variant and op not in self.cal.kernel_host:
            return view_s(op, phase)
        return shipped_host(self, phase, launches, op, math_mode)

    rates_mod.Rates.host = host
    reruns = zc.rerun_steps(RESULTS)
    rows = []
    for f in FILES:
        for row in zc.measured_rows(json.loads((RESULTS / f).read_text())):
            case = get_case(row["name"])
            measured = statistics.median([row["measured"]["step_s"],
                                          *reruns.get(row["name"], [])])
            g = capture(case.factory(), precision=case.precision,
                        sdpa=target_for(spec.full_name), compile=case.compile)
            shipped = evaluate(g, Target(spec, cal)).time.step_s
            split = evaluate(g, Target(spec, variant)).time.step_s
            rows.append({"file": f, "name": row["name"], "measured_step_s": measured,
                         "shipped_step_s": shipped, "view_split_step_s": split,
                         "shipped_err": shipped / measured - 1,
                         "view_split_err": split / measured - 1})
            print(f"{row['name']:28s} measured {measured * 1e3:7.1f} ms  shipped "
                  f"{rows[-1]['shipped_err']:+6.1%}  view split {rows[-1]['view_split_err']:+6.1%}",
                  flush=True)
    summary = {}
    for f in FILES:
        for model in ("shipped", "view_split"):
            e = sorted(abs(r[f"{model}_err"]) for r in rows if r["file"] == f)
            summary[f"{f}:{model}"] = {"median": statistics.median(e), "worst": e[-1],
                                       "over_15pct": sum(x > 0.15 for x in e)}
            print(f, model, {k: round(v, 4) for k, v in summary[f"{f}:{model}"].items()})
    write_json(out, {"benchmark": "host model with views split out", "tiny_steps": counts,
                     "op_overhead": {"shipped": cal.op_overhead, "view_split": per_op},
                     "view_host_s": table, "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
