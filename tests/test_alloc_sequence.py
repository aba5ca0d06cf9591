"""The predicted allocation sequence held against the real one, request by request.

benchmarks/results/zoo_diagnose_h100.json holds the caching allocator's own trace of zoo steps
on an H100 (benchmarks/zoo_diagnose.py): every alloc and free, tagged with the ATen op that
made it. Here the requests that ops allocate inside themselves (reduction staging buffers,
LayerNorm's contiguous copies, cuDNN attention's backward workspace) and where the BLAS
workspaces appear are held against that trace, and the staging-buffer arithmetic against
requests read off it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost.reduce_scratch import reduce_buffers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TRACES = ROOT / "benchmarks" / "results" / "zoo_diagnose_h100.json"
STEP = 4  # the measured step (3 warm-ups before it)


@pytest.mark.parametrize("shape,dtype_bytes,expected", [
    ((8192, 768), 4, (50331648, 24)),  # BERT fp32: a 768-wide bias gradient
    ((8192, 3072), 4, (138412032, 96)),  # BERT fp32: the intermediate bias
    ((8192, 30522), 4, (31254528, 1908)),  # BERT fp32: the decoder bias (odd width)
    ((64 * 197, 2304), 2, (139198464, 72)),  # ViT-B/16 bf16: the packed in-projection bias
])
def test_reduce_buffers_match_requests_read_off_the_trace(shape, dtype_bytes, expected):
    """Sizes as the allocator trace recorded them for a sum over the tokens (dim 0)."""
    assert reduce_buffers(shape, (shape[1], 1), [0], dtype_bytes) == expected


def test_a_convolutions_bias_gradient_stages_as_laid_out():
    """ViT-B/16's patch-embedding gradient (64, 768, 14, 14) bf16 arrives channels-last (from
    the permute after it): its bias's sum reduces across blocks, as the trace recorded
    (77,070,336 + 24 bytes); laid out channels-first, the same sum would not."""
    assert reduce_buffers((64, 768, 14, 14), (150528, 1, 10752, 768), [0, 2, 3], 2) == (
        77070336, 24)
    assert reduce_buffers((64, 768, 14, 14), (150528, 196, 14, 1), [0, 2, 3], 2) == (0, 0)


def test_a_reduction_within_blocks_stages_nothing():
    """Summing a row's 768 values (the fastest dim) needs no second pass: no staging."""
    assert reduce_buffers((8192, 768), (768, 1), [1], 4) == (0, 0)


@functools.cache
def _rows() -> dict[str, dict]:
    if not TRACES.exists():
        pytest.skip(f"{TRACES.name} is not recorded: run benchmarks/zoo_diagnose.py on a GPU")
    return {r["name"]: r for r in json.loads(TRACES.read_text())["alloc"] if "error" not in r}


@functools.cache
def _steps(name: str):
    import zoo_allocdiff
    from zoo import compare
    from zoo.cases import get_case

    case = get_case(name)
    if importlib.util.find_spec(case.library) is None:
        pytest.skip(f"{case.library} is not installed")
    row = _rows()[name]
    return zoo_allocdiff.real_steps(row), zoo_allocdiff.predicted_steps(compare.predict(case))


def _requests(step: dict, ops: set[str]) -> Counter:
    return Counter((e[2].split(" @ ")[0], e[1]) for e in step["events"]
                   if e[0] == 0 and e[2].split(" @ ")[0] in ops)


INSIDE = {"sum", "native_layer_norm", "native_layer_norm_backward",
          "_scaled_dot_product_cudnn_attention_backward"}


@pytest.mark.parametrize("name", ["vit_b_16-tv", "whisper-base", "bert-base-mlm-fp32"])
def test_requests_inside_ops_match_the_trace(name):
    """Every request these ops make in the measured step (outputs and what they allocate
    inside), as a multiset of (op, bytes), is the trace's."""
    real, pred = _steps(name)
    r, p = _requests(real[STEP], INSIDE), _requests(pred[STEP], INSIDE)
    assert r == p, (f"only real: {sorted((r - p).items())[:8]}; "
                    f"only predicted: {sorted((p - r).items())[:8]}")


@pytest.mark.parametrize("name", ["vit_b_16-tv", "bert-base-mlm-fp32", "mobilenet_v3_large-tv"])
def test_blas_workspaces_appear_where_the_trace_has_them(name):
    """The ops (and their order) at which step 1 allocates the 32 MiB cuBLAS and 1 MiB
    cuBLASLt workspaces: lazily, at the first matmul of each thread."""
    real, pred = _steps(name)

    def where(step):
        return [(e[2].split(" @ ")[0], e[1]) for e in step["events"]
                if e[0] == 0 and e[1] in (32 * 2**20, 2**20)
                and e[2].split(" @ ")[0] in ("mm", "addmm", "bmm")]
    assert where(real[1]) == where(pred[1])


def test_autocast_casts_the_weight_before_the_input():
    """CUDA autocast casts an op's arguments last first (GCC evaluates the C++ call's
    arguments right to left): the traced Linear's weight cast comes before its input's."""
    def make():
        model = nn.Linear(64, 32, bias=False)
        return gobrrr.Workload(model=model, batch=(torch.randn(16, 64),),
                               loss=lambda y, b: y.float().pow(2).mean())
    g = capture(make, precision="bf16-mixed")
    casts = [n for n in g.nodes if n.phase == "forward" and n.name == "_to_copy"]
    assert [tuple(n.outputs[0].shape) for n in casts[:2]] == [(32, 64), (16, 64)]
