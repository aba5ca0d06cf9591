"""The report's charts as plotly figures, each drawn from a result's JSON data only.

Text a user controls (module and op names, workload names, plan phrases) is HTML-escaped
before it reaches a figure: plotly reads a small set of HTML tags in its text, so a module
named `<b>x</b>` would render bold and `&lt;` as `<`; escaped, every name shows as typed.
"""

from __future__ import annotations

import html
from typing import Any

import plotly.graph_objects as go

from gobrrr.report.terminal import human_count, human_time, op_label

GiB = 2**30
REGIME_COLOURS = {
    "compute": "#2c7fb8",
    "memory": "#e6550d",
    "overhead": "#969696",
    "comm": "#8856a7",
    "none": "#d9d9d9",
}
KIND_COLOURS = {
    "parameter": "#4c72b0",
    "buffer": "#64b5cd",
    "gradient": "#dd8452",
    "optimizer_state": "#c44e52",
    "input": "#8172b3",
    "activation": "#55a868",
    "temporary": "#ccb974",
    "workspace": "#8c8c8c",
}
PHASE_COLOURS = {
    "forward": "rgba(44,127,184,0.08)",
    "backward": "rgba(230,85,13,0.08)",
    "recompute": "rgba(136,86,167,0.10)",
    "optimizer": "rgba(85,168,104,0.10)",
}
LAYOUT = dict(template="plotly_white", margin=dict(l=70, r=30, t=50, b=50), height=460)


def gib_values(values: list[int]) -> list[float]:
    """Bytes as GiB to the KiB (the charts' resolution; the JSON keeps the bytes)."""
    return [round(v / GiB, 6) for v in values]


def esc(text: Any) -> str:
    """A user's text as plotly shows it literally."""
    return html.escape(str(text), quote=False)


# ------------------------------------------------------------------------------- roofline
def roofline_figure(data: dict[str, Any], title: str, measured: bool = False) -> go.Figure:
    """Ops at their arithmetic intensity (FLOP/byte) and FLOP/s, marker area = time, colour
    = regime, under the compute roofs and the bandwidth roofs (`charts.roofline`'s data)."""
    ops = data["ops"]
    fig = go.Figure()
    if not ops.get("op"):
        return _empty(fig, title, "no op with FLOPs to place on the roofline")
    x = [f / b for f, b in zip(ops["flops"], ops["bytes"], strict=True)]
    y = [f / t for f, t in zip(ops["flops"], ops["time_s"], strict=True)]
    if data.get("roofs"):
        _roof_lines(fig, data["roofs"], min(x), max(x))
    biggest = max(ops["time_s"])
    for regime in sorted(set(ops["regime"])):
        idx = [i for i, r in enumerate(ops["regime"]) if r == regime]
        fig.add_trace(
            go.Scatter(
                x=[x[i] for i in idx],
                y=[y[i] for i in idx],
                mode="markers",
                name=regime,
                marker=dict(
                    size=[ops["time_s"][i] for i in idx],
                    sizemode="area",
                    sizeref=2 * biggest / 40**2,
                    sizemin=3,
                    color=REGIME_COLOURS.get(regime, "#636363"),
                    opacity=0.7,
                    line=dict(width=0.5, color="#333"),
                ),
                text=[_op_hover(ops, i, x[i], y[i]) for i in idx],
                hovertemplate="%{text}<extra></extra>",
            )
        )
    what = "measured" if measured else "predicted"
    fig.update_layout(
        title=title,
        xaxis=dict(type="log", title="arithmetic intensity (FLOP/byte)"),
        yaxis=dict(type="log", title=f"{what} FLOP/s"),
        **LAYOUT,
    )
    return fig


def _op_hover(ops: dict, i: int, x: float, y: float) -> str:
    count = ops["count"][i]
    return "<br>".join(
        (
            f"<b>{esc(op_label(ops['op'][i]))}</b>" + (f" x{count}" if count > 1 else ""),
            f"module {esc(ops['module'][i] or '<top>')}",
            f"{esc(ops['phase'][i])}, {esc(ops['math'][i])}, {esc(ops['regime'][i])}-bound",
            f"time {human_time(ops['time_s'][i])}",
            f"FLOPs {human_count(ops['flops'][i])}, bytes {human_count(ops['bytes'][i])}",
            f"{x:.1f} FLOP/byte, {human_count(y)}FLOP/s",
        )
    )


