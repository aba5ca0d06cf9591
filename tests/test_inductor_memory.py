"""How a compiled graph's generated code allocates (gobrrr.passes.compile, gobrrr.cost.pad_mm).

Hand-built compiled captures, each a few ops in compiled regions, with what Inductor's wrapper
would do worked out by hand from its rules (torch/_inductor/codegen/wrapper.py: inputs freed
after the kernel, `can_reuse`, `AllocateLine.plan`; scheduler.py: `decide_inplace_update`;
fx_passes/pad_mm.py), and the pad_mm copies against the buffers Inductor's generated code for
Hugging Face's GPT-2 allocated on an H100.
"""

from __future__ import annotations

import math
import re
import shutil

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

from gobrrr.cost import pad_mm
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo
from gobrrr.graph.meta import Region, StepMeta
from gobrrr.memory.replay import simulate
from gobrrr.passes.compile import inductor

MB = 2**20
EXTERN = "mylib.kernel.default"  # a custom op: Inductor calls it as it is (an extern kernel)


def _t(sid: int, n: int, dtype: str = "float32") -> TensorInfo:
    return TensorInfo(
        shape=(n // 4 if dtype == "float32" else n // 2,), stride=(1,), dtype=dtype, storage=sid
    )


class _Builder:
    """Ops in order; each names what it reads and makes (storage id, bytes)."""

    def __init__(self) -> None:
        self.nodes: list[OpNode] = []
        self.sizes: dict[int, int] = {}
        self.created: dict[int, int] = {}
        self.dtypes: dict[int, str] = {}
        self.ops: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []

    def before(self, sid: int, nbytes: int, dtype: str = "float32") -> None:
        """A storage made before the step (a parameter, the batch)."""
        self.sizes[sid], self.created[sid], self.dtypes[sid] = nbytes, -1, dtype

    def op(
        self, name: str, reads=(), makes=(), phase: str = "forward", dtype: str = "float32"
    ) -> int:
        i = len(self.ops)
        for sid, nbytes in makes:
            self.sizes[sid], self.created[sid], self.dtypes[sid] = nbytes, i, dtype
        self.ops.append((name, phase, tuple(reads), tuple(sid for sid, _ in makes)))
        return i

    def graph(self, regions, survive=()) -> StepGraph:
        """The graph with each storage freed after its last read (or where made, if never
        read); `survive`: storages alive after the step."""
        last = dict(self.created)
        for i, (_, _, reads, _) in enumerate(self.ops):
            for sid in reads:
                last[sid] = i
        freed = {
            sid: (None if sid in survive or self.created[sid] < 0 else last[sid])
            for sid in self.sizes
        }
        nodes = []
        for i, (name, phase, reads, makes) in enumerate(self.ops):
            nodes.append(
                OpNode(
                    index=i,
                    op=name if "." in name else f"aten.{name}.default",
                    phase=phase,
                    module="m",
                    inputs=tuple(_t(s, self.sizes[s], self.dtypes[s]) for s in reads),
                    outputs=tuple(_t(s, self.sizes[s], self.dtypes[s]) for s in makes),
                    allocs=makes,
                    frees=tuple(s for s in self.sizes if freed[s] == i),
                )
            )
        storages = tuple(
            StorageInfo(sid, self.sizes[sid], "activation", self.created[sid], freed[sid])
            for sid in sorted(self.sizes)
        )
        return StepGraph(
            nodes=tuple(nodes),
            storages=storages,
            meta=StepMeta(compiled_regions=tuple(Region(*r) for r in regions)),
        )


def _peak(g: StepGraph) -> int:
    return simulate(g).peak


def test_a_fused_kernel_holds_its_inputs_until_its_outputs_are_made():
    # x (a graph input, 8 MiB) is read by the first op of a fused group and dies there; the
    # group's output y (8 MiB of another dtype: no in-place) is made by its last op. Eager
    # order frees x before y exists; Inductor's kernel frees x after it.
    b = _Builder()
    b.before(0, 8 * MB)
    b.op(EXTERN, reads=(0,), makes=((1, 8 * MB),))  # an extern kernel makes x
    b.op("neg", reads=(1,), makes=((2, 8 * MB),))  # fused: an intermediate, never allocated
    b.op("relu", reads=(2,), makes=((3, 4 * MB),), dtype="bfloat16")
    b.op("sum", reads=(3,), makes=((4, 512),))
    g = inductor(b.graph([("forward", 1, 2)], survive=(4,)))
    assert g.storages[2].nbytes == 0
    assert g.storages[1].freed == 2 and 1 in g.nodes[2].frees
    assert _peak(g) == 8 * MB + 8 * MB + 4 * MB + 512  # x alive while the output is made
    assert g.meta.inductor["in_place"] == 0


def test_a_fused_kernel_writes_in_place_into_an_intermediate_it_reads_last():
    # x, made by an extern kernel inside the same graph, is read last by the fused group,
    # whose output has x's dtype and size: Inductor writes the output into x's buffer.
    b = _Builder()
    b.before(0, 8 * MB)
    b.op(EXTERN, reads=(0,), makes=((1, 8 * MB),))
    b.op("relu", reads=(1,), makes=((2, 8 * MB),))
    b.op("sum", reads=(2,), makes=((3, 512),))
    g = inductor(b.graph([("forward", 0, 1)], survive=(3,)))
    assert g.meta.inductor["in_place"] == 1
    assert _peak(g) == 8 * MB + 8 * MB + 512  # one 8 MiB block for x and y
    # an input of the graph itself is never reused: the same ops in a region starting after
    # the extern kernel hold both blocks
    g = inductor(b.graph([("forward", 1, 1)], survive=(3,)))
    assert g.meta.inductor["in_place"] == 0
    assert _peak(g) == 3 * 8 * MB + 512  # and the previous step's sum, until it is made anew


def test_in_place_needs_the_same_dtype_and_95_to_100_percent_of_the_size():
    for out_bytes, dtype, expect in (
        (8 * MB, "bfloat16", 0),
        (int(7.5 * MB), "float32", 0),
        (int(7.8 * MB), "float32", 1),
    ):
        b = _Builder()
        b.before(0, 8 * MB)
        b.op(EXTERN, reads=(0,), makes=((1, 8 * MB),))
        b.op("relu", reads=(1,), makes=((2, out_bytes),), dtype=dtype)
        b.op("sum", reads=(2,), makes=((3, 512),))
        g = inductor(b.graph([("forward", 0, 1)], survive=(3,)))
        assert g.meta.inductor["in_place"] == expect, (out_bytes, dtype)


def test_a_saved_tensor_only_backward_reads_is_donated_to_backward():
    # the forward graph makes s (16 MiB) and saves it; only the backward graph reads it, last
    # in a fused kernel whose output (the gradient, 16 MiB) goes in place into s's buffer. A
    # tensor the eager code between the graphs also reads (a user output) is not donated.
    for user_reads, expect in ((False, 1), (True, 0)):
        b = _Builder()
        b.before(0, 16 * MB)
        b.op(EXTERN, reads=(0,), makes=((1, 16 * MB),))  # forward graph: s
        b.op("mul", reads=(1,), makes=((2, 512),))  # forward graph: the loss
        b.op("clone", reads=(1,) if user_reads else (2,), makes=((3, 512),), phase="forward")
        b.op("mul", reads=(1, 2), makes=((4, 16 * MB),), phase="backward")  # backward graph
        b.op(EXTERN, reads=(4, 0), makes=((5, 16 * MB),), phase="backward")
        g = inductor(b.graph([("forward", 0, 1), ("backward", 3, 4)], survive=(3, 5)))
        assert g.meta.inductor["in_place"] == expect, user_reads


def test_a_dead_buffer_of_the_same_dtype_and_size_is_reused_by_a_later_allocation():
    # Inside one graph: extern kernels make a (4 MiB), then b (1 MiB), read a last (a dies),
    # make c (2 MiB), then d (4 MiB, a's size). The planner's pool hands d a's buffer, which
    # stays allocated from a's death to d: at c, a's 4 MiB are still held.
    b = _Builder()
    b.before(0, 512)
    b.op(EXTERN, reads=(0,), makes=((1, 4 * MB),))
    b.op(EXTERN, reads=(1,), makes=((2, 1 * MB),))
    b.op(EXTERN, reads=(2,), makes=((3, 2 * MB),))
    b.op(EXTERN, reads=(3,), makes=((4, 4 * MB),))
    b.op("sum", reads=(4,), makes=((5, 512),))
    g = inductor(b.graph([("forward", 0, 3)], survive=(5,)))
    assert g.meta.inductor["reused"] == 1
    assert g.storages[1].freed == 2  # held until the op before d
    # at c: a's buffer, b, c, with the parameter and the previous step's sum (512 B each)
    assert _peak(g) == 2 * 512 + 4 * MB + 1 * MB + 2 * MB
    # eagerly (no region), a is gone when c is made: the peak is at d, with c
    eager = b.graph([], survive=(5,))
    assert _peak(inductor(eager)) == _peak(eager) == 2 * 512 + 2 * MB + 4 * MB


GPT2 = {"m": 8192, "d": 768, "vocab": 50257}


def _mm(a: TensorInfo, b: TensorInfo) -> OpNode:
    return OpNode(
        index=0, op="aten.mm.default", phase="backward", module="lm_head", inputs=(a, b), outputs=()
    )


def test_pad_mm_copies_gpt2_s_lm_head_gradient_as_inductor_did_on_an_h100():
    # Inductor's backward for Hugging Face's GPT-2 (batch 8 x 1024) padded the (8192, 50257)
    # logits gradient to (8192, 50264) with rows 50304 apart, and the weight to (50264, 768)
    m, d, v = GPT2["m"], GPT2["d"], GPT2["vocab"]
    grad = TensorInfo((m, v), (v, 1), "bfloat16", 0)
    weight = TensorInfo((v, d), (d, 1), "bfloat16", 1)
    assert pad_mm.copies(_mm(grad, weight)) == [(grad, 8192 * 50304 * 2), (weight, 50264 * 768 * 2)]
    # the forward: hidden (8192, 768) @ weight.t() (768, 50257): n is padded, k is aligned
    hidden = TensorInfo((m, d), (d, 1), "bfloat16", 2)
    wt = TensorInfo((d, v), (1, d), "bfloat16", 1)
    assert [b for _, b in pad_mm.copies(_mm(hidden, wt))] == [768 * 50304 * 2]
    # the weight gradient (50257, 8192) @ (8192, 768): only m is misaligned, left unpadded
    assert pad_mm.copies(_mm(TensorInfo((v, m), (1, v), "bfloat16", 0), hidden)) == []
    # aligned, fp32, or an operand its producer writes padded: no copy
    assert pad_mm.copies(_mm(hidden, TensorInfo((d, 50304), (50304, 1), "bfloat16", 3))) == []
    assert (
        pad_mm.copies(
            _mm(TensorInfo((m, v), (v, 1), "float32", 0), TensorInfo((v, d), (d, 1), "float32", 1))
        )
        == []
    )
    assert [t for t, _ in pad_mm.copies(_mm(grad, weight), planned=lambda t: t is grad)] == [weight]


def test_pad_copies_are_a_compiled_matmul_s_scratch_and_free_an_operand_it_reads_last():
    # the backward graph's matmul reads its input (the logits' gradient from the eager loss:
    # copied, and kept by the caller) and a bf16 weight the forward graph saved, read last by
    # this matmul (copied, then freed before the matmul runs). A weight a fused kernel of
    # the same graph makes is written padded in the first place: no copy.
    m, d, v = 64, 16, 1001
    copies = (m * 1008 * 2, 1008 * d * 2)
    for made_in_forward, expect in ((True, copies), (False, copies[:1])):
        b = _Builder()
        b.before(0, m * v * 2, "bfloat16")  # the gradient
        b.before(1, v * d * 4)  # the fp32 weight
        b.op(
            EXTERN if made_in_forward else "_to_copy",
            reads=(1,),
            makes=((2, v * d * 2),),
            phase="forward" if made_in_forward else "backward",
            dtype="bfloat16",
        )
        b.op("mm", reads=(0, 2), makes=((3, m * d * 2),), phase="backward", dtype="bfloat16")
        b.op("sum", reads=(3,), makes=((4, 512),), phase="backward")
        runs = [("forward", 0, 0), ("backward", 1, 1)] if made_in_forward else [("backward", 0, 1)]
        g = b.graph(runs, survive=(4,))
        nodes = list(g.nodes)
        nodes[1] = OpNode(
            1,
            "aten.mm.default",
            "backward",
            "m",
            (TensorInfo((m, v), (v, 1), "bfloat16", 0), TensorInfo((v, d), (d, 1), "bfloat16", 2)),
            g.nodes[1].outputs,
            allocs=(3,),
            frees=g.nodes[1].frees,
        )
        g = StepGraph(tuple(nodes), g.storages, g.meta)
        assert pad_mm.scratch(g) == {1: expect}
        planned = inductor(g)
        assert planned.meta.inductor["padded"] == 1
        assert g.storages[2].freed == 1
        assert planned.storages[2].freed == (0 if made_in_forward else 1)


def test_a_padded_compiled_matmul_pays_for_its_copy_kernels():
    # the same misaligned (4096 x 1001) @ (1001 x 1024) bf16 matmul, compiled: at the aligned
    # rate, plus two copy kernels that read each operand and write its padded copy
    from gobrrr.cost.flops import op_cost
    from gobrrr.cost.rates import Rates
    from gobrrr.cost.roofline import time_op
    from gobrrr.evaluate import predict
    from gobrrr.hardware import get_gpu

    m, k, n = 4096, 1001, 1024
    a = TensorInfo((m, k), (k, 1), "bfloat16", 0)
    b = TensorInfo((k, n), (n, 1), "bfloat16", 1)
    node = OpNode(
        0,
        "aten.mm.default",
        "forward",
        "m",
        (a, b),
        (TensorInfo((m, n), (n, 1), "bfloat16", 2),),
        args=({"t": 0}, {"t": 1}),
        allocs=(2,),
    )
    storages = (
        StorageInfo(0, a.nbytes, "activation", -1, None),
        StorageInfo(1, b.nbytes, "parameter", -1, None),
        StorageInfo(2, m * n * 2, "activation", 0, None),
    )
    gpu = get_gpu("h100")
    eager = StepGraph((node,), storages, StepMeta(tokens=1))
    compiled = StepGraph(
        (node,), storages, eager.meta.replace(compiled_regions=(Region("forward", 0, 0),))
    )
    copies = pad_mm.copies(node)
    assert [c for _, c in copies] == [m * 1008 * 2, 1008 * n * 2]
    moved = a.nbytes + b.nbytes + sum(c for _, c in copies)
    rates = Rates(gpu, None)
    cost = op_cost(node, False)
    aligned = time_op(node, cost, rates, padded=True).device_s  # no misalignment penalty
    padded = predict(compiled, gpu, compiled=True).ops[0]
    expect = aligned + moved / rates.bandwidth("copy") + 2 * rates.latency
    assert math.isclose(padded.device_s, expect, rel_tol=1e-9)
    assert padded.device_s < predict(eager, gpu).ops[0].device_s  # misaligned is slower


class _LNBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.ln = nn.Linear(64, 256), nn.LayerNorm(256)
        self.fc, self.out = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x):
        h = self.inp(x)
        return self.out(torch.nn.functional.silu(self.fc(self.ln(h)))) + h


