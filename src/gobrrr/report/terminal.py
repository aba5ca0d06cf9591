"""Terminal tables (rich) for an Estimate."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gobrrr.estimate import Estimate
from gobrrr.hardware import BUILTIN_GPUS, GiB
from gobrrr.memory import module_rollup

KIND_ORDER = ("parameter", "buffer", "gradient", "optimizer_state", "input", "activation",
              "temporary", "workspace")


def gib(n: float) -> str:
    return f"{n / GiB:,.2f} GiB"


def human_time(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def human_count(n: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return f"{n:.0f}"


def print_estimate(est: Estimate, console: Console | None = None, top: int = 12) -> None:
    """Summary, memory breakdown, regime split, top ops and modules."""
    c = console or Console()
    meta, m, t = est.graph.meta, est.memory, est.time
    cal = (f"calibrated ({est.calibration})" if est.calibration
           else "datasheet peaks, no calibration")
    mode = " · torch.compile" if est.compiled else ""
    c.print(f"[bold]{meta.get('name')}[/] · {meta.get('precision')}{mode} · checkpoint "
            f"{meta.get('checkpoint')} · {meta.get('tokens'):,} tokens/step · "
            f"{human_count(meta.get('params', 0))} params · on [bold]{est.gpu.name}[/] ({cal})")
    verdict = "[green]fits[/]" if est.fits else "[red]does NOT fit[/]"
    if est.compiled:
        verdict += " (eager step's memory: compiled graphs save less, so this is an upper bound)"
    room = (f", headroom {gib(m.headroom)} ({m.headroom_share:.1%})"
            if m.headroom is not None and m.headroom >= 0 else "")
    c.print(f"peak memory {gib(m.peak)} allocated, {gib(m.reserved)} reserved of "
            f"{gib(m.budget or est.gpu.memory_bytes)} usable → {verdict}{room} "
            f"(peak at op #{m.peak_index} {m.peak_op} in '{m.peak_module or '<top>'}', "
            f"{m.peak_phase})")
    share = t.regime_share()
    c.print(f"step {human_time(t.step_s)} · {t.tokens_per_s:,.0f} tokens/s · MFU "
            f"{t.mfu:.1%} · HFU {t.hfu:.1%} · compute {share.get('compute', 0):.0%} / memory "
            f"{share.get('memory', 0):.0%} / overhead {share.get('overhead', 0):.0%} · "
            f"bwd/fwd FLOPs {t.backward_forward_ratio():.2f}")
    c.print(_memory_table(est))
    top_mods = list(module_rollup(m.by_module).items())[:5]
    if top_mods:
        c.print("activations + temporaries at the peak, by module: " + ", ".join(
            f"{k} {gib(v)}" for k, v in top_mods))
    c.print(_ops_table(est, top))
    c.print(_modules_table(est, top))
    if est.formulas:
        c.print(_formulas_table(est))
    from gobrrr.estimate import hints

    for h in hints(est):
        c.print(f"[yellow]hint:[/] {h}")
    for line in assumption_lines(est.graph.meta.get("assumptions") or []):
        c.print(line)


def assumption_lines(assumptions: list[dict]) -> list[str]:
    """One line per kind of value the trace read (gobrrr.capture.assume): what it took, how
    often, by which ops and where (module, phase)."""
    by_kind: dict[str, list[dict]] = {}
    for a in assumptions:
        by_kind.setdefault(a["kind"], []).append(a)
    lines = []
    for kind, rows in by_kind.items():
        n = sum(r["count"] for r in rows)
        ops = ", ".join(sorted({r["op"].removeprefix("aten.") for r in rows}))
        places = sorted({f"{r['module'] or '<top>'} ({r['phase']})" for r in rows})
        where = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3
                                         else "")
        values = sorted({r["value"] for r in rows})
        took = ", ".join(values[:3]) + (" …" if len(values) > 3 else "")
        tag = "[cyan]read exactly:[/]" if kind == "derived" else "[yellow]assumed:[/]"
        what = rows[0]["what"].removeprefix("read exactly: ")
        lines.append(f"{tag} {what} — {n}× {ops} → {took}; in {where}")
    return lines


def _memory_table(est: Estimate) -> Table:
    m = est.memory
    tab = Table(title="memory at the peak", title_justify="left")
    tab.add_column("what")
    tab.add_column("bytes", justify="right")
    tab.add_column("share", justify="right")
    for kind in KIND_ORDER:
        b = m.at_peak.get(kind, 0)
        if b:
            tab.add_row(kind.replace("_", " "), gib(b), f"{b / m.peak:.1%}")
    tab.add_row("[bold]peak[/]", f"[bold]{gib(m.peak)}[/]", "")
    return tab


def _ops_table(est: Estimate, top: int) -> Table:
    tab = Table(title=f"top {top} ops by predicted time", title_justify="left")
    for col in ("#", "op", "module", "phase", "time", "TFLOP", "GB", "FLOP/B", "regime"):
        tab.add_column(col, justify="right" if col in ("#", "time", "TFLOP", "GB", "FLOP/B")
                       else "left")
    for o in sorted(est.time.ops, key=lambda o: -o.device_s)[:top]:
        tab.add_row(str(o.index), o.op.removeprefix("aten.").removesuffix(".default"),
                    o.module or "<top>", o.phase,
                    human_time(o.device_s), f"{o.flops / 1e12:.3f}", f"{o.bytes / 1e9:.3f}",
                    f"{o.intensity:.0f}" if o.intensity != float("inf") else "∞", o.regime)
    return tab


def _modules_table(est: Estimate, top: int) -> Table:
    tab = Table(title="time by module", title_justify="left")
    tab.add_column("module")
    tab.add_column("time", justify="right")
    tab.add_column("share", justify="right")
    total = est.time.device_s or 1.0
    for name, s in list(est.time.by_module().items())[:top]:
        tab.add_row(name, human_time(s), f"{s / total:.1%}")
    return tab


def _formulas_table(est: Estimate) -> Table:
    f = est.formulas
    tab = Table(title="textbook formulas vs the trace", title_justify="left")
    tab.add_column("quantity")
    tab.add_column("formula", justify="right")
    tab.add_column("traced", justify="right")
    tab.add_row("parameters (12·d²·L + 2·d·V)", human_count(f["params_textbook_12d2L_2dV"]),
                human_count(f["params_traced"]))
    if "activations_traced_bytes" in f:
        traced = gib(f["activations_traced_bytes"])
        tab.add_row("activations (12·L·d·T + L·a·T² + V·T)", gib(f["activations_lecture_bytes"]),
                    traced)
        tab.add_row(f"activations (Megatron, {f['megatron_variant']})",
                    gib(f["activations_megatron_bytes"]), traced)
    return tab


def print_gpus(console: Console | None = None) -> None:
    c = console or Console()
    tab = Table(title="built-in GPUs (dense peaks)", title_justify="left")
    for col in ("name", "aliases", "memory", "HBM TB/s", "bf16 TF", "tf32 TF", "fp32 TF",
                "fp8 TF", "ridge FLOP/B"):
        tab.add_column(col, justify="left" if col in ("name", "aliases") else "right")
    for g in BUILTIN_GPUS:
        p = g.peak_flops
        tab.add_row(g.name, ", ".join(g.aliases), gib(g.memory_bytes), f"{g.bandwidth / 1e12:.2f}",
                    f"{p['bf16'] / 1e12:.0f}", f"{p['tf32'] / 1e12:.0f}",
                    f"{p['fp32'] / 1e12:.1f}",
                    f"{p['fp8'] / 1e12:.0f}" if "fp8" in p else "-", f"{g.ridge_point:.0f}")
    c.print(tab)
