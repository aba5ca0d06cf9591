"""Compiled steps measured on an H100 (benchmarks/zoo/bench_compiled.py), predicted again here.

Each measured case of tests/fixtures/compiled_h100_*.json is predicted on the CPU
(`gobrrr.estimate(..., compile=True)` for the compiled ones, their eager twins as they are)
and held against the zoo's bounds (tests/test_zoo.py): allocated peak within 3% (never more
than 2% under), reserved within 5%, step time within 15%; and what the forward keeps for
backward (the allocator's blocks made in forward and alive at its end, `forward_kept`)
against the prediction's activations. Skipped while no results file exists.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from zoo.common import available

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "tests" / "fixtures").glob("compiled_h100_*.json"))
ALLOC_MAX, ALLOC_UNDER_MAX, RESERVED_MAX, TIME_MAX = 0.03, 0.02, 0.05, 0.15
KEPT_MAX = 0.05  # what the forward keeps, |error| (ResNet-50's -4.4%: the H100 forward keeps
# one more 196 MiB bf16 activation of the stem or first stage; not yet traced to its op)
# Known misses, {case: {"alloc" | "reserved" | "time" | "kept": cause}}: required to miss.
_BERT_MATH = (
    "under torch.compile Hugging Face materialises BERT's 4-D padding mask (it cannot "
    "test it for all ones while tracing); with that mask and dropout 0.1 the H100 "
    "ran attention on the math path: its forward kept a fp32 (B, H, S, S) "
    "probability tensor and a bool dropout mask of that shape per layer (12 x 384 "
    "and 12 x 96 MiB). The trace takes cuDNN's fused attention, as eager does with "
    "a mask; which rule sends the compiled call to math is not known yet"
)
KNOWN_MISSES: dict[str, dict[str, str]] = {
    "bert-base-mlm-compiled": {"alloc": _BERT_MATH, "reserved": _BERT_MATH, "kept": _BERT_MATH},
}


def _rows() -> list[dict]:
    rows: dict[str, dict] = {}
    for path in RESULTS:  # a later run's row replaces an earlier one's
        doc = json.loads(path.read_text())
        for r in doc["cases"]:
            if "measured" in r and "peak_allocated" in r["measured"]:
                rows[r["name"]] = r
    return list(rows.values())


ROWS = _rows()


@functools.cache
def _predict(name: str):
    import gobrrr
    from zoo.compiled import case_named

    case = case_named(name)
    if not available(case.library):
        pytest.skip(f"{case.library} is not installed: pip install 'gobrrr[zoo]'")
    return gobrrr.estimate(
        case.factory(),
        gpu="h100",
        precision=case.precision,
        compile=case.compile,
        loop="drops-output",
    )


def errors(row: dict) -> dict[str, float]:
    """{what: predicted / measured - 1} of one measured case."""
    from gobrrr.evaluate import saved_activations

    est, m = _predict(row["name"]), row["measured"]
    out = {
        "alloc": est.memory.peak / m["peak_allocated"] - 1,
        "reserved": est.memory.reserved / m["peak_reserved"] - 1,
        "time": est.time.step_s / m["step_s"] - 1,
    }
    if row.get("forward_kept"):
        out["kept"] = saved_activations(est.graph) / row["forward_kept"]["bytes"] - 1
    return out


def breaks(name: str, err: dict[str, float]) -> dict[str, str]:
    bounds = {"alloc": ALLOC_MAX, "reserved": RESERVED_MAX, "time": TIME_MAX, "kept": KEPT_MAX}
    out = {k: f"{k} {e:+.1%}" for k, e in err.items() if abs(e) > bounds[k]}
    if err["alloc"] < -ALLOC_UNDER_MAX:
        out["alloc"] = f"alloc {err['alloc']:+.1%} (under)"
    return out


@pytest.mark.skipif(not ROWS, reason="no tests/fixtures/compiled_h100_*.json yet")
@pytest.mark.parametrize("name", [r["name"] for r in ROWS])
def test_measured_compiled_step_is_predicted(name):
    row = next(r for r in ROWS if r["name"] == name)
    err = errors(row)
    print(f"\n  {name:28s} " + "  ".join(f"{k} {e:+.1%}" for k, e in err.items()))
    missed = breaks(name, err)
    known = KNOWN_MISSES.get(name, {})
    assert {k: v for k, v in missed.items() if k not in known} == {}
    assert [k for k in known if k not in missed] == [], "a known miss is met now: remove it"
