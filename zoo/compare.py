"""gobrrr's predictions of the zoo held against its measurements (measure.py's JSON).

Used by tests/test_zoo.py (bounds) and benchmarks/zoo/report.py (the table). Errors are
predicted / measured - 1: positive = predicted too high, negative = too low.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zoo.cases import ZooCase, get_case

GPU = "h100"
# Runs of some cases again, on other H100 hosts (benchmarks/results): a host-bound step's time
# follows the host's CPU, and one case measured 114 to 154 ms over four hosts. A case's step
# time is the median over the main run and these; its memory comes from the main run.
RERUNS = (
    "zoo_h100_rerun_hostbound.json",
    "zoo_h100_hostbound_run3.json",
    "zoo_h100_hostbound_run4.json",
    "zoo_h100_holdout_run2.json",
    "zoo_h100_holdout_run3.json",
)


def predict(case: ZooCase):
    """gobrrr.estimate of the case as measured: its batch, seq, precision, compile flag, on
    the H100 with the shipped calibration."""
    import gobrrr

    return gobrrr.estimate(  # the zoo measures gobrrr's TrainStep: the loop that drops the output
        case.factory(),
        gpu=GPU,
        precision=case.precision,
        compile=case.compile,
        loop="drops-output",
    )


def predicted_reserved(est) -> int | None:
    """The predicted max_memory_reserved, where the estimate has one."""
    return getattr(est.memory, "reserved", 0) or None


@dataclass(frozen=True)
class CaseError:
    """One measured case beside its prediction (bytes, seconds). predicted_* are None when
    the trace failed (`trace_error` says why) or the prediction has no such figure."""

    name: str
    family: str
    recipe: tuple[str, ...]
    precision: str
    measured_alloc: int
    measured_reserved: int
    measured_step_s: float
    runs: int = 1  # the runs whose median step time measured_step_s is
    step_range_s: tuple[float, float] | None = None  # (fastest, slowest) of those runs
    predicted_alloc: int | None = None
    predicted_reserved: int | None = None
    predicted_step_s: float | None = None
    capture_s: float | None = None
    trace_error: str | None = None

    @property
    def alloc_err(self) -> float | None:
        return _err(self.predicted_alloc, self.measured_alloc)

    @property
    def reserved_err(self) -> float | None:
        return _err(self.predicted_reserved, self.measured_reserved)

    @property
    def time_err(self) -> float | None:
        return _err(self.predicted_step_s, self.measured_step_s)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "family": self.family,
            "recipe": list(self.recipe),
            "precision": self.precision,
            "measured_alloc": self.measured_alloc,
            "measured_reserved": self.measured_reserved,
            "measured_step_s": self.measured_step_s,
            "runs": self.runs,
            "predicted_alloc": self.predicted_alloc,
            "predicted_reserved": self.predicted_reserved,
            "predicted_step_s": self.predicted_step_s,
            "capture_s": self.capture_s,
            "trace_error": self.trace_error,
            "alloc_err": self.alloc_err,
            "reserved_err": self.reserved_err,
            "time_err": self.time_err,
        }


def _err(pred: float | None, meas: float) -> float | None:
    return None if pred is None or not meas else pred / meas - 1


def measured_rows(doc: dict) -> list[dict]:
    """The rows of a results file that are real GPU measurements of the case as it is
    defined now (same batch and seq; dry runs and failed cases left out)."""
    out = []
    for row in doc["cases"]:
        if "error" in row or "measured" not in row or not row.get("device", "").startswith("cuda"):
            continue
        case = get_case(row["name"])
        if (row["batch"], row["seq"]) == (case.batch, case.seq):
            out.append(row)
    return out


def failed_rows(doc: dict) -> list[dict]:
    """The rows whose measurement failed (out of memory, an exception, a timeout)."""
    return [r for r in doc["cases"] if "error" in r]


def rerun_steps(results_dir) -> dict[str, list[float]]:
    """{case: [step seconds, ...]} of every rerun (RERUNS) in results_dir that measured the
    case as it is defined now."""
    out: dict[str, list[float]] = {}
    for name in RERUNS:
        path = Path(results_dir) / name
        if path.exists():
            for row in measured_rows(json.loads(path.read_text())):
                out.setdefault(row["name"], []).append(row["measured"]["step_s"])
    return out


def compare_row(
    row: dict, estimate_of=predict, reruns: dict[str, list[float]] | None = None
) -> CaseError:
    """The row's measurement beside a fresh prediction; a failed trace is recorded as such.
    `reruns` (`rerun_steps`): the case's step time is the median over the row and them."""
    case, m = get_case(row["name"]), row["measured"]
    steps = [m["step_s"], *(reruns or {}).get(case.name, [])]
    base = CaseError(
        case.name,
        case.family,
        case.recipe,
        case.precision,
        m["peak_allocated"],
        m["peak_reserved"],
        statistics.median(steps),
        runs=len(steps),
        step_range_s=(min(steps), max(steps)) if len(steps) > 1 else None,
    )
    try:
        est = estimate_of(case)
    except Exception as e:  # a case that fails to trace is a result, not a crash
        msg = str(e).splitlines()[0] if str(e) else ""
        return _replace(base, trace_error=f"{type(e).__name__}: {msg}"[:300])
    return _replace(
        base,
        predicted_alloc=est.memory.peak,
        predicted_reserved=predicted_reserved(est),
        predicted_step_s=est.time.step_s,
        capture_s=est.capture_s,
    )


