"""The BLAS workspaces in the memory model (gobrrr.memory.replay): cuBLAS keeps one per
handle, the main thread's (forward, optimizer) and the autograd engine's (backward), each
made by its first matmul; cuBLASLt its own once an addmm ran. Expected bytes by hand."""

from dataclasses import replace

from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import get_gpu
from gobrrr.memory.replay import blas_workspace_ops, blas_workspaces, step_memory

KiB = 1024
WS, LT = 64 * KiB, 32 * KiB  # a cuBLAS handle's workspace, cuBLASLt's


def _gpu():
    return replace(get_gpu("h100"), blas_workspace=WS, blaslt_workspace=LT)


def _linear_step():
    """A Linear with a bias: the forward's addmm (op 0) makes y (8 KiB) from the parameter W
    and the input x (4 KiB each); the backward's mm (op 1) makes W's gradient (4 KiB), and y
    dies after it."""
    storages = (
        StorageInfo(0, 4 * KiB, "parameter", -1, None),
        StorageInfo(1, 4 * KiB, "input", -1, None),
        StorageInfo(2, 8 * KiB, "activation", 0, 1),
        StorageInfo(3, 4 * KiB, "gradient", 1, None),
    )
    nodes = (
        OpNode(0, "aten.addmm.default", "forward", "fc", (), (), allocs=(2,)),
        OpNode(1, "aten.mm.default", "backward", "fc", (), (), allocs=(3,), frees=(2,)),
    )
    return StepGraph(nodes, storages, StepMeta())


def test_each_handle_and_cublaslt_keep_a_workspace():
    g, gpu = _linear_step(), _gpu()
    assert blas_workspaces(g, gpu, None) == (WS, WS, LT)  # main thread, engine, cuBLASLt
    # made by the forward's addmm (the main handle's and cuBLASLt's), the backward's mm
    assert blas_workspace_ops(g, gpu, None) == ((WS, 0), (LT, 0), (WS, 1))


def test_the_workspaces_count_in_the_peak():
    m = step_memory(_linear_step(), _gpu(), None)
    # in the measured step all three exist from the start: 64 + 64 + 32 KiB; the state
    # (W, x, and last step's gradient until the new one replaces it) 12 KiB; y 8 KiB while
    # ops 0 and 1 run: the peak is 180 KiB, first reached at op 0
    assert m.workspace == 160 * KiB
    assert m.peak == 180 * KiB and m.peak_index == 0
    assert m.at_peak["workspace"] == 160 * KiB
    assert m.timeline == (180 * KiB, 180 * KiB)


def test_no_matmul_no_workspace():
    g = _linear_step()
    adds = tuple(replace(n, op="aten.add.Tensor") for n in g.nodes)
    assert blas_workspaces(replace(g, nodes=adds), _gpu(), None) == ()
