"""The sections of each page: an estimate's, a profile's and a plan's, from their JSON.

Every value shown in a summary carries the JSON's number beside its text
(`<dd data-key="memory.peak_bytes" data-value="...">`), so what the page says can be held
against the JSON it was drawn from. Every text a user controls is escaped here.
"""

from __future__ import annotations

import html
from typing import Any

from gobrrr.errors import GobrrrError
from gobrrr.hardware import get_gpu
from gobrrr.report import figures as F
from gobrrr.report.charts import op_points, roofs
from gobrrr.report.html import Section
from gobrrr.report.terminal import human_count, human_time, op_label

GiB = 2**30
TOP = 15


def sections(kind: str, r: dict[str, Any]) -> tuple[str, str, list[Section]]:
    """(title, subtitle, sections) of the page of a `kind` result."""
    return {"estimate": estimate_page, "profile": profile_page, "plan": plan_page}[kind](r)


# ------------------------------------------------------------------------------ helpers
def e(text: Any) -> str:
    return html.escape(str(text))


def fact(label: str, key: str, value: Any, text: str, small: str = "") -> str:
    """One summary figure: its text, and the JSON's value it shows (`data-value`)."""
    extra = f" <small>{e(small)}</small>" if small else ""
    return (
        f'<div class="fact"><dt>{e(label)}</dt><dd data-key="{e(key)}" '
        f'data-value="{e(_plain(value))}">{e(text)}{extra}</dd></div>'
    )


def _plain(v: Any) -> str:
    return "" if v is None else repr(v) if isinstance(v, float) else str(v)


def facts(*items: str) -> str:
    return '<dl class="facts">' + "".join(items) + "</dl>"


def table(headers: list[str], rows: list[list[Any]], numeric: set[int] = frozenset()) -> str:
    """An HTML table; every cell escaped; columns in `numeric` right-aligned."""

    def cells(tag: str, row: list[Any]) -> str:
        return "".join(
            f"<{tag}{' class=n' if i in numeric else ''}>{e(c)}</{tag}>" for i, c in enumerate(row)
        )

    head = f"<tr>{cells('th', headers)}</tr>"
    return "<table>" + head + "".join(f"<tr>{cells('td', r)}</tr>" for r in rows) + "</table>"


def items(lines: list[str], what: str) -> str:
    if not lines:
        return ""
    return f"<p>{e(what)}</p><ul>" + "".join(f"<li>{e(x)}</li>" for x in lines) + "</ul>"


def need(r: dict, key: str, what: str) -> Any:
    if key not in r:
        raise GobrrrError(
            f"the result has no {key!r}: it was saved by a gobrrr without the report's {what}",
            hint="run the command again with this gobrrr and --json (or --html)",
        )
    return r[key]


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GiB:,.2f} GiB"


# ----------------------------------------------------------------------------- estimate
def estimate_page(r: dict[str, Any]) -> tuple[str, str, list[Section]]:
    w, t, m = r["workload"], r["time"], r["memory"]
    charts = need(r, "charts", "charts")
    title = f"{w.get('name', 'step')} on {r['gpu']['name']}"
    sub = f"gobrrr estimate: predicted, {w.get('precision', '')}, {w.get('tokens', 0):,} " + (
        "tokens per step" if t.get("unit") == "tokens" else "samples per step"
    )
    out = [
        estimate_summary(r),
        roofline_section(charts["roofline"], "predicted", charts["roofline"].get("left_out_s")),
        memory_section(charts["memory"], m, r.get("parallel")),
        time_section(r, charts),
    ]
    return title, sub, out


