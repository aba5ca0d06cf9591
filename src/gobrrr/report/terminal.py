"""Terminal tables (rich) for an Estimate and the built-in GPUs.

Everything fits an 80-column terminal or pipe: tables have no vertical rules, names (ops,
modules, GPUs) wrap within their column and are never cut, and a list cut at N says of how
many and how to see the rest.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from gobrrr.evaluate import Estimate, checkpointing, throughput_unit
from gobrrr.hardware import BUILTIN_GPUS, GiB
from gobrrr.memory.replay import module_rollup
from gobrrr.memory.trainable import SHORT, Params, Trainable
from gobrrr.report.advice import hints
from gobrrr.report.estimate import loop_line, per_rank_state

KIND_ORDER = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "input",
    "activation",
    "temporary",
    "workspace",
)
TOP_MODULES_AT_PEAK = 5


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


def op_label(op: str) -> str:
    """An op as the tables show it: "aten.mm.default" -> "mm", "aten.add.Tensor" ->
    "add.Tensor" (the same abbreviation everywhere)."""
    return op.removeprefix("aten.").removesuffix(".default")


def _table(title: str) -> Table:
    return Table(
        title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1)
    )


def _cut(shown: int, total: int, what: str, more: str) -> str:
    """ "top 12 of 1,517 ops ..." when a list is cut, with how to see the rest; "7 ops ..."
    when it is not."""
    if shown >= total:
        return f"{total:,} {what if total != 1 else what.replace('s ', ' ', 1)}"
    return f"top {shown:,} of {total:,} {what} ({more})"


def print_estimate(est: Estimate, console: Console | None = None, top: int = 12) -> None:
    """Summary, memory breakdown, regime split, top ops and modules, formulas, hints."""
    c = console or Console()
    for line in summary_lines(est):
        c.print(line)
    c.print(Text(loop_line(est)))
    if est.trainable.frozen:
        c.print(Text(trainable_line(est.trainable)))
    c.print(_memory_table(est))
    rollup = module_rollup(est.memory.by_module)
    if rollup:
        shown = list(rollup.items())[:TOP_MODULES_AT_PEAK]
        cut = (
            ""
            if len(shown) == len(rollup)
            else f" (top {len(shown)} of {len(rollup)}; --json lists all)"
        )
        c.print(
            Text(
                f"activations + temporaries at the peak, by module{cut}: "
                + ", ".join(f"{k} {gib(v)}" for k, v in shown)
            )
        )
    c.print(_ops_table(est, top))
    c.print(_modules_table(est, top))
    if est.formulas:
        c.print(_formulas_table(est))
    for h in hints(est):
        c.print(Text.assemble(("hint: ", "yellow"), h))
    for line in assumption_lines(est.graph.meta.assumptions or []):
        c.print(line)


def summary_lines(est: Estimate) -> list[Text]:
    """The header, the memory verdict and the time line."""
    meta, m, t = est.graph.meta, est.memory, est.time
    cal = (
        f"calibrated ({est.calibration})" if est.calibration else "datasheet peaks, no calibration"
    )
    if est.memory_calibration:  # no calibration of its own: its chip's workspaces
        cal += f"; workspaces as measured on the {est.memory_calibration}"
    mode = " · torch.compile" if est.compiled else ""
    precision = str(meta.precision)
    if meta.parallel is not None and meta.parallel.kind in ("fsdp", "hsdp"):  # as FSDP2 computes
        precision = "bf16-mixed (FSDP2: parameters gathered in bf16, gradients reduced in fp32)"
    unit = throughput_unit(est.graph)
    head = Text.assemble(
        (str(meta.name), "bold"),
        f" · {precision}{mode} · "
        f"{_checkpoint(est)} · {t.tokens:,} {unit}/step · "
        f"{human_count(meta.params)} params · on ",
        (est.gpu.name, "bold"),
        f" ({cal})",
    )
    verdict = Text("fits", "green") if est.fits else Text("does NOT fit", "red")
    if est.compiled and not meta.compiled:  # an eager trace costed as compiled
        verdict.append(
            " (eager step's memory: compiled graphs save less, so this is an upper bound)"
        )
    room = (
        f", headroom {gib(m.headroom)} ({m.headroom_share:.1%})"
        if m.headroom is not None and m.headroom >= 0
        else ""
    )
    peak = Text.assemble(
        f"peak memory {gib(m.peak)} allocated, {gib(m.reserved)} reserved of "
        f"{gib(m.budget or est.gpu.memory_bytes)} usable → ",
        verdict,
        f"{room} (peak at op #{m.peak_index} {op_label(m.peak_op)} in "
        f"'{m.peak_module or '<top>'}', {m.peak_phase})",
    )
    share = t.regime_share()
    pmode = meta.precision.peak_mode
    step = Text(
        f"step {human_time(t.step_s)} · {t.tokens_per_s:,.0f} {unit}/s · MFU "
        f"{t.mfu:.1%} · HFU {t.hfu:.1%} of the {pmode} peak "
        f"({t.peak_flops / 1e12:,.0f} TFLOP/s) · compute {share.get('compute', 0):.0%}"
        f" / memory {share.get('memory', 0):.0%} / overhead "
        f"{share.get('overhead', 0):.0%} · bwd/fwd FLOPs "
        f"{t.backward_forward_ratio():.2f}"
    )
    if t.clock_fraction < 1.0:
        step.append(f" · power-limited: compute at {t.clock_fraction:.0%} of its burst rate")
    note = Text(
        "MFU counts the FLOPs of the traced forward and backward (no recompute), HFU "
        "every FLOP the step runs, both over the precision's dense matmul peak",
        "dim",
    )
    return [head, peak, step, *_parallel_lines(est), note]


def _parallel_lines(est: Estimate) -> list[Text]:
    """Data-parallel runs: the job's throughput and the communication (per rank)."""
    par, t = est.graph.meta.parallel, est.time
    if par is None:
        return []
    unit = throughput_unit(est.graph)
    how = f"{par.kind} over {par.world} GPUs on {par.hosts} host(s)"
    if par.kind == "hsdp":
        how += f" (sharded over each host's {par.per_host}, replicated over the {par.hosts})"
    lines = [
        Text(
            f"{how}, figures per GPU: "
            f"{t.tokens_per_s:,.0f} {unit}/s a GPU, {t.job_tokens_per_s:,.0f} {unit}/s the job"
            f" · communication {human_time(t.comm_s)}: {human_time(t.exposed_comm_s)} exposed, "
            f"{human_time(t.overlapped_comm_s)} overlapped with compute"
        )
    ]
    state = per_rank_state(est.graph)
    if state is not None:
        lines.append(Text(state_line(state)))
    return lines


