"""What a module call costs the host, and how much of a step's forward it is, on a GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/module_calls.py OUT.json \
        [--cases NAME,NAME]                      # on the GPU machine

The host's per-op cost is calibrated on tiny models (`calibrate_host.step_overhead`) and
carries their module calls per op (0.16-0.38). Models written by others call more modules
per op, many of them running no op at all (timm's ViT: `nn.Identity` for its q/k norms, layer
scales and drop paths). Each case in a fresh process (a zoo case by name, a built-in model as
"model:batch:seq:checkpoint"), built and warmed up as host_phases.py does:
- "calls": modules called per forward, and those that run no ATen op (counted with forward
  pre-hooks and a dispatch mode, one forward);
- "phases": host_phases.phase_medians of the step as it is, then with every `nn.Identity`
  replaced by a plain function (the same computation, no module call), and the forward's
  difference per removed call;
- "per_call": back-to-back calls on the host of an elementwise add, of an `nn.Identity`, and
  of a module whose forward is that add (the module call's own cost is the difference).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402
from host_phases import _prepared, phase_medians  # noqa: E402

VERSION = 1
CASES = ("vit_small-timm", "convnextv2_tiny-timm", "distilbert-mlm", "qwen2-0.5b",
         "gpt2:1:16:none")


def call_costs() -> dict[str, float]:
    """Seconds per call, as gobrrr.calibrate.sections.host.per_call times op_host's cases."""
    import torch
    from torch import nn

    from gobrrr.calibrate.sections.host import per_call

    class Add(nn.Module):
        def forward(self, x):
            return x + x

    dev = torch.device("cuda")
    a = torch.randn(8, device=dev)
    ident, add = nn.Identity(), Add()
    return {name: per_call(fn, dev, 400, rounds=5, warmup=20) for name, fn in (
        ("add", lambda: a + a), ("identity_module", lambda: ident(a)),
        ("add_module", lambda: add(a)))}


def count_calls(precision, wl) -> dict[str, int]:
    """Modules called in one forward (and loss), and those inside which no ATen op ran."""
    import torch
    from zoo.measure import OpCounter

    from gobrrr.training.step import autocast_for

    counter = OpCounter()
    stack, calls, empty = [], [0], [0]

    def pre(m, args):
        calls[0] += 1
        stack.append(counter.counts.total())

    def post(m, args, out):
        if counter.counts.total() == stack.pop():
            empty[0] += 1

    hooks = [h for m in wl.model.modules() for h in (m.register_forward_pre_hook(pre),
                                                      m.register_forward_hook(post))]
    try:
        with torch.no_grad(), counter, autocast_for(precision, "cuda"):
            wl.compute_loss(wl.batch)
    finally:
        for h in hooks:
            h.remove()
    return {"modules": calls[0], "without_ops": empty[0], "ops": counter.counts.total()}


def strip_identities(model) -> int:
    """Replace every nn.Identity child by a plain function; returns how many were."""
    from torch import nn

    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, nn.Identity):
                del parent._modules[name]
                object.__setattr__(parent, name, _identity)
                n += 1
    return n


def _identity(x, *args, **kwargs):
    return x


def one(name: str) -> dict:
    import torch

    prepared = _prepared(name)
    precision, wl, opt, _ = prepared
    before = count_calls(precision, wl)
    opt.zero_grad(set_to_none=True)
    phases = phase_medians(prepared)
    stripped = strip_identities(wl.model)
    after = count_calls(precision, wl)
    opt.zero_grad(set_to_none=True)
    phases_stripped = phase_medians(prepared)
    torch.cuda.synchronize()
    removed = before["modules"] - after["modules"]
    return {"name": name, "calls": before, "calls_stripped": after, "identities": stripped,
            "phases": phases, "phases_stripped": phases_stripped,
            "forward_saved_per_call_s": (phases["forward"] - phases_stripped["forward"]) /
            removed if removed else None, "per_call": call_costs()}


def _report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    c, p, q = row["calls"], row["phases"], row["phases_stripped"]
    saved = row["forward_saved_per_call_s"]
    print(f"{row['name']:24s} modules {c['modules']} ({c['without_ops']} without ops), ops "
          f"{c['ops']}; identities {row['identities']}; fwd {p['forward'] * 1e3:.2f} -> "
          f"{q['forward'] * 1e3:.2f} ms ({'-' if saved is None else f'{saved * 1e6:.1f}'} us "
          f"a call); per call: add {row['per_call']['add'] * 1e6:.1f}, identity "
          f"{row['per_call']['identity_module'] * 1e6:.1f}, add module "
          f"{row['per_call']['add_module'] * 1e6:.1f} us", flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, _report)


if __name__ == "__main__":
    sys.exit(main())