def estimate_summary(r: dict[str, Any]) -> Section:
    w, t, m, g = r["workload"], r["time"], r["memory"], r["gpu"]
    unit = t.get("unit", "tokens")
    cal = g.get("calibration")
    note = f"calibrated: {cal}" if cal else "datasheet"
    if g.get("memory_calibration"):  # no calibration of its own: its chip's workspaces
        note += f"; workspaces as measured on the {g['memory_calibration']}"
    s = Section("summary", "Summary")
    s.body = facts(
        fact("workload", "workload.name", w.get("name"), str(w.get("name")), _workload_line(w)),
        fact("GPU", "gpu.name", g["name"], g["name"], note),
        fact("peak allocated", "memory.peak_bytes", m["peak_bytes"], gib(m["peak_bytes"])),
        fact(
            "peak reserved",
            "memory.reserved_bytes",
            m["reserved_bytes"],
            gib(m["reserved_bytes"]),
            f"of {gib(m['budget_bytes'])}: " + ("fits" if m["fits"] else "does not fit"),
        ),
        fact("step time", "time.step_s", t["step_s"], human_time(t["step_s"])),
        fact(f"{unit}/s", "time.per_s", t["per_s"], f"{t['per_s']:,.0f}"),
        fact("MFU", "time.mfu", t["mfu"], f"{t['mfu']:.1%}", f"HFU {t['hfu']:.1%}"),
        fact(
            "idle (the GPU waits for the host)",
            "time.idle_s",
            t["idle_s"],
            human_time(t["idle_s"]),
            f"host issues for {human_time(t['host_s'])}",
        ),
    )
    if m.get("budget_bytes"):
        s.body += (
            f'<p>reserved peak against the GPU\'s budget: <meter min="0" '
            f'max="{m["budget_bytes"]}" value="{m["reserved_bytes"]}"></meter></p>'
        )
    if par := r.get("parallel"):
        s.body += facts(
            fact("GPUs", "parallel.gpus", par["gpus"], f"{par['gpus']} ({par['kind']})"),
            fact(
                "job tokens/s",
                "parallel.tokens_per_s_job",
                par["tokens_per_s_job"],
                f"{par['tokens_per_s_job']:,.0f}",
            ),
        )
    s.figure(
        "regimes",
        F.bars_figure(
            t["regime_share"], "share of the step by regime", "share", "share", F.REGIME_COLOURS
        ),
    )
    s.body += items(r.get("assumptions", []), "What the trace assumed:")
    s.body += items(r.get("hints", []), "What would help:")
    s.body += items(r.get("warnings", []), "Warnings:")
    return s


def _workload_line(w: dict) -> str:
    parts = [w.get("precision", "")]
    if w.get("seq_len"):
        parts.append(f"seq {w['seq_len']}")
    if w.get("params"):
        parts.append(f"{human_count(w['params'])} parameters")
    if w.get("checkpointing") not in (None, "none"):
        parts.append(f"checkpointing {w['checkpointing']}")
    if w.get("compiled"):
        parts.append("compiled")
    return ", ".join(p for p in parts if p)


def roofline_section(data: dict, what: str, left_out_s: float | None = None) -> Section:
    s = Section("roofline", "Roofline")
    grouped = "op classes (one op in one phase across layers)" if data["grouped"] else "ops"
    s.figure(
        "roofline",
        F.roofline_figure(data, f"{what} {grouped}", measured=what == "measured"),
        f"Each marker is one of the step's {e(grouped)}: its FLOPs per byte moved against "
        f"the FLOP/s it {'achieved' if what == 'measured' else 'is predicted to achieve'}; "
        "marker area is its time, colour its regime. Lines: the GPU's compute roofs under "
        "its bandwidth roof; left of a ridge an op cannot be compute-bound."
        + (
            f" Not shown: ops without FLOPs (copies, views), {human_time(left_out_s)}."
            if left_out_s
            else ""
        ),
    )
    return s


