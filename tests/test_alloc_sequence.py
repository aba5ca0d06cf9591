"""The predicted allocation sequence held against the real one, request by request.

tests/fixtures/zoo_diagnose_h100.json holds the caching allocator's own trace of zoo steps
on an H100 (benchmarks/zoo/diagnose.py): every alloc and free, tagged with the ATen op that
made it. Here the requests that ops allocate inside themselves (reduction staging buffers,
LayerNorm's contiguous copies, cuDNN attention's backward workspace) and where the BLAS
workspaces appear are held against that trace, and the staging-buffer arithmetic against
requests read off it. Convolutions too, call by call: what depthwise ones allocate inside
(PyTorch's own kernels nothing; cuDNN's channels-last weight gradient its fp32 partials, in
ConvNeXt's trace, zoo_diagnose_h100_run2.json) and 1x1 weight gradients' partials.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.memory.scratch.reduce import reduce_buffers
from zoo.common import available

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "tests" / "fixtures" / "zoo_diagnose_h100.json"
TRACES2 = ROOT / "tests" / "fixtures" / "zoo_diagnose_h100_run2.json"  # ConvNeXt-gc
STEP = 4  # the measured step (3 warm-ups before it)


@pytest.mark.parametrize(
    "shape,dtype_bytes,expected",
    [
        ((8192, 768), 4, (50331648, 24)),  # BERT fp32: a 768-wide bias gradient
        ((8192, 3072), 4, (138412032, 96)),  # BERT fp32: the intermediate bias
        ((8192, 30522), 4, (31254528, 1908)),  # BERT fp32: the decoder bias (odd width)
        ((64 * 197, 2304), 2, (139198464, 72)),  # ViT-B/16 bf16: the packed in-projection bias
    ],
)
def test_reduce_buffers_match_requests_read_off_the_trace(shape, dtype_bytes, expected):
    """Sizes as the allocator trace recorded them for a sum over the tokens (dim 0)."""
    assert reduce_buffers(shape, (shape[1], 1), [0], dtype_bytes) == expected


def test_a_convolutions_bias_gradient_stages_as_laid_out():
    """ViT-B/16's patch-embedding gradient (64, 768, 14, 14) bf16 arrives channels-last (from
    the permute after it): its bias's sum reduces across blocks, as the trace recorded
    (77,070,336 + 24 bytes); laid out channels-first, the same sum would not."""
    assert reduce_buffers((64, 768, 14, 14), (150528, 1, 10752, 768), [0, 2, 3], 2) == (
        77070336,
        24,
    )
    assert reduce_buffers((64, 768, 14, 14), (150528, 196, 14, 1), [0, 2, 3], 2) == (0, 0)


def test_a_reduction_within_blocks_stages_nothing():
    """Summing a row's 768 values (the fastest dim) needs no second pass: no staging."""
    assert reduce_buffers((8192, 768), (768, 1), [1], 4) == (0, 0)


@functools.cache
def _rows() -> dict[str, dict]:
    if not TRACES.exists():
        pytest.skip(f"{TRACES.name} is not recorded: run benchmarks/zoo/diagnose.py on a GPU")
    return {r["name"]: r for r in json.loads(TRACES.read_text())["alloc"] if "error" not in r}


@functools.cache
def _rows2() -> dict[str, dict]:
    if not TRACES2.exists():
        pytest.skip(f"{TRACES2.name} is not recorded: run benchmarks/zoo/diagnose.py on a GPU")
    return {r["name"]: r for r in json.loads(TRACES2.read_text())["alloc"] if "error" not in r}


@functools.cache
def _predict(name: str):
    from zoo import compare
    from zoo.cases import get_case

    case = get_case(name)
    if not available(case.library):
        pytest.skip(f"{case.library} is not installed")
    return compare.predict(case)


@functools.cache
def _steps(name: str):
    from zoo import allocdiff

    row = _rows()[name] if name in _rows() else _rows2()[name]
    est = _predict(name)
    return allocdiff.real_steps(row), allocdiff.predicted_steps(est)


def _requests(step: dict, ops: set[str]) -> Counter:
    return Counter(
        (e[2].split(" @ ")[0], e[1])
        for e in step["events"]
        if e[0] == 0 and e[2].split(" @ ")[0] in ops
    )


INSIDE = {
    "sum",
    "native_layer_norm",
    "native_layer_norm_backward",
    "_scaled_dot_product_cudnn_attention_backward",
}


@pytest.mark.parametrize("name", ["vit_b_16-tv", "whisper-base", "bert-base-mlm-fp32"])
def test_requests_inside_ops_match_the_trace(name):
    """Every request these ops make in the measured step (outputs and what they allocate
    inside), as a multiset of (op, bytes), is the trace's."""
    real, pred = _steps(name)
    r, p = _requests(real[STEP], INSIDE), _requests(pred[STEP], INSIDE)
    assert r == p, (
        f"only real: {sorted((r - p).items())[:8]}; only predicted: {sorted((p - r).items())[:8]}"
    )


