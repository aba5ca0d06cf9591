"""How big the HTML report of a large step is, and how fast a browser draws it.

The page of `gobrrr estimate --model llama3-70b --batch 1 --seq 4096 --html` (18,722 ops):
its size in bytes (plotly.js inlined, the charts' data, the result) and the time headless
Chromium takes from navigation to its last chart drawn (the page's own `data-render-ms`),
loaded from a file URL with the network off, in a fresh browser (cold: plotly.js compiled
first) and once more in the same one (warm), `--runs` times. The limits the report keeps:
under 10 MB, drawn in under 2 s cold. The machine's load is recorded beside the times.

    PYTHONPATH=src:. python benchmarks/report/page_size.py            # writes the result
    PYTHONPATH=src:. python benchmarks/report/page_size.py --model gpt2 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from browser import Chromium, find_chromium  # noqa: E402

from gobrrr.estimate import estimate  # noqa: E402
from gobrrr.report.charts import estimate_charts  # noqa: E402
from gobrrr.report.estimate import estimate_dict  # noqa: E402
from gobrrr.report.html import render  # noqa: E402

MAX_BYTES = 10 * 10**6
MAX_RENDER_MS = 2000


def measure(model: str, batch: int, seq: int, runs: int) -> dict:
    t0 = time.perf_counter()
    est = estimate(model, "h100", batch=batch, seq=seq)
    result = {**estimate_dict(est), "charts": estimate_charts(est), "warnings": []}
    t1 = time.perf_counter()
    page = render(result)
    render_s = time.perf_counter() - t1
    data = page.encode()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{model}.html"
        path.write_bytes(data)
        loads = []
        for _ in range(runs):  # a fresh browser each run: plotly.js compiled cold, then warm
            with Chromium() as b:
                loads.append({"cold": _load(b, path), "warm": _load(b, path)})
    plotly_js = len(page.split("<script>", 2)[2].split("</script>", 1)[0].encode())
    points = loads[0]["cold"]["points"]
    for x in loads:
        x["cold"].pop("points"), x["warm"].pop("points")
    cold = statistics.median(x["cold"]["render_ms"] for x in loads)
    warm = statistics.median(x["warm"]["render_ms"] for x in loads)
    return {
        "version": 1,
        "what": f"gobrrr estimate --model {model} --batch {batch} --seq {seq} --html",
        "ops": len(est.graph.nodes),
        "page_bytes": len(data),
        "plotly_js_bytes": plotly_js,
        "data_bytes": len(data) - plotly_js,
        "points": points,
        "estimate_s": round(t1 - t0, 2),
        "page_build_s": round(render_s, 2),
        "loads": loads,
        "render_ms_median": {"cold": cold, "warm": warm},
        "limits": {"page_bytes": MAX_BYTES, "render_ms": MAX_RENDER_MS},
        "within_limits": len(data) < MAX_BYTES and cold < MAX_RENDER_MS,
        "machine": {
            "cpus": os.cpu_count(),
            "load_1min": round(os.getloadavg()[0], 2),
            "platform": platform.platform(),
            "chromium": _version(),
        },
        "date": time.strftime("%Y-%m-%d"),
    }


def _load(b: Chromium, path: Path) -> dict:
    """One load: ms to the scripts read in and to the last chart drawn, s to the page's mark."""
    p = b.load(path, timeout=60)
    if p.errors or p.rendered != len(p.charts):
        raise SystemExit(f"the page did not render: {p.errors}")
    return {
        "scripts_ms": p.scripts_ms,
        "render_ms": p.render_ms,
        "load_s": round(p.load_s, 3),
        "points": {
            c["id"]: sum(len(t.get("x") or t.get("values") or []) for t in c["traces"])
            for c in p.charts
        },
    }


def _version() -> str:
    out = subprocess.run([find_chromium(), "--version"], capture_output=True, text=True)
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-70b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "page_size.json"))
    args = ap.parse_args()
    r = measure(args.model, args.batch, args.seq, args.runs)
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    print(
        f"{r['what']}: {r['page_bytes'] / 1e6:.2f} MB ({r['plotly_js_bytes'] / 1e6:.2f} MB "
        f"plotly.js), drawn in {r['render_ms_median']['cold']:.0f} ms from a cold browser, "
        f"{r['render_ms_median']['warm']:.0f} ms warm (medians of {args.runs}, load "
        f"{r['machine']['load_1min']} on {r['machine']['cpus']} CPUs); "
        f"limits 10 MB, 2000 ms: {'within' if r['within_limits'] else 'OVER'} -> {args.out}"
    )


if __name__ == "__main__":
    main()
