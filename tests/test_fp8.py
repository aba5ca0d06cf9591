"""FP8 training of the linear layers (torchao's float8 recipe) as a planner knob: the traced
step against torchao's own module swap, the cost of `_scaled_mm` against the datasheet, the
planner's gate, and apply on the CPU."""

from __future__ import annotations

import functools
import json
import math
from collections import Counter

import pytest
import torch

from gobrrr.cli import main
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op as roofline_time
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.hardware import Target, get_gpu
from gobrrr.models.registry import get_workload
from gobrrr.plan.apply import apply
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.search import plan
from gobrrr.plan.trace import Tracer
from gobrrr.training import fp8

pytest.importorskip("torchao.float8")

FP8 = Knobs(micro_batch=1, fp8=True)  # the traced FP8 variant
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(batch_size: int = 2, seq_len: int = 64, n_layer: int = 2):
    """Llama blocks (two by default) whose linears are all multiples of 16 wide, a 248-token
    head (not)."""
    return get_workload(
        "llama3-1b",
        batch_size,
        seq_len,
        n_layer=n_layer,
        dim=64,
        n_head=4,
        n_kv_head=2,
        ffn_dim=128,
        vocab_size=248,
    )


@pytest.fixture(scope="module")
def traces():
    """The step traced as it runs without and with FP8 linears (bf16 autocast, H100)."""
    target = Target.resolve("h100", calibration=False)
    out = {}
    for name, variant in (("base", Knobs(micro_batch=1)), ("fp8", FP8)):
        tracer = Tracer(tiny_llama, seq=64, precision="bf16-mixed", target=target, variant=variant)
        out[name] = tracer.trace(2)
    return out


def _ops(g, module: str) -> Counter:
    return Counter((n.name, n.phase) for n in g.nodes if n.module == module)