def _roof_lines(fig: go.Figure, roofs: dict, lo: float, hi: float) -> None:
    """Each compute roof under the first (measured) bandwidth roof, and the other bandwidth
    roofs dashed, over the intensities shown (with the ridge points)."""
    bandwidths = list(roofs["bandwidth"].items())
    peak = max(roofs["compute"].values())
    ridges = [c / bw for _, bw in bandwidths for c in roofs["compute"].values()]
    lo, hi = min([lo, *ridges]) / 4, max([hi, *ridges]) * 4
    xs = [lo * (hi / lo) ** (k / 80) for k in range(81)]
    name_bw, bw = bandwidths[0]
    for name, c in roofs["compute"].items():
        pts = sorted({*xs, c / bw})
        fig.add_trace(
            go.Scatter(
                x=pts,
                y=[min(c, bw * v) for v in pts],
                mode="lines",
                name=f"roof: {name} / {name_bw}",
                line=dict(color="#252525", width=1.5),
                hovertemplate=f"{esc(name)}: {human_count(c)}FLOP/s<br>{esc(name_bw)}: "
                f"{bw / 1e12:.2f} TB/s<br>ridge {c / bw:.0f} FLOP/byte<extra></extra>",
            )
        )
    for name, b in bandwidths[1:]:
        pts = [v for v in xs if b * v <= peak]
        fig.add_trace(
            go.Scatter(
                x=pts,
                y=[b * v for v in pts],
                mode="lines",
                name=f"roof: {name}",
                line=dict(color="#737373", width=1, dash="dash"),
                hovertemplate=f"{esc(name)}: {b / 1e12:.2f} TB/s<extra></extra>",
            )
        )


# -------------------------------------------------------------------------------- memory
def memory_figure(series: dict[str, Any], title: str) -> go.Figure:
    """Bytes allocated over the step's ops stacked by kind, the peak marked with its op,
    module and what is alive there, the reserved peak and the budget as lines, the phases
    shaded (`charts.memory_series`'s data)."""
    fig = go.Figure()
    x = series["x"]
    for kind, ys in series["kinds"].items():
        name = kind.replace("_", " ") + (", scratch, rounding" if kind == "workspace" else "")
        fig.add_trace(
            go.Scatter(
                x=x,
                y=gib_values(ys),
                name=name,
                stackgroup="memory",
                mode="lines",
                line=dict(width=0.5, color=KIND_COLOURS.get(kind)),
                hovertemplate=esc(name) + " %{y:.3f} GiB<extra></extra>",
            )
        )
    fig.add_trace(  # the allocator's total, which the stack adds up to: the ops in the hover
        go.Scatter(
            x=x,
            y=gib_values(series["total"]),
            name="allocated",
            mode="lines",
            line=dict(width=1, color="#252525"),
            text=[
                f"op {i}: {esc(op_label(o))} in {esc(m or '<top>')}"
                for i, o, m in zip(x, series["op"], series["module"], strict=True)
            ],
            hovertemplate="%{text}<br>allocated %{y:.3f} GiB<extra></extra>",
        )
    )
    _phase_shading(fig, series["phases"], lambda i: i)
    _peak_marker(fig, series)
    _lines(fig, series["reserved_bytes"], _near(series["budget_bytes"], series["reserved_bytes"]))
    fig.update_layout(
        title=title,
        xaxis=dict(title="op index (the step's ops in the order they run)"),
        yaxis=dict(title="allocated (GiB)"),
        hovermode="x unified",
        **LAYOUT,
    )
    return fig


def _near(budget: int | None, reserved: int) -> int | None:
    """The budget where drawing it leaves the curve readable (within 2x the reserved peak);
    the page states it in words either way."""
    return budget if budget and reserved and budget <= 2 * reserved else None


def _peak_marker(fig: go.Figure, series: dict) -> None:
    p = series["peak"]
    alive = "<br>".join(
        f"  {esc(k.replace('_', ' '))}: {v / GiB:.3f} GiB"
        for k, v in sorted(p["at_peak"].items(), key=lambda kv: -kv[1])
        if v
    )
    where = f"{esc(op_label(p['op']))} in {esc(p['module'] or '<top>')} ({esc(p['phase'])})"
    x = max(p["index"], 0)
    fig.add_trace(
        go.Scatter(
            x=[x],
            y=[p["bytes"] / GiB],
            mode="markers",
            name="peak",
            marker=dict(symbol="triangle-down", size=13, color="#cb181d"),
            hovertemplate=f"<b>peak {p['bytes'] / GiB:.3f} GiB</b> at op {p['index']}: "
            f"{where}<br>alive:<br>{alive}<extra></extra>",
        )
    )
    fig.add_annotation(
        x=x, y=p["bytes"] / GiB, text=f"peak {p['bytes'] / GiB:.2f} GiB: {where}", ay=-36
    )


