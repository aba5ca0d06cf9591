"""gobrrr.apply's fused loss through the Triton kernel itself (the interpreter, set up by this
directory's conftest): the same step as the plain one, and no (tokens, vocab) logits."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_apply's models

from test_apply import Ops, V, apply, assert_same_step, make, reference  # noqa: E402

from gobrrr.plan.knobs import Knobs  # noqa: E402


@pytest.mark.parametrize("name", ["gpt2", "hf-llama"])
def test_fused_loss_kernel_is_the_same_step(name):
    step = apply(make(name), Knobs(micro_batch=2, accumulation=2, fused_loss=True), "fp32")
    grads = {}
    step.optimizer.register_step_pre_hook(
        lambda o, a, k: grads.update({n: p.grad.clone() for n, p in step.model.named_parameters()})
    )
    with Ops() as rec:
        loss = step()
    assert any("gobrrr.linear_cross_entropy" in op for op, _ in rec.ops)
    made = [(op, s) for op, shapes in rec.ops for s in shapes if s and s[-1] == V]
    assert not made, f"logits were made: {made[:3]}"
    assert_same_step((loss, grads), reference(name), 1e-4)