def test_eligible_linears_are_torchaos_swap():
    w = tiny_llama()
    names = fp8.eligible(w.model)
    assert names == [f"layers.{i}.{p}.{n}" for i in range(2) for p, n in _where()]
    from torchao.float8 import convert_to_float8_training

    # torchao's own swap with gobrrr's filter: the same layers, the head left as it was
    convert_to_float8_training(w.model, module_filter_fn=fp8.fp8_filter(w.model))
    swapped = [n for n, m in w.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert swapped == names and type(w.model.lm_head) is torch.nn.Linear


def _where():
    return [("self_attn", n) for n in LINEARS[:4]] + [("mlp", n) for n in LINEARS[4:]]


def test_each_eligible_linear_runs_three_scaled_mms_and_the_head_is_unchanged(traces):
    base, f8 = traces["base"], traces["fp8"]

    def where(g, name):  # (module, phase) of each such op inside the blocks
        return Counter(
            (n.module, n.phase) for n in g.nodes if n.name == name and ".layers" in f".{n.module}"
        )

    # every matmul of the blocks' linears runs as _scaled_mm where the bf16 trace ran `mm`
    # (a backward op is filed under the module whose backward was running, as in both traces)
    assert where(f8, "_scaled_mm") == where(base, "mm") and not where(f8, "mm")
    for i in range(2):
        for part, lin in _where():  # forward: out = x @ w.t(), one per layer
            assert where(f8, "_scaled_mm")[(f"layers.{i}.{part}.{lin}", "forward")] == 1
    # backward: grad input and grad weight of each of the 14 layers
    assert sum(v for (_, ph), v in where(f8, "_scaled_mm").items() if ph == "backward") == 28
    assert _ops(f8, "lm_head") == _ops(base, "lm_head")  # the head as it was: bf16 `mm`s
    assert _ops(f8, "lm_head")[("mm", "forward")] == 1


def test_scaled_mm_has_the_bf16_matmuls_flops_on_float8_operands(traces):
    base, f8 = traces["base"], traces["fp8"]

    def matmuls(g, name):
        return [n for n in g.nodes if n.name == name and n.module.endswith(LINEARS)]

    mm, smm = matmuls(base, "mm"), matmuls(f8, "_scaled_mm")
    assert sorted(op_cost(n).flops for n in smm) == sorted(op_cost(n).flops for n in mm)
    assert all(op_cost(n).math == "fp8" for n in smm)
    fwd = [n for n in smm if n.phase == "forward"]
    assert {(n.inputs[0].dtype, n.inputs[1].dtype) for n in fwd} == {
        ("float8_e4m3fn", "float8_e4m3fn")
    }
    # backward: the output's gradient in e5m2 against the weight or the input in e4m3
    bwd = {tuple(sorted((n.inputs[0].dtype, n.inputs[1].dtype))) for n in smm if n not in fwd}
    assert bwd == {("float8_e4m3fn", "float8_e5m2")}
    assert {n.outputs[0].dtype for n in smm} == {"bfloat16"}  # autocast's dtype


def test_the_layer_scales_its_autocast_input_as_on_a_gpu(traces):
    # under CUDA autocast Float8Linear casts its input to bf16 before its amax: the trace's
    # first op reading the input in q_proj is that reduction's abs, on bf16
    first_abs = next(
        n
        for n in traces["fp8"].nodes
        if n.module == "layers.0.self_attn.q_proj" and n.name == "abs"
    )
    assert first_abs.inputs[0].dtype == "bfloat16"


def _mm_node(name: str, dtype: str, m: int, k: int, n: int) -> OpNode:
    a = TensorInfo((m, k), (k, 1), dtype, 0)
    b = TensorInfo((k, n), (1, k), dtype, 1)
    out = TensorInfo((m, n), (n, 1), "bfloat16", 2)
    scales = (TensorInfo((), (), "float32", 3), TensorInfo((), (), "float32", 4))
    inputs = (a, b, *scales) if name == "_scaled_mm" else (a, b)
    args = tuple({"t": i} for i in range(len(inputs)))
    return OpNode(0, f"aten.{name}.default", "forward", "l", inputs, (out,), args)


def test_scaled_mm_runs_at_the_fp8_datasheet_peak_without_a_calibration():
    gpu = get_gpu("h100")
    m = k = n = 4096
    rates = Rates(gpu, None)
    t8 = _time(_mm_node("_scaled_mm", "float8_e4m3fn", m, k, n), rates)
    t16 = _time(_mm_node("mm", "bfloat16", m, k, n), rates)
    # 32 x 32 tiles of 128 over 132 SMs: 8 waves, 1024 / 1056 of the chip busy
    wave = 1024 / (8 * 132)
    assert t8.compute_s == pytest.approx(2 * m * k * n / (1978.9e12 * 0.80 * wave), rel=1e-12)
    assert t16.compute_s / t8.compute_s == pytest.approx(1978.9 / 989.4, rel=1e-12)


def _time(node: OpNode, rates: Rates):
    return roofline_time(node, op_cost(node), rates)


def test_scaled_mm_runs_at_the_bf16_grids_efficiency_times_the_fp8_peak():
    shipped = Target.resolve("h100")  # the shipped calibration: bf16 and fp8 grids
    assert shipped.cal.matmul_grid.get("bf16") and shipped.cal.matmul_grid.get("fp8")
    # a grid point of the shipped fp8 grid is read as measured
    m2, k, rate = shipped.cal.matmul_grid["fp8"][-1]
    assert Rates(shipped.gpu, shipped.cal).matmul("fp8", 2.0 * m2 * k, (m2, k)) == pytest.approx(
        rate
    )
    # without an fp8 grid: the bf16 grid's efficiency at that shape times the fp8 peak
    bf16_only = {k: v for k, v in shipped.cal.matmul_grid.items() if k != "fp8"}
    target = Target(shipped.gpu, _with_grid(shipped.cal, bf16_only))
    rates = Rates(target.gpu, target.cal)
    for m, k, n in ((4096, 4096, 4096), (512, 8192, 512), (16384, 2048, 2048)):
        r16 = rates.matmul("bf16", 2.0 * m * k * n, (m * n, k))
        r8 = rates.matmul("fp8", 2.0 * m * k * n, (m * n, k))
        assert r8 == pytest.approx(r16 * 1978.9 / 989.4, rel=1e-12)
    grid = {**target.cal.matmul_grid, "fp8": [[1.0, 1.0, 7e14], [1e9, 1e6, 7e14]]}
    measured = Rates(target.gpu, _with_grid(target.cal, grid))
    assert measured.matmul("fp8", 1e12, (4096.0**2, 4096.0)) == pytest.approx(7e14)


def _with_grid(cal, grid):
    from dataclasses import replace

    return replace(cal, matmul_grid=grid)


def test_the_gpu_specs_say_which_have_fp8_tensor_cores():
    have = {g: get_gpu(g).fp8_tensor_cores for g in ("h100", "h200", "l4", "l40s", "4090")}
    assert all(have.values())
    assert not get_gpu("a100").fp8_tensor_cores and not get_gpu("a100-40gb").fp8_tensor_cores


# -- the planner ------------------------------------------------------------------------------
def test_plan_allow_fp8_costs_fp8_plans_and_says_how():
    r = plan(tiny_llama, "h100", global_batch=2, seq=64, allow=["fp8"])
    ours = [p for p in r.plans if p.knobs.fp8]
    assert ours and all("fp8 linear layers (torchao float8)" in p.changes for p in ours)
    # the shipped H100 calibration measured its fp8 grid: no datasheet note
    assert not any("datasheet FP8 dense peak" in n for n in r.notes)
    uncalibrated = plan(tiny_llama, "l40s", global_batch=2, seq=64, allow=["fp8"])
    assert any("datasheet FP8 dense peak" in n for n in uncalibrated.notes)
    without = plan(tiny_llama, "h100", global_batch=2, seq=64)
    assert not any(p.knobs.fp8 for p in without.plans)  # a change of numerics: asked for only


def _cli(capsys, tmp_path, *argv):
    src = tmp_path / "tiny.py"
    src.write_text(
        "from gobrrr.models.registry import get_workload\n"
        "def make(batch_size=2, seq_len=64):\n"
        "    return get_workload('llama3-1b', batch_size, seq_len, n_layer=1, dim=64,\n"
        "        n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=248)\n"
    )
    code = main(["plan", "--model", f"{src}:make", "--global-batch", "2", *argv, "--json"])
    cap = capsys.readouterr()
    return code, json.loads(cap.out), cap.err


@pytest.mark.parametrize("gpu", ["a100", "a100-40gb"])
def test_allow_fp8_on_a_gpu_without_fp8_is_one_line_and_exit_2(capsys, tmp_path, gpu):
    code, out, err = _cli(capsys, tmp_path, "--gpu", gpu, "--allow", "fp8")
    assert code == 2 and "no FP8 tensor cores" in out["error"] and gpu in out["error"]
    assert len(err.strip().splitlines()) == 1


def test_allow_fp8_without_torchao_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch):
    real = fp8.importlib.util.find_spec
    monkeypatch.setattr(
        fp8.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("torchao") else real(name, *a),
    )
    code, out, err = _cli(capsys, tmp_path, "--gpu", "h100", "--allow", "fp8")
    assert code == 2 and "torchao is not installed" in out["error"]
    assert len(err.strip().splitlines()) == 1


