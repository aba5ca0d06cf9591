"""What an estimate advises: the changes its prediction says would pay, with what they save."""

from __future__ import annotations

from gobrrr.cost.rates import Rates
from gobrrr.cost.shapes import misaligned, misaligned_nt
from gobrrr.evaluate import Estimate


def hints(est: Estimate) -> list[str]:
    """What the prediction says to change, with the time it would save."""
    out = []
    slow = [
        o
        for o in est.time.ops
        if o.kind == "matmul"
        and o.device_s > 0
        and o.math not in ("fp32",)
        and misaligned(est.graph.nodes[o.index])
    ]
    if slow:
        rates = Rates(est.gpu, est.cal)
        fracs = [
            rates.misaligned_fraction(o.math, misaligned_nt(est.graph.nodes[o.index])) for o in slow
        ]
        lo, hi = min(fracs), max(fracs)
        saved = sum(o.device_s * (1 - f) for o, f in zip(slow, fracs, strict=True))
        mods = sorted({o.module or "<top>" for o in slow})
        shapes = sorted(
            {
                n
                for o in slow
                for t in est.graph.nodes[o.index].outputs
                for n in t.shape
                if (n * t.itemsize) % 16
            }
        )
        dims = _listed([str(n) for n in shapes], 3)
        out.append(
            f"{len(slow)} matmuls in {_listed(mods, 3)} have a dimension that is "
            f"not a multiple of 16 bytes ({dims}): they run at "
            f"{f'{lo:.0%}-{hi:.0%}' if hi - lo >= 0.005 else f'{lo:.0%}'} of the aligned "
            "rate; padding it (e.g. a vocabulary to a multiple of 64) would save "
            f"≈{saved * 1e3:.1f} ms per step"
        )
    if not est.fits:
        cap, gib = est.memory.budget or est.gpu.memory_bytes, 2**30
        state = sum(
            est.memory.at_peak.get(k, 0) for k in ("parameter", "gradient", "optimizer_state")
        )
        if state > cap:
            gpus = -(-state // cap)
            out.append(
                f"parameters, gradients and optimizer states alone need {state / gib:.1f}"
                f" GiB of {cap / gib:.1f} GiB: shard them over ≥{gpus} GPUs (FSDP), keep"
                " them in bf16 (--precision bf16) or offload the optimizer states to CPU"
            )
        else:
            out.append(
                f"the step needs {est.memory.reserved / gib:.1f} GiB reserved of "
                f"{cap / gib:.1f} GiB, mostly activations: try --checkpoint full or a "
                "smaller --batch"
            )
    return out


def _listed(items: list[str], n: int) -> str:
    """The first n items, and how many more there are."""
    more = f" and {len(items) - n} more (--json lists every op)" if len(items) > n else ""
    return ", ".join(items[:n]) + more
