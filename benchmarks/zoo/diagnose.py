"""Why a zoo case's reserved peak or step time is off: the real allocator sequence, op by op,
and the device time per kernel kind, recorded on a GPU.

    PYTHONUNBUFFERED=1 python benchmarks/zoo/diagnose.py --out OUT.json \
        [--alloc-cases NAME,NAME] [--profile-cases NAME,NAME] [--parallel 5]
    python benchmarks/zoo/diagnose.py --out /tmp/d.json --device cpu --alloc-cases \
        vit_b_16-tv --profile-cases "" --batch 2      # a dry run of the tagging on the CPU

1. Allocator traces (`--alloc-cases`), each case in a fresh process as measure.py runs it:
   the case built on the device, prepared, then 4 steps (measure.py's 3 warm-ups and its first
   timed step) under `torch.cuda.memory._record_memory_history` and a dispatch mode that marks
   where each ATen op starts in the allocator's event stream. Kept per case, compactly: every
   alloc, free and segment event from the build on ([kind, bytes or alloc id, op id]; kind
   0 alloc of the bytes requested, 1 free of the alloc with that id (its index among the
   allocs), 2 segment alloc and 3 segment free, with the segment's address), the
   ops that own an event ([op, module, phase, autograd node]; the module in forward, the
   autograd node in backward), where each phase starts, the counters after each step, the
   peaks of the last step (reset at its start) and the segments at the end.
   With `--plain`, neither the dispatch mode nor the module hooks run: the events are those of
   the step exactly as measure.py runs it, without op labels (a Python dispatch mode can change
   which kernels, and so which workspaces, an op takes), and zoo/allocdiff.py compares bytes.
2. Per-kernel comparisons (`--profile-cases`): as zoo/profile_compare.py (gobrrr's prediction
   beside gobrrr.profile of the same step, joined kernel by kernel: per kernel kind, module,
   phase), plus per ATen op, the single ops with the largest gaps and the measured ops joined
   to no predicted op; each case in a fresh process, one at a time after the traces so the
   GPU is quiet.

An error is recorded per item, never fatal; OUT.json is rewritten after every item.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [
    str(HERE.parents[2] / "src"),
    str(HERE.parents[2]),
    str(HERE.parents[1]),
    str(HERE.parent),
]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from zoo.allocdiff import compact_trace  # noqa: E402

VERSION = 1
STEPS = 4  # measure.py: 3 warm-ups, then the peaks are reset and the timed steps run
ALLOC_CASES = (
    "mobilenet_v3_large-tv",
    "bert-base-mlm-fp32",
    "efficientnet_b0-timm-fp32",
    "vit_b_16-tv",
    "resnet50-tv-fp32",
    "resnet50-tv-cl",
    "resnet50d-timm-cl",
    "whisper-base",
    "bert-base-mlm",
)
PROFILE_CASES = ("deberta-v3-base-mlm", "wav2vec2-base-ctc", "qwen2-moe-small-bf16")


# -- the child: one case's allocator trace ---------------------------------------------------


class _Names:
    """Interned strings: each distinct string once, events refer to it by index."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, s: str) -> int:
        return self.ids.setdefault(s, len(self.ids))

    def table(self) -> list[str]:
        return list(self.ids)


_BASE = [0, 0]  # the counts when the recording started: the trace's events count from there


def _counts(device: int | None) -> tuple[int, int]:
    """(allocations, frees) the caching allocator made since the recording started; (0, 0)
    on the CPU (a dry run)."""
    if device is None:
        return 0, 0
    s = torch.cuda.memory_stats_as_nested_dict(device)["allocation"]["all"]
    return s["allocated"] - _BASE[0], s["freed"] - _BASE[1]


