"""One-off: Inductor's generated code for compiled GPT-2 (zoo case gpt2-124m-compiled) under
gobrrr's TrainStep and the plain loop, and each loop's allocated peak, on this GPU.

    PYTHONPATH=src:. python benchmarks/zoo/compiled_head_code.py OUT.json

Each loop in a fresh process (`--one LOOP`): the case built and prepared as loops.py measures
it, its first step run under `torch._inductor.utils.run_and_get_code` (every module Inductor
compiled in it), two more steps, the peak stats reset, one step: max_memory_allocated. Kept:
the peak, and the source of each compiled module that holds a padded vocabulary dimension
(50264), with the lines that allocate, fill and free those buffers and the matmuls reading them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parent)]

import torch  # noqa: E402

CASE = "gpt2-124m-compiled"


def one(loop: str) -> dict:
    from torch._inductor.utils import run_and_get_code

    from gobrrr.profile.runner import prepare
    from loops import make_loop
    from zoo.cases import get_case

    case = get_case(CASE)
    torch.manual_seed(0)
    with torch.device("cuda"):
        wl = case.build(case.batch, case.seq)
    wl, opt, scaler = prepare(wl, "cuda", case.precision, "none", case.compile)
    step = make_loop(loop, wl, opt, scaler, case.precision, "cuda")
    _, codes = run_and_get_code(step)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    padded = [c for c in codes if "50264" in c]
    lines = []
    for k, c in enumerate(padded):
        src = c.splitlines()
        bufs = set(re.findall(r"(buf\d+) = empty_strided_cuda\(\(5026\d", c))
        bufs |= set(re.findall(r"(buf\d+) = empty_strided_cuda\(\(\d+, 5026\d", c))
        for i, line in enumerate(src):
            s = line.strip()
            if "50264" in s or any(re.search(rf"\b{b}\b", s) for b in bufs) and (
                "mm(" in s or ".run(" in s or s.startswith("del ")
            ):
                lines.append([k, i, s[:300]])
    return {
        "loop": loop,
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "modules": len(codes),
        "padded_modules": [len(c.splitlines()) for c in padded],
        "lines": lines,
    }


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(one(sys.argv[2])))
        return
    out = {
        "environment": {"device": torch.cuda.get_device_name(), "torch": torch.__version__},
        "case": CASE,
        "loops": {},
    }
    for loop in ("trainstep", "plain"):
        p = subprocess.run([sys.executable, __file__, "--one", loop], capture_output=True, text=True)
        rows = [x for x in p.stdout.splitlines() if x.startswith("{")]
        out["loops"][loop] = json.loads(rows[-1]) if rows else {"error": p.stderr[-3000:]}
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
    for loop, r in out["loops"].items():
        print(loop, r.get("peak_allocated"), len(r.get("lines", [])), r.get("error", "")[:2000])


if __name__ == "__main__":
    main()
