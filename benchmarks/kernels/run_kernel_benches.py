"""Run every kernel benchmark into one folder in one GPU call, then print a summary table.

    PYTHONPATH=src python benchmarks/kernels/run_kernel_benches.py OUT [--sweep lce norms] \
        [--budget-s N]
    PYTHONPATH=src python benchmarks/kernels/run_kernel_benches.py benchmarks/results --report

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
            rows.append(
                {
                    "bench": name,
                    "what": "max smoothed loss gap",
                    "value": data["summary"]["max_smoothed_gap"],
                }
            )
    return rows


def _what(r: dict) -> str:
    keys = ("config", "impl", "norm", "op", "shape", "chunk")
    return " ".join(str(r[k]) for k in keys if r.get(k) is not None)


def _figures(r: dict) -> dict:
    if "time_vs_eager" in r:
        return {
            "value": r["median_ms"],
            "unit": "ms",
            "vs": r["time_vs_eager"],
            "extra": f"mem x{r['mem_vs_eager']:.3f}",
        }
    if "fwdbwd_GBps" in r:
        return {"value": r["fwdbwd_GBps"], "unit": "GB/s fwd+bwd"}
    if "fwd_vs_copy" in r:
        return {
            "value": r["fwd_GBps"],
            "unit": "GB/s fwd",
            "vs": r["fwd_vs_copy"],
            "extra": f"bwd x{r['bwd_vs_copy']:.3f} of copy",
        }
    if "tokens_per_s" in r:
        return {
            "value": r["tokens_per_s"],
            "unit": "tok/s",
            "vs": r.get("speedup_vs_eager"),
            "extra": f"{r['peak_gib']:.2f} GiB",
        }
    return {"extra": r.get("error") or r.get("skipped")}


def _md(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def _env(d: dict) -> str:
    e = d["env"]
    return (
        f"{e.get('gpu')}, driver {e.get('driver')}, CUDA {e.get('cuda')}, torch {e['torch']}, "
        f"triton {e['triton']}, {e['date']}"
    )


def _report_one(name: str, d: dict) -> list[str]:
    out = [f"### {name}", "", _env(d), ""]
    rows = [r for r in d.get("rows", []) if "error" not in r and "skipped" not in r]
    failed = [r for r in d.get("rows", []) if "error" in r or "skipped" in r]
    if name.startswith("lce"):
        out += [
            f"shape {d['shape']}; check vs eager (rel. error) {d['check_vs_eager_rel_err']}",
            "",
            _md(
                rows,
                [
                    "impl",
                    "chunk",
                    "median_ms",
                    "p20_ms",
                    "p80_ms",
                    "peak_extra_gib",
                    "time_vs_eager",
                    "mem_vs_eager",
                ],
            ),
        ]
        if "ce_kernel" in d:
            out += ["", f"loss kernel alone: {d['ce_kernel']}"]
    elif name.startswith("norms"):
        out += [
            _md(
                rows,
                [
                    "norm",
                    "impl",
                    "shape",
                    "fwd_GBps",
                    "bwd_GBps",
                    "fwdbwd_GBps",
                    "launch_fwd_GBps",
                    "launch_bwd_GBps",
                    "launch_fwdbwd_GBps",
                ],
            )
        ]
        sweep = sorted(
            (r for r in d.get("sweep", []) if "bwd_GBps" in r),
            key=lambda r: (r["shape"], -r["bwd_GBps"]),
        )
        if sweep:
            out += [
                "",
                "backward sweep (RMSNorm), best 4 per shape:",
                "",
                _md(
                    [
                        r
                        for i, r in enumerate(sweep)
                        if sum(x["shape"] == r["shape"] for x in sweep[:i]) < 4
                    ],
                    [
                        "shape",
                        "rows_per_prog",
                        "warps",
                        "per_sm",
                        "stages",
                        "fwd_GBps",
                        "bwd_GBps",
                        "fwdbwd_GBps",
                    ],
                ),
            ]
    elif name.startswith("pointwise"):
        out += [
            f"device copy {d['copy']['GBps']:.0f} GB/s",
            "",
            _md(
                rows,
                [
                    "op",
                    "impl",
                    "fwd_GBps",
                    "bwd_GBps",
                    "fwd_vs_copy",
                    "bwd_vs_copy",
                    "launch_fwd_GBps",
                    "launch_bwd_GBps",
                ],
            ),
        ]
    elif name.startswith("gpt2"):
        out += [
            f"gobrrr attention unavailable: {d.get('attention_unavailable')}",
            "",
            _md(
                rows,
                [
                    "config",
                    "compile",
                    "step_ms",
                    "tokens_per_s",
                    "mfu",
                    "peak_gib",
                    "first_loss",
                    "speedup_vs_eager",
                ]
                + (
                    ["predicted_ms", "predicted_ms_no_kernel_host"]
                    if any("predicted_ms" in r for r in rows)
                    else []
                ),
            ),
        ]
    elif name.startswith("convergence"):
        s = d["summary"]
        out += [
            f"kernels {d['kernels']}; attention unavailable: {d.get('attention_unavailable')}",
            "",
            _md([s], list(s)),
        ]
    if failed:
        out += [
            "",
            "failed: "
            + "; ".join(
                f"{r.get('impl') or r.get('config')}: {(r.get('error') or r.get('skipped'))[:90]}"
                for r in failed
            ),
        ]
    return out + [""]


def _lce_targets(d: dict, src: str) -> list[dict]:
    r = next(
        r for r in d["rows"] if r.get("impl") == "gobrrr" and r.get("chunk") == d["default_chunk"]
    )
    return [
        {
            "target": "linear+CE peak <= 0.2 x eager",
            "measured": r["mem_vs_eager"],
            "met": r["mem_vs_eager"] <= 0.2,
            "source": src,
        },
        {
            "target": "linear+CE time <= 1.1 x eager",
            "measured": r["time_vs_eager"],
            "met": r["time_vs_eager"] <= 1.1,
            "source": src,
        },
    ]


def _norm_targets(d: dict, src: str) -> list[dict]:
    out = []
    for r in d["rows"]:
        if r.get("impl") == "gobrrr" and "fwdbwd_GBps" in r:
            out.append(
                {
                    "target": f"{r['norm']} {r['shape']} fwd+bwd >= 2850 GB/s",
                    "measured": r["fwdbwd_GBps"],
                    "met": r["fwdbwd_GBps"] >= 2850,
                    "source": src,
                }
            )
    best = {}
    for r in d.get("sweep", []):
        if "fwdbwd_GBps" in r and r["fwdbwd_GBps"] > best.get(r["shape"], {}).get("fwdbwd_GBps", 0):
            best[r["shape"]] = r
    for shape, r in best.items():
        cfg = f"{r['rows_per_prog']} rows, {r['warps']} warps, {r['per_sm']}/SM, {r['stages']} st."
        out.append(
            {
                "target": f"rms_norm {shape} fwd+bwd >= 2850 GB/s (best sweep: {cfg})",
                "measured": r["fwdbwd_GBps"],
                "met": r["fwdbwd_GBps"] >= 2850,
                "source": src,
            }
        )
    return out


def _pointwise_targets(d: dict, src: str) -> list[dict]:
    out = []
    for r in d["rows"]:
        if r.get("impl") == "gobrrr" and "fwd_vs_copy" in r:
            worst = min(r["fwd_vs_copy"], r["bwd_vs_copy"])
            out.append(
                {
                    "target": f"{r['op']} fwd and bwd >= 0.9 x copy",
                    "measured": worst,
                    "met": worst >= 0.9,
                    "source": src,
                }
            )
    return out


def targets(results_dir: Path) -> str:
    """The task's targets against the latest result of each benchmark, as a markdown table."""
    rows = []
    for prefix, fn in (
        ("lce", _lce_targets),
        ("norms", _norm_targets),
        ("pointwise", _pointwise_targets),
    ):
        paths = sorted(results_dir.glob(f"{prefix}_*.json"))
        if paths:
            rows += fn(json.loads(paths[-1].read_text()), paths[-1].name)
    return _md(rows, ["target", "measured", "met", "source"])


def report(results_dir: Path) -> str:
    """Markdown tables of every kernel benchmark JSON in results_dir, targets first."""
    lines = ["### targets (latest run of each)", "", targets(results_dir), ""]
    for prefix in ORDER:
        for path in sorted(results_dir.glob(f"{prefix}_*.json")):
            lines += _report_one(path.stem, json.loads(path.read_text()))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="where to write results (or read them, with --report)")
    p.add_argument("--report", action="store_true", help="print markdown tables of out_dir")
    p.add_argument(
        "--sweep",
        nargs="*",
        default=[],
        choices=ORDER,
        help="sections that also sweep their launch configurations",
    )
    p.add_argument("--budget-s", type=float, default=400.0, help="wall-clock budget, seconds")
    p.add_argument("--only", nargs="*", default=ORDER, choices=ORDER)
    args = p.parse_args(argv)
    if args.report:
        print(report(Path(args.out_dir)))
        return
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
