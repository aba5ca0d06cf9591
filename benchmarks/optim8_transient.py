"""What torchao's 8-bit AdamW allocates inside an update, by parameter list: one shape alone
(the calibration grid's setting) against a model's mix of shapes.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/optim8_transient.py OUT.json

torchao compiles its per-parameter update (`single_param_adam`) with torch.compile. The
calibration (gobrrr.calibrate.sections.optim) times it over lists of parameters of one shape;
a model's optimizer sees many shapes, and Dynamo recompiles as they come (marking the sizes
dynamic after the first change, `automatic_dynamic_shapes`). Per list: after 3 warm-up steps,
one step under `torch.cuda.memory._record_memory_history`; kept: the parameters' shapes in
order, and every allocation the step made (bytes, and whether it is freed within the step),
with `max_memory_allocated` over the step against the bytes allocated before it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

VERSION = 1
GPT2 = [(50257, 768), (1024, 768)] + [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,),
                                      (768,), (768,), (3072, 768), (3072,), (768, 3072),
                                      (768,)] * 12 + [(768,), (768,)]
LISTS = {
    "wte-alone": [(50257, 768)],
    "block-256-alone": [(150771, 256)],  # the same numel laid out as the grid lays it out
    "square-alone": [(4096, 4096)],
    "gpt2-mix": GPT2,
    "two-shapes": [(4096, 4096), (50257, 768)],
}


def run_list(shapes: list[tuple[int, ...]]) -> dict:
    import torch
    import torchao.optim as ao

    torch._dynamo.reset()
    dev = torch.device("cuda")
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=dev))
        p.grad = torch.randn_like(p) * 1e-3
        params.append(p)
    opt = ao.AdamW8bit(params, lr=1e-3)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=200_000)
    opt.step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live, allocs = {}, []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = len(allocs)
            allocs.append([e["size"], False])
        elif e["action"] == "free_completed" and e["addr"] in live:
            allocs[live.pop(e["addr"])][1] = True
    out = {"shapes": [list(s) for s in shapes], "allocated_before": before,
           "transient": torch.cuda.max_memory_allocated() - before, "allocs": allocs}
    del opt, params
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    out = sys.argv[1] if argv is None else argv[0]
    from bench_estimate_suite import environment

    doc = {"version": VERSION, "environment": environment(), "lists": {}}
    for name, shapes in LISTS.items():
        try:
            doc["lists"][name] = run_list(shapes)
        except Exception as e:  # recorded, not fatal
            doc["lists"][name] = {"error": f"{type(e).__name__}: {e}"}
        row = doc["lists"][name]
        print(name, row.get("error") or f"transient {row['transient'] / 2**20:.1f} MiB, "
              f"{len(row['allocs'])} allocs", flush=True)
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
