"""The join, regimes and diagnosis on real H100 traces recorded by
benchmarks/suite/bench_profile_checks.py (a 2-layer GPT-2, d=128, 4 heads, V=1024, batch 4 x 128
tokens, AdamW; and x.cos().cos() on 2**22 fp32 elements, eager and torch.compile'd)."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import get_gpu
from gobrrr.profile.analyze import analyze
from gobrrr.profile.diagnose import diagnose
from gobrrr.profile.join import join_trace, load_trace, op_family

FIX = Path(__file__).parent / "fixtures" / "traces"
H100 = get_gpu("h100")
LINEARS = ("c_attn", "c_proj", "c_fc", "lm_head")


@pytest.fixture(scope="module")
def bf16():
    return join_trace(load_trace(FIX / "tiny_gpt_bf16.json.gz"))


@pytest.fixture(scope="module")
def bf16_graph():
    return StepGraph.from_json(gzip.decompress((FIX / "tiny_gpt_bf16.graph.json.gz").read_bytes()))


def test_every_kernel_is_attributed_to_an_aten_op(bf16):
    assert bf16.kernels and bf16.unattributed == 0
    for k in bf16.kernels:
        assert k.op >= 0
        assert bf16.ops[k.op].op.startswith("aten::")


def test_phases_follow_the_kernels(bf16):
    by_phase = {}
    for k in bf16.kernels:
        by_phase.setdefault(bf16.ops[k.op].phase, []).append(k.name)
    assert set(by_phase) == {"forward", "backward", "optimizer"}
    # cuDNN flash attention: the forward kernels run in forward, the backward ones in backward
    assert any("fprop" in n for n in by_phase["forward"])
    assert not any("bprop" in n for n in by_phase["forward"])
    assert any("bprop" in n for n in by_phase["backward"])
    # AdamW (foreach) runs multi_tensor_apply kernels, and only in the optimizer phase
    assert all("multi_tensor" in n for n in by_phase["optimizer"])
    assert not any("multi_tensor" in n for n in by_phase["forward"] + by_phase["backward"])
    # the phases are in time order
    first = {p: min(k.ts for k in bf16.kernels if bf16.ops[k.op].phase == p) for p in by_phase}
    assert first["forward"] < first["backward"] < first["optimizer"]


def test_matmuls_are_attributed_to_their_linear_in_forward_and_backward(bf16):
    mms = [o for o in bf16.ops if o.family == "matmul" and o.kernels]
    fwd = [o for o in mms if o.phase == "forward"]
    bwd = [o for o in mms if o.phase == "backward"]
    # 2 blocks x 4 Linears + lm_head forward; backward: grad-input + grad-weight of each
    assert len(fwd) == 9 and len(bwd) == 18
    for o in mms:
        assert o.module.split(".")[-1] in LINEARS, (o.op, o.phase, o.module)
    assert [o.module for o in fwd[:4]] == [
        f"transformer.h.0.{m}" for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    # backward runs the blocks in reverse: the head first, block 0 last
    assert bwd[0].module == "lm_head" and bwd[-1].module == "transformer.h.0.attn.c_attn"


def test_graph_alignment_matches_every_launching_op(bf16, bf16_graph):
    from gobrrr.profile.join import align_graph

    match, frac = align_graph(bf16.ops, bf16_graph)
    assert frac == 1.0
    for o, n in zip(bf16.ops, match, strict=True):
        if n >= 0:
            node = bf16_graph.nodes[n]
            assert op_family(node.op) == o.family and node.phase == o.phase
    # the SDPA backend differs (CPU trace vs cuDNN on the GPU) yet the ops were joined
    attn = [i for i, o in enumerate(bf16.ops) if o.family == "attention"]
    assert attn and all(match[i] >= 0 for i in attn)
    assert all("cpu" in bf16_graph.nodes[match[i]].op for i in attn)


def test_analysis_sums_and_rates(bf16, bf16_graph):
    a = analyze(bf16, H100, "bf16-mixed", bf16_graph)
    assert a.kernels == a.kernels_attributed == len(bf16.kernels)
    total = sum(o.device_s for o in a.ops)
    assert sum(k.dur for k in bf16.kernels) == pytest.approx(total)
    assert sum(g.device_s for g in a.phases) == pytest.approx(total)
    assert 0 < a.busy_s <= total + 1e-12 and a.busy_s <= a.span_s
    for o in a.ops:
        assert o.cost_source == "graph"
        assert o.flops_per_s == pytest.approx(o.flops / o.device_s)
    # a tiny model on an H100: every op is far below a microsecond-scale roof -> overhead
    assert {o.regime for o in a.ops} == {"overhead"}


def test_fp32_trace_flags_matmuls_off_tensor_cores():
    j = join_trace(load_trace(FIX / "tiny_gpt_fp32.json.gz"))
    graph = StepGraph.from_json(gzip.decompress((FIX / "tiny_gpt_fp32.graph.json.gz").read_bytes()))
    a = analyze(j, H100, "fp32", graph)
    found = {
        f.kind: f for f in diagnose(a.ops, H100, step_s=a.span_s, idle_share=0.9, precision="fp32")
    }
    # 27 Linear matmuls (9 forward + 18 backward) and 4 SDPA calls (2 fwd, 2 bwd), all fp32
    assert found["tensor_cores"].title.startswith("31 matmul(s) run in fp32")
    assert found["overhead"].saving_s == pytest.approx(0.9 * a.span_s)
    mm = [o for o in a.ops if o.kind == "matmul"]
    assert {o.math for o in mm} == {"fp32"}


def test_eager_cos_is_memory_bound_and_compiled_is_labelled():
    eager = join_trace(load_trace(FIX / "cos_cos_eager.json.gz"))
    a = analyze(eager, H100, "fp32")
    cos = [o for o in a.ops if o.family == "cos"]
    assert len(cos) == 2 and all(o.kernels == 1 for o in cos)
    n = 2**22
    # shapes from the trace: 4 bytes read + 4 written per element
    assert cos[0].bytes == 8 * n
    assert cos[0].bytes_per_s == pytest.approx(8 * n / cos[0].device_s)
    assert cos[0].regime == "memory"  # first kernel: no gap before it, > 40 % of HBM bandwidth

    comp = join_trace(load_trace(FIX / "cos_cos_compiled.json.gz"))
    assert comp.unattributed == 0
    fused = [o for o in comp.ops if o.op.startswith("compiled::")]
    assert [o.op for o in fused] == ["compiled::triton_poi_fused_cos_0"]
    assert fused[0].phase == "forward" and "CompiledFxGraph" in fused[0].compiled
    assert not any(o.family == "cos" for o in comp.ops)


def test_gpt2_small_batch_trace_is_joined_and_overhead_bound():
    """GPT-2 124M, batch 1 x 256 tokens, bf16-mixed eager, one step on an H100."""
    j = join_trace(load_trace(FIX / "gpt2_b1_s256_bf16.json.gz"))
    assert j.kernels and j.unattributed == 0
    a = analyze(j, H100, "bf16-mixed")
    mm = [o for o in a.ops if o.family == "matmul"]
    # 12 blocks x 4 Linears + lm_head = 49 forward, two matmuls each in backward
    assert sum(o.phase == "forward" for o in mm) == 49
    assert sum(o.phase == "backward" for o in mm) == 98
    attn = [o for o in a.ops if o.kind == "attention"]
    assert sorted(o.module for o in attn if o.phase == "forward") == sorted(
        f"transformer.h.{i}.attn" for i in range(12)
    )
    assert {o.module for o in attn if o.phase == "backward"} == {o.module for o in attn}
    # the GPU computes for a small part of the profiled step: kernels are tiny
    (start, end) = j.steps[0]
    assert a.busy_s < 0.25 * (end - start)
    regimes = [o.regime for o in a.ops]
    assert regimes.count("overhead") > 0.9 * len(regimes)
    found = diagnose(a.ops, H100, step_s=end - start, idle_share=1 - a.busy_s / (end - start))
    assert found[0].kind == "overhead"
