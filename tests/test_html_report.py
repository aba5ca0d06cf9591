"""The HTML report without a browser: the figures equal the JSON's (and the JSON the
prediction's), names a user controls cannot become markup, writing is atomic, a missing
plotly is one line naming the extra, and plan's progress goes to stderr only."""

from __future__ import annotations

import html.parser
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gobrrr import Workload
from gobrrr.cli.app import main
from gobrrr.errors import GobrrrError
from gobrrr.estimate import estimate
from gobrrr.memory.replay import round_alloc
from gobrrr.report import html as H
from gobrrr.report.charts import downsample, estimate_charts, layer_class
from gobrrr.report.estimate import estimate_dict
from gobrrr.report.progress import Progress

pytest.importorskip("plotly")

ROOT = Path(__file__).resolve().parents[1]
EVIL_MODULE = "<script>alert(1)</script>"
EVIL_NAME = '</script><img src=x onerror="document.title=1">&amp;'
B, D = 64, 256


class Evil(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module(EVIL_MODULE, nn.Linear(D, D, bias=False))
        self.head = nn.Linear(D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(getattr(self, EVIL_MODULE)(x))).square().mean()


def evil_workload() -> Workload:
    return Workload(model=Evil(), batch=(torch.randn(B, D),), name=EVIL_NAME)


@pytest.fixture(scope="module")
def evil():
    est = estimate(evil_workload(), "h100")
    result = {**estimate_dict(est), "charts": estimate_charts(est), "warnings": []}
    return est, json.loads(json.dumps(result)), H.render(result)


class Scripts(html.parser.HTMLParser):
    """The page's <script> elements (their attributes) and the text a reader sees."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict] = []
        self.text: list[str] = []
        self.tags: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "script":
            self.scripts.append(dict(attrs))
            self._in_script = True

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = False

    def handle_data(self, data):
        if not self._in_script:
            self.text.append(data)


def figures(page: str) -> dict[str, dict]:
    """{div id: the figure's JSON} as embedded in the page."""
    out, mark = {}, 'class="gobrrr-figure" data-target="'
    for chunk in page.split(mark)[1:]:
        div, rest = chunk.split('">', 1)
        out[div] = json.loads(rest.split("</script>", 1)[0])
    return out


def test_names_a_user_controls_stay_text(evil):
    _, result, page = evil
    p = Scripts()
    p.feed(page)
    # the script elements are the page's own: error catcher, plotly.js (as text, run by the
    # loader), the result, one per figure, the loader; no name opened one, none made an <img>
    kinds = [s.get("class") or s.get("id") or "inline" for s in p.scripts]
    assert kinds.count("inline") == 2
    assert kinds.count("gobrrr-plotly") == 1
    assert kinds.count("gobrrr-result") == 1
    assert kinds.count("gobrrr-figure") == len(figures(page))
    assert "img" not in p.tags
    text = "".join(p.text)
    assert EVIL_MODULE in text  # shown as typed, in the tables
    assert EVIL_NAME in text  # the title
    assert "<script>alert" not in page and "<img src=x" not in page
    # the embedded JSON reads back as the result, names intact
    embedded = page.split('id="gobrrr-result">', 1)[1].split("</script>", 1)[0]
    assert json.loads(embedded) == result
    # in the figures, plotly's own markup is escaped too (it reads <b>, <br>, &lt; in text)
    memory = next(f for d, f in figures(page).items() if d.endswith("-memory"))
    hover = " ".join(t for tr in memory["data"] for t in tr.get("text") or [])
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in hover


def test_figures_equal_the_json_and_the_prediction(evil):
    est, result, page = evil
    charts, figs = result["charts"], figures(page)
    gib = 2**30
    # memory: the stack adds up to the allocator replay's figure at every op drawn, and its
    # peak is the prediction's peak
    mem = charts["memory"]
    assert mem["total"] == [est.memory.timeline[i] for i in mem["x"]]
    for j in range(len(mem["x"])):
        assert sum(v[j] for v in mem["kinds"].values()) == mem["total"][j]
    assert max(mem["total"]) == est.memory.peak == result["memory"]["peak_bytes"]
    # the parameters' bytes as torch counts them, each rounded as the allocator rounds
    params = sum(round_alloc(p.numel() * p.element_size()) for p in Evil().parameters())
    assert set(mem["kinds"]["parameter"]) == {params}
    fig = next(f for d, f in figs.items() if d.endswith("-memory"))
    drawn = {t["name"]: t["y"] for t in fig["data"]}
    assert drawn["allocated"] == pytest.approx([v / gib for v in mem["total"]], abs=1e-6)
    assert drawn["peak"] == pytest.approx([est.memory.peak / gib], abs=1e-9)
    # roofline: the first Linear's forward matmul does 2·B·D·D FLOPs (hand-derived)
    ops = charts["roofline"]["ops"]
    mm = [
        i
        for i, (o, m, ph) in enumerate(zip(ops["op"], ops["module"], ops["phase"], strict=True))
        if o == "aten.mm.default" and m == EVIL_MODULE and ph == "forward"
    ]
    assert [ops["flops"][i] for i in mm] == [2 * B * D * D]
    roof = next(f for d, f in figs.items() if d.endswith("-roofline"))
    xs = sorted(x for t in roof["data"] if t["mode"] == "markers" for x in t["x"])
    assert xs == pytest.approx(
        sorted(f / b for f, b in zip(ops["flops"], ops["bytes"], strict=True))
    )
    # the module tree's root is the step's busy device time
    tree = charts["modules"]
    assert tree["time_s"][tree["id"].index("")] == pytest.approx(result["time"]["device_s"])
    # the summary shows the JSON's numbers
    assert f'data-key="memory.peak_bytes" data-value="{result["memory"]["peak_bytes"]}"' in page
    assert f'data-key="time.step_s" data-value="{result["time"]["step_s"]!r}"' in page


def test_downsample_keeps_the_peak_and_every_extreme():
    values = [1000 + (i % 7) for i in range(20_000)]
    values[12_345] = 5000  # a one-op spike
    values[777] = 0  # a one-op dip
    keep = downsample(values, 100, 12_345)
    assert 12_345 in keep and 777 in keep and keep[0] == 0 and keep[-1] == 19_999
    assert len(keep) <= 2 * 100 + 3 and keep == sorted(keep)
    assert downsample([3, 1, 2], 100, 0) == [0, 1, 2]


def test_layer_class():
    assert layer_class("transformer.h.11.attn.c_attn") == "transformer.h.*.attn.c_attn"
    assert layer_class("layers.0") == "layers.*" and layer_class("0.conv") == "*.conv"
    assert layer_class("block2.fc") == "block2.fc"


def test_a_failed_write_leaves_no_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "page.html"
    real_fdopen = os.fdopen

    def half_then_fail(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)

        class Half:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def write(self, text):
                f.write(text[: len(text) // 2])
                f.flush()
                raise OSError(28, "No space left on device")

        return Half()

    monkeypatch.setattr(H.os, "fdopen", half_then_fail)
    with pytest.raises(OSError):
        H.atomic_write(target, "<html>" + "x" * 10_000)
    assert list(tmp_path.iterdir()) == []  # no page, no temp file
    target.write_text("the page before")
    with pytest.raises(OSError):
        H.atomic_write(target, "<html>" + "x" * 10_000)
    assert target.read_text() == "the page before"
    assert list(tmp_path.iterdir()) == [target]
    monkeypatch.undo()
    H.atomic_write(target, "new")
    assert target.read_text() == "new" and list(tmp_path.iterdir()) == [target]


def test_without_plotly_one_line_names_the_extra(tmp_path, monkeypatch, capsys):
    fake = tmp_path / "fake" / "plotly"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'plotly'\")\n")
    monkeypatch.syspath_prepend(str(fake.parent))
    for name in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, name)
    saved = tmp_path / "r.json"
    saved.write_text("{}")
    for args in (
        ["report", str(saved), "-o", str(tmp_path / "r.html")],
        ["estimate", "--model", "mlp", "--html", str(tmp_path / "e.html"), "--json"],
    ):
        assert main(args) == 2
        out, err = capsys.readouterr()
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "pip install 'gobrrr[report]'" in lines[0]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["fake", "r.json"]
    assert json.loads(out)["hint"].endswith("pip install 'gobrrr[report]'")


def test_report_from_saved_json_is_the_page_html_wrote(tmp_path, capsys):
    page = tmp_path / "direct.html"
    assert main(["estimate", "--model", "mlp", "--batch", "8", "--json", "--html", str(page)]) == 0
    saved = tmp_path / "mlp.json"
    saved.write_text(capsys.readouterr().out)
    assert "charts" in json.loads(saved.read_text())
    assert main(["report", str(saved)]) == 0  # default: mlp.html beside it
    assert capsys.readouterr().out.strip() == str(tmp_path / "mlp.html")
    assert (tmp_path / "mlp.html").read_text() == page.read_text()


@pytest.mark.parametrize(
    ("content", "says"),
    [("not json", "is not JSON"), ("[1, 2]", "not a result"), ('{"a": 1}', "not a gobrrr")],
)
def test_report_of_something_else_is_one_clear_error(tmp_path, capsys, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["report", str(bad), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not (tmp_path / "x.html").exists()
    with pytest.raises(GobrrrError):
        H.kind_of(json.loads(content) if content != "not json" else None)


def test_progress_goes_to_stderr_and_never_under_json(capsys):
    args = ["plan", "--model", "mlp", "--global-batch", "4", "--memory-budget", "4GiB"]
    main(args)
    out, err = capsys.readouterr()
    assert "gobrrr: costing" in err and "gobrrr: costing" not in out
    last = [x for x in err.splitlines() if x.startswith("gobrrr: costing")][-1]
    done, total = last.rsplit(" ", 1)[1].split("/")
    assert done == total
    main([*args, "--json"])
    out, err = capsys.readouterr()
    assert "gobrrr: costing" not in err and "gobrrr: tracing" not in err
    json.loads(out)


def test_progress_rewrites_one_line_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    s = Tty()
    p = Progress("costing", stream=s)
    for i in range(1, 4):
        p(i, 3)
    assert s.getvalue() == "".join(f"\r\033[Kgobrrr: costing {i}/3" for i in range(1, 4)) + "\n"
    log = io.StringIO()
    p = Progress("costing", stream=log, every=3600)
    for i in range(1, 6):
        p(i, 5)
    assert log.getvalue() == "gobrrr: costing 1/5\ngobrrr: costing 5/5\n"


def test_a_multi_gpu_plan_page_and_one_without_the_step_as_given(tmp_path, capsys):
    """plan --gpus: the page and its charts come from the sharded graphs; a data-parallel
    search that never costed the step as given (a 70B over 64 GPUs) still gets its page."""
    page = tmp_path / "plan.html"
    args = ["plan", "--model", "mlp", "--global-batch", "8", "--gpus", "4", "--json"]
    assert main([*args, "--html", str(page)]) == 0
    data = json.loads(capsys.readouterr()[0])
    assert data["best"]["parallel"].startswith(("DDP x4", "FSDP2 x4"))
    chosen = data["charts"]["memory"]["chosen"]
    # the chosen plan's memory series is its sharded step's: its peak is the plan's
    assert chosen["peak"]["bytes"] == data["best"]["peak_bytes"]
    assert "<svg" in page.read_text() or "plotly" in page.read_text()
    data["user"] = None
    data["charts"]["candidates"]["user"] = None
    data["charts"]["memory"].pop("as given", None)
    other = tmp_path / "no_user.html"
    H.write_html(data, str(other))
    assert "not costed" in other.read_text()
