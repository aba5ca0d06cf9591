"""Terminal tables for a ProfileResult, a Comparison, a ScalingResult, a Calibration."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from gobrrr.hardware import Calibration, GiB
from gobrrr.profile.result import ProfileResult


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def print_profile(
    r: ProfileResult, comparison=None, scaling=None, top: int = 12, console: Console | None = None
) -> None:
    """Step summary, top ops, top modules, diagnosis (and comparison / scaling if given)."""
    c = console or Console()
    c.print(_summary(r))
    c.print(_ops(r, top))
    c.print(_groups("Modules", r.modules, top))
    c.print(_groups("Op kinds", r.kinds, top))
    if r.diagnosis:
        t = Table(title="Diagnosis (largest saving first)")
        for col in ("finding", "saves", "evidence", "remedy"):
            t.add_column(col, overflow="fold")
        for f in r.diagnosis:
            saves = _t(f.saving_s) + (
                f" / {f.memory_bytes / GiB:.2g} GiB" if f.memory_bytes else ""
            )
            t.add_row(f.title, saves, f.evidence, f.remedy)
        c.print(t)
    if comparison is not None:
        t = Table(title="Predicted vs measured")
        for col in ("group", "predicted", "measured", "error"):
            t.add_column(col)
        for row in (comparison.step, *comparison.kinds, *comparison.phases):
            t.add_row(row.name, _t(row.predicted_s), _t(row.measured_s), _pct(row.rel_error))
        c.print(t)
    if scaling is not None:
        c.print(f"[bold]Batch scaling:[/] {scaling.summary}")


def _summary(r: ProfileResult) -> Table:
    t = Table(
        title=f"{r.workload} on {r.device_name} ({r.precision}"
        f"{', compiled' if r.compiled else ''}) {r.label}".strip(),
        show_header=False,
    )
    rows = [
        (
            f"step (median of {r.steps})",
            f"{_t(r.step_s)}  (min {_t(r.step_min_s)}, max {_t(r.step_max_s)})",
        ),
        (f"{r.unit}/s", f"{r.per_s:,.0f}  ({r.units_per_step:,} {r.unit}/step)"),
        *_utilization(r),
        (
            "peak allocated / reserved",
            f"{r.peak_allocated / GiB:.2f} / {r.peak_reserved / GiB:.2f} GiB",
        ),
        ("GPU idle in a step", f"{_t(r.idle_s)} ({_pct(r.idle_share)})"),
        ("kernels attributed", f"{r.kernels_attributed} / {r.kernels}"),
    ]
    if r.graph_matched is not None:
        rows.append(("ops joined to the step graph", _pct(r.graph_matched)))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _flops(n: float) -> str:
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= div:
            return f"{n / div:.3g} {unit}FLOP"
    return f"{n:,.0f} FLOP"


def _utilization(r: ProfileResult) -> list[tuple[str, str]]:
    """MFU and HFU against the stated peak, the FLOPs they count, PaLM's figure apart."""
    if not r.model_flops:
        return [("MFU / HFU", f"- ({r.flops_source})")]
    if r.peak_flops:
        mfu = f"{_pct(r.mfu)} / {_pct(r.hfu)} of the {r.peak} ({r.peak_flops / 1e12:,.0f} TFLOP/s)"
    else:
        mfu = "- (no matmul peak on the CPU)"
    rows = [
        ("MFU / HFU", mfu),
        (
            "model / executed FLOPs per step",
            f"{_flops(r.model_flops)} / {_flops(r.executed_flops)}",
        ),
    ]
    if r.model_flops_6n_attention is not None:
        palm = _flops(r.model_flops_6n_attention)
        if r.mfu_6n_attention is not None:
            palm += f", MFU {_pct(r.mfu_6n_attention)}"
        rows.append(("model FLOPs, 6·N·T + attention (PaLM)", palm))
    rows.append(
        (
            "",
            "MFU counts the traced forward and backward (no recompute), HFU every "
            "FLOP the step runs",
        )
    )
    return rows


def _ops(r: ProfileResult, top: int) -> Table:
    t = Table(title=f"Top {top} ops by device time")
    for col in ("op", "phase", "module", "time", "TFLOP/s", "GB/s", "roofline", "regime"):
        t.add_column(col, overflow="fold")
    for o in sorted(r.ops, key=lambda o: -o.device_s)[:top]:
        t.add_row(
            o.op.replace("aten::", ""),
            o.phase,
            o.module or "-",
            _t(o.device_s),
            f"{o.flops_per_s / 1e12:.3g}",
            f"{o.bytes_per_s / 1e9:.4g}",
            _pct(o.roofline),
            o.regime,
        )
    return t


def _groups(title: str, groups, top: int) -> Table:
    t = Table(title=title)
    for col in ("name", "time", "share", "ops", "TFLOP/s", "GB/s", "regime"):
        t.add_column(col)
    for g in groups[:top]:
        t.add_row(
            g.name,
            _t(g.device_s),
            _pct(g.share),
            str(g.ops),
            f"{g.flops_per_s / 1e12:.3g}",
            f"{g.bytes_per_s / 1e9:.4g}",
            g.regime,
        )
    return t