def state_line(state: dict) -> str:
    """ "per rank: parameters X, gradients Y, optimizer states Z (ZeRO-3: Psi x 4/N, 4/N,
    8/N = ...)" from `report.estimate.per_rank_state`."""
    got = [state[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes")]
    closed = state["closed_form"]
    want = [closed[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes")]
    n, w = state["shards"], state["bytes_per_element"]
    if state["rule"] == "ZeRO-3":
        rule = f"ZeRO-3: Psi x {w}/N, {w}/N, {2 * w}/N with N = {n}"
    else:
        rule = f"replicated: {w} Psi, {w} Psi, {2 * w} Psi"
    forms = ", ".join("-" if v is None else _size(v) for v in want)
    return (
        f"per rank: parameters {_size(got[0])}, gradients {_size(got[1])}, optimizer states "
        f"{_size(got[2])} ({rule} = {forms})"
    )


def trainable_line(split: Trainable) -> str:
    """ "trains 1.70M parameters (0.14%: LoRA adapters, 6.50 MiB fp32) + their gradients
    6.50 MiB + AdamW states 13.00 MiB; frozen 1.24G (2.30 GiB bf16)" (`Estimate.trainable`)."""
    states = f"{split.optimizer} states" if split.optimizer else "optimizer states"
    return (
        f"trains {human_count(split.trained_elements)} parameters ({split.trained_share:.2%}: "
        f"{split.what}, {_by_dtype(split.trained) or '0 bytes'}) + their gradients "
        f"{_bytes(split.gradients_bytes)} + {states} {_bytes(split.optimizer_states_bytes)}; "
        f"frozen {human_count(split.frozen_elements)} ({_by_dtype(split.frozen)})"
    )


def _by_dtype(params: tuple[Params, ...]) -> str:
    return ", ".join(f"{_bytes(p.bytes)} {SHORT.get(p.dtype, p.dtype)}" for p in params)


def _bytes(n: float) -> str:
    """GiB, MiB or KiB: an adapter's figures are often under a MiB."""
    return _size(n) if n >= 2**20 else f"{n / 2**10:,.2f} KiB"


def _size(n: float) -> str:
    """GiB, or MiB below one GiB (a small model's shards)."""
    return gib(n) if n >= GiB else f"{n / 2**20:,.2f} MiB"


def _checkpoint(est: Estimate) -> str:
    how, recomputed = checkpointing(est.graph)
    if how == "none":
        return "checkpoint none"
    who = "full (every block)" if how == "full" else "by the model itself"
    return f"checkpoint {who}, {recomputed:,} ops recomputed"


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
        where = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
        values = sorted({r["value"] for r in rows})
        took = ", ".join(values[:3]) + (" …" if len(values) > 3 else "")
        tag = "[cyan]read exactly:[/]" if kind == "derived" else "[yellow]assumed:[/]"
        what = rows[0]["what"].removeprefix("read exactly: ")
        lines.append(f"{tag} {what} — {n}× {ops} → {took}; in {where}")
    return lines


def _memory_table(est: Estimate) -> Table:
    m = est.memory
    tab = _table("memory at the peak")
    tab.add_column("what")
    tab.add_column("bytes", justify="right")
    tab.add_column("share", justify="right")
    for kind in KIND_ORDER:
        b = m.at_peak.get(kind, 0)
        if b:
            tab.add_row(kind.replace("_", " "), gib(b), f"{b / m.peak:.1%}")
    tab.add_row(Text("peak", "bold"), Text(gib(m.peak), "bold"), "")
    return tab


def _ops_table(est: Estimate, top: int) -> Table:
    timed = [o for o in est.time.ops if o.device_s > 0]
    title = _cut(
        min(top, len(timed)),
        len(timed),
        "ops by predicted time",
        "--top N for more, --json for data",
    )
    tab = _table(title[0].upper() + title[1:])
    tab.add_column("op, #index in module", overflow="fold", ratio=1)
    for col in ("phase", "time", "TFLOP", "GB", "regime"):
        tab.add_column(col, justify="left" if col in ("phase", "regime") else "right", no_wrap=True)
    for o in sorted(timed, key=lambda o: -o.device_s)[:top]:
        name = Text(op_label(o.op))
        name.append(f"\n#{o.index} in {o.module or '<top>'}", "dim")
        tab.add_row(
            name,
            o.phase,
            human_time(o.device_s),
            f"{o.flops / 1e12:.3f}",
            f"{o.bytes / 1e9:.3f}",
            o.regime,
        )
    return tab


def _modules_table(est: Estimate, top: int) -> Table:
    modules = list(est.time.by_module().items())
    title = _cut(
        min(top, len(modules)), len(modules), "modules by predicted time", "--top N for more"
    )
    tab = _table(title[0].upper() + title[1:])
    tab.add_column("module", overflow="fold")
    tab.add_column("time", justify="right", no_wrap=True)
    tab.add_column("share", justify="right", no_wrap=True)
    total = est.time.device_s or 1.0
    for name, s in modules[:top]:
        tab.add_row(name, human_time(s), f"{s / total:.1%}")
    return tab


def _formulas_table(est: Estimate) -> Table:
    f = est.formulas
    tab = _table("textbook formulas vs the trace")
    tab.add_column("quantity", overflow="fold", ratio=1)
    tab.add_column("formula", justify="right", no_wrap=True)
    tab.add_column("traced", justify="right", no_wrap=True)
    tab.add_row(
        "parameters, 12·d²·L + 2·d·V",
        human_count(f["params_textbook_12d2L_2dV"]),
        human_count(f["params_traced"]),
    )
    for what, delta in f.get("params_gap", []):
        tab.add_row(
            Text(f"  {what}", "dim"), f"{'+' if delta > 0 else '−'}{human_count(abs(delta))}", ""
        )
    if "activations_traced_bytes" in f:
        traced = gib(f["activations_traced_bytes"])
        tab.add_row(
            "activations, 12·L·d·T + L·a·T² + V·T", gib(f["activations_lecture_bytes"]), traced
        )
        tab.add_row(
            f"activations, Megatron ({f['megatron_variant']})",
            gib(f["activations_megatron_bytes"]),
            traced,
        )
    u = est.utilization()
    if "model_flops_6n_attention" in u:
        tab.add_row(
            f"model FLOPs/step, 6·N·T + attention (PaLM; MFU {u['mfu_6n_attention']:.1%})",
            human_count(u["model_flops_6n_attention"]),
            human_count(u["model_flops"]),
        )
    return tab


def print_gpus(console: Console | None = None) -> None:
    """Every built-in GPU, names and aliases in full."""
    c = console or Console()
    tab = _table("built-in GPUs: dense peaks in TFLOP/s, HBM in TB/s, ridge point in FLOP/B")
    width = max(len(g.name) for g in BUILTIN_GPUS)
    tab.add_column("name", no_wrap=True, min_width=width)
    tab.add_column("aliases", overflow="fold")
    for col in ("memory", "HBM", "bf16", "tf32", "fp32", "fp8", "ridge"):
        tab.add_column(col, justify="right", no_wrap=True)
    for g in BUILTIN_GPUS:
        p = g.peak_flops
        tab.add_row(
            g.name,
            ", ".join(g.aliases) or "-",
            gib(g.memory_bytes),
            f"{g.bandwidth / 1e12:.2f}",
            f"{p['bf16'] / 1e12:.0f}",
            f"{p['tf32'] / 1e12:.0f}",
            f"{p['fp32'] / 1e12:.1f}",
            f"{p['fp8'] / 1e12:.0f}" if "fp8" in p else "-",
            f"{g.ridge_point:.0f}",
        )
    c.print(tab)
