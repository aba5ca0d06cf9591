"""gobrrr's multi-GPU predictions against every measured step: DDP and FSDP2, H100 and H200.

    PYTHONPATH=src python benchmarks/multigpu/compare.py [--cases KEY ...]
        [--readme [docs/accuracy.md]]
    PYTHONPATH=src python benchmarks/multigpu/compare.py --table-only --readme

For every case of every `benchmarks/results/multigpu_steps_*.json` (recorded by `steps.py`),
the step is predicted on this machine's CPU as `gobrrr.estimate(..., gpus=world,
parallel=...)` predicts it: the `transformers` model of the case's shape (`steps.SHAPES`), the
per-rank batch, torchtitan's loop (cross-entropy on the `.float()` logits, the logits dropped
before backward, AdamW lr 1e-4 foreach), the model's own non-reentrant checkpointing, traced
in `estimate.traced_precision("bf16-mixed", ...)` (DDP: autocast over fp32 weights; FSDP2:
the bf16 trace), `passes.accumulate` for accumulation, then `estimate.shard` (FSDP2 without
resharding after forward: `passes.fsdp` with `reshard_after_forward=False`, which `shard`
does not expose), evaluated on the measuring machine's spec (`h100` or `h200`) with the
shipped H100 calibration (the only one, and the only measured collectives): H200 times are
an indication only; memory does not depend on the GPU.

Per case: per-rank allocated and reserved peaks (max over ranks), the step (slowest rank's
median), exposed communication. The measured exposed communication differs a lot between
ranks: a rank that reaches a collective first waits inside the NCCL kernel for the others,
so its exposed time includes the skew between ranks; the min, median and max over ranks are
kept. Where `steps.py` split every NCCL kernel where the last rank arrived (waiting for other
ranks, then transfer), the prediction (ranks in lockstep, a collective costs its transfer
only) is compared with the median rank's exposed transfer; in older results, without the
split, with the min exposed: the rank whose NCCL kernels wait least is the one closest to
that model. `measured.comm_exposed_against` says which.

Writes `benchmarks/results/multigpu_predictions.json`; `--readme` writes the table (built
from that JSON) between the multigpu-table markers of docs/accuracy.md. Traces are cached
under /tmp/multigpu_graphs (keyed by shape, batch, sequence, checkpointing, precision).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gobrrr
from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.estimate import shard, traced_precision
from gobrrr.evaluate import evaluate
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target, find_calibration, get_gpu
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.fsdp import fsdp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE.parent / "results"
OUT = RESULTS / "multigpu_predictions.json"
CACHE = Path("/tmp/multigpu_graphs")
sys.path[:0] = [str(HERE), str(HERE.parent)]
from readme_block import write_table  # noqa: E402
from steps import SHAPES  # noqa: E402

START = "<!-- multigpu-table: start (benchmarks/multigpu/compare.py --readme) -->"
END = "<!-- multigpu-table: end -->"
#: the calibration every prediction uses: the only one shipped, with measured collectives
CALIBRATION_GPU = "h100"
GIB = 2**30


def gpu_of(meta: dict) -> str:
    """The built-in spec (`gobrrr gpus`) of the device a results file was measured on."""
    return "h200" if "H200" in meta["device"] else "h100"


def workload(shape: str, batch: int, seq: int, checkpoint: bool) -> gobrrr.Workload:
    """One micro-batch of the case's step on one rank, as `steps.py` runs it (unwrapped)."""
    import transformers  # the zoo extra: only the predictions need it, not the table

    cls, kw = SHAPES[shape]
    config = getattr(transformers, cls)(**kw)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))

    def step(m, b):
        logits = m(input_ids=b[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), b[:, 1:].flatten())

    return gobrrr.Workload(
        model=model,
        batch=tokens,
        step=step,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
        tokens=batch * seq,
        seq_len=seq,
        name=shape,
    )


def traced(case: dict, target: Target) -> StepGraph:
    """The one-rank step graph as `gobrrr.estimate` captures it, from the cache when there."""
    precision = traced_precision("bf16-mixed", case["world"], case["parallel"])
    sdpa = target_for(target.gpu.full_name)
    key = (
        f"{case['shape']}-b{case['batch']}-s{case['seq']}{'-ckpt' if case['checkpoint'] else ''}"
        f"-{precision}-sm{sdpa.capability[0]}{sdpa.capability[1]}"
    )
    path = CACHE / f"{key}.json"
    if path.exists():
        return StepGraph.load(path)
    t = time.perf_counter()
    graph = capture(
        lambda: workload(case["shape"], case["batch"], case["seq"], case["checkpoint"]),
        precision=precision,
        sdpa=sdpa,
    )
    CACHE.mkdir(parents=True, exist_ok=True)
    graph.save(path)
    print(f"  traced {key} in {time.perf_counter() - t:.0f} s", flush=True)
    return graph


