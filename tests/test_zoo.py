"""The zoo (zoo/, measured by benchmarks/zoo/): models written by others, predicted on the CPU.

1. Every case traces: gobrrr.estimate runs without an exception, and the traced parameter
   count is the model's own (built apart, on the meta device).
2. Every case measured on an H100 (tests/fixtures/zoo_h100.json, written by
   benchmarks/zoo/measure.py) is predicted again here and held against the bounds below; a
   case's step time is the median over that run and the reruns on other hosts
   (`compare.RERUNS`). A failure lists every case's errors. Skipped while the file does not
   exist.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest
import torch

from zoo import compare
from zoo.cases import CASES, get_case
from zoo.common import available

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"

# The targets (zoo, H100, shipped calibration). Errors are predicted / measured - 1.
ALLOC_MEDIAN_MAX = 0.01  # median |error| of the allocated peak
ALLOC_EVERY_MAX = 0.03  # every case's |error| of the allocated peak
ALLOC_UNDER_MAX = 0.02  # never more than this under (the dangerous "fits" direction)
RESERVED_EVERY_MAX = 0.05  # every case's |error| of the reserved peak, where predicted
TIME_MEDIAN_MAX = 0.05  # median |error| of the step time
TIME_EVERY_MAX = 0.15  # every case's |error| of the step time

# Known misses, {case: {"alloc" | "reserved" | "time": cause}}: left out of the per-case
# bounds, and required to still miss them, so that a fix shows here.
KNOWN_MISSES: dict[str, dict[str, str]] = {
    "convnext_tiny-timm-gc": {
        "reserved": (
            "the real allocator trace (zoo_diagnose_plain_h100.json) replays to the "
            "GPU's 2034 MiB with the addresses cudaMalloc returned and to 1812 MiB "
            "(-10.9%) with the modelled ones (segments in the order they are made; "
            "below each other does no better): equal-size free blocks in different "
            "segments compete, the address decides, and the real step 2 then opens "
            "two more segments (74 and 148 MiB). The prediction (1810 MiB) matches the "
            "modelled replay; where the driver places segments is not predicted. "
            "tests/test_allocator.py checks every zoo trace this way"
        )
    },
    "wav2vec2-base-ctc": {
        "reserved": (
            "over-predicted (the safe side). Its config's LayerDrop (0.1) skips encoder layers at "
            "random in each measured step, where the trace runs every layer (the common branch of "
            "`torch.rand([]) < 0.1`): the allocator trace (zoo_diagnose_wav2vec2_h100.json) has "
            "1785 requests in step 1 and 1686 in steps 3-4 against 2024 predicted; and its first "
            "feature convolution asks 283 MB inside where the conv grid's class predicts 100 MB"
        )
    },
}

RESULTS = Path(os.environ.get("GOBRRR_ZOO_RESULTS", FIXTURES / "zoo_h100.json"))


def _needs(name: str):
    case = get_case(name)
    if not available(case.library):
        pytest.skip(f"{case.library} is not installed: pip install 'gobrrr[zoo]'")
    return case


@functools.cache
def _estimate(name: str):
    return compare.predict(get_case(name))


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_case_traces(name):
    case = _needs(name)
    est = _estimate(name)  # raises (the test fails) when the case does not trace
    with torch.device("meta"):
        model = case.build(case.batch, case.seq).model
    assert est.graph.meta.params == sum(p.numel() for p in model.parameters())
    assert {"forward", "backward", "optimizer"} <= {n.phase for n in est.graph.nodes}
    assert est.memory.peak > 0 and est.time.step_s > 0


def _breaks(e: compare.CaseError) -> dict[str, str]:
    """{what: line} for every per-case bound this case breaks."""
    out = {}
    if e.alloc_err is not None and (
        abs(e.alloc_err) > ALLOC_EVERY_MAX or e.alloc_err < -ALLOC_UNDER_MAX
    ):
        out["alloc"] = f"allocated peak {e.alloc_err:+.1%}"
    if e.reserved_err is not None and abs(e.reserved_err) > RESERVED_EVERY_MAX:
        out["reserved"] = f"reserved peak {e.reserved_err:+.1%}"
    if e.time_err is not None and abs(e.time_err) > TIME_EVERY_MAX:
        out["time"] = f"step time {e.time_err:+.1%}"
    return out


def known_miss_failures(
    errors: list[compare.CaseError], known: dict[str, dict[str, str]]
) -> list[str]:
    """Known misses that are met now (remove them from KNOWN_MISSES), one line each."""
    by = {e.name: _breaks(e) for e in errors if not e.trace_error}
    return [
        f"{name}: {what} is within its bound now: remove it from KNOWN_MISSES"
        for name, whats in known.items()
        for what in whats
        if name in by and what not in by[name]
    ]


def bound_failures(
    errors: list[compare.CaseError],
    known: dict[str, dict[str, str]] | None = None,
    time_median: float = TIME_MEDIAN_MAX,
) -> list[str]:
    """Every bound that the errors break, one line each (known misses left out);
    `time_median`: the bound on the median |step time error|."""
    known = known or {}
    out = [f"{e.name}: fails to trace: {e.trace_error}" for e in errors if e.trace_error]
    every = errors  # the medians are over every case, known misses included
    errors = [
        compare.CaseError(
            **{
                **e.__dict__,
                **{
                    f"predicted_{'step_s' if w == 'time' else w}": None
                    for w in known.get(e.name, {})
                },
            }
        )
        for e in errors
    ]
    for e in errors:
        if e.alloc_err is not None and abs(e.alloc_err) > ALLOC_EVERY_MAX:
            out.append(
                f"{e.name}: allocated peak {e.alloc_err:+.1%} (bound ±{ALLOC_EVERY_MAX:.0%})"
            )
        if e.alloc_err is not None and e.alloc_err < -ALLOC_UNDER_MAX:
            out.append(
                f"{e.name}: allocated peak {e.alloc_err:+.1%} under (bound -{ALLOC_UNDER_MAX:.0%})"
            )
        if e.reserved_err is not None and abs(e.reserved_err) > RESERVED_EVERY_MAX:
            out.append(
                f"{e.name}: reserved peak {e.reserved_err:+.1%} (bound ±{RESERVED_EVERY_MAX:.0%})"
            )
        if e.time_err is not None and abs(e.time_err) > TIME_EVERY_MAX:
            out.append(f"{e.name}: step time {e.time_err:+.1%} (bound ±{TIME_EVERY_MAX:.0%})")
    for what, bound in (("alloc", ALLOC_MEDIAN_MAX), ("time", time_median)):
        med = compare.median_abs(every, what)
        if med is not None and med > bound:
            out.append(f"median |{what} error| {med:.1%} (bound {bound:.0%})")
    return out


def test_bound_failures_names_each_broken_bound():
    """The checker itself, on hand-made errors: 4% over breaks the per-case memory bound, 2.2%
    under the under-bound only, a 20% slow step the time bound, and medians are checked."""
    mk = lambda name, a, t: compare.CaseError(
        name,
        "f",
        (),
        "bf16-mixed",
        1000,
        2000,
        1.0,
        predicted_alloc=a,
        predicted_reserved=None,
        predicted_step_s=t,
    )
    fails = bound_failures(
        [mk("over", 1040, 1.0), mk("under", 978, 1.0), mk("slow", 1000, 1.2), mk("ok", 1000, 1.0)]
    )
    assert any(f.startswith("over: allocated peak +4.0%") for f in fails)
    assert [f for f in fails if f.startswith("under")] == [
        "under: allocated peak -2.2% under (bound -2%)"
    ]
    assert any(f.startswith("slow: step time +20.0%") for f in fails)
    assert "median |alloc error| 1.1% (bound 1%)" in fails
    assert not [f for f in fails if f.startswith("ok")]


def test_known_misses_are_left_out_and_must_still_miss():
    mk = lambda name, a, t: compare.CaseError(
        name,
        "f",
        (),
        "bf16-mixed",
        1000,
        2000,
        1.0,
        predicted_alloc=a,
        predicted_reserved=None,
        predicted_step_s=t,
    )
    errors = [mk("slow", 1000, 1.5), mk("fixed", 1000, 1.0), mk("ok", 1000, 1.0)]
    known = {"slow": {"time": "why"}, "fixed": {"time": "why"}}
    assert not [f for f in bound_failures(errors, known) if not f.startswith("median")]
    assert known_miss_failures(errors, known) == [
        "fixed: time is within its bound now: remove it from KNOWN_MISSES"
    ]
    assert any(f.startswith("slow: step time +50.0%") for f in bound_failures(errors))


def _measured_errors(path: Path) -> list[compare.CaseError]:
    """Every case a results file measured (with its libraries installed), predicted again,
    its step time the median over the reruns too (`compare.rerun_steps`)."""
    if not path.exists():
        pytest.skip(
            f"{path.name} is not recorded yet: run benchmarks/zoo/measure.py on an "
            "H100 and commit its JSON"
        )
    rows = [
        r
        for r in compare.measured_rows(json.loads(path.read_text()))
        if available(get_case(r["name"]).library)
    ]
    if not rows:
        pytest.skip(f"{path.name} has no GPU measurement of the cases as defined now")
    reruns = compare.rerun_steps(path.parent)
    return [compare.compare_row(r, lambda case: _estimate(case.name), reruns) for r in rows]


def _assert_within(
    errors: list[compare.CaseError],
    known: dict[str, dict[str, str]],
    time_median: float = TIME_MEDIAN_MAX,
) -> None:
    fails = bound_failures(errors, known, time_median) + known_miss_failures(errors, known)
    assert not fails, "\n".join([*fails, "", *compare.summary(errors), "", compare.table(errors)])


def test_zoo_against_h100():
    _assert_within(_measured_errors(RESULTS), KNOWN_MISSES)


HOLDOUT_RESULTS = RESULTS.with_name("zoo_h100_holdout.json")
# the held-out step times' median misses the 5% target: 6.0% with every case's step the median
# of three hosts' runs (zoo_h100_holdout.json, _run2, _run3): what is claimed. ConvNeXt-V2's
# kernels are now predicted within 2.7% of the profiled ones (zoo_diagnose_patchify_h100.json),
# and its step error (-9.9%) is the device's idle time, which the host model leaves out
HOLDOUT_TIME_MEDIAN_CLAIMED = 0.06
# held-out cases (zoo.cases.HOLDOUT, measured after the model was fixed) that miss a bound
HOLDOUT_MISSES: dict[str, dict[str, str]] = {
    "efficientnet_v2_s-tv-cl": {
        "time": (
            "host-bound: its step measured 91, 109 and 118 ms on three hosts "
            "(zoo_h100_holdout.json, _run2, _run3), its timed steps spreading from 81 to 136 ms; "
            "profiled, its device phases are within 12% (zoo_profile_holdout_h100.json) and the "
            "host's per-op cost is the rest: an add costs the second and third hosts 9.4 and 13.6"
            " us a call (host_op_classes_h100.json, _run2) against the calibration host's 9.8"
        )
    },
}


def test_holdout_against_h100():
    """The held-out cases, predicted again, against the same bounds as the zoo."""
    errors = _measured_errors(HOLDOUT_RESULTS)
    assert len(errors) == 10
    _assert_within(errors, HOLDOUT_MISSES, HOLDOUT_TIME_MEDIAN_CLAIMED)


HOST_PHASES = FIXTURES / "host_phases_h100.json"


def test_the_optimizer_host_follows_its_parameter_tensors():
    """The host's time to issue the optimizer step (and zero_grad), measured on an H100 host
    for eight zoo models (benchmarks/host/host_phases.py: 148 to 452 parameter tensors; AdamW and
    SGD with weight decay), against the predicted host seconds of the optimizer phase: one
    ratio for all of them within 2x (the host's speed sets the scale, and varies by host).
    The per-op cost of tiny models alone, blind to the tensor count, left them 4.5x apart."""
    rows = json.loads(HOST_PHASES.read_text())["rows"]
    ratios = {}
    for r in rows:
        _needs(r["name"])
        pred = sum(o.host_s for o in _estimate(r["name"]).time.ops if o.phase == "optimizer")
        ratios[r["name"]] = r["optimizer"] / pred
    assert max(ratios.values()) / min(ratios.values()) < 2.0, ratios


def test_a_rerun_case_shows_its_median_and_spread():
    """A case measured on several hosts: the table gives the median step and the fastest and
    slowest run (zoo_h100_holdout.json and its two reruns: EfficientNetV2-S 91.1, 109.3 and
    118.2 ms)."""
    doc = json.loads((FIXTURES / "zoo_h100_holdout.json").read_text())
    row = next(r for r in compare.measured_rows(doc) if r["name"] == "efficientnet_v2_s-tv-cl")
    reruns = compare.rerun_steps(FIXTURES)
    e = compare.compare_row(
        row,
        estimate_of=lambda case: (_ for _ in ()).throw(RuntimeError("not traced here")),
        reruns=reruns,
    )
    assert e.runs == 3
    assert compare._runs(e) == " [median of 3 runs, 91.1-118.2]"
    assert f"{e.measured_step_s * 1e3:.1f}" == "109.3"
