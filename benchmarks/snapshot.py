"""Every recorded prediction, computed now, to the last bit: a refactoring's proof of no change.

    python benchmarks/snapshot.py --out /tmp/before.json [--only suite,zoo,holdout,plan]
    python benchmarks/snapshot.py --compare /tmp/before.json /tmp/after.json

Predicts, on this machine's CPU with the shipped H100 calibration, each case a committed GPU
result holds: the built-in suite (`estimate_suite_h100.json`), the zoo (`zoo_h100.json`), the
held-out zoo (`zoo_h100_holdout.json`) and every configuration the planner's GPU runs measured
(`plan_h100_*.json`, costed with `Planner.cost` as `plan_repredict.py` does). For each it
records the step's figures (seconds, bytes, FLOPs) as exact float reprs, and a SHA-256 over
every op's (device_s, host_s, compute_s, memory_s, regime), so two snapshots are equal only if
every op's time is. `--compare` prints what differs and exits 1 if anything does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

PARTS = ("suite", "zoo", "holdout", "plan")


def figures(est) -> dict:
    """The figures of one Estimate that a refactoring must leave bit-identical."""
    t, m = est.time, est.memory
    digest = hashlib.sha256()
    for o in t.ops:
        digest.update(
            repr(
                (o.index, o.device_s, o.host_s, o.compute_s, o.memory_s, o.regime, o.flops, o.bytes)
            ).encode()
        )
    return {
        "step_s": repr(t.step_s),
        "device_s": repr(t.device_s),
        "host_s": repr(t.host_s),
        "idle_s": repr(t.idle_s),
        "flops": repr(t.flops),
        "model_flops": repr(t.model_flops),
        "clock_fraction": repr(t.clock_fraction),
        "peak": m.peak,
        "reserved": m.reserved,
        "ops": len(t.ops),
        "ops_sha256": digest.hexdigest(),
    }


def suite() -> dict:
    import gobrrr

    data = json.loads((FIXTURES / "estimate_suite_h100.json").read_text())
    out = {}
    for c in data["cases"]:
        key = (
            f"{c['model']} b{c['batch']} s{c['seq']} {c['precision']} "
            f"ckpt={c['checkpoint']} compile={c['compile']}"
        )
        est = gobrrr.estimate(
            c["model"],
            "h100",
            batch=c["batch"],
            seq=c["seq"],
            precision=c["precision"],
            checkpoint=c["checkpoint"],
            compile=c["compile"],
            loop="drops-output",  # the recorded steps ran gobrrr's TrainStep
        )
        out[key] = figures(est)
    return out


def zoo(holdout: bool) -> dict:
    from zoo.cases import CASES, HOLDOUT
    from zoo.compare import predict

    out = {}
    for case in HOLDOUT if holdout else CASES:
        try:
            out[case.name] = figures(predict(case))
        except Exception as e:  # a trace that fails is a figure too: it must fail the same way
            out[case.name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def plan() -> dict:
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.search import Planner
    from zoo.scenarios import SCENARIOS

    out = {}
    for path in sorted(FIXTURES.glob("plan_h100_*.json")):
        data = json.loads(path.read_text())
        for name, sc in (data.get("scenarios") or {}).items():
            source, seq, g, precision, *rest = SCENARIOS[name]
            planner = Planner(
                source,
                "h100",
                global_batch=g,
                seq=seq,
                precision=precision,
                allow=rest[0] if rest else (),
            )
            for c in sc["configs"]:
                key = f"{path.name} {name} {json.dumps(c['knobs'], sort_keys=True)}"
                p = planner.cost(Knobs.from_dict(c["knobs"]))
                out[key] = {
                    "step_s": repr(p.step_s),
                    "peak": p.peak_bytes,
                    "reserved": p.reserved_bytes,
                }
    return out


def snapshot(parts: list[str]) -> dict:
    out = {}
    for part in parts:
        t = time.perf_counter()
        out[part] = {
            "suite": suite,
            "zoo": lambda: zoo(False),
            "holdout": lambda: zoo(True),
            "plan": plan,
        }[part]()
        print(f"{part}: {len(out[part])} cases in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return out


def compare(a: dict, b: dict) -> list[str]:
    """Lines naming each case and figure that differs between snapshots `a` and `b`."""
    diffs = []
    for part in sorted(set(a) | set(b)):
        pa, pb = a.get(part, {}), b.get(part, {})
        for key in sorted(set(pa) | set(pb)):
            fa, fb = pa.get(key), pb.get(key)
            if fa is None or fb is None:
                diffs.append(f"{part} {key}: only in {'second' if fa is None else 'first'}")
                continue
            for f in sorted(set(fa) | set(fb)):
                if fa.get(f) != fb.get(f):
                    diffs.append(f"{part} {key} {f}: {fa.get(f)} -> {fb.get(f)}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the snapshot here (JSON)")
    ap.add_argument("--only", default=",".join(PARTS), help=f"parts: {','.join(PARTS)}")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(a["parts"], b["parts"])
        cases = sum(len(v) for v in a["parts"].values())
        print(
            "\n".join(diffs)
            or f"identical: {cases} cases in "
            f"{', '.join(f'{k} {len(v)}' for k, v in a['parts'].items())}"
        )
        return 1 if diffs else 0
    parts = [p.strip() for p in args.only.split(",") if p.strip()]
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown part(s) {', '.join(bad)}: choose from {', '.join(PARTS)}")
    import subprocess

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {"version": 1, "commit": commit, "parts": snapshot(parts)}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