def memory_section(series: dict, m: dict, par: dict | None = None) -> Section:
    s = Section("memory", "Memory")
    p = series["peak"]
    rank = f" of one rank (each of {par['gpus']}, {par['kind']})" if par else ""
    s.figure(
        "memory",
        F.memory_figure(series, f"allocated over the step{rank}, by kind"),
        f"{len(series['x']):,} of the step's {series['ops']:,} ops drawn (the peak and each "
        "stretch's lowest and highest kept). Reserved: the caching allocator's segments at "
        f"their peak; the GPU's budget is {gib(m['budget_bytes'])}.",
    )
    rows = [[k.replace("_", " "), gib(v)] for k, v in sorted(p["at_peak"].items(), key=_big) if v]
    s.body += f"<p>Alive at the peak (op {p['index']}, {e(op_label(p['op']))} in "
    s.body += f"{e(p['module'] or '<top>')}, {e(p['phase'])}):</p>"
    s.body += table(["kind", "bytes"], rows, {1})
    mods = list((m.get("at_peak_by_module") or {}).items())[:TOP]
    if mods:
        s.body += "<p>Activations and temporaries at the peak, by module:</p>"
        s.body += table(["module", "bytes"], [[k, gib(v)] for k, v in mods], {1})
    return s


def _big(kv: tuple) -> float:
    return -kv[1]


def time_section(r: dict, charts: dict) -> Section:
    t = r["time"]
    s = Section("time", "Time")
    root = r["workload"].get("name", "step")
    s.figure("modules", F.treemap_figure(charts["modules"], root, "device time by module"))
    rows = {**t["phase_s"], "idle (device waits for the host)": t["idle_s"]}
    par = r.get("parallel")
    if par:
        rows["comm overlapped"] = par["overlapped_comm_s"]
        rows["comm exposed"] = par["exposed_comm_s"]
    s.figure("phases", F.bars_figure(rows, "device time by phase", "ms"))
    title = "the step in time" + (": compute and the collectives (one rank)" if par else "")
    s.figure("timeline", F.timeline_figure(charts["phases"], t["step_s"], title))
    s.body += f"<p>Host: {human_time(t['host_s'])} to issue the step's ops; "
    s.body += f"device busy {human_time(t['device_s'])} of {human_time(t['step_s'])}.</p>"
    s.body += "<p>Top ops by predicted time:</p>" + ops_table(r["top_ops"])
    return s


def ops_table(ops: list[dict]) -> str:
    rows = [
        [
            op_label(o["op"]),
            o["module"] or "<top>",
            o["phase"],
            o["regime"],
            human_time(o["device_s"]),
            human_count(o["flops"]),
            human_count(o["bytes"]),
        ]
        for o in ops[:TOP]
    ]
    headers = ["op", "module", "phase", "regime", "time", "FLOPs", "bytes"]
    return table(headers, rows, {4, 5, 6})


# ------------------------------------------------------------------------------ profile
def profile_page(r: dict[str, Any]) -> tuple[str, str, list[Section]]:
    p = r["profile"]
    title = f"{p['workload']} on {p['device_name']}"
    sub = f"gobrrr profile: measured, {p['precision']}, {p['units_per_step']:,} {p['unit']}/step"
    out = [profile_summary(r), roofline_section(measured_roofline(p), "measured")]
    out.append(profile_time(p))
    if "compare" in r:
        out.append(compare_section(r["compare"]))
    return title, sub, out


