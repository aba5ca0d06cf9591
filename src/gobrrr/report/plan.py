"""Terminal report of `gobrrr plan`: the step as given, the best plans, the choice."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from gobrrr.plan.result import Plan, PlanResult, no_fit_message
from gobrrr.report.terminal import _table, gib, human_time


def rate(p: Plan, per_gpu: bool = False) -> str:
    if p.step_s is None:
        return "-"
    value = p.units_per_s_per_gpu if per_gpu else p.units_per_s
    return f"{value:,.0f} {'tok' if p.unit == 'tokens' else p.unit}/s"


def _header(r: PlanResult) -> str:
    over = (
        f" x{r.gpus} GPUs" + (f" on {r.nodes} nodes" if r.nodes > 1 else "") if r.gpus > 1 else ""
    )
    per_rank = f" ({r.global_batch // r.gpus} per rank)" if r.gpus > 1 else ""
    each = " per GPU" if r.gpus > 1 else ""
    return (
        f"[bold]{r.workload}[/bold] on {r.gpu}{over}, {r.precision}, global batch "
        f"{r.global_batch}{per_rank}: budget {gib(r.budget_bytes)} reserved{each} "
        f"({r.considered} configurations costed from {r.traces} traces, "
        f"{r.took_s:.1f} s)"
    )


def print_plan(r: PlanResult, top: int = 8) -> None:
    c = Console()
    c.print(_header(r))
    c.print(
        "memory for the loop apply runs (gobrrr's step: the model's output dropped before "
        "backward; a loop keeping it holds more, see estimate --loop)"
    )
    u = r.user
    if u is not None:
        mb = r.global_batch // r.gpus
        c.print(
            f"as given (micro-batch {mb}{', ' + u.parallel if u.parallel else ''}, nothing "
            "checkpointed): " + (f"fits, {rate(u)}" if u.fits else f"does not fit: {u.why}")
        )
    c.print(_plans_table(r, top))
    for note in r.notes:
        c.print(f"note: {note}")
    if r.best is None:
        c.print(Text(no_fit_message(r), "red"))
        return
    b = r.best
    gain = f", {b.units_per_s / u.units_per_s:.2f}x the step as given" if u and u.fits else ""
    what = ", ".join([*([b.parallel] if b.parallel else []), *b.changes])
    per_gpu = f" ({rate(b, per_gpu=True)} per GPU)" if r.gpus > 1 else ""
    c.print(
        f"[bold]chosen:[/bold] {what or 'the step as given'}: {rate(b)}{per_gpu}{gain}; {b.why}"
    )
    if b.host_bytes:
        c.print(
            f"host memory: {gib(b.host_bytes)} ({gib(b.host_pinned_bytes)} pinned): the "
            "machine's RAM must hold it besides the data loader and the process"
        )


def _plans_table(r: PlanResult, top: int):
    """The plans, best first: over several GPUs with the parallelism, the job's and one
    GPU's throughput, and one rank's peaks."""
    many = r.gpus > 1
    t = _table(
        f"plans, best first ({min(top, len(r.plans))} of {len(r.plans)}; --top N shows more)"
    )
    columns = [
        ("#", "right"),
        *([("parallel", "left")] if many else []),
        ("what changes", "left"),
        ("job throughput" if many else "throughput", "right"),
        *([("per GPU", "right")] if many else []),
        ("step", "right"),
        ("peak/rank" if many else "peak", "right"),
        ("reserved", "right"),
        ("fits", "left"),
    ]
    for name, just in columns:
        t.add_column(name, justify=just)
    for i, p in enumerate(r.plans[:top], 1):
        t.add_row(
            str(i),
            *([p.parallel] if many else []),
            ", ".join(p.changes) or "as given",
            rate(p),
            *([rate(p, per_gpu=True)] if many else []),
            "-" if p.step_s is None else human_time(p.step_s),
            gib(p.peak_bytes),
            gib(p.reserved_bytes),
            Text("yes", "green") if p.fits else Text("no", "red"),
        )
    return t


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
