"""One self-contained HTML page per result: `gobrrr estimate|profile|plan --html FILE` and
`gobrrr report result.json -o FILE`.

The page is drawn from the result's JSON alone (the `--json` output, with its "charts"), so
a page made later from a saved result is the page the command would have written. plotly.js
is embedded once, inline: the page opens offline and fetches nothing. The result is embedded
too (`<script type="application/json" id="gobrrr-result">`), its `<`, `>` and `&` written as
JSON escapes, as plotly writes its figures: no name a user controls can close the tag.
The page's text paints first; the charts on the first screen are drawn once plotly.js has run,
the others when scrolled near or when the browser is idle (`LOADER`). The page marks when its
first screen is drawn (`<body data-first-ms>`, ms from navigation) and when every chart is
(`data-rendered=N`, `data-render-ms`; plotly.js run at `data-scripts-ms`), and shows any
script error in a banner (`#gobrrr-errors`).
"""

from __future__ import annotations

import html
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gobrrr.errors import GobrrrError

EXTRA = "pip install 'gobrrr[report]'"

STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222}
header{background:#1b2a3a;color:#fff;padding:14px 28px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#c8d3de}nav{margin-top:8px}nav a{color:#9ecbff;margin-right:14px}
main{max-width:1200px;margin:0 auto;padding:0 28px 40px}section{padding-top:18px}
h2{border-bottom:1px solid #ddd;padding-bottom:4px}.facts{display:grid;
grid-template-columns:repeat(auto-fill,minmax(230px,1fr));gap:10px 18px;margin:0}
.fact dt{color:#666;font-size:12px}.fact dd{margin:0;font-size:17px;font-weight:600}
.fact dd small{font-weight:400;color:#666;font-size:12px}meter{width:100%}
table{border-collapse:collapse;margin:10px 0;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 10px;text-align:left}
td.n,th.n{text-align:right;font-variant-numeric:tabular-nums}.chart{min-height:200px}
.note{color:#555}#gobrrr-errors{background:#fdd;color:#900;padding:8px 28px}
"""

# records script errors before plotly.js runs; shows them once the page is there
CATCH = """window.gobrrrErrors=[];window.addEventListener('error',function(e){
window.gobrrrErrors.push(String(e.message));var b=document.getElementById('gobrrr-errors');
if(b){b.hidden=false;b.textContent='a chart failed: '+window.gobrrrErrors.join('; ');
document.body.dataset.errors=String(window.gobrrrErrors.length);}});"""

# Draws the charts. plotly.js (4.8 MB) waits in a `text/plain` script until the page's text
# has painted, then runs; the charts on the first screen are drawn at once, the others when
# scrolled near (IntersectionObserver) or when the browser is idle, one per idle spell, so
# the page opens (first screen drawn, input answered) before plotly has drawn every chart.
# A treemap is drawn first with only the levels its first view shows (its `maxdepth`: plotly
# lays out every node whatever the depth shown, 5x the time for the 966 modules of a 70B
# model); the first click on it draws the whole tree from the node clicked.
# Marks on <body>: data-scripts-ms (plotly.js run), data-first-ms (first screen drawn and
# painted), data-render-ms and data-rendered=N (every chart drawn); per chart data-draw-ms.
LOADER = """(function(){var B=document.body,W=window,all=[].slice.call(
document.querySelectorAll('script.gobrrr-figure')),left=all.length,idle=W.requestIdleCallback||
function(f){return setTimeout(f,30);},io=null;
function now(){return String(Math.round(performance.now()));}
function fail(e){W.dispatchEvent(new ErrorEvent('error',{message:String(e)}));}
function after_paint(f){requestAnimationFrame(function(){setTimeout(f,0);});}
function draw(e){if(e.gobrrrDrawn)return e.gobrrrDrawn;if(io)io.unobserve(e.gobrrrDiv);
var d=e.gobrrrDiv,f=JSON.parse(e.textContent),t=performance.now(),data=first_view(f.data);
return e.gobrrrDrawn=Plotly.newPlot(d,data,f.layout,{responsive:true,displaylogo:false}).then(
function(g){if(data!==f.data)whole_on_click(d,f);d.dataset.traces=String(g.data.length);d.dataset.drawMs=String(Math.round(
performance.now()-t));if(--left===0){B.dataset.renderMs=now();B.dataset.rendered=String(
all.length);}},fail);}
function first_view(data){var t=data[0],n=t&&t.type==='treemap'&&t.maxdepth>0&&t.ids?
t.ids.length:0,ix={},dp={},keep=[],c={},k,i;if(!n)return data;
t.ids.forEach(function(x,i){ix[x]=i;});function depth(i){if(dp[i]===undefined){var p=t.parents[i];
dp[i]=p&&ix[p]!==undefined?depth(ix[p])+1:0;}return dp[i];}
for(i=0;i<n;i++)if(depth(i)<t.maxdepth)keep.push(i);if(keep.length===n)return data;
for(k in t)c[k]=Array.isArray(t[k])&&t[k].length===n?keep.map(function(i){return t[k][i];}):t[k];
return [c].concat(data.slice(1));}
function whole_on_click(d,f){d.on('plotly_treemapclick',function(ev){if(d.dataset.whole)return;
d.dataset.whole='1';var t={},k,p=ev.points[0];for(k in f.data[0])t[k]=f.data[0][k];
t.level=p.id||d.data[0].ids[p.pointNumber];Plotly.react(d,[t].concat(f.data.slice(1)),f.layout);
return false;});}
function next(){var e=all.filter(function(x){return !x.gobrrrDrawn;})[0];if(e){draw(e);idle(next);}}
function rest(){B.dataset.firstMs=now();if(W.IntersectionObserver){io=new IntersectionObserver(
function(es){es.forEach(function(x){if(x.isIntersecting)draw(x.target.gobrrrFigure);});},
{rootMargin:'300px'});all.forEach(function(e){if(!e.gobrrrDrawn)io.observe(e.gobrrrDiv);});}
idle(next);}
function start(){B.dataset.scriptsMs=now();var first=[];all.forEach(function(e){var d=e.gobrrrDiv=
document.getElementById(e.dataset.target),r=d.getBoundingClientRect();d.gobrrrFigure=e;
if(r.bottom>0&&r.top<innerHeight){d.dataset.first='1';first.push(draw(e));}});
W.addEventListener('beforeprint',function(){all.forEach(draw);});
Promise.all(first).then(function(){after_paint(rest);});}
after_paint(function(){var s=document.createElement('script');s.text=document.getElementById(
'gobrrr-plotly').textContent;document.head.appendChild(s);if(W.Plotly)start();});})();"""


# V8's explicit compile hint (Chrome 136+; a comment elsewhere): compile plotly.js's functions
# with the script rather than each on its first call (parsed once, not pre-parsed then parsed
# again): ~100 ms less on the main thread of a cold load here, its total CPU no higher
COMPILE_HINT = "//# allFunctionsCalledOnLoad\n"


@dataclass
class Section:
    """One part of the page: its anchor, heading, HTML (escaped by its maker) and figures."""

    id: str
    title: str
    body: str = ""
    figures: list[tuple[str, Any]] = field(default_factory=list)  # (div id, go.Figure)

    def figure(self, name: str, fig: Any, caption: str = "") -> None:
        div = f"fig-{self.id}-{len(self.figures)}-{name}"
        self.figures.append((div, fig))
        # its height kept before it is drawn, so drawing it later moves nothing else
        height = getattr(fig.layout, "height", None) or 450  # plotly's default, px
        self.body += f'<div class="chart" id="{div}" style="min-height:{height}px"></div>'
        if caption:
            self.body += f'<p class="note">{caption}</p>'


def require_plotly() -> None:
    """A GobrrrError naming the extra when plotly is not installed (checked before the work
    starts)."""
    try:
        import plotly.graph_objects  # noqa: F401
    except ImportError:
        raise GobrrrError(
            "--html and `gobrrr report` draw their charts with plotly, which is not installed",
            hint=f"install the report extra: {EXTRA}",
        ) from None


def kind_of(result: dict[str, Any]) -> str:
    """ "estimate", "plan" or "profile": which command's `--json` output `result` is."""
    if not isinstance(result, dict) or "error" in result:
        raise GobrrrError(
            "not a result: the JSON is "
            + ("an error's" if isinstance(result, dict) else f"a {type(result).__name__}"),
            hint="give the output of `gobrrr estimate|profile|plan --json` (saved to a file)",
        )
    for kind, keys in (("plan", ("plans", "user")), ("profile", ("profile",))):
        if all(k in result for k in keys):
            return kind
    if all(k in result for k in ("memory", "time", "gpu")):
        return "estimate"
    raise GobrrrError(
        f"not a gobrrr result: the JSON has keys {', '.join(sorted(result)[:6])}",
        hint="give the output of `gobrrr estimate|profile|plan --json` (saved to a file)",
    )


def render(result: dict[str, Any]) -> str:
    """The page of `result` (an estimate's, a profile's or a plan's `--json` output)."""
    require_plotly()
    from gobrrr.report import pages  # lazy: plotly

    title, subtitle, sections = pages.sections(kind_of(result), result)
    return page(title, subtitle, sections, result)


def page(title: str, subtitle: str, sections: list[Section], result: dict) -> str:
    import plotly.io as pio
    from plotly.offline import get_plotlyjs

    nav = "".join(f'<a href="#{s.id}">{html.escape(s.title)}</a>' for s in sections)
    body = "".join(
        f'<section id="{s.id}"><h2>{html.escape(s.title)}</h2>{s.body}</section>' for s in sections
    )
    figures = "".join(
        f'<script type="application/json" class="gobrrr-figure" data-target="{div}">'
        f"{pio.to_json(fig, validate=False)}</script>"
        for s in sections
        for div, fig in s.figures
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>gobrrr: {html.escape(title)}</title><style>{STYLE}</style>"
        f"<script>{CATCH}</script></head>"
        f"<body><header><h1>{html.escape(title)}</h1><p>{html.escape(subtitle)}</p>"
        f'<nav>{nav}</nav></header><div id="gobrrr-errors" hidden></div><main>{body}</main>'
        f'<script type="application/json" id="gobrrr-result">{safe_json(result)}</script>'
        f'{figures}<script type="text/plain" id="gobrrr-plotly">{COMPILE_HINT}{get_plotlyjs()}'
        "</script>"
        f"<script>{LOADER}</script></body></html>\n"
    )


def safe_json(data: Any) -> str:
    """JSON that cannot end a <script> element: `<`, `>` and `&` as \\u escapes (they occur
    only inside strings, where the escape means the same character)."""
    text = json.dumps(data, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_html(result: dict[str, Any], path: str | Path) -> Path:
    """Render `result` and write it to `path` atomically (a temp file in the same folder,
    then a rename): a failure leaves no file and an existing one as it was."""
    text = render(result)
    return atomic_write(path, text)


def atomic_write(path: str | Path, text: str) -> Path:
    """Write `text` to a temp file beside `path`, then rename it over `path`; on any error
    (Ctrl-C included) the temp file is removed and `path` is untouched."""
    path = Path(path).expanduser()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_result(path: str | Path) -> dict[str, Any]:
    """A saved `--json` output; a GobrrrError naming the file when it cannot be read."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise GobrrrError(
            f"cannot read {path}: {why}", hint="give a saved `--json` output"
        ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GobrrrError(
            f"{path} is not JSON ({e.msg} at line {e.lineno})",
            hint="save a command's output with `gobrrr estimate ... --json > result.json`",
        ) from None
