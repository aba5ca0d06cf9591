"""A checkpointed block's forward costs the host per tensor its ops save for backward.

The checkpoint's saved-tensor hook runs once per saved tensor, so a forward op inside a
checkpointed block costs the forward rate plus the calibration's surcharge per saved tensor
("checkpointed_per_saved") times what it saves (`OpNode.saved`). References: hand-derived
host times; PyTorch's own pack-hook calls in a real CPU step; the shipped calibration's
recorded per-op figure, by exact algebra.
"""

from __future__ import annotations

import pytest
import torch
from fake_tensors import contiguous as t

from gobrrr.calibrate.sections.host import _tiny_workloads
from gobrrr.capture import capture
from gobrrr.cost.shapes import checkpointed_modules
from gobrrr.evaluate import predict
from gobrrr.graph.ir import OpNode, StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import get_gpu
from gobrrr.passes.checkpoint import checkpoint
from gobrrr.precision import Precision
from gobrrr.training.checkpointing import block_names

pytestmark = pytest.mark.usefixtures("one_thread")

H100 = get_gpu("h100")
FWD, PER_OP, PER_SAVED = 10e-6, 30e-6, 7e-6


def _graph(saved: tuple) -> StepGraph:
    # two equal adds inside block h.0 (recomputed in backward, so checkpointed), one outside
    x = t((64, 64), "float32")
    nodes = (
        OpNode(0, "aten.add.Tensor", "forward", "h.0", (x, x), (x,), saved=saved[0]),
        OpNode(1, "aten.add.Tensor", "forward", "h.0", (x, x), (x,), saved=saved[1]),
        OpNode(2, "aten.add.Tensor", "forward", "head", (x, x), (x,), saved=saved[2]),
        OpNode(3, "aten.add.Tensor", "recompute", "h.0", (x, x), (x,)),
    )
    meta = StepMeta(tokens=1, precision=Precision.parse("fp32"))
    return StepGraph(nodes=nodes, storages=(), meta=meta)


def test_checkpointed_forward_op_costs_forward_rate_plus_surcharge_per_saved_tensor(make_cal):
    per_op = {"forward": FWD, "backward": 12e-6, "recompute": 20e-6, "checkpointed": PER_OP}
    cal = make_cal(op_overhead={**per_op, "checkpointed_per_saved": PER_SAVED})
    hosts = [o.host_s for o in predict(_graph((2, 0, 2)), H100, cal).ops]
    # saving 2: 10 + 2 x 7 us; saving 0: the forward's 10 us; outside a block: 10 us
    assert hosts == pytest.approx([24e-6, 10e-6, 10e-6, 20e-6])
    # a calibration that measured the surcharge per op only, or an op with no count: per op
    old = make_cal(op_overhead=per_op)
    assert [o.host_s for o in predict(_graph((2, 0, 2)), H100, old).ops][:2] == pytest.approx(
        [PER_OP, PER_OP]
    )
    unknown = [o.host_s for o in predict(_graph((None, None, None)), H100, cal).ops]
    assert unknown[:2] == pytest.approx([PER_OP, PER_OP])


def test_selective_blocks_fall_back_to_the_full_policys_rate(make_cal):
    # a calibration without the selective policy's keys charges a selective block as full
    from gobrrr.cost.rates import Rates

    cal = make_cal(op_overhead={"forward": FWD, "checkpointed_per_saved": PER_SAVED})
    r = Rates(H100, cal)
    assert r.host("checkpointed_selective", 1, saved=3) == pytest.approx(FWD + 3 * PER_SAVED)
    sel = make_cal(op_overhead={"forward": FWD, "checkpointed_selective_per_saved": 2e-6})
    assert Rates(H100, sel).host("checkpointed_selective", 1, saved=3) == pytest.approx(16e-6)


def _real_pack_calls(make) -> dict[str, int]:
    """{block: tensors autograd packed while the block ran} in a real CPU step of `make`'s
    model, without checkpointing: what a checkpoint's hook would run on."""
    wl = make()
    model, here, out = wl.model, [], {}

    def pack(x):
        if here:
            out[here[-1]] = out.get(here[-1], 0) + 1
        return x

    def enter(name):
        return lambda m, a: here.append(name)

    def leave(m, a, o):
        here.pop()

    handles = []
    for name in block_names(model):
        m = model.get_submodule(name)
        handles += [m.register_forward_pre_hook(enter(name)), m.register_forward_hook(leave)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        wl.compute_loss(wl.batch)
    for h in handles:
        h.remove()
    return out


def _traced_per_block(graph: StepGraph, blocks: list[str]) -> dict[str, int]:
    under = checkpointed_modules(graph)
    out: dict[str, int] = {}
    for n in graph.nodes:
        if n.phase == "forward" and n.module in under:
            b = next(b for b in blocks if n.module == b or n.module.startswith(b + "."))
            out[b] = out.get(b, 0) + n.saved
    return out


def test_traced_and_pass_counts_match_pytorchs_pack_calls():
    # the calibration's tiny Llama: traced with its blocks checkpointed (the hooks packed
    # what each op saved), and checkpointed by the pass from a plain trace, each block's ops
    # save what PyTorch packs for that block in a real CPU step, op for op the same
    make = list(_tiny_workloads())[1]
    blocks = block_names(make().model)
    traced = capture(make, precision="fp32", checkpoint="full")
    passed = checkpoint(capture(make, precision="fp32"), dict.fromkeys(blocks, "full"))
    real = _real_pack_calls(make)
    assert set(real) == set(blocks) and all(v > 0 for v in real.values())
    assert _traced_per_block(traced, blocks) == real
    assert _traced_per_block(passed, blocks) == real
    fwd = [(n.name, n.saved) for n in traced.nodes if n.phase == "forward"]
    assert fwd == [(n.name, n.saved) for n in passed.nodes if n.phase == "forward"]