_MODELS = {
    "mlp-gelu": lambda: nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 64)
    ),
    "mlp-tanh": lambda: nn.Sequential(
        nn.Linear(64, 256), nn.SiLU(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)
    ),
    "ln-block": _LNBlock,
}
#: outputs written into other buffers in Inductor's code (in place or from the pool)
_WRITTEN = {"mlp-gelu": 3, "mlp-tanh": 3, "ln-block": 3}
_REUSE = re.compile(r"^buf\d+ = (buf\d+); del buf\d+  # reuse$")
_CALL = re.compile(r"^[\w.]+\(")


def _written_into(code: str) -> int:
    """Lines "bufA = bufB; del bufB  # reuse" of a generated wrapper whose bufB a kernel had
    written (a buffer aliased right after it is allocated, before any kernel, is one buffer)."""
    called: set[str] = set()
    count = 0
    for line in code[code.index("def call(") :].splitlines():
        line = line.strip()
        if m := _REUSE.match(line):
            count += m.group(1) in called
        elif _CALL.match(line):
            called.update(re.findall(r"\bbuf\d+\b", line))
    return count


@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="Inductor's CPU code generation needs a C++ compiler",
)
@pytest.mark.parametrize("name", list(_MODELS))
def test_buffers_written_into_others_as_inductor_s_generated_code_does(name):
    # Inductor compiles the step on the CPU (its wrapper plans memory as on a GPU); each line
    # "bufA = bufB; del bufB  # reuse" of its code is an output written into another buffer
    # (in place, or from the planner's pool). The pass makes as many, and prefers a buffer made
    # in the graph to a donated one (in the MLPs' backward both are read last by the kernel
    # of the activation's gradient; Inductor wrote into the matmul's output). Not modelled:
    # a LayerNorm backward with no residual gradient added to it (Linear-LayerNorm-Linear)
    # that Inductor writes into a new buffer, where the pass writes it into the matmul
    # output it reads last (5 against 4 on such a stack); with a residual add, as in
    # "ln-block", Inductor writes it in place too. And Inductor moves the weight gradients'
    # matmuls late in its backward, which changes which dead buffers its pool can hand out:
    # on a five-layer MLP 7 against 6.
    import gobrrr
    from gobrrr.capture import capture

    torch.manual_seed(0)
    model, x = _MODELS[name](), torch.randn(128, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model)

    def step():
        out = compiled(x)
        (out * out).mean().backward()

    step()
    _, codes = run_and_get_code(step)
    torch._dynamo.reset()
    written = sum(_written_into(c) for c in codes)

    def make():
        torch.manual_seed(0)
        return gobrrr.Workload(
            model=_MODELS[name](),
            batch=(torch.randn(128, 64),),
            loss=lambda y, b: (y * y).mean(),
            optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        )

    done = capture(make, precision="fp32", compile=True).meta.inductor
    assert done["in_place"] + done["reused"] == written == _WRITTEN[name]
