"""One-off: Inductor's pad_mm decision for GPT-2's head matmuls in backward, on this GPU.

    PYTHONPATH=src python benchmarks/zoo/pad_mm_decision.py OUT.json [--repeats 5]

For the two matmuls of the LM head's backward (batch 8 x 1024 tokens, vocabulary 50257,
width 768, bf16): the weight gradient `grad.t() @ h` (the odd dimension is its rows, m) and
the input gradient `grad @ w` (the odd dimension is its depth, k). Per matmul:
1. the eager kernel's time, the zero-padded matmul's time and the padding copy's, with
   CUDA events (median of 50 after 10 warm-ups);
2. whether Inductor pads it: the function compiled in a fresh process with an empty
   Inductor cache (`TORCHINDUCTOR_CACHE_DIR`), its generated code read for a padded buffer
   (a dimension of 50264), `--repeats` times;
3. pad_mm's own rule: pad when the unpadded time exceeds 1.1 x the padded matmul's plus the
   copies' (`torch/_inductor/fx_passes/pad_mm.py`, `should_pad_bench`: graph inputs' copies
   are timed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import torch

M, V, D = 8192, 50257, 768
VP = 50264  # pad_mm pads to a multiple of 8 elements


def _time(fn, n=50, warm=10) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def timings() -> dict:
    dev = "cuda"
    g = torch.randn(M, V, device=dev, dtype=torch.bfloat16)
    h = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    w = torch.randn(V, D, device=dev, dtype=torch.bfloat16)
    gp = torch.zeros(M, VP, device=dev, dtype=torch.bfloat16)
    gp[:, :V] = g
    wp = torch.zeros(VP, D, device=dev, dtype=torch.bfloat16)
    wp[:V] = w

    def copy_g():
        out = torch.zeros(M, VP, device=dev, dtype=torch.bfloat16)
        out[:, :V] = g
        return out

    def copy_w():
        out = torch.zeros(VP, D, device=dev, dtype=torch.bfloat16)
        out[:V] = w
        return out

    out = {
        "weight_grad": {
            "unpadded_s": _time(lambda: g.t() @ h),
            "padded_mm_s": _time(lambda: gp.t() @ h),
            "copies_s": _time(copy_g),
        },
        "input_grad": {
            "unpadded_s": _time(lambda: g @ w),
            "padded_mm_s": _time(lambda: gp @ wp),
            "copies_s": _time(copy_g) + _time(copy_w),
        },
    }
    for r in out.values():
        r["ratio"] = r["unpadded_s"] / (r["padded_mm_s"] + r["copies_s"])
        r["rule_pads"] = r["ratio"] > 1.1
    return out


def child(which: str) -> None:
    """Compile one of the matmuls and print whether Inductor's code pads it."""
    from torch._inductor.utils import run_and_get_code

    g = torch.randn(M, V, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(V, D, device="cuda", dtype=torch.bfloat16)
    if which == "weight_grad":
        fn, args = (lambda a, b: a.t() @ b), (g, h)
    else:
        fn, args = (lambda a, b: a @ b), (g, w)
    _, code = run_and_get_code(torch.compile(fn), *args)
    text = "\n".join(code)
    print(json.dumps({"padded": str(VP) in text, "lines": len(text.splitlines())}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        return child(a.child)
    result = {
        "environment": {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "driver": subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True,
            ).stdout.strip(),
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        },
        "shapes": {"tokens": M, "vocab": V, "width": D, "padded_vocab": VP, "dtype": "bf16"},
        "timings": timings(),
        "inductor": {},
    }
    for which in ("weight_grad", "input_grad"):
        runs = []
        for _ in range(a.repeats):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
            r = subprocess.run(
                [sys.executable, __file__, "--child", which], capture_output=True, text=True, env=env
            )
            line = (r.stdout.strip().splitlines() or ["{}"])[-1]
            runs.append(json.loads(line) if r.returncode == 0 else {"error": r.stderr[-500:]})
        result["inductor"][which] = runs
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text)


if __name__ == "__main__":
    main()
