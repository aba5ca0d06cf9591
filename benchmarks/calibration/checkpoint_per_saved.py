"""Derive a calibration's checkpoint surcharge per saved tensor from the one it recorded per op.

    python benchmarks/calibration/checkpoint_per_saved.py src/gobrrr/data/calibration/h100-sxm.json

`step_overhead` measured "checkpointed" (and "checkpointed_selective"): host seconds per
forward op inside a checkpointed block of its tiny GPT-2 and Llama steps. The surcharge over
the forward rate, times those ops, is the whole forward surcharge it timed; over the tensors
the same ops saved for backward it is the surcharge per saved tensor
(`checkpoint_surcharge`), what a new calibration records directly. The counts come from
tracing those tiny steps on the CPU (`tiny_counts`, the calibration's own counting; they do
not depend on the device). Sets "checkpointed_per_saved" and
"checkpointed_selective_per_saved" in the file's `op_overhead` and nothing else; prints
what it computed. `--dry-run`: print only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gobrrr.calibrate.sections.host import _tiny_workloads, checkpoint_surcharge, tiny_counts
from gobrrr.errors import GobrrrError

POLICIES = (("full", "checkpointed"), ("selective", "checkpointed_selective"))


def derive(op_overhead: dict[str, float]) -> dict[str, dict]:
    """{key + "_per_saved": the derivation} for each checkpointed key the calibration has:
    its per-op rate, the forward rate, the ops and saved tensors counted, the total surcharge
    (s, over one step of each tiny model) and the rate per saved tensor (s)."""
    out = {}
    for policy, key in POLICIES:
        if key not in op_overhead or "forward" not in op_overhead:
            continue
        counts = [tiny_counts(make, policy) for make in _tiny_workloads()]
        ops = sum(c["checkpointed"] for c in counts)
        saved = sum(c["saved"] for c in counts)
        if not saved:
            raise GobrrrError(f"{key}: the tiny steps' checkpointed ops saved no tensor")
        per_op = op_overhead[key] - op_overhead["forward"]
        out[key + "_per_saved"] = {
            "per_op_s": op_overhead[key],
            "forward_s": op_overhead["forward"],
            "ops": ops,
            "saved": saved,
            "surcharge_total_s": per_op * ops,
            "per_saved_s": checkpoint_surcharge(per_op, ops, saved),
        }
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("calibration", help="calibration JSON to set the keys in")
    p.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = p.parse_args(argv)
    path = Path(args.calibration)
    data = json.loads(path.read_text())
    found = derive(data["op_overhead"])
    print(json.dumps(found, indent=2))
    if args.dry_run:
        return
    for key, d in found.items():
        data["op_overhead"][key] = d["per_saved_s"]
    path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    main()
