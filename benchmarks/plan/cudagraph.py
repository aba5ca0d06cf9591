"""CUDA graphs on host-bound steps: eager applied vs cuda_graph applied vs the hand-written
torch.cuda.graph loop, measured and predicted, one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/plan/cudagraph.py benchmarks/results/cudagraph_h100.json \\
        [--cases mlp,resnet18,gpt2] [--rounds 20] [--steps 10] [--gpu h100]
    python benchmarks/plan/cudagraph.py /tmp/cg.json --device cpu --dry-run   # the logic only

Cases (bf16-mixed, AdamW): "mlp" (gobrrr's DeepMLP, 4 layers x 1024, batch 64), "resnet18"
(torchvision, batch 32, 224 px), "gpt2" (gpt2-124m, batch 1, seq 256), "mlp-accum" (the mlp
at micro-batch 16 x 4). For each, three runners on fresh copies of the same model: "eager"
(`gobrrr.apply` with the knobs), "graphed" (the same knobs with cuda_graph=True), "hand"
(PyTorch's whole-network capture written out: AdamW(capturable=True), warm-up on a side
stream, `torch.cuda.graph`, static input copy + replay). They run interleaved: each round
times `--steps` steps of each (perf_counter around the steps, synchronized at both ends), in
a rotating order; the median over rounds per runner. Before the rounds, each runner's memory
(reserved and allocated peaks over its first steps, capture included, as deltas over what the
process held before it was built).

The prediction of each (`Planner.cost` of the same knobs) uses the calibration's cudagraph
section measured in this run first (`calibrate.sections.cudagraph`, recorded in the output),
so the figures compared come from one machine. OUT.json is rewritten after every case.

`--device cpu --dry-run`: tiny sizes, 2 rounds of 1 step, eager and hand eager only (no CUDA
graphs on a CPU), predictions with a stand-in section: the logic, not the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2])]

import torch  # noqa: E402

VERSION = 1
CASES = ("mlp", "resnet18", "gpt2", "mlp-accum")
#: the cudagraph section's stand-in for --dry-run (never used for a figure)
DRY_SECTION = {"launch_host_s": 5e-6, "node_host_s": 1e-8, "node_device_s": 2e-6}


def workload_fn(case: str, dry: bool):
    """(batch_size) -> the case's workload; its global batch and micro-batch."""
    from gobrrr.models.registry import get_workload
    from gobrrr.workload import Workload

    if case.startswith("mlp"):
        from gobrrr.models.mlp import DeepMLP, MLPConfig

        width = 64 if dry else 1024

        def mlp(batch_size=8):
            x, y = torch.randn(batch_size, width), torch.randn(batch_size, width)
            return Workload(model=DeepMLP(MLPConfig(4, width)), batch=(x, y), name="mlp")

        batch = 8 if dry else 64
        return mlp, batch, batch // 4 if case == "mlp-accum" else None
    if case == "resnet18":
        from zoo.vision import torchvision_model

        return (
            lambda batch_size=2: torchvision_model(batch_size, None, arch="resnet18"),
            32 if not dry else 2,
            None,
        )
    extra = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256} if dry else {}
    seq = 32 if dry else 256
    return (
        lambda batch_size=1: get_workload("gpt2", batch_size=batch_size, seq_len=seq, **extra),
        1,
        None,
    )


def hand_graphed(w, device: str, accumulation: int = 1):
    """PyTorch's whole-network capture of the workload's step (`accumulation` micro-batches,
    each loss / accumulation, then one optimizer step): bf16 autocast, AdamW with
    capturable=True; returns step(batch) -> loss (eager on a CPU)."""
    w.model.to(device)
    opt = w.make_optimizer()
    if device == "cuda":
        for g in opt.param_groups:
            g["capturable"] = True
    batch = tuple(t.to(device) for t in w.batch) if isinstance(w.batch, tuple) else w.batch
    static = _map(batch, lambda t: t.to(device).clone())

    n = accumulation
    size = next(iter(_leaves(static))).shape[0] // n
    parts = [_map(static, lambda t, i=i: t[i * size : (i + 1) * size]) for i in range(n)]

    def one():
        total = 0
        for part in parts:
            with torch.autocast(device, dtype=torch.bfloat16):
                loss = w.compute_loss(part) / n
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    if device != "cuda":
        return lambda b: (_copy(static, b), one())[1]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = one()

    def step(b):
        _copy(static, b)
        graph.replay()
        return loss

    return step