def test_plan_on_the_command_line_emits_an_fp8_plan(capsys, tmp_path):
    code, out, _ = _cli(capsys, tmp_path, "--gpu", "h100", "--allow", "fp8", "--top", "50")
    assert code == 0
    knobs = [p["knobs"] for p in out["plans"]]
    assert any(k.get("fp8") for k in knobs) and any("fp8" not in k for k in knobs)


# -- apply --------------------------------------------------------------------------------------
def test_knobs_json_keeps_fp8_only_when_on():
    assert "fp8" not in Knobs(micro_batch=2).to_dict()
    k = Knobs(micro_batch=2, fp8=True)
    assert k.to_dict()["fp8"] is True and Knobs.from_dict(k.to_dict()) == k
    with pytest.raises(GobrrrError, match="fp8"):
        Knobs(micro_batch=2, fp8="yes")


def test_apply_swaps_the_linears_and_trains_on_the_cpu():
    torch.manual_seed(0)
    w = tiny_llama()
    ref = tiny_llama()
    ref.model.load_state_dict(w.model.state_dict())
    step = apply(w, Knobs(micro_batch=2, fp8=True), precision="fp32")
    swapped = [n for n, m in w.model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert swapped == fp8.eligible(ref.model) and type(w.model.lm_head) is torch.nn.Linear
    assert any(c.startswith("fp8 training of 14 linear layer(s)") for c in step.changes)
    loss = step(ref.batch)  # torch._scaled_mm's CPU kernel: FP8 numerics, the same step
    want = apply(ref, Knobs(micro_batch=2), precision="fp32")(ref.batch)
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(want.item(), rel=0.02)  # 8-bit operands: close
    assert loss.item() != want.item()


def test_apply_refuses_fp8_where_no_linear_converts():
    w = get_workload(
        "llama3-1b", 2, 16, n_layer=1, dim=40, n_head=4, n_kv_head=2, ffn_dim=72, vocab_size=64
    )
    with pytest.raises(GobrrrError, match="multiples of 16"):
        apply(w, Knobs(micro_batch=2, fp8=True), precision="fp32")
    assert not hasattr(w.model, "_gobrrr_applied")  # refused before anything changed


# -- the calibration section ---------------------------------------------------------------
def test_the_grid_case_is_a_tensorwise_scaled_matmul():
    from gobrrr.calibrate.sections.fp8 import fp8_matmul_grid, scaled_mm_case, scaled_mm_operands

    dev = torch.device("cpu")
    assert fp8_matmul_grid(dev) == {}  # no FP8 tensor cores: no fp8 key in the calibration
    assert scaled_mm_case(32, 64, 48, dev)().shape == (32, 48)
    torch.manual_seed(0)
    a, b, sa, sb = scaled_mm_operands(32, 64, 48, dev)
    assert b.shape == (64, 48) and b.stride() == (1, 64)  # column-major, as cuBLASLt takes
    out = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=1e-2, atol=0.5)


def test_fp8_blocks_compile_once_for_every_block():
    """FP8 with each block compiled (`--allow fp8,compile`) over more blocks than dynamo's
    recompile limit (8): every block reuses one compiled graph. The trace's input cast was
    a wrapper per layer, whose identity each block's guards held: a recompile per block, then
    eager past the limit."""
    from gobrrr.plan.search import variant_of

    ten_blocks = functools.partial(tiny_llama, n_layer=10)
    target = Target.resolve("h100", calibration=False)
    variant = variant_of(Knobs(micro_batch=2, fp8=True, compile="blocks"))
    g = Tracer(ten_blocks, seq=32, precision="bf16-mixed", target=target, variant=variant).trace(2)
    assert g.meta.compiled_graphs == {"forward": 1, "backward": 1}
    assert len(g.meta.compiled_regions) == 2 * 10  # each block's forward and backward