def predict(case: dict, target: Target) -> dict:
    """The prediction of one case on `target` (per rank)."""
    t0 = time.perf_counter()
    graph = traced(case, target)
    if case["accumulation"] > 1:
        graph = accumulate(graph, case["accumulation"])
    if case["parallel"] == "fsdp" and not case["reshard"]:
        graph = fsdp(graph, case["world"], 1, reshard_after_forward=False)
    else:
        graph = shard(graph, case["parallel"], case["world"])
    est = evaluate(graph, target)
    return {
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "step_s": est.time.step_s,
        "comm_busy_s": est.time.comm_s,
        "comm_exposed_s": est.time.exposed_comm_s,
        "comm_by_collective": est.time.comm_by_collective,
        "peak_phase": est.memory.peak_phase,
        "peak_op": est.memory.peak_op,
        "seconds": time.perf_counter() - t0,
    }


def measured(case: dict) -> dict:
    """The job's figures, with the exposed communication's spread over ranks, and where the
    ranks' NCCL kernels were split (results since the split), the exposed transfer's and the
    waiting for other ranks' spread; `comm_exposed_against`: the figure a prediction of
    exposed communication is compared with."""
    m, ranks = case["measured"], case["ranks"]
    out = {
        "peak_allocated": m["peak_allocated"],
        "peak_reserved": m["peak_reserved"],
        "step_s": m["step_s"],
        **_spread("comm_exposed_s", [r["comm_exposed_s"] for r in ranks]),
        "comm_exposed_s_ranks": [r["comm_exposed_s"] for r in ranks],
        "comm_busy_s_min": min(r["comm_busy_s"] for r in ranks),
        "comm_busy_s_max": max(r["comm_busy_s"] for r in ranks),
        "comm_exposed_against": "comm_exposed_s_min",
    }
    if all(r.get("comm_transfer_exposed_s") is not None for r in ranks):
        for key in ("comm_transfer_exposed_s", "comm_wait_s"):
            out.update(_spread(key, [r[key] for r in ranks]))
        out["comm_exposed_against"] = "comm_transfer_exposed_s_median"
        kinds = sorted({k for r in ranks for k in r["collectives"]})
        out["comm_by_collective"] = {
            k: {
                f"{f}_median": statistics.median(
                    r["collectives"].get(k, {}).get(f) or 0.0 for r in ranks
                )
                for f in ("transfer_busy_s", "transfer_exposed_s", "wait_s")
            }
            for k in kinds
        }
    return out


def _spread(key: str, xs: list[float]) -> dict:
    """{key_min, key_median, key_max} over the ranks."""
    return {f"{key}_min": min(xs), f"{key}_median": statistics.median(xs), f"{key}_max": max(xs)}


def errors(m: dict, p: dict) -> dict:
    """predicted / measured - 1 per column; exposed communication as predicted - measured
    (s; a few milliseconds, where a ratio says little) against `m["comm_exposed_against"]`:
    the median rank's exposed transfer, or without the split the ranks' min exposed."""
    out = {k: p[k] / m[k] - 1 for k in ("peak_allocated", "peak_reserved", "step_s")}
    against = m.get("comm_exposed_against", "comm_exposed_s_min")
    return {**out, "comm_exposed_s": p["comm_exposed_s"] - m[against]}


def sources() -> list[Path]:
    return sorted(RESULTS.glob("multigpu_steps_*.json"))


def latest(files: list[Path]) -> tuple[list[tuple[Path, dict, str, dict]], list[dict]]:
    """The cases to compare: of a case measured more than once on one GPU kind (same key:
    name and world size), the latest run by its file's date stands (a re-run with the
    wait/transfer split supersedes one without); the others are listed as superseded.
    Returns ([(file, its data, key, case)] in results-file order, [superseded: where, when])."""
    runs = []
    for src in files:
        data = json.loads(src.read_text())
        for key, case in data["cases"].items():
            if "measured" in case and case["world"] > 1:  # one rank: a baseline, not a case
                runs.append((src, data, key, case))
    newest: dict[tuple[str, str], str] = {}
    for _src, data, key, _ in runs:
        k = (gpu_of(data["meta"]), key)
        newest[k] = max(newest.get(k, ""), data["meta"]["date"])
    kept, superseded = [], []
    for run_ in runs:
        src, data, key, _ = run_
        if data["meta"]["date"] == newest[(gpu_of(data["meta"]), key)]:
            kept.append(run_)
        else:
            superseded.append({"key": key, "source": src.name, "date": data["meta"]["date"]})
    return kept, superseded