def _replace(e: CaseError, **kw) -> CaseError:
    import dataclasses

    return dataclasses.replace(e, **kw)


def median_abs(errors: list[CaseError], what: str) -> float | None:
    """Median |error| of `what` ("alloc", "reserved", "time") over the cases that have it."""
    xs = [abs(v) for e in errors if (v := getattr(e, f"{what}_err")) is not None]
    return statistics.median(xs) if xs else None


def worst(errors: list[CaseError], what: str) -> CaseError | None:
    """The case with the largest |error| of `what`."""
    have = [e for e in errors if getattr(e, f"{what}_err") is not None]
    return max(have, key=lambda e: abs(getattr(e, f"{what}_err"))) if have else None


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.1%}"


def _gib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2**30:.2f}"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x * 1e3:.1f}"


def _runs(e: CaseError) -> str:
    """ " [median of N runs, fastest-slowest ms]" where more than one run measured the case."""
    if e.runs <= 1:
        return ""
    spread = f", {_ms(e.step_range_s[0])}-{_ms(e.step_range_s[1])}" if e.step_range_s else ""
    return f" [median of {e.runs} runs{spread}]"


def table(errors: list[CaseError]) -> str:
    """Markdown: one row per case, measured vs predicted allocated / reserved peak (GiB) and
    step time (ms; the median over the runs that measured it, with the fastest and slowest
    where more than one did), with the errors."""
    head = (
        "| case | family | precision | recipe | allocated GiB (pred) | err | "
        "reserved GiB (pred) | err | step ms (pred) | err |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for e in errors:
        if e.trace_error:
            pred = f"trace failed: {e.trace_error[:90]}"
            lines.append(
                f"| {e.name} | {e.family} | {e.precision} | {', '.join(e.recipe)} | "
                f"{_gib(e.measured_alloc)} | — | {_gib(e.measured_reserved)} | — | "
                f"{_ms(e.measured_step_s)} | {pred} |"
            )
            continue
        lines.append(
            f"| {e.name} | {e.family} | {e.precision} | {', '.join(e.recipe)} | "
            f"{_gib(e.measured_alloc)} ({_gib(e.predicted_alloc)}) | {_pct(e.alloc_err)} | "
            f"{_gib(e.measured_reserved)} ({_gib(e.predicted_reserved)}) | "
            f"{_pct(e.reserved_err)} | {_ms(e.measured_step_s)}{_runs(e)} "
            f"({_ms(e.predicted_step_s)}) | {_pct(e.time_err)} |"
        )
    return "\n".join(lines)


def summary(errors: list[CaseError]) -> list[str]:
    """Median |error| and worst case per quantity, and the cases that failed to trace."""
    out = []
    for what, label in (
        ("alloc", "allocated peak"),
        ("reserved", "reserved peak"),
        ("time", "step time"),
    ):
        med, w = median_abs(errors, what), worst(errors, what)
        if w is None:
            out.append(f"{label}: no predictions")
            continue
        out.append(
            f"{label}: median |error| {med:.1%} over "
            f"{sum(getattr(e, f'{what}_err') is not None for e in errors)} cases, worst "
            f"{_pct(getattr(w, f'{what}_err'))} ({w.name})"
        )
    failed = [e for e in errors if e.trace_error]
    out.append(
        f"failed to trace: {len(failed)} of {len(errors)}"
        + "".join(f"\n  {e.name}: {e.trace_error}" for e in failed)
    )
    return out
