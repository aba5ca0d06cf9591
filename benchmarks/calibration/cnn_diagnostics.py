"""Where a convolutional step's memory and time go, op by op (a diagnostic for the cost model).

    python benchmarks/calibration/cnn_diagnostics.py OUT.json

1. Memory, per ATen op: the built-in convnet's steady-state step (fp32 b32, bf16-mixed b64)
   runs under a dispatch mode that reads the caching allocator around every op: allocated
   before, the peak inside the op, allocated after. A transient (peak above both before and
   after) is memory the op allocates and frees inside itself (a workspace); the op at the
   step's peak and what was allocated then locate any gap against gobrrr's simulation, which
   is computed beside it from the same step traced on the CPU.
2. Batch norm bandwidth over the spatial size of a channel plane (the contiguous run its
   NCHW kernels reduce over), forward and backward, bf16 and fp32, at a fixed tensor size,
   through F.batch_norm, so the kernels are the ones a model gets on this GPU.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from gobrrr.estimate import estimate  # noqa: E402
from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.profile.runner import matmul_precision, prepare, run_step  # noqa: E402

CASES = [("fp32", 32), ("bf16-mixed", 64)]


class AllocatorTrace(TorchDispatchMode):
    """Allocated bytes before, peak during and after every ATen op."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, int, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **(kwargs or {}))
        self.rows.append(
            (
                func.overloadpacket.__name__,
                before,
                torch.cuda.max_memory_allocated(),
                torch.cuda.memory_allocated(),
            )
        )
        return out


def memory_case(precision: str, batch: int) -> dict:
    with torch.device("cuda"):
        wl = get_workload("convnet", batch_size=batch)
    wl, opt, scaler = prepare(wl, "cuda", precision)
    with matmul_precision(precision):
        for _ in range(3):
            run_step(wl, opt, precision, scaler)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        run_step(wl, opt, precision, scaler)
        torch.cuda.synchronize()
        step_peak = torch.cuda.max_memory_allocated()
        trace = AllocatorTrace()
        with trace:
            run_step(wl, opt, precision, scaler)
        torch.cuda.synchronize()
    rows = trace.rows
    peak_i = max(range(len(rows)), key=lambda i: rows[i][2])
    transients = sorted(
        (
            {"index": i, "op": r[0], "bytes": r[2] - max(r[1], r[3])}
            for i, r in enumerate(rows)
            if r[2] - max(r[1], r[3]) > 0
        ),
        key=lambda t: -t["bytes"],
    )
    est = estimate("convnet", "h100", batch=batch, precision=precision, loop="drops-output")
    graph, sim = est.graph, est.memory
    return {
        "precision": precision,
        "batch": batch,
        "allocated_at_start": start,
        "step_peak": step_peak,
        "traced_peak": rows[peak_i][2],
        "peak_op": rows[peak_i][0],
        "peak_index": peak_i,
        "allocated_before_peak_op": rows[peak_i][1],
        "transients": transients[:30],
        "ops": [list(r) for r in rows],
        "gobrrr": {
            "peak": sim.peak,
            "peak_index": sim.peak_index,
            "peak_op": graph.nodes[sim.peak_index].name if sim.peak_index >= 0 else "",
            "ops": [n.name for n in graph.nodes],
            "timeline": list(sim.timeline),
        },
    }


def bn_bandwidth(elements: int = 2**25) -> list[dict]:
    """Achieved bytes/s of batch norm forward and backward over channel-plane sizes, bytes as
    read x + write y (forward) and read x, dy + write dx (backward)."""
    from gobrrr.calibrate.sections.step import batch_norm_times

    out = []
    for dtype in (torch.bfloat16, torch.float32):
        for hw in (7, 14, 28, 56, 112):
            shape = (max(elements // (64 * hw * hw), 1), 64, hw, hw)
            t_f, t_b = batch_norm_times(torch.device("cuda"), shape, dtype)
            nb = shape[0] * 64 * hw * hw * dtype.itemsize
            out.append(
                {
                    "dtype": str(dtype).split(".")[-1],
                    "shape": list(shape),
                    "forward_s": t_f,
                    "backward_s": t_b,
                    "forward_gbs": 2 * nb / t_f / 1e9,
                    "backward_gbs": 3 * nb / t_b / 1e9,
                }
            )
    return out


def main() -> None:
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("cnn_diagnostics.json")
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "memory": [memory_case(p, b) for p, b in CASES],
        "batch_norm": bn_bandwidth(),
    }
    for m in result["memory"]:
        print(
            f"{m['precision']} b{m['batch']}: step peak {m['step_peak'] / 2**20:.1f} MiB, "
            f"traced {m['traced_peak'] / 2**20:.1f} at {m['peak_op']} #{m['peak_index']}, "
            f"gobrrr {m['gobrrr']['peak'] / 2**20:.1f} at {m['gobrrr']['peak_op']} "
            f"#{m['gobrrr']['peak_index']}"
        )
        for t in m["transients"][:8]:
            print(f"   transient {t['bytes'] / 2**20:8.1f} MiB  #{t['index']} {t['op']}")
    for r in result["batch_norm"]:
        print(
            f"bn {r['dtype']} {r['shape']}: fwd {r['forward_gbs']:.0f} GB/s, "
            f"bwd {r['backward_gbs']:.0f} GB/s"
        )
    tmp = out_path.with_name(out_path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out_path)


if __name__ == "__main__":
    main()
