"""Run every kernel benchmark into one folder in one GPU session, then print a summary table.

    PYTHONPATH=src python benchmarks/run_kernel_benches.py OUT [--sweep lce norms] [--budget-s N]

Sections run in order (lce, norms, pointwise, convergence, gpt2_kernels); each writes its own
JSON as soon as it is done, so a section that fails or runs out of time loses only itself.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

from gobrrr.kernels.bench import _load, gpu_tag, table

ORDER = ["lce", "norms", "pointwise", "convergence", "gpt2_kernels"]


def summary_rows(paths: dict[str, Path]) -> list[dict]:
    rows = []
    for name, path in paths.items():
        data = json.loads(path.read_text())
        for r in data.get("rows", []):
            if "impl" in r or "config" in r:
                rows.append({"bench": name, "what": _what(r), **_figures(r)})
        if "summary" in data:
            rows.append({"bench": name, "what": "max smoothed loss gap",
                         "value": data["summary"]["max_smoothed_gap"]})
    return rows


def _what(r: dict) -> str:
    keys = ("config", "impl", "norm", "op", "shape", "chunk")
    return " ".join(str(r[k]) for k in keys if r.get(k) is not None)


def _figures(r: dict) -> dict:
    if "time_vs_eager" in r:
        return {"value": r["median_ms"], "unit": "ms", "vs": r["time_vs_eager"],
                "extra": f"mem x{r['mem_vs_eager']:.3f}"}
    if "fwdbwd_GBps" in r:
        return {"value": r["fwdbwd_GBps"], "unit": "GB/s fwd+bwd"}
    if "fwd_vs_copy" in r:
        return {"value": r["fwd_GBps"], "unit": "GB/s fwd", "vs": r["fwd_vs_copy"],
                "extra": f"bwd x{r['bwd_vs_copy']:.3f} of copy"}
    if "tokens_per_s" in r:
        return {"value": r["tokens_per_s"], "unit": "tok/s", "vs": r.get("speedup_vs_eager"),
                "extra": f"{r['peak_gib']:.2f} GiB"}
    return {"extra": r.get("error") or r.get("skipped")}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--sweep", nargs="*", default=[], choices=ORDER,
                   help="sections that also sweep their launch configurations")
    p.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget, seconds")
    p.add_argument("--only", nargs="*", default=ORDER, choices=ORDER)
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    out, written = Path(args.out_dir), {}
    for name in [n for n in ORDER if n in args.only]:
        left = deadline - time.perf_counter()
        if left < 30:
            print(f"== {name}: skipped, {left:.0f} s left")
            continue
        print(f"== {name} ({left:.0f} s left)", flush=True)
        if name == "gpt2_kernels":
            kwargs = {"budget_s": left - 20}
        else:
            kwargs = {"sweep": name in args.sweep}
        try:
            written[name] = _load(name).run(out / f"{name}_{gpu_tag()}.json", **kwargs)
        except Exception:  # noqa: BLE001 - report and go on to the next section
            traceback.print_exc()
    print("== summary")
    print(table(summary_rows(written), ["bench", "what", "value", "unit", "vs", "extra"]))


if __name__ == "__main__":
    main()