def profile_summary(r: dict) -> Section:
    p = r["profile"]
    s = Section("summary", "Summary")
    mfu = p.get("mfu")
    s.body = facts(
        fact("workload", "profile.workload", p["workload"], p["workload"], p["label"]),
        fact("device", "profile.device_name", p["device_name"], p["device_name"], p["gpu"]),
        fact("step time", "profile.step_s", p["step_s"], human_time(p["step_s"]), "median"),
        fact(f"{p['unit']}/s", "profile.per_s", p["per_s"], f"{p['per_s']:,.0f}"),
        fact("MFU", "profile.mfu", mfu, "n/a" if mfu is None else f"{mfu:.1%}"),
        fact(
            "peak allocated",
            "profile.peak_allocated",
            p["peak_allocated"],
            gib(p["peak_allocated"]),
        ),
        fact("peak reserved", "profile.peak_reserved", p["peak_reserved"], gib(p["peak_reserved"])),
        fact(
            "idle", "profile.idle_s", p["idle_s"], human_time(p["idle_s"]), f"{p['idle_share']:.0%}"
        ),
    )
    if c := r.get("compare"):
        err = c["step"]["rel_error"]
        s.body += facts(
            fact(
                "prediction's error",
                "compare.step.rel_error",
                err,
                "n/a" if err is None else f"{err:+.1%}",
                f"predicted {human_time(c['step']['predicted_s'])}",
            )
        )
    s.body += items([f"{f['title']}: {f['remedy']}" for f in p.get("diagnosis", [])], "Findings:")
    return s


def measured_roofline(p: dict) -> dict:
    """The measured ops with FLOPs as roofline points, under the datasheet roofs of the GPU
    the profile names (none on a CPU)."""
    rows = [
        (
            o["op"],
            o["module"],
            o["phase"],
            o["regime"],
            o["math"],
            1,
            o["device_s"],
            o["flops"],
            o["bytes"],
        )
        for o in p["ops"]
        if o["device_s"] > 0 and o["flops"] > 0 and o["bytes"] > 0
    ]
    data = op_points(rows)
    data["roofs"] = roofs(get_gpu(p["gpu"]), None, {r[4] for r in rows}) if p["gpu"] else None
    return data


def profile_time(p: dict) -> Section:
    s = Section("time", "Time")
    for key, what in (("modules", "module"), ("phases", "phase"), ("kinds", "op kind")):
        rows = {g["name"]: g["device_s"] for g in p[key][:25]}
        s.figure(key, F.bars_figure(rows, f"measured device time by {what}", "ms"))
    s.body += f"<p>Idle: {human_time(p['idle_s'])} ({p['idle_share']:.0%} of the step).</p>"
    top = sorted(p["ops"], key=lambda o: -o["device_s"])
    s.body += "<p>Top ops by measured time:</p>" + ops_table(top)
    return s


def compare_section(c: dict) -> Section:
    s = Section("compare", "Prediction vs measurement")
    for key, what in (("kinds", "op class"), ("modules", "module"), ("phases", "phase")):
        s.figure(key, F.compare_figure(c[key], f"by {what}"))
        rows = [
            [
                x["name"],
                human_time(x["predicted_s"]),
                human_time(x["measured_s"]),
                "n/a" if x["rel_error"] is None else f"{x['rel_error']:+.1%}",
                x["ops"],
            ]
            for x in c[key]
        ]
        s.body += table([what, "predicted", "measured", "error", "ops"], rows, {1, 2, 3, 4})
    s.body += f"<p>{c['matched_ops']:,} of {c['measured_ops']:,} measured ops held against "
    s.body += "a predicted op.</p>"
    return s


# --------------------------------------------------------------------------------- plan
def plan_page(r: dict[str, Any]) -> tuple[str, str, list[Section]]:
    charts = need(r, "charts", "charts")
    title = f"plan for {r['workload']} on {r['gpu']}"
    sub = f"gobrrr plan: {r['precision']}, global batch {r['global_batch']}"
    return title, sub, [plan_summary(r), plan_section(r, charts), plan_memory(r, charts)]


