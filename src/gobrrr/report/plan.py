"""Terminal report of `gobrrr plan`: the step as given, the best plans, the choice."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from gobrrr.plan.result import Plan, PlanResult, no_fit_message
from gobrrr.report.terminal import _table, gib, human_time


def rate(p: Plan) -> str:
    return f"{p.units_per_s:,.0f} {'tok' if p.unit == 'tokens' else p.unit}/s"


def print_plan(r: PlanResult, top: int = 8) -> None:
    c = Console()
    c.print(
        f"[bold]{r.workload}[/bold] on {r.gpu}, {r.precision}, global batch "
        f"{r.global_batch}: budget {gib(r.budget_bytes)} reserved "
        f"({r.considered} configurations costed from {r.traces} traces, "
        f"{r.took_s:.1f} s)"
    )
    u = r.user
    c.print(
        f"as given (micro-batch {r.global_batch}, nothing checkpointed): "
        + (f"fits, {rate(u)}" if u.fits else f"does not fit: {u.why}")
    )
    t = _table(
        f"plans, best first ({min(top, len(r.plans))} of {len(r.plans)}; --top N shows more)"
    )
    for name, just in (
        ("#", "right"),
        ("what changes", "left"),
        ("throughput", "right"),
        ("step", "right"),
        ("peak", "right"),
        ("reserved", "right"),
        ("fits", "left"),
    ):
        t.add_column(name, justify=just)
    for i, p in enumerate(r.plans[:top], 1):
        t.add_row(
            str(i),
            ", ".join(p.changes) or "as given",
            rate(p),
            human_time(p.step_s),
            gib(p.peak_bytes),
            gib(p.reserved_bytes),
            Text("yes", "green") if p.fits else Text("no", "red"),
        )
    c.print(t)
    for note in r.notes:
        c.print(f"note: {note}")
    if r.best is None:
        c.print(Text(no_fit_message(r), "red"))
        return
    b = r.best
    gain = f", {b.units_per_s / u.units_per_s:.2f}x the step as given" if u.fits else ""
    c.print(
        f"[bold]chosen:[/bold] {', '.join(b.changes) or 'the step as given'}: {rate(b)}"
        f"{gain}; {b.why}"
    )
    if b.host_bytes:
        c.print(
            f"host memory: {gib(b.host_bytes)} ({gib(b.host_pinned_bytes)} pinned): the "
            "machine's RAM must hold it besides the data loader and the process"
        )


def print_verified(rows) -> None:
    """The plans as run on this GPU beside their predictions."""
    t = _table("verified on this GPU: predicted, measured")
    for name, just in (
        ("what changes", "left"),
        ("step", "right"),
        ("", "right"),
        ("peak", "right"),
        ("", "right"),
        ("reserved", "right"),
        ("", "right"),
    ):
        t.add_column(name, justify=just)
    for v in rows:
        what = ", ".join(v.plan.changes) or "as given"
        if v.error:
            t.add_row(what, Text(v.error, "red"), "", "", "", "", "")
            continue
        t.add_row(
            what,
            human_time(v.plan.step_s),
            human_time(v.step_s),
            gib(v.plan.peak_bytes),
            gib(v.peak_allocated),
            gib(v.plan.reserved_bytes),
            gib(v.peak_reserved),
        )
    Console().print(t)
