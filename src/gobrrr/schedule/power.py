"""The power limit's hold on compute-bound tensor-core kernels: a fixed point over the
scheduler (the step's duty sets the clock, the clock the kernels' times, those the duty)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gobrrr.cost.curves import interp
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import OpTime
from gobrrr.graph.ir import evolve
from gobrrr.schedule.scheduler import Timeline

#: math modes whose compute-bound kernels run on the tensor cores (the power limit's hold on
#: them is calibrated on bf16 matmuls; CUDA-core fp32 is left at its burst rate)
TENSOR_CORE_MATH = ("bf16", "fp16", "fp8", "tf32")


def power_limited(
    ops: tuple[OpTime, ...],
    weights: Sequence[int],
    rates: Rates,
    schedule: Callable[[tuple[OpTime, ...]], Timeline],
) -> tuple[tuple[OpTime, ...], float, Timeline]:
    """The ops with their compute-bound tensor-core kernels slowed to the rate the power limit
    leaves them, the fraction of the burst rate they run at, and `schedule`'s timeline of
    those ops.

    Every compute rate is calibrated in bursts; a GPU at its power limit lowers its clock
    once compute-bound kernels take most of its time (`calibrate_power`). Their duty here is
    their share of the step's time (idle time included: the board cools while the host is the
    bottleneck), read off the step as scheduled; the calibrated curve gives the fraction
    their rate keeps at that duty, and the fraction, applied, gives a new duty. Repeated to a
    fixed point (a few rounds: the duty grows as the kernels slow, so the fraction settles
    from above). Without `power_duty` in the calibration, the ops as they are."""
    curve = rates.cal.power_duty.get("bf16") if rates.cal else None
    if not curve:
        return ops, 1.0, schedule(ops)
    xs, ys = [0.0, *(p[0] for p in curve)], [1.0, *(min(p[1], 1.0) for p in curve)]
    hot = [
        i
        for i, o in enumerate(ops)
        if o.math in TENSOR_CORE_MATH
        and o.compute_s > 0
        and o.compute_s >= o.memory_s
        and o.device_s > 0
    ]
    fraction, out = 1.0, ops
    for _ in range(8):
        out = slowed(ops, hot, fraction)
        timeline = schedule(out)
        step = timeline.step_s
        busy = sum(out[i].device_s * weights[i] for i in hot)
        new = interp(xs, ys, busy / step) if step > 0 else 1.0
        if abs(new - fraction) < 1e-4:
            break
        fraction = new
    else:
        out = slowed(ops, hot, fraction)
        timeline = schedule(out)
    return out, fraction, timeline


def slowed(ops: tuple[OpTime, ...], hot: list[int], fraction: float) -> tuple[OpTime, ...]:
    """`ops` with the compute time of those at `hot` over `fraction` (their device time
    follows: the larger of compute and memory, plus what else it holds)."""
    if fraction >= 1.0:
        return ops
    out = list(ops)
    for i in hot:
        o = ops[i]
        compute = o.compute_s / fraction
        rest = o.device_s - max(o.compute_s, o.memory_s)  # launch latency, layout copies
        device = max(compute, o.memory_s) + rest
        regime = "overhead" if o.host_s >= device else "compute"
        out[i] = evolve(o, compute_s=compute, device_s=device, regime=regime)
    return tuple(out)