def plan_summary(r: dict) -> Section:
    s = Section("summary", "Summary")
    u, b = r.get("user"), r.get("best")
    if u is None:  # a multi-GPU search need not cost the step as given: an empty stand-in
        u = {"unit": (b or {}).get("unit", "tokens"), "fits": False, "reserved_bytes": 0}
    unit = u["unit"]
    s.body = facts(
        fact(
            "workload",
            "workload",
            r["workload"],
            r["workload"],
            f"global batch {r['global_batch']}",
        ),
        fact("GPU", "gpu", r["gpu"], r["gpu"], r["precision"]),
        fact("budget", "budget_bytes", r["budget_bytes"], gib(r["budget_bytes"]), "reserved"),
        fact(
            "as given",
            "user.fits",
            u["fits"],
            f"{u[f'{unit}_per_s']:,.0f} {unit}/s" if u["fits"] else "does not fit",
            f"reserved {gib(u['reserved_bytes'])}" if u["reserved_bytes"] else "not costed",
        ),
    )
    if b:
        gain = b[f"{unit}_per_s"] / u[f"{unit}_per_s"] if u["fits"] and u[f"{unit}_per_s"] else None
        s.body += facts(
            fact(
                "chosen",
                "best.changes",
                ", ".join(b["changes"]),
                ", ".join(b["changes"]) or "as given",
            ),
            fact(
                f"chosen {unit}/s",
                f"best.{unit}_per_s",
                b[f"{unit}_per_s"],
                f"{b[f'{unit}_per_s']:,.0f}",
                f"{gain:.2f}x as given" if gain else "",
            ),
            fact(
                "chosen reserved",
                "best.reserved_bytes",
                b["reserved_bytes"],
                gib(b["reserved_bytes"]),
                f"{gib(b['headroom_bytes'])} to spare",
            ),
        )
        s.body += f"<p>{e(b['why'])}</p>"
    else:
        s.body += "<p>No configuration fits the budget.</p>"
    s.body += f"<p>{r['considered']} configurations costed from {r['traces']} traces in "
    s.body += f"{r['took_s']:.1f} s.</p>" + items(r.get("notes", []), "Notes:")
    return s


def plan_section(r: dict, charts: dict) -> Section:
    s = Section("plan", "Plan")
    c = charts["candidates"]
    usable = charts.get("usable_bytes", r["budget_bytes"])
    s.figure(
        "candidates",
        F.candidates_figure(
            {**c, "changes": [", ".join(x) for x in c["changes"]]},
            r["budget_bytes"],
            usable,
            "every configuration costed",
        ),
    )
    s.body += "<p>What each change does alone (the best configuration costed with only it):</p>"
    s.body += knob_table(c)
    return s


def knob_table(c: dict) -> str:
    """Each change of the chosen plan alone, against the step as given; then all together."""
    if c["chosen"] is None:
        return "<p>Nothing fits: no plan was chosen.</p>"
    u, unit = c["user"], c["unit"]
    rows = []
    for phrase in c["changes"][c["chosen"]]:
        alone = [i for i, ch in enumerate(c["changes"]) if ch == [phrase]]
        rows.append(
            _knob_row(c, phrase, max(alone, key=lambda i: c["per_s"][i]) if alone else None, u)
        )
    rows.append(_knob_row(c, "all together (chosen)", c["chosen"], u))
    return table(["change", f"{unit}/s", "vs as given", "reserved", "fits"], rows, {1, 2, 3})


def _knob_row(c: dict, name: str, i: int | None, u: int | None) -> list:
    if i is None:
        return [name, "not costed alone", "", "", ""]
    costed = u is not None and c["fits"][u] and c["per_s"][u]
    gain = c["per_s"][i] / c["per_s"][u] if costed else None
    return [
        name,
        f"{c['per_s'][i]:,.0f}",
        f"{gain:.2f}x" if gain else "as given does not fit",
        gib(c["reserved_bytes"][i]),
        "yes" if c["fits"][i] else "no",
    ]


def plan_memory(r: dict, charts: dict) -> Section:
    s = Section("memory", "Memory")
    s.figure(
        "memory",
        F.memory_pair_figure(
            charts["memory"], r["budget_bytes"], "allocated over the step: as given and chosen"
        ),
        "x: the share of each step's ops (checkpointing adds recomputed ops, accumulation "
        "runs several micro-batches).",
    )
    return s
