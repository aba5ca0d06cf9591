"""The offload configurations benchmarks/calibration/bench_offload.py measures on a GPU, and
their prediction on any CPU, which tests/test_offload.py holds against
tests/fixtures/offload_h100_run2.json.
"""

from __future__ import annotations

import dataclasses

from gobrrr.hardware import Target, find_calibration, get_gpu
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import Planner

#: name -> (built-in workload, seq, global batch, knobs); precision bf16-mixed throughout
CONFIGS = {
    "gpt2-offload": ("gpt2", 1024, 8, {"micro_batch": 8, "offload": True}),
    "llama3-1b-offload": ("llama3-1b", 1024, 4, {"micro_batch": 4, "offload": True}),
    "gpt2-acc2-offload": ("gpt2", 1024, 8, {"micro_batch": 4, "accumulation": 2, "offload": True}),
    "llama3-3b-offload": ("llama3-3b", 1024, 2, {"micro_batch": 2, "offload": True}),
    "llama3-1b-acc2-offload": (
        "llama3-1b",
        1024,
        4,
        {"micro_batch": 2, "accumulation": 2, "offload": True},
    ),
    "gpt2-plain": ("gpt2", 1024, 8, {"micro_batch": 8}),
    "llama3-1b-plain": ("llama3-1b", 1024, 4, {"micro_batch": 4}),
}
PRECISION = "bf16-mixed"


def predicted(results: dict, calibration=None) -> dict:
    """Each configuration's prediction on the shipped H100 calibration with the offload
    section measured in `results` (or `calibration`'s own), beside what was measured:
    {name: {"predicted": {...}, "measured": {...}, "errors": {...}}}."""
    gpu = get_gpu("h100")
    cal = calibration or find_calibration(gpu)
    section = (results.get("section") or {}).get("offload")
    if section:
        cal = dataclasses.replace(cal, offload=section)
    target, out, planners = Target(gpu, cal), {}, {}
    for name, m in results["measured"].items():
        source, seq, g, knobs = CONFIGS[name]
        key = (source, seq, g)
        if key not in planners:
            planners[key] = Planner(
                source, target, global_batch=g, seq=seq, precision=PRECISION, allow=["offload"]
            )
        p = planners[key].cost(Knobs.from_dict(knobs))
        pred = {
            "step_s": p.step_s,
            "peak_allocated": p.peak_bytes,
            "peak_reserved": p.reserved_bytes,
            "host_bytes": p.host_bytes,
            "host_pinned_bytes": p.host_pinned_bytes,
        }
        row = {
            "predicted": pred,
            "measured": {
                k: m.get(k)
                for k in (
                    "step_s",
                    "to_optimizer_s",
                    "optimizer_s",
                    "peak_allocated",
                    "peak_reserved",
                    "error",
                )
            },
        }
        host = m.get("host") or {}
        if host:  # pinned: the host allocator's count (its power-of-two blocks) where known
            pinned = (host.get("host_allocator") or {}).get(
                "allocated_bytes.current", host["pinned_tensor_bytes"]
            )
            row["measured"].update(
                host_bytes=pinned + host["state_bytes"], host_pinned_bytes=pinned
            )
        row["errors"] = {
            k: pred[k] / row["measured"][k] - 1 for k in pred if row["measured"].get(k)
        }
        out[name] = row
    return out