def _lines(fig: go.Figure, reserved: int | None, budget: int | None) -> None:
    for value, name, dash in ((reserved, "reserved peak", "dash"), (budget, "GPU budget", "dot")):
        if value:
            fig.add_hline(
                y=value / GiB,
                line=dict(dash=dash, color="#252525", width=1),
                annotation_text=f"{name} {value / GiB:.2f} GiB",
                annotation_position="top left",
            )


def _phase_shading(fig: go.Figure, phases: list, at) -> None:
    seen = set()
    for phase, first, last in phases:
        fig.add_vrect(
            x0=at(first) - 0.5,
            x1=at(last) + 0.5,
            fillcolor=PHASE_COLOURS.get(phase, "rgba(0,0,0,0.04)"),
            line_width=0,
            layer="below",
            annotation_text=esc(phase) if phase not in seen else None,
            annotation_position="bottom left",
        )
        seen.add(phase)


def memory_pair_figure(pair: dict[str, dict], budget: int, title: str) -> go.Figure:
    """Two configurations' allocated bytes over the share of their step's ops (their ops
    differ: checkpointing recomputes, accumulation repeats), each with its reserved peak,
    and the plan's budget (bytes)."""
    fig = go.Figure()
    colours = ("#737373", "#2c7fb8", "#e6550d")
    for (name, s), colour in zip(pair.items(), colours, strict=False):
        n = max(s["ops"] - 1, 1)
        fig.add_trace(
            go.Scatter(
                x=[i / n for i in s["x"]],
                y=gib_values(s["total"]),
                mode="lines",
                name=f"{esc(name)}: peak {s['peak']['bytes'] / GiB:.2f} GiB",
                line=dict(color=colour, width=1.5),
                text=[f"op {i}: {esc(op_label(o))}" for i, o in zip(s["x"], s["op"], strict=True)],
                hovertemplate="%{text}<br>%{y:.3f} GiB<extra>" + esc(name) + "</extra>",
            )
        )
        fig.add_hline(
            y=s["reserved_bytes"] / GiB,
            line=dict(dash="dash", color=colour, width=1),
            annotation_text=f"{esc(name)}: reserved {s['reserved_bytes'] / GiB:.2f} GiB",
            annotation_position="top left",
        )
    _lines(fig, None, budget)
    fig.update_layout(
        title=title,
        xaxis=dict(title="share of the step's ops", tickformat=".0%"),
        yaxis=dict(title="allocated (GiB)"),
        **LAYOUT,
    )
    return fig


# ---------------------------------------------------------------------------------- time
def treemap_figure(tree: dict[str, Any], root: str, title: str) -> go.Figure:
    """Time by module, every module inside the one above it (click to drill down)."""
    total = tree["time_s"][tree["id"].index("")] if "" in tree["id"] else sum(tree["time_s"])
    labels = [esc(i.rpartition(".")[2]) if i else esc(root) for i in tree["id"]]
    text = [
        f"{esc(i or root)}<br>{human_time(t)} ({t / total:.1%})" if total else esc(i)
        for i, t in zip(tree["id"], tree["time_s"], strict=True)
    ]
    fig = go.Figure(
        go.Treemap(
            ids=[f"m:{i}" for i in tree["id"]],
            parents=["" if p is None else f"m:{p}" for p in tree["parent"]],
            labels=labels,
            values=tree["time_s"],
            branchvalues="total",
            text=text,
            hovertemplate="%{text}<extra></extra>",
            textinfo="label+percent root",
            maxdepth=3,
        )
    )
    fig.update_layout(title=title, **{**LAYOUT, "margin": dict(l=10, r=10, t=50, b=10)})
    return fig


def bars_figure(
    rows: dict[str, float], title: str, axis: str, unit: str = "s", colours=None
) -> go.Figure:
    """One horizontal bar per name, largest on top (seconds or a share)."""
    items = sorted(rows.items(), key=lambda kv: kv[1])
    fmt = human_time if unit == "s" else (lambda v: f"{v:.1%}")
    scale = 1e3 if unit == "s" else 1.0  # seconds drawn in ms
    fig = go.Figure(
        go.Bar(
            x=[v * scale for _, v in items],
            y=[esc(k) for k, _ in items],
            orientation="h",
            text=[fmt(v) for _, v in items],
            textposition="auto",
            marker_color=[(colours or {}).get(k, "#2c7fb8") for k, _ in items],
            hovertemplate="%{y}: %{text}<extra></extra>",
        )
    )
    layout = {**LAYOUT, "height": max(220, 40 + 28 * len(items))}
    fig.update_layout(title=title, xaxis=dict(title=axis), **layout)
    return fig


