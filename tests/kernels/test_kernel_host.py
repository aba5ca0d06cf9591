"""The calibration's host cost of gobrrr's kernel ops is keyed by the op names a trace records."""

import torch

from gobrrr.calibrate.sections.kernels import _cases, kernel_host_costs


def test_kernel_host_keys_are_the_traced_op_names(recorder, monkeypatch):
    from gobrrr.calibrate.sections import kernels as calibrate_kernels

    monkeypatch.setattr(calibrate_kernels, "CHAIN", 2)  # the interpreter is slow
    cpu = torch.device("cpu")
    # the least of three rounds: a backward's cost is a difference of two timings, which one
    # round on a busy machine can turn negative (clamped to zero)
    costs = kernel_host_costs(cpu, calls=2, rounds=3)
    traced = set()
    for _, fn, inputs in _cases(cpu):
        with recorder() as rec:
            y = fn(inputs[0])
            torch.autograd.grad(y, inputs, torch.ones_like(y))
        traced |= {name.split("::")[1] for name, _ in rec.ops if name.startswith("gobrrr::")}
    assert set(costs) == traced
    assert len(traced) == 10  # five kernel families, forward and backward
    assert all(v > 0 for v in costs.values())