def run(keys: list[str] | None) -> dict:
    """Every case's prediction, measurement and error (the latest run of each), grouped in
    results-file order."""
    cal = find_calibration(get_gpu(CALIBRATION_GPU))
    rows = []
    kept, superseded = latest(sources())
    for src, data, key, case in kept:
        gpu = gpu_of(data["meta"])
        target = Target.resolve(gpu, cal)
        if keys and key not in keys and case["name"] not in keys:
            continue
        p = predict(case, target)
        m = measured(case)
        rows.append(
            {
                "key": key,
                "source": src.name,
                "gpu": gpu,
                "device": data["meta"]["device"],
                "case": {k: v for k, v in case.items() if k not in ("ranks", "measured")},
                "measured": m,
                "predicted": p,
                "error": errors(m, p),
            }
        )
        print(line(rows[-1]), flush=True)
    return {"cases": rows, "summary": summary(rows), "superseded": superseded}


def summary(rows: list[dict]) -> dict:
    """Median and worst |error| of each column, per GPU."""
    out = {}
    for gpu in sorted({r["gpu"] for r in rows}):
        errs = [r["error"] for r in rows if r["gpu"] == gpu]
        col = {}
        for k in errs[0]:
            xs = [e[k] for e in errs]
            worst = max(xs, key=abs)
            col[k] = {"median_abs": statistics.median(abs(x) for x in xs), "worst": worst}
        hits = [exposed_hit(r) for r in rows if r["gpu"] == gpu]
        col["comm_exposed_s"]["within_20pct_or_1ms"] = sum(hits)
        out[gpu] = {"cases": len(errs), **col}
    return out


def exposed_hit(row: dict) -> bool:
    """Whether a case's exposed communication is within the target: 20% of the measured
    figure it is set against, or 1 ms (a few hundred microseconds of a small step's exposed
    transfer is within the profile's own spread)."""
    m, p = row["measured"], row["predicted"]
    measured = m[m.get("comm_exposed_against", "comm_exposed_s_min")]
    miss = abs(p["comm_exposed_s"] - measured)
    return miss <= 1e-3 or miss <= 0.2 * measured


def versions() -> dict:
    import transformers

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "commit": commit,
        "gobrrr": gobrrr.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def pct(x: float) -> str:
    return f"{x:+.0%}" if abs(x) >= 0.1 else f"{x:+.1%}"


def line(r: dict) -> str:
    m, p, e = r["measured"], r["predicted"], r["error"]
    return (
        f"{r['gpu']} {r['key']:44s} alloc {m['peak_allocated'] / GIB:6.2f} "
        f"{p['peak_allocated'] / GIB:6.2f} {pct(e['peak_allocated']):>6} | reserved "
        f"{m['peak_reserved'] / GIB:6.2f} {p['peak_reserved'] / GIB:6.2f} "
        f"{pct(e['peak_reserved']):>6} | step {m['step_s'] * 1e3:6.1f} {p['step_s'] * 1e3:6.1f} "
        f"{pct(e['step_s']):>6} | exposed {m['comm_exposed_s_min'] * 1e3:5.1f}/"
        f"{m['comm_exposed_s_median'] * 1e3:5.1f}/{m['comm_exposed_s_max'] * 1e3:5.1f} "
        f"{p['comm_exposed_s'] * 1e3:5.1f}"
        + (
            f" | transfer {m['comm_transfer_exposed_s_median'] * 1e3:5.1f} waiting "
            f"{m['comm_wait_s_median'] * 1e3:5.1f}"
            if "comm_transfer_exposed_s_median" in m
            else ""
        )
    )