def compare_figure(rows: list[dict], title: str) -> go.Figure:
    """Predicted beside measured seconds per group, the relative error in the hover."""
    rows = rows[:25]
    names = [esc(r["name"]) for r in rows]
    err = [
        "no measurement" if r["rel_error"] is None else f"error {r['rel_error']:+.1%}" for r in rows
    ]
    fig = go.Figure()
    for key, name, colour in (
        ("predicted_s", "predicted", "#2c7fb8"),
        ("measured_s", "measured", "#e6550d"),
    ):
        fig.add_trace(
            go.Bar(
                x=names,
                y=[r[key] * 1e3 for r in rows],
                name=name,
                marker_color=colour,
                text=err,
                textposition="none",
                hovertemplate="%{x}: %{y:.3f} ms<br>%{text}<extra>" + name + "</extra>",
            )
        )
    fig.update_layout(title=title, barmode="group", yaxis=dict(title="ms"), **LAYOUT)
    return fig


def timeline_figure(phases: dict[str, Any], step_s: float, title: str) -> go.Figure:
    """The phases over the predicted step and the collectives on the comm stream (ms)."""
    fig = go.Figure()
    for phase, start, end in phases["spans"]:
        fig.add_trace(_span("compute", start, end, phase, PHASE_COLOURS.get(phase)))
    for start, end, index in phases["comm"]:
        fig.add_trace(_span("comm", start, end, f"collective (op {index})", "#8856a7"))
    fig.update_layout(
        title=title,
        barmode="overlay",
        showlegend=False,
        xaxis=dict(title="ms into the step", range=[0, step_s * 1e3]),
        **{**LAYOUT, "height": 240},
    )
    return fig


def _span(row: str, start: float, end: float, name: str, colour: str | None) -> go.Bar:
    solid = (colour or "#2c7fb8").replace("0.08", "0.7").replace("0.10", "0.7")
    return go.Bar(
        y=[row],
        x=[(end - start) * 1e3],
        base=[start * 1e3],
        text=[esc(name)],
        textposition="inside",
        orientation="h",
        marker=dict(color=solid, line=dict(width=0.5, color="#333")),
        name=esc(name),
        hovertemplate=f"{esc(name)}: {start * 1e3:.3f} to {end * 1e3:.3f} ms<extra></extra>",
    )


# ---------------------------------------------------------------------------------- plan
def candidates_figure(c: dict[str, list], budget: int, usable: int, title: str) -> go.Figure:
    """Every configuration costed: reserved peak against throughput, those that fit apart,
    the budget as a line, the chosen plan and the step as given marked."""
    fig = go.Figure()
    unit = c["unit"]
    for fits, name, colour in ((True, "fits", "#2c7fb8"), (False, "does not fit", "#bdbdbd")):
        idx = [i for i, f in enumerate(c["fits"]) if f == fits]
        fig.add_trace(_candidates(c, idx, name, dict(color=colour, size=8, opacity=0.75), unit))
    for key, name, marker in (
        ("user", "as given", dict(symbol="diamond", size=14, color="#525252")),
        ("chosen", "chosen", dict(symbol="star", size=18, color="#e6550d")),
    ):
        if c.get(key) is not None:
            fig.add_trace(_candidates(c, [c[key]], name, marker, unit))
    fig.add_vline(
        x=budget / GiB,
        line=dict(dash="dot", color="#252525"),
        annotation_text=f"budget {budget / GiB:.1f} GiB",
    )
    if usable != budget:
        fig.add_vline(
            x=usable / GiB,
            line=dict(dash="dash", color="#737373"),
            annotation_text=f"less the margin {usable / GiB:.1f} GiB",
        )
    fig.update_layout(
        title=title,
        xaxis=dict(title="predicted reserved peak (GiB)"),
        yaxis=dict(title=f"{unit}/s"),
        **LAYOUT,
    )
    return fig


def _candidates(c: dict, idx: list[int], name: str, marker: dict, unit: str) -> go.Scatter:
    return go.Scatter(
        x=[c["reserved_bytes"][i] / GiB for i in idx],
        y=[c["per_s"][i] for i in idx],
        mode="markers",
        name=name,
        marker=marker,
        text=[
            f"<b>{esc(c['changes'][i] or 'as given')}</b><br>{c['per_s'][i]:,.0f} {unit}/s, "
            f"step {human_time(c['step_s'][i])}<br>peak {c['peak_bytes'][i] / GiB:.2f} GiB, "
            f"reserved {c['reserved_bytes'][i] / GiB:.2f} GiB"
            for i in idx
        ],
        hovertemplate="%{text}<extra>" + name + "</extra>",
    )


def _empty(fig: go.Figure, title: str, why: str) -> go.Figure:
    fig.add_annotation(text=esc(why), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, **{**LAYOUT, "height": 200})
    return fig
