"""The report in a real browser: headless Chromium loads each kind of page (an estimate, a
profile with --compare, a plan) from a file URL with the network off, and every chart draws
(plotly's SVG), nothing logs an error, nothing is fetched, the charts hold the JSON's numbers,
and a module or workload named as markup stays text. Skipped where no Chromium is installed
(`.ci/setup` installs Debian's where it can)."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest

from gobrrr.cli.app import main

pytest.importorskip("plotly")
ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "report_browser", ROOT / "benchmarks/report/browser.py"
)
browser = sys.modules["report_browser"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser)
if browser.find_chromium() is None:
    pytest.skip("no chromium binary found (apt-get install chromium)", allow_module_level=True)

EVIL = "<script>alert(1)</script>"
WORKLOAD = f"""
import torch
from torch import nn
from gobrrr import Workload

class Evil(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module({EVIL!r}, nn.Linear(64, 256))
        self.head = nn.Linear(256, 64)

    def forward(self, x):
        return self.head(torch.relu(getattr(self, {EVIL!r})(x))).square().mean()

def make(batch_size: int = 16):
    return Workload(model=Evil(), batch=(torch.randn(batch_size, 64),),
                    name='<img src=x onerror="document.title=1">')
"""


@pytest.fixture(scope="module")
def pages(tmp_path_factory):
    """{kind: (page path, the command that writes it and prints its JSON)}."""
    d = tmp_path_factory.mktemp("pages")
    (d / "evil.py").write_text(WORKLOAD)
    spec = f"{d / 'evil.py'}:make"
    runs = {
        "estimate": ["estimate", spec, "--batch", "16"],
        "profile": [
            "profile",
            spec,
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--compare",
            "--gpu",
            "h100",
        ],
        "plan": ["plan", "--model", "mlp", "--global-batch", "8", "--memory-budget", "3GiB"],
    }
    out = {}
    for kind, args in runs.items():
        out[kind] = (d / f"{kind}.html", [*args, "--json", "--html", str(d / f"{kind}.html")])
    return out


def run(args, capsys) -> dict:
    assert main(args) in (0, 1)
    return json.loads(capsys.readouterr().out)


def test_pages_render_offline_with_the_json_numbers(pages, capsys):
    results = {kind: run(args, capsys) for kind, (_, args) in pages.items()}
    with browser.Chromium() as b:
        for kind, (path, _) in pages.items():
            page = b.load(path)
            charts = page.charts
            assert page.errors == [], kind
            assert page.requests == [], kind  # nothing fetched
            assert page.rendered == len(charts) > 0, kind
            assert all(c["svg"] > 0 and c["traces"] for c in charts), kind
            check_numbers(b, kind, results[kind], charts)
        # markup in names stayed text: no script ran, the title is the name as typed
        b.load(pages["estimate"][0])
        title = 'gobrrr: <img src=x onerror="document.title=1"> on h100-sxm'
        assert b.evaluate("document.title") == title
        assert not any(e.get("method") == "Page.javascriptDialogOpening" for e in b.events)
        assert EVIL in b.text("#time table")
        assert b.evaluate("document.querySelectorAll('main img, main script').length") == 0


def check_numbers(b, kind: str, r: dict, charts: list[dict]) -> None:
    """What the drawn charts and the summary hold is the JSON's."""
    gib = 2**30
    if kind == "estimate":
        mem = r["charts"]["memory"]
        drawn = next(c for c in charts if c["id"].endswith("-memory"))
        total = next(t for t in drawn["traces"] if t["name"] == "allocated")
        assert total["y"] == pytest.approx([v / gib for v in mem["total"]], abs=1e-6)
        tree = next(c for c in charts if c["id"].endswith("-modules"))["traces"][0]
        assert tree["values"] == pytest.approx(r["charts"]["modules"]["time_s"])
        shown = b.evaluate(
            "document.querySelector('[data-key=\"memory.peak_bytes\"]').dataset.value"
        )
        assert int(shown) == r["memory"]["peak_bytes"]
    elif kind == "profile":
        assert "compare" in r
        bars = next(c for c in charts if c["id"].endswith("compare-0-kinds"))["traces"]
        assert bars[1]["y"] == pytest.approx([k["measured_s"] * 1e3 for k in r["compare"]["kinds"]])
    else:
        c = r["charts"]["candidates"]
        drawn = next(x for x in charts if x["id"].endswith("-candidates"))["traces"]
        xs = sorted(x for t in drawn if t["name"] in ("fits", "does not fit") for x in t["x"])
        assert xs == pytest.approx(sorted(v / gib for v in c["reserved_bytes"]))


def test_charts_below_the_first_screen_draw_when_scrolled_to(pages, capsys):
    """With the browser never idle (requestIdleCallback does nothing), the page opens with
    its first screen's charts drawn, the rest not yet; each draws once scrolled into view."""
    path, args = pages["estimate"]
    result = run(args, capsys)
    with browser.Chromium(height=700) as b:
        b.call(
            "Page.addScriptToEvaluateOnNewDocument",
            session=True,
            source="window.requestIdleCallback = function () { return 0; };",
        )
        page = b.load(path, until="first")
        assert page.errors == [] and page.first_ms is not None
        charts = page.charts
        first = [c for c in charts if c["first"]]
        assert first and all(c["svg"] > 0 for c in first)
        later = [c["id"] for c in charts if not c["svg"]]
        assert later and later[-1] == charts[-1]["id"]  # the last chart waits for a scroll
        assert b.evaluate("document.body.dataset.rendered || null") is None
        for div in later:
            b.evaluate(f"document.getElementById({json.dumps(div)}).scrollIntoView()")
            drawn = f"document.getElementById({json.dumps(div)}).querySelectorAll('.main-svg')"
            deadline = time.monotonic() + 20
            while not b.evaluate(f"{drawn}.length") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert b.evaluate(f"{drawn}.length") > 0, div
        assert b.evaluate("document.body.dataset.rendered") == str(len(charts))
        charts = json.loads(b.evaluate(browser.CHARTS_JS))
        check_numbers(b, "estimate", result, charts)
        assert b._errors() == []


NESTED = """
import torch
from torch import nn
from gobrrr import Workload

def make(batch_size: int = 4):
    block = lambda: nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 8))
    return Workload(model=nn.Sequential(block(), block(), block()),
                    batch=(torch.randn(batch_size, 8),), loss=lambda out, b: out.square().mean())
"""


def test_treemap_draws_its_first_view_then_the_whole_tree_on_a_click(tmp_path, capsys):
    """The module treemap is drawn with the levels its first view shows (maxdepth 3: the
    step, the blocks, their children); a click on a block's child draws the whole tree from
    there, its own children (the 4th level) included."""
    (tmp_path / "nested.py").write_text(NESTED)
    path = tmp_path / "nested.html"
    r = run(["estimate", f"{tmp_path / 'nested.py'}:make", "--json", "--html", str(path)], capsys)
    tree = r["charts"]["modules"]
    assert "1.0.0" in tree["id"]  # the 4th level exists in the JSON
    with browser.Chromium() as b:
        page = b.load(path)
        assert page.errors == [] and page.rendered == len(page.charts)
        div = "document.querySelector('[id$=\"-modules\"]')"
        drawn = next(c for c in page.charts if c["id"].endswith("-modules"))["traces"][0]
        shown = [i for i in tree["id"] if i.count(".") < 2]  # "", "<top>", "1", "1.0", ...
        assert drawn["ids"] == [f"m:{i}" for i in shown]
        assert drawn["values"] == pytest.approx(
            [tree["time_s"][tree["id"].index(i)] for i in shown]
        )
        slices = f"Array.from({div}.querySelectorAll('g.slice'))"
        b.evaluate(f"{div}.scrollIntoView()")
        x, y = b.evaluate(
            f"(function(){{var s={slices}.filter(function(s){{return s.__data__.data.data.id"
            "==='m:1.0';})[0].getBoundingClientRect();return [s.left+s.width/2,s.top+s.height/2]"
            "})()"
        )
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            b.call(
                "Input.dispatchMouseEvent",
                session=True,
                type=kind,
                x=x,
                y=y,
                button="left",
                clickCount=1,
            )
        ids = f"{slices}.map(function(s){{return s.__data__.data.data.id;}})"
        deadline = time.monotonic() + 10
        while "m:1.0.0" not in (b.evaluate(ids) or []) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert {"m:1.0.0", "m:1.0.1"} <= set(b.evaluate(ids))
        assert b.evaluate(f"{div}.data[0].ids.length") == len(tree["id"])
        assert b.evaluate(f"{div}.data[0].level") == "m:1.0"
        assert b._errors() == []