def _map(b, fn):
    if isinstance(b, torch.Tensor):
        return fn(b)
    if isinstance(b, dict):
        return {k: _map(v, fn) for k, v in b.items()}
    return type(b)(_map(v, fn) for v in b)


def _leaves(b):
    if isinstance(b, torch.Tensor):
        yield b
    else:
        for v in b.values() if isinstance(b, dict) else b:
            yield from _leaves(v)


def _copy(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src, non_blocking=True)
    else:
        for a, b in zip(
            dst.values() if isinstance(dst, dict) else dst,
            src.values() if isinstance(src, dict) else src,
            strict=True,
        ):
            _copy(a, b)


def runners(case: str, device: str, dry: bool) -> tuple[dict, dict, object]:
    """{name: step(batch)} and {name: memory} for the case's runners, and its knobs."""
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs

    make, batch, micro = workload_fn(case, dry)
    knobs = Knobs(micro_batch=micro or batch, accumulation=batch // (micro or batch))
    names = ["eager", "graphed", "hand"] if device == "cuda" else ["eager", "hand"]
    out, memory, data = {}, {}, None
    for name in names:
        torch.manual_seed(0)
        w = make(batch)
        data = _map(w.batch, lambda t: t.to(device))
        before = _mem(device)
        if name == "hand":
            step = hand_graphed(w, device, knobs.accumulation)
        else:
            w.model.to(device)
            w.batch = data
            k = knobs if name == "eager" else Knobs(**{**knobs.to_dict(), "cuda_graph": True})
            step = apply(w, k, "bf16-mixed")
        for _ in range(3):
            step(data)
        memory[name] = {k: v - before.get(k, 0) for k, v in _mem(device).items()}
        out[name] = step
    return {n: (lambda s=s: s(data)) for n, s in out.items()}, memory, knobs


def _mem(device: str) -> dict:
    if device != "cuda":
        return {}
    torch.cuda.synchronize()
    return {
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "allocated_peak": torch.cuda.max_memory_allocated(),
    }


def timed(run, steps: int, device: str) -> float:
    """Seconds per step over `steps` steps."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    sync()
    return (time.perf_counter() - t0) / steps


def predicted(case: str, knobs, target, dry: bool) -> dict:
    """Planner.cost of the knobs, eager and captured: step seconds and peaks."""
    import dataclasses

    from gobrrr.plan.search import Planner

    make, batch, _ = workload_fn(case, dry)
    planner = Planner(make, target, global_batch=batch, precision="bf16-mixed", allow=[])
    out = {}
    for name, k in (("eager", knobs), ("graphed", dataclasses.replace(knobs, cuda_graph=True))):
        p = planner.cost(k)
        out[name] = {"step_s": p.step_s, "peak": p.peak_bytes, "reserved": p.reserved_bytes}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gpu", default="h100")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args(argv)
    import dataclasses

    from gobrrr.hardware import Target
    from gobrrr.kernels.bench import write_json

    dry = a.dry_run
    rounds, steps = (2, 1) if dry else (a.rounds, a.steps)
    if a.device == "cuda":
        from gobrrr.calibrate.sections.cudagraph import cudagraph_section

        section = cudagraph_section(torch.device("cuda"))
    else:
        section = {**DRY_SECTION, "dry_run": True}
    base = Target.resolve(a.gpu)
    target = Target(base.gpu, dataclasses.replace(base.cal, cudagraph=section))
    result = {"benchmark": "cudagraph", "bench_version": VERSION, "section": section, "cases": {}}
    for case in a.cases.split(","):
        run, memory, knobs = runners(case, a.device, dry)
        times: dict[str, list[float]] = {n: [] for n in run}
        names = list(run)
        for r in range(rounds):
            for n in names[r % len(names) :] + names[: r % len(names)]:
                times[n].append(timed(run[n], steps, a.device))
        row = {
            "knobs": knobs.to_dict(),
            "measured_s": {n: statistics.median(t) for n, t in times.items()},
            "rounds_s": times,
            "memory": memory,
            "predicted": predicted(case, knobs, target, dry),
        }
        result["cases"][case] = row
        print(case, json.dumps(row["measured_s"]), json.dumps(row["predicted"]), flush=True)
        write_json(a.out, result)
        del run
        if a.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
