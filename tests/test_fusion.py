"""torch.compile's fusion as the cost model sees it: bytes of a fused chain, by hand."""

import pytest
import torch

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import fuse
from gobrrr.evaluate import predict
from gobrrr.hardware import get_gpu


class CosCos(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return (x * self.w).cos().cos().sum()


def workload(n=1 << 20):
    return lambda: gobrrr.Workload(
        model=CosCos(n),
        batch=(torch.randn(n),),
        loss=lambda y, b: y,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
    )


def test_forward_chain_fuses_into_one_kernel_reading_inputs_once():
    n = 1 << 20
    g = capture(workload(n), precision="fp32")
    groups = [grp for grp in fuse(g, graph_costs(g)) if g.nodes[grp.nodes[0]].phase == "forward"]
    assert len(groups) == 1
    grp = groups[0]
    ops = {g.nodes[i].name for i in grp.nodes}
    assert {"mul", "cos", "sum"} <= ops
    # reads x and w once (4n bytes each); writes what backward needs (the saved x*w and its
    # cos, 4n each) and the scalar loss; the second cos never reaches memory
    saved = [s for s in g.storages if s.kind == "activation" and s.nbytes == 4 * n]
    assert grp.cost.bytes == pytest.approx(2 * 4 * n + len(saved) * 4 * n + 4)
    eager_bytes = sum(graph_costs(g)[i].bytes for i in grp.nodes)
    assert grp.cost.bytes < eager_bytes


def test_compiled_prediction_is_faster_for_memory_bound_chains():
    g = capture(workload(1 << 24), precision="fp32")
    gpu = get_gpu("h100")
    eager, compiled = predict(g, gpu), predict(g, gpu, compiled=True)
    assert compiled.device_s < eager.device_s
    assert any(o.kind == "fused" for o in compiled.ops)
