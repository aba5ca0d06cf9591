"""How big the HTML report of a large step is, and how fast a browser opens and draws it.

The page of `gobrrr estimate --model llama3-70b --batch 1 --seq 4096 --html` (18,722 ops):
its size in bytes (plotly.js inlined, the charts' data, the result) and, loaded in headless
Chromium (1280x900) from a file URL with the network off, the page's own marks in ms from
navigation:

- paint_ms: first contentful paint (the page's text, before plotly.js runs);
- scripts_ms: plotly.js compiled and run;
- first_ms: the first screen's charts drawn and a frame painted after them: the page is
  open (what a reader sees is there, the main thread free for input);
- render_ms: every chart drawn (those below the first screen when the browser is idle or
  when scrolled near: here idle, no scrolling);

and each chart's own drawing time. Each run starts a fresh browser (cold: plotly.js compiled
from its source) and loads the page again in it (warm: V8's cache holds the compiled code).
The limits held: under 10 MB, and opened (first_ms) in under 2 s cold: "opens" is when the
reader can read and use the page; the charts below the first screen are not on screen until
scrolled to, and each draws before a scroll reaches it (render_ms is recorded beside it).
`--baseline PAGE` loads another page (e.g. one written by an older gobrrr) in the same runs,
interleaved, so the two are compared under the same load: the machine may be shared, so the
1-minute load average is recorded at each run and the spread (min, max) beside each median.

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
from plotly.offline import get_plotlyjs  # noqa: E402

from gobrrr.estimate import estimate  # noqa: E402
from gobrrr.report.charts import estimate_charts  # noqa: E402
from gobrrr.report.estimate import estimate_dict  # noqa: E402
from gobrrr.report.html import render  # noqa: E402

MAX_BYTES = 10 * 10**6
MAX_FIRST_MS = 2000


def measure(model: str, batch: int, seq: int, runs: int, baseline: Path | None = None) -> dict:
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
        pages = {"page": path, **({"baseline": baseline} if baseline else {})}
        loads: dict[str, list] = {k: [] for k in pages}
        for _ in range(runs):
            for name, p in pages.items():  # a fresh browser each: plotly.js cold, then warm
                load_1min = round(os.getloadavg()[0], 2)
                with Chromium() as b:
                    loads[name].append(
                        {"cold": _load(b, p), "warm": _load(b, p), "load_1min": load_1min}
                    )
    plotly_js = len(get_plotlyjs().encode())
    points = loads["page"][0]["cold"]["points"]
    for x in (x for runs_ in loads.values() for x in runs_):
        x["cold"].pop("points"), x["warm"].pop("points")
    out = {
        "version": 2,
        "what": f"gobrrr estimate --model {model} --batch {batch} --seq {seq} --html",
        "ops": len(est.graph.nodes),
        "page_bytes": len(data),
        "plotly_js_bytes": plotly_js,
        "data_bytes": len(data) - plotly_js,
        "points": points,
        "estimate_s": round(t1 - t0, 2),
        "page_build_s": round(render_s, 2),
        "loads": loads["page"],
        "summary": summary(loads["page"]),
    }
    if baseline:
        out["baseline"] = {
            "page": str(baseline),
            "page_bytes": baseline.stat().st_size,
            "loads": loads["baseline"],
            "summary": summary(loads["baseline"]),
        }
    first = out["summary"]["cold"]["first_ms"]["median"]
    return {
        **out,
        "limits": {"page_bytes": MAX_BYTES, "first_ms_cold": MAX_FIRST_MS},
        "within_limits": len(data) < MAX_BYTES and first is not None and first < MAX_FIRST_MS,
        "machine": {
            "cpus": os.cpu_count(),
            "load_1min": [x["load_1min"] for x in loads["page"]],
            "platform": platform.platform(),
            "chromium": _version(),
        },
        "date": time.strftime("%Y-%m-%d"),
    }


MARKS = ("paint_ms", "scripts_ms", "first_ms", "render_ms")


def summary(loads: list[dict]) -> dict:
    """{cold|warm: {mark: {median, min, max}}} over the runs (ms; None where a page does not
    set the mark: an older page marks only scripts_ms and render_ms)."""
    out: dict = {}
    for when in ("cold", "warm"):
        out[when] = {}
        for mark in (*MARKS, "load_s"):
            v = [x[when][mark] for x in loads if x[when][mark] is not None]
            out[when][mark] = (
                {"median": statistics.median(v), "min": min(v), "max": max(v)} if v else None
            )
    return out


def _load(b: Chromium, path: Path) -> dict:
    """One load: the page's marks (ms), each chart's drawing time (ms), s to the last mark."""
    p = b.load(path, timeout=60)
    if p.errors or p.rendered != len(p.charts):
        raise SystemExit(f"the page did not render: {p.errors}")
    return {
        **{m: getattr(p, m) for m in MARKS},
        "load_s": round(p.load_s, 3),
        "draw_ms": {c["id"]: c["draw_ms"] for c in p.charts if c["draw_ms"] is not None},
        "first_screen": [c["id"] for c in p.charts if c["first"]],
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
    ap.add_argument("--baseline", type=Path, help="another page to load in the same runs")
    args = ap.parse_args()
    r = measure(args.model, args.batch, args.seq, args.runs, args.baseline)
    Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    cold, warm = r["summary"]["cold"], r["summary"]["warm"]
    print(
        f"{r['what']}: {r['page_bytes'] / 1e6:.2f} MB ({r['plotly_js_bytes'] / 1e6:.2f} MB "
        f"plotly.js); cold: open {_ms(cold['first_ms'])}, all charts {_ms(cold['render_ms'])}; "
        f"warm: open {_ms(warm['first_ms'])}, all {_ms(warm['render_ms'])} (medians of "
        f"{args.runs} [min-max], load {r['machine']['load_1min']} on "
        f"{r['machine']['cpus']} CPUs); limits 10 MB, open in 2000 ms cold: "
        f"{'within' if r['within_limits'] else 'OVER'} -> {args.out}"
    )
    if "baseline" in r:
        c = r["baseline"]["summary"]["cold"]
        print(f"baseline {args.baseline}: cold all charts {_ms(c['render_ms'])}")


def _ms(s: dict | None) -> str:
    return "n/a" if s is None else f"{s['median']:.0f} ms [{s['min']:.0f}-{s['max']:.0f}]"


if __name__ == "__main__":
    main()