def print_calibration(cal: Calibration, where: str | None, console: Console | None = None) -> None:
    c = console or Console()
    t = Table(title=f"Calibration of {cal.device_name} ({cal.gpu})", show_header=False)
    for dt, rate in cal.matmul_flops.items():
        t.add_row(f"matmul {dt}", f"{rate / 1e12:.4g} TFLOP/s")
    t.add_row("copy bandwidth", f"{cal.copy_bandwidth / 1e9:.4g} GB/s")
    t.add_row("pointwise bandwidth", f"{cal.pointwise_bandwidth / 1e9:.4g} GB/s")
    t.add_row("reduction bandwidth", f"{cal.reduction_bandwidth / 1e9:.4g} GB/s")
    t.add_row("eager op (host)", _t(cal.launch_overhead))
    t.add_row("tiny kernel (device)", _t(cal.kernel_latency))
    ws = "-" if cal.blas_workspace is None else f"{cal.blas_workspace / 2**20:.3g} MiB"
    t.add_row("cuBLAS workspace", ws)
    c.print(t)
    if where:
        c.print(f"saved to {where}")


def _bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _comm(comm: dict | None, key: str) -> str:
    return "-" if comm is None else _t(comm.get(key))


def print_parallel(out: dict, console: Console | None = None) -> None:
    """`gobrrr profile --parallel`'s result: per rank, the job, and the prediction beside it
    when there is one."""
    c = console or Console()
    reshard = out["reshard_after_forward"]
    t = Table(
        title=f"{out['workload']}: {out['parallel']}"
        f"{'' if reshard is None else ', reshard after forward ' + ('on' if reshard else 'off')}"
        f" on {out['world']} x {out['device']} ({out['precision']})"
    )
    for col in ("rank", "step (median)", "peak allocated", "peak reserved", "comm busy",
                "comm exposed", "waiting for other ranks", "transfer exposed"):  # fmt: skip
        t.add_column(col)
    for r in out["ranks"]:
        t.add_row(
            str(r["rank"]),
            _t(r["median_s"]),
            _bytes(r["peak_allocated"]),
            _bytes(r["peak_reserved"]),
            *(_comm(r["comm"], k) for k in ("comm_busy_s", "comm_exposed_s")),
            *(_comm(r["comm"], k) for k in ("comm_wait_s", "comm_transfer_exposed_s")),
        )
    c.print(t)
    m, p, err = out["measured"], out.get("predicted"), out.get("error", {})
    rows = [
        ("step (slowest rank's median)", "step_s", _t),
        ("peak allocated (largest rank)", "peak_allocated", _bytes),
        ("peak reserved (largest rank)", "peak_reserved", _bytes),
    ]
    t = Table(title="The job" + (" against the prediction" if p else ""))
    for col in ("", "measured") + (("predicted", "error") if p else ()):
        t.add_column(col)
    for label, key, fmt in rows:
        t.add_row(label, fmt(m[key]), *((fmt(p[key]), _pct(err.get(key))) if p else ()))
    for label, key, predicted in _comm_rows(m, err):
        s = m.get(key)
        spread = f"{_t(s['min'])} / {_t(s['median'])} / {_t(s['max'])}" if s else "-"
        extra = ()
        if p and predicted:
            against, stat = _against(err).split()
            diff = err.get("comm_exposed_s") if key == against else None
            extra = (_t(p[predicted]), "-" if diff is None else f"{diff * 1e3:+.2f} ms vs {stat}")
        elif p:  # the exposed time, once split, is the transfer row's and the waiting's
            extra = ("not predicted" if key == "comm_wait_s" else "-", "")
        t.add_row(f"{label} (min / median / max over ranks)", spread, *extra)
    for op, row in m.get("collectives", {}).items():
        s = row["transfer_exposed_s"]
        spread = f"{_t(s['min'])} / {_t(s['median'])} / {_t(s['max'])}"
        extra = ()
        if p:
            exposed = (p.get("comm_by_collective") or {}).get(op, {}).get("exposed_s")
            extra = (
                ("-", "")
                if exposed is None
                else (_t(exposed), f"{(exposed - s['median']) * 1e3:+.2f} ms vs median")
            )
        t.add_row(f"  {op} transfer exposed (min / median / max)", spread, *extra)
    c.print(t)
    if "comm" in m:
        c.print(m["comm"])
    elif m.get("comm_split"):
        c.print(f"NCCL kernels split where the last rank arrives: {m['comm_split']}")


def _against(err: dict) -> str:
    """The measured figure the predicted exposed communication was set against, and which
    of its spread: "comm_transfer_exposed_s median" or "comm_exposed_s min" (older results
    say nothing: the min of exposed)."""
    return err.get("comm_exposed_against", "comm_exposed_s min")


def _comm_rows(m: dict, err: dict) -> list[tuple[str, str, str | None]]:
    """(label, measured key, predicted key beside it or None) of the job's communication:
    the prediction (ranks in lockstep) beside the exposed transfer where the NCCL kernels
    were split, beside the exposed time where not; the waiting for other ranks is never
    predicted."""
    split = m.get("comm_transfer_exposed_s") is not None
    rows = [
        ("comm busy", "comm_busy_s", "comm_busy_s"),
        ("comm exposed", "comm_exposed_s", None if split else "comm_exposed_s"),
    ]
    if split:
        rows += [
            ("comm transfer exposed", "comm_transfer_exposed_s", "comm_exposed_s"),
            ("comm waiting for other ranks", "comm_wait_s", None),
        ]
    return rows