def _autograd_node():
    """The autograd node running now (backward), or None."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


class OpMarks(TorchDispatchMode):
    """Records, for every ATen op, the allocator's cumulative (allocs, frees) when it starts,
    with its name, the innermost module running (forward) and the autograd node (backward)."""

    def __init__(self, device: int, names: _Names, where: dict) -> None:
        super().__init__()
        self.device, self.names, self.where = device, names, where
        self.marks: list[tuple[int, int, int, int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        node = _autograd_node()
        mod = (
            self.where["module"][-1]
            if threading.current_thread() is threading.main_thread() and self.where["module"]
            else ""
        )
        a, f = _counts(self.device)
        self.marks.append(
            (
                a,
                f,
                self.names(str(func)),
                self.names(mod),
                self.names(self.where["phase"]),
                self.names(node.name() if node is not None else ""),
            )
        )
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def module_names(model: torch.nn.Module, where: dict):
    """Keeps where["module"] a stack of the qualified names of the modules running."""
    names = {id(m): n for n, m in model.named_modules()}
    stack = where["module"]

    def pre(m, args):
        stack.append(names.get(id(m), type(m).__name__))

    def post(m, args, out):
        if stack:
            stack.pop()

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


def segments_now() -> list[list]:
    """[pool ("small" | "large"), total bytes, [[block bytes, allocated?], ...]] per segment,
    by address."""
    segs = sorted(torch.cuda.memory_snapshot(), key=lambda s: s["address"])
    return [
        [
            s["segment_type"],
            s["total_size"],
            [[b["size"], int(b["state"] == "active_allocated")] for b in s["blocks"]],
        ]
        for s in segs
    ]


class _NoMarks(contextlib.nullcontext):
    """`--plain`: no dispatch mode; no op marks."""

    marks: list = []


def trace_case(name: str, device: str, batch: int | None, plain: bool = False) -> dict:
    """One case's allocator trace, from the build through STEPS steps (see the docstring).
    `plain`: no dispatch mode and no module hooks (the events carry no op labels)."""
    from gobrrr.profile.runner import prepare
    from gobrrr.training.step import TrainStep
    from zoo.cases import get_case

    case = get_case(name)
    cuda = device.startswith("cuda")
    idx = (torch.device(device).index or 0) if cuda else None
    if cuda:
        torch.cuda.init()
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=4_000_000
        )
        _BASE[:] = _counts(idx)
    names, where = _Names(), {"phase": "build", "module": [], "step": 0}
    phases: list[tuple[str, tuple[int, int]]] = [("build", _counts(idx))]
    counts0 = _counts(idx)
    torch.manual_seed(0)
    with torch.device(device):
        wl = case.build(batch or case.batch, case.seq)
    wl, opt, scaler = prepare(wl, device, case.precision, "none", case.compile)

    @contextlib.contextmanager
    def phase(label):
        where["phase"] = label
        phases.append((f"step{where['step']}:{label}", _counts(idx)))
        yield

    after = []
    marks = _NoMarks() if plain else OpMarks(idx, names, where)
    hooks = contextlib.nullcontext() if plain else module_names(wl.model, where)
    with hooks, marks:
        for s in range(1, STEPS + 1):
            where["step"] = s
            if s == STEPS and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            TrainStep(
                wl,
                opt,
                case.precision,
                device_type=device.split(":")[0],
                scaler=scaler,
                phase=phase,
            )()
            if cuda:
                torch.cuda.synchronize()
                after.append(
                    {
                        "allocated": torch.cuda.memory_allocated(),
                        "reserved": torch.cuda.memory_reserved(),
                    }
                )
    out = {
        "name": name,
        "batch": batch or case.batch,
        "seq": case.seq,
        "precision": case.precision,
        "steps": STEPS,
        "after_step": after,
        "counts": [counts0, _counts(idx)],
        "op_marks": len(marks.marks),
        "plain": plain,
    }
    if not cuda:  # a dry run: the tagging ran, there is no allocator to read
        return {**out, **compact_trace([], marks.marks, phases), "strings": names.table()}
    out.update(
        max_memory_allocated=torch.cuda.max_memory_allocated(),
        max_memory_reserved=torch.cuda.max_memory_reserved(),
        stats={
            k: v
            for k, v in torch.cuda.memory_stats(idx).items()
            if k.startswith(("segment.", "reserved_bytes.", "num_"))
        },
    )
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][idx]
    compact = compact_trace(trace, marks.marks, phases)
    # the op tags hold only if the trace saw every alloc and free the counters did
    traced = [sum(e[0] == k for e in compact["events"]) for k in (0, 1)]
    return {
        **out,
        "trace_entries": len(trace),
        "segments_end": segments_now(),
        **compact,
        "strings": names.table(),
        "traced_vs_counted": [traced, list(_counts(idx))],
    }


# -- the child: one case's per-kernel comparison ---------------------------------------------


def profile_case(name: str, device: str, batch: int | None) -> dict:
    """zoo/profile_compare.py's comparison (per kernel kind, module, phase), plus the same per
    ATen op, the ops with the largest device-time gap and the measured ops joined to no
    predicted op, by name."""
    import gobrrr
    from gobrrr.hardware import find_calibration, get_gpu, match_device_name
    from gobrrr.profile.api import profile
    from gobrrr.profile.compare import compare
    from zoo.cases import get_case

    case = get_case(name)
    spec = (
        match_device_name(torch.cuda.get_device_name()) if device == "cuda" else None
    ) or get_gpu("h100")
    cal = find_calibration(spec)
    kw = {"batch_size": batch} if batch else {}
    est = gobrrr.estimate(
        lambda: case.factory()(**kw),
        gpu=spec,
        precision=case.precision,
        compile=case.compile,
        calibration=cal,
        loop="drops-output",  # profile measures gobrrr's TrainStep
    )
    res = profile(
        case.factory()(**kw),
        device=device,
        precision=case.precision,
        compile=case.compile,
        graph=est.graph,
        calibration=cal,
        steps=3 if device == "cpu" else 10,
    )
    pred = {p.index: p for p in est.time.ops}
    joined = [(pred[m.node], m) for m in res.ops if m.node in pred]
    return {
        "name": name,
        "predicted_step_s": est.time.step_s,
        "measured_step_s": res.step_s,
        "predicted_device_s": sum(p.device_s for p in est.time.ops),
        "measured_busy_s": res.busy_s,
        "measured_idle_s": res.idle_s,
        "compare": compare(est.time, res).to_dict(),
        "aten": by_aten(joined),
        "worst_ops": worst_ops(joined),
        "unjoined": unjoined(res.ops, pred),
        "idle": idle_by_phase(est.time.ops, res),
    }


def idle_by_phase(predicted, res) -> dict:
    """Where the device sat idle, by the phase of the op it then ran: measured, the gaps
    before each op's first kernel in the profiled step (the profiler's own host cost widens
    them) and the rest of the timed step (before the first kernel, after the last, the
    timed step less the profiled one); predicted, the same gaps in a plain two-queue
    replay of the predicted ops (host issues each op in turn, the device runs it once issued
    and free; no syncs), with the largest single gaps of each."""
    measured: dict[str, float] = {}
    for m in res.ops:
        measured[m.phase] = measured.get(m.phase, 0.0) + m.gap_s
    replay: dict[str, float] = {}
    host = dev = 0.0
    gaps = []
    for o in predicted:
        host += o.host_s
        gap = max(0.0, host - dev)
        replay[o.phase] = replay.get(o.phase, 0.0) + gap
        if gap > 0:
            gaps.append((gap, o.op, o.module, o.phase))
        dev = max(host, dev) + o.device_s
    top = sorted(res.ops, key=lambda m: -m.gap_s)[:15]
    return {
        "measured_gaps_s": measured,
        "measured_outside_gaps_s": res.step_s - res.busy_s - sum(measured.values()),
        "profiled_step_s": res.profiled_step_s,
        "predicted_gaps_s": replay,
        "predicted_replay_step_s": max(host, dev),
        "measured_largest": [[m.gap_s, m.op, m.module, m.phase] for m in top],
        "predicted_largest": [list(g) for g in sorted(gaps, reverse=True)[:15]],
    }


def by_aten(joined: list) -> list[dict]:
    """Predicted and measured device seconds per (ATen op, phase), largest measured first."""
    acc: dict[tuple[str, str], list] = {}
    for p, m in joined:
        a = acc.setdefault((p.op, p.phase), [0.0, 0.0, 0])
        a[0] += p.device_s
        a[1] += m.device_s
        a[2] += 1
    rows = [
        {"op": k[0], "phase": k[1], "predicted_s": a[0], "measured_s": a[1], "n": a[2]}
        for k, a in acc.items()
    ]
    return sorted(rows, key=lambda r: -r["measured_s"])[:60]


def worst_ops(joined: list, n: int = 40) -> list[dict]:
    """The single ops whose measured device time most exceeds (or trails) the prediction."""
    rows = sorted(joined, key=lambda pm: -abs(pm[1].device_s - pm[0].device_s))[:n]
    return [
        {
            "index": p.index,
            "op": p.op,
            "module": p.module,
            "phase": p.phase,
            "kind": p.kind,
            "math": p.math,
            "flops": p.flops,
            "bytes": p.bytes,
            "predicted_s": p.device_s,
            "measured_s": m.device_s,
            "kernels": m.kernels,
            "kernel": m.kernel[:160],
        }
        for p, m in rows
    ]


def unjoined(ops, pred: dict) -> list[dict]:
    """Measured ops joined to no predicted op: device seconds and count per op name."""
    acc: dict[str, list] = {}
    for m in ops:
        if m.node not in pred:
            a = acc.setdefault(m.op, [0.0, 0, m.kernel[:120]])
            a[0] += m.device_s
            a[1] += 1
    return sorted(
        ({"op": k, "measured_s": a[0], "n": a[1], "kernel": a[2]} for k, a in acc.items()),
        key=lambda r: -r["measured_s"],
    )[:30]


# -- the parent ------------------------------------------------------------------------------


def environment(device: str) -> dict:
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "alloc_conf": {
            k: os.environ.get(k)
            for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG")
        },
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=props.name,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            allocator_backend=torch.cuda.get_allocator_backend(),
        )
    else:
        env["device"] = "cpu"
    for lib in ("transformers", "torchvision", "timm"):
        try:
            env[lib] = __import__(lib).__version__
        except ImportError:
            env[lib] = None
    return env


def child(args, what: str, name: str) -> dict:
    """One item in a fresh process; its row, or a row saying how the process failed."""
    cmd = [
        sys.executable,
        str(HERE),
        "--out",
        args.out,
        f"--one-{what}",
        name,
        "--device",
        args.device,
    ] + (["--plain"] if args.plain else [])
    if args.batch:
        cmd += ["--batch", str(args.batch)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=args.timeout,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return {
            "name": name,
            "error": f"Timeout: no result in {args.timeout} s",
            "traceback": (tail or "")[-1500:],
            "wall_s": time.perf_counter() - t0,
        }
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if rows:
        row = json.loads(rows[-1])
    else:
        row = {
            "name": name,
            "error": f"ProcessDied: exit code {proc.returncode}",
            "traceback": proc.stderr[-2000:],
        }
    row["wall_s"] = time.perf_counter() - t0
    return row


def one(what: str, name: str, device: str, batch: int | None, plain: bool = False) -> dict:
    try:
        if what == "alloc":
            return trace_case(name, device, batch, plain)
        return profile_case(name, device, batch)
    except Exception as e:  # recorded, not fatal
        return {
            "name": name,
            "error": f"{type(e).__name__}: {str(e)[:1500]}",
            "traceback": traceback.format_exc()[-2000:],
        }


def summary(what: str, row: dict) -> str:
    if "error" in row:
        return f"{what} {row['name']}: {row['error'][:200]}"
    if what == "alloc":
        gib = {k: row.get(f"max_memory_{k}", 0) / 2**30 for k in ("reserved", "allocated")}
        return (
            f"alloc {row['name']}: {len(row['events'])} events, {len(row['ops'])} of "
            f"{row['op_marks']} ops own one, reserved {gib['reserved']:.3f} GiB, allocated "
            f"{gib['allocated']:.3f} GiB, wall {row['wall_s']:.0f} s"
        )
    return (
        f"profile {row['name']}: step {row['predicted_step_s'] * 1e3:.1f} ms predicted, "
        f"{row['measured_step_s'] * 1e3:.1f} measured, wall {row['wall_s']:.0f} s"
    )


def run_all(args) -> None:
    doc = {
        "version": VERSION,
        "environment": environment(args.device),
        "settings": {
            "steps": STEPS,
            "device": args.device,
            "batch_override": args.batch,
            "plain": args.plain,
        },
        "alloc": [],
        "profile": [],
    }
    lock, t0 = threading.Lock(), time.perf_counter()

    def done(what: str, row: dict) -> None:
        with lock:
            doc[what].append(row)
            print(summary(what, row), flush=True)
            write(args.out, doc)

    alloc = [n for n in args.alloc_cases.split(",") if n]
    with ThreadPoolExecutor(max_workers=max(1, args.parallel)) as pool:
        for fut in as_completed([pool.submit(child, args, "alloc", n) for n in alloc]):
            done("alloc", fut.result())
    for name in [n for n in args.profile_cases.split(",") if n]:
        done("profile", child(args, "profile", name))
    doc["seconds"] = round(time.perf_counter() - t0, 1)
    write(args.out, doc)
    print(f"done in {doc['seconds']} s -> {args.out}", flush=True)


def write(out: str, doc: dict) -> None:
    tmp = Path(out + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    tmp.replace(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the JSON to write")
    ap.add_argument("--alloc-cases", default=",".join(ALLOC_CASES))
    ap.add_argument("--profile-cases", default=",".join(PROFILE_CASES))
    ap.add_argument(
        "--parallel",
        type=int,
        default=5,
        help="allocator traces run at once (each its own process and allocator)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=None, help="override the batch (dry runs)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per item")
    ap.add_argument(
        "--plain",
        action="store_true",
        help="allocator traces without the dispatch mode and hooks (no op labels)",
    )
    ap.add_argument("--one-alloc", help=argparse.SUPPRESS)
    ap.add_argument("--one-profile", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for what in ("alloc", "profile"):
        name = getattr(args, f"one_{what}")
        if name:
            print(
                "ROW "
                + json.dumps(
                    one(what, name, args.device, args.batch, args.plain), separators=(",", ":")
                )
            )
            return 0
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            "error: --device cuda: no CUDA device here; use --device cpu for a dry run",
            file=sys.stderr,
        )
        return 2
    run_all(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