@pytest.mark.parametrize("name", ["vit_b_16-tv", "bert-base-mlm-fp32", "mobilenet_v3_large-tv"])
def test_blas_workspaces_appear_where_the_trace_has_them(name):
    """The ops (and their order) at which step 1 allocates the 32 MiB cuBLAS and 1 MiB
    cuBLASLt workspaces: lazily, at the first matmul of each thread."""
    real, pred = _steps(name)

    def where(step):
        return [
            (e[2].split(" @ ")[0], e[1])
            for e in step["events"]
            if e[0] == 0
            and e[1] in (32 * 2**20, 2**20)
            and e[2].split(" @ ")[0] in ("mm", "addmm", "bmm")
        ]

    assert where(real[1]) == where(pred[1])


def test_autocast_casts_the_weight_before_the_input():
    """CUDA autocast casts an op's arguments last first (GCC evaluates the C++ call's
    arguments right to left): the traced Linear's weight cast comes before its input's."""

    def make():
        model = nn.Linear(64, 32, bias=False)
        return gobrrr.Workload(
            model=model, batch=(torch.randn(16, 64),), loss=lambda y, b: y.float().pow(2).mean()
        )

    g = capture(make, precision="bf16-mixed")
    casts = [n for n in g.nodes if n.phase == "forward" and n.name == "_to_copy"]
    assert [tuple(n.outputs[0].shape) for n in casts[:2]] == [(32, 64), (16, 64)]


def _op_runs(step: dict, op: str) -> list[list[tuple]]:
    """The step's allocs and frees made by one ATen op, a list per call (consecutive events
    with its name; the allocator's segment events left out)."""
    runs, last = [], False
    for e in (e for e in step["events"] if e[0] in (0, 1)):
        mine = e[2].split(" @ ")[0] == op
        if mine:
            if not last:
                runs.append([])
            runs[-1].append(e)
        last = mine
    return runs


def _inside(run: list[tuple]) -> Counter:
    """Sizes of the blocks a call allocates and frees within itself."""
    freed = {e[3] for e in run if e[0] == 1}
    return Counter(e[1] for e in run if e[0] == 0 and e[3] in freed)


@pytest.mark.parametrize(
    "name,op,calls",
    [
        ("efficientnet_b0-timm-fp32", "convolution", 16),  # channels-first tf32: PyTorch's kernels
        ("efficientnet_b0-timm-fp32", "convolution_backward", 16),
        ("mobilenet_v3_large-tv", "convolution", 15),  # channels-first bf16: PyTorch's kernels
        ("mobilenet_v3_large-tv", "convolution_backward", 15),
        ("convnext_tiny-timm-gc", "convolution_backward", 18),  # channels-last bf16: cuDNN
    ],
)
def test_depthwise_convolutions_allocate_inside_as_the_trace(name, op, calls):
    """Every depthwise convolution's blocks allocated and freed inside the call (its scratch
    and its bias gradient's staging), call by call, are the trace's: nothing for PyTorch's
    own kernels, cuDNN's fp32 weight-gradient partials for channels-last."""
    from gobrrr.cost import conv

    real, pred = _steps(name)
    nodes = [n for n in _predict(name).graph.nodes if n.name == op]
    r_runs, p_runs = _op_runs(real[1], op), _op_runs(pred[1], op)
    assert len(r_runs) == len(p_runs) == len(nodes)
    checked = [
        (n.module, _inside(r), _inside(p))
        for n, r, p in zip(nodes, r_runs, p_runs, strict=True)
        if conv.depthwise(n)
    ]
    assert len(checked) == calls
    assert [c[1] for c in checked] == [c[2] for c in checked], checked[:3]


@pytest.mark.parametrize("name,count", [("mobilenet_v3_large-tv", 22), ("resnet50-tv-fp32", 16)])
def test_1x1_weight_gradients_sum_partials_as_the_trace(name, count):
    """Where a stride-1 channels-first 1x1 backward is predicted to sum its weight gradient in
    fp32 partials (bf16 MobileNetV3, tf32 ResNet-50), the largest block it allocates inside
    is the trace's to within a few hundred bytes (cuDNN's small descriptors ride along)."""
    from gobrrr.cost import conv
    from gobrrr.cost._ops_common import tf32_of
    from gobrrr.cost.flops import op_cost
    from gobrrr.hardware import find_calibration

    real, _ = _steps(name)
    est = _predict(name)
    cal, tf32 = find_calibration(est.gpu), tf32_of(est.graph.meta)
    nodes = [n for n in est.graph.nodes if n.name == "convolution_backward"]
    runs = _op_runs(real[1], "convolution_backward")
    assert len(runs) == len(nodes)
    got = []
    for n, run in zip(nodes, runs, strict=True):
        math = op_cost(n, tf32).math
        partials = conv.pointwise_wgrad_partials(n, math)
        cls = conv.class_inside(n, cal, math)
        if partials is not None and cls is not None and partials < cls:
            got.append((n.module, max(_inside(run)), partials))
    assert len(got) == count
    assert all(abs(r - p) <= 512 for _, r, p in got), [g for g in got if abs(g[1] - g[2]) > 512]
