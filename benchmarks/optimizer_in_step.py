"""Why a zoo step's optimizer costs the host more inside the step than alone, on a GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/optimizer_in_step.py OUT.json \
        [--cases NAME,NAME]                      # on the GPU machine

`host_normalized.py` found the optimizer's step and zero_grad taking the host 1.2-1.9x as long
inside a training step as alone with the GPU idle (the way the calibration's `optimizer_host`
times it). Each case in a fresh process, built and warmed up as host_phases.py does; the
host's seconds for `opt.step(); opt.zero_grad(set_to_none=True)`, median of 7, in each of:
- "in_step": right after the step's backward returns (host_phases.timed_step);
- "in_step_synced": the same, the GPU synchronised after backward (does a busy GPU matter?);
- "in_step_no_gc": the whole step with Python's cyclic garbage collector off;
- "alone": the model's parameters and gradients, the GPU idle before it;
- "after_backward": right after a backward of a cheap loss over the parameters alone
  (sum of each parameter), the GPU synchronised before that forward;
- "synthetic_alone" / "synthetic_after_backward": the same two over as many plain fp32
  tensors of 2**20 elements (the calibration's large tensors);
- "after_forward": right after a forward under torch.no_grad (GPU synchronised), the model's
  gradients in place;
- "after_churn": right after 2000 CUDA tensors of 4 KiB to 64 MiB were allocated and freed
  (the caching allocator's free lists filled, as a step's activations leave them);
- "after_objects": right after 200,000 small Python containers were made and dropped (the
  interpreter's heap and the garbage collector's generations, as a forward leaves them).
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402
from host_phases import _prepared, timed_step  # noqa: E402

VERSION = 2
CASES = ("vit_small-timm", "efficientnet_v2_s-tv-cl", "gpt2-124m", "pythia-410m")
REPS = 7
DEVICE = "cuda"


def _opt_s(opt) -> float:
    t0 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _median(fn, reps: int = REPS) -> float:
    fn()
    fn()
    return statistics.median(fn() for _ in range(reps))


def _in_step(prepared, synced: bool) -> float:
    import torch

    from gobrrr.training.step import autocast_for

    precision, wl, opt, _ = prepared

    def one():
        torch.cuda.synchronize()
        with autocast_for(precision, DEVICE):
            loss = wl.compute_loss(wl.batch)
        loss.backward()
        if synced:
            torch.cuda.synchronize()
        return _opt_s(opt)

    return _median(one)


def _no_gc(prepared) -> float:
    import torch

    gc.disable()
    try:
        return _median(lambda: (torch.cuda.synchronize(), timed_step(*prepared))[1]["optimizer"])
    finally:
        gc.enable()


def _forward_no_grad(precision, wl) -> None:
    import torch

    from gobrrr.training.step import autocast_for

    with torch.no_grad(), autocast_for(precision, DEVICE):
        wl.compute_loss(wl.batch)


def _churn() -> None:
    import torch

    sizes = [4096 * 2 ** (i % 15) for i in range(2000)]
    held = [torch.empty(n, dtype=torch.uint8, device=DEVICE) for n in sizes]
    del held


def _objects() -> None:
    junk = [{"a": [i], "b": (i, i)} for i in range(200_000)]
    del junk


def optimizer_alone(opt, params, grads, after_backward: bool = False, before=None) -> float:
    """The host's seconds for opt's step and zero_grad with `grads` as the parameters'
    gradients (median of REPS after 2): the GPU synchronised, then `before()` where given,
    or a backward of the parameters' sum (`after_backward`: the GPU left running it), else
    nothing, then the gradients set and (but after a backward) the GPU synchronised again."""
    import torch

    def one():
        torch.cuda.synchronize()
        if before is not None:
            before()
        elif after_backward:
            sum(p.sum() for p in params).backward()
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        if not after_backward:
            torch.cuda.synchronize()
        return _opt_s(opt)

    return _median(one)


def one(name: str) -> dict:
    import torch

    prepared = _prepared(name)
    precision, wl, opt, _ = prepared
    for _ in range(3):
        timed_step(*prepared)
    out = {"name": name}
    out["in_step"] = _median(lambda: (torch.cuda.synchronize(),
                                      timed_step(*prepared))[1]["optimizer"])
    out["in_step_synced"] = _in_step(prepared, synced=True)
    out["in_step_no_gc"] = _no_gc(prepared)
    from gobrrr.training.step import autocast_for

    with autocast_for(precision, DEVICE):
        loss = wl.compute_loss(wl.batch)
    loss.backward()
    del loss
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad.detach().clone() for p in params]
    out["alone"] = optimizer_alone(opt, params, grads)
    out["after_backward"] = optimizer_alone(opt, params, grads, after_backward=True)
    for key, before in (("after_forward", lambda: _forward_no_grad(precision, wl)),
                        ("after_churn", _churn), ("after_objects", _objects)):
        out[key] = optimizer_alone(opt, params, grads, before=before)
    opt.zero_grad(set_to_none=True)
    out["tensors"] = len(params)
    del grads
    synth = [torch.zeros(2**20, device=DEVICE, requires_grad=True) for _ in params]
    sgrads = [torch.ones(2**20, device=DEVICE) for _ in synth]
    sopt = type(opt)(synth, **{k: v for k, v in opt.defaults.items()
                               if k in ("lr", "betas", "eps", "weight_decay", "foreach",
                                        "momentum")})
    out["synthetic_alone"] = optimizer_alone(sopt, synth, sgrads)
    out["synthetic_after_backward"] = optimizer_alone(sopt, synth, sgrads, after_backward=True)
    return out


def _report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    print(f"{row['name']:26s} ({row['tensors']} tensors) " + " ".join(
        f"{k} {v * 1e3:.2f}" for k, v in row.items() if isinstance(v, float)) + " ms",
        flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, _report)


if __name__ == "__main__":
    sys.exit(main())
