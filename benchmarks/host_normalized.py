"""A zoo step's host time per phase beside the host calibration measured in the same process,
so that what the host model misses can be told from how fast this host happens to be.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/host_normalized.py OUT.json \
        [--cases NAME,NAME]                      # on the GPU machine
    python benchmarks/host_normalized.py OUT.json --compare   # on any machine

Each case in a fresh process, built and warmed up as host_phases.py does. Then:
- "phases": 7 steps timed per phase with the host's clock (host_phases.timed_step), medians;
- "optimizer": the optimizer's step and zero_grad timed alone, the GPU idle before each (as
  the calibration times it), median of 7: "model" with the model's own parameters and
  gradients, "plain" with a new optimizer of the same kind over plain-tensor copies of them
  (torch.nn.Parameter is a Python subclass);
- "host_sections": the calibration's host sections measured right after, in this process
  (`op_overhead`, `launch_overhead`, `op_host`, `optimizer_host`: gobrrr.calibrate.api,
  calibrate_host), as `gobrrr calibrate` measures them.
`--compare` predicts each case twice, with the shipped H100 calibration and with its host
sections replaced by the ones measured beside it, and adds both predictions' per-phase host
seconds (`OpTime.host_s` summed; recomputation counted in backward) and step time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402
from host_phases import PHASES, _predicted, _prepared, host_by_phase, phase_medians  # noqa: E402,E501
from optimizer_in_step import optimizer_alone  # noqa: E402

VERSION = 1
CASES = ("efficientnet_v2_s-tv-cl", "vit_small-timm", "mobilenet_v3_large-tv",
         "convnextv2_tiny-timm", "densenet121-tv", "pythia-410m", "gpt2-124m",
         "distilbert-mlm")
HOST_SECTIONS = ("op_overhead", "launch_overhead", "op_host", "optimizer_host")


def _plain_copy(opt):
    """(optimizer, parameters, gradients): a new optimizer of opt's kind and hyper-parameters
    over plain-tensor copies of its parameters, and copies of their gradients."""
    groups, params, grads = [], [], []
    for g in opt.param_groups:
        ps = [p.detach().clone().requires_grad_(True) for p in g["params"]]
        params += ps
        grads += [p.grad.detach().clone() for p in g["params"]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ps})
    return type(opt)(groups), params, grads


def one(name: str) -> dict:
    import importlib

    import torch

    from gobrrr.calibrate.sections import host as ch

    prepared = _prepared(name)
    precision, wl, opt, scaler = prepared
    phases = phase_medians(prepared)
    # the optimizer alone: gradients from one more backward
    from gobrrr.training.step import autocast_for

    with autocast_for(precision, "cuda"):
        loss = wl.compute_loss(wl.batch)
    loss.backward()
    del loss
    params = [p for g in opt.param_groups for p in g["params"]]
    grads = [p.grad.detach().clone() for p in params]
    model_s = optimizer_alone(opt, params, grads)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    plain, plain_params, plain_grads = _plain_copy(opt)
    opt.zero_grad(set_to_none=True)
    del grads
    plain_s = optimizer_alone(plain, plain_params, plain_grads)
    del plain, plain_params, plain_grads
    torch.cuda.empty_cache()
    dev = torch.device("cuda")
    sections = {"op_overhead": ch.step_overhead(dev, reps=10, rounds=3, warmup=5),
                "launch_overhead": importlib.import_module(
                    "gobrrr.calibrate.api").launch_overhead(dev)[0],
                "op_host": ch.op_host_costs(dev),
                "optimizer_host": ch.optimizer_host(dev, reps=7)}
    return {"name": name, "phases": phases,
            "optimizer": {"model_s": model_s, "plain_s": plain_s, "tensors": len(params)},
            "host_sections": sections}


def _with_sections(sections: dict):
    import dataclasses

    from gobrrr.hardware import find_calibration, get_gpu

    shipped = find_calibration(get_gpu("h100"))
    return dataclasses.replace(shipped, **{k: sections[k] for k in HOST_SECTIONS})


def compare(path: Path) -> None:
    import gobrrr
    from zoo.cases import get_case

    doc = json.loads(path.read_text())
    for row in doc["rows"]:
        if "error" in row:
            continue
        shipped = host_by_phase(_predicted(row["name"]))
        case = get_case(row["name"])
        cal = _with_sections(row["host_sections"])
        est = gobrrr.estimate(case.factory(), gpu="h100", precision=case.precision,
                              compile=case.compile, calibration=cal)
        here = host_by_phase(est)
        row["predicted"] = {"shipped": shipped, "this_host": here}
        m = row["phases"]
        print(f"{row['name']:26s} " + "  ".join(
            f"{k} {m[k] * 1e3:6.1f}/{shipped[k] * 1e3:6.1f}/{here[k] * 1e3:6.1f}"
            for k in PHASES) + f"  step {m['step'] * 1e3:6.1f}/{shipped['step'] * 1e3:6.1f}/"
            f"{here['step'] * 1e3:6.1f} ms (measured/shipped/this host); optimizer alone "
            f"{row['optimizer']['model_s'] * 1e3:.1f} ms, plain tensors "
            f"{row['optimizer']['plain_s'] * 1e3:.1f} ms", flush=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    p, o, s = row["phases"], row["optimizer"], row["host_sections"]
    print(f"{row['name']:26s} " + " ".join(f"{k} {p[k] * 1e3:.1f}" for k in p)
          + f" | optimizer alone {o['model_s'] * 1e3:.1f} ms, plain {o['plain_s'] * 1e3:.1f} ms"
          f" ({o['tensors']} tensors) | op_overhead fwd {s['op_overhead']['forward'] * 1e6:.1f}"
          f" bwd {s['op_overhead']['backward'] * 1e6:.1f} us, launch "
          f"{s['launch_overhead'] * 1e6:.1f} us", flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, _report,
                      actions={"--compare": compare})


if __name__ == "__main__":
    sys.exit(main())