def exposed_cell(m: dict, p: dict) -> str:
    """The table's exposed communication (ms): measured min / median / max over ranks, then
    where split the median rank's exposed transfer and waiting for other ranks, then the
    prediction."""
    ms = [m[f"comm_exposed_s_{s}"] * 1e3 for s in ("min", "median", "max")]
    cell = f"{ms[0]:.1f} / {ms[1]:.1f} / {ms[2]:.1f}"
    if "comm_transfer_exposed_s_median" in m:
        cell += (
            f" (transfer {m['comm_transfer_exposed_s_median'] * 1e3:.1f}, waiting "
            f"{m['comm_wait_s_median'] * 1e3:.1f})"
        )
    return f"{cell}, {p['comm_exposed_s'] * 1e3:.1f}"


def table(doc: dict) -> str:
    """The table of docs/accuracy.md, from the JSON."""
    head = (
        "| case (per-rank batch x seq) | GPUs | allocated GiB: measured, predicted | "
        "reserved GiB | step ms | exposed comm ms: measured min / median / max, predicted |\n"
        "|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in doc["cases"]:
        m, p, e = r["measured"], r["predicted"], r["error"]
        lines.append(
            f"| {r['case']['name']} | {r['case']['world']}x {r['gpu'].upper()} | "
            f"{m['peak_allocated'] / GIB:.2f}, {p['peak_allocated'] / GIB:.2f} "
            f"({pct(e['peak_allocated'])}) | "
            f"{m['peak_reserved'] / GIB:.2f}, {p['peak_reserved'] / GIB:.2f} "
            f"({pct(e['peak_reserved'])}) | "
            f"{m['step_s'] * 1e3:.1f}, {p['step_s'] * 1e3:.1f} ({pct(e['step_s'])}) | "
            f"{exposed_cell(m, p)} |"
        )
    lines.append("")
    for gpu, s in doc["summary"].items():
        cols = ", ".join(
            f"{name} {pct(s[k]['median_abs']).lstrip('+')} ({pct(s[k]['worst'])})"
            for k, name in (("peak_allocated", "allocated"), ("peak_reserved", "reserved"))
        )
        c = s["comm_exposed_s"]
        lines.append(
            f"{gpu.upper()}, {s['cases']} cases, median |error| (worst): {cols}, step "
            f"{pct(s['step_s']['median_abs']).lstrip('+')} ({pct(s['step_s']['worst'])}), "
            f"exposed comm against {_against(doc, gpu)} {c['median_abs'] * 1e3:.1f} ms "
            f"({c['worst'] * 1e3:+.1f} ms), within 20% or 1 ms in {c['within_20pct_or_1ms']} of "
            f"{s['cases']}.  "
        )
    lines.append(
        "Errors are predicted / measured - 1 (exposed comm: predicted - measured). Every "
        "prediction uses the H100 calibration (the only one shipped), whose measured rates "
        "replace the datasheet's: an H200 case's predicted time is the H100's, an indication "
        "only; memory does not depend on the GPU. Measured exposed communication is the time "
        "NCCL kernels run with no other kernel beside them, per rank; a rank that reaches a "
        "collective early waits inside the kernel for the others, so the prediction (ranks "
        "in lockstep) is set against the median rank's exposed transfer (each NCCL kernel "
        "from the last rank's arrival on) where measured, else the rank with the least. "
        f"Commit {doc['versions']['commit'][:10]}; "
        "`benchmarks/results/multigpu_predictions.json`."
    )
    return "\n".join(lines)


def _against(doc: dict, gpu: str) -> str:
    """What a GPU's cases' exposed communication was compared with, in words."""
    against = {r["measured"].get("comm_exposed_against") for r in doc["cases"] if r["gpu"] == gpu}
    words = {
        "comm_transfer_exposed_s_median": "the median rank's transfer",
        "comm_exposed_s_min": "the min rank",
        None: "the min rank",
    }
    return " / ".join(sorted({words[a] for a in against}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", help="case keys or names (default: every case)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--readme", nargs="?", const=str(ROOT / "docs" / "accuracy.md"), default=None)
    ap.add_argument("--table-only", action="store_true", help="rebuild the table from --out")
    args = ap.parse_args()
    if args.table_only:
        doc = json.loads(args.out.read_text())
    else:
        doc = {
            "versions": versions(),
            "calibration": f"{CALIBRATION_GPU} (shipped); H200 times are an indication only",
            "exposed_comm_compared_with": (
                "median over ranks of the exposed transfer where split, else min over ranks "
                "of the exposed (per case: measured.comm_exposed_against)"
            ),
            **run(args.cases),
        }
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")
    text = table(doc)
    print(text)
    if args.readme:
        write_table(Path(args.readme), START, END, text)


if __name__ == "__main__":
    main()
