"""Memory simulation: allocator rounding, hand-built graphs, and hand-derived traced steps."""

from pathlib import Path

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.memory.replay import module_rollup, round_alloc, simulate
from gobrrr.report.estimate import estimate_dict

MiB = 1024**2
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("n,expected", [(0, 0), (1, 512), (512, 512), (513, 1024), (4096, 4096)])
def test_round_alloc_matches_the_caching_allocator(n, expected):
    assert round_alloc(n) == expected


def _graph(storages, nodes):
    return StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=StepMeta())


def _node(i, allocs=(), frees=(), phase="forward"):
    return OpNode(
        index=i,
        op="aten.add.Tensor",
        phase=phase,
        module="m",
        inputs=(),
        outputs=(),
        allocs=tuple(allocs),
        frees=tuple(frees),
    )


def _hand_built():
    """A 1000-byte parameter alive throughout; op0 makes a (3000 B), op1 makes b (100 B) and
    frees a right after; op2 makes c (5000 B). Rounded: 1024, 3072, 512, 5120."""
    storages = [
        StorageInfo(0, 1000, "parameter", -1, None),
        StorageInfo(1, 3000, "activation", 0, 1),
        StorageInfo(2, 100, "temporary", 1, None),
        StorageInfo(3, 5000, "temporary", 2, 2),
    ]
    return _graph(storages, [_node(0, [1]), _node(1, [2], [1]), _node(2, [3], [3])])


def test_hand_built_graph_peak_and_breakdown():
    # a 1000-byte parameter alive throughout; op0 makes a (3000 B), op1 makes b (100 B) and
    # frees a right after; op2 makes c (5000 B). Rounded: 1024, 3072, 512, 5120.
    m = simulate(_hand_built(), workspace=2048)
    # b outlives the step: in the measured step the previous step's b is alive until op1
    # makes the new one
    assert m.timeline == (
        2048 + 1024 + 512 + 3072,
        2048 + 1024 + 3072 + 512,
        2048 + 1024 + 512 + 5120,
    )
    assert m.peak == m.peak_rounded == 2048 + 1024 + 512 + 5120 and m.peak_index == 2
    assert m.at_peak == {"parameter": 1024, "temporary": 512 + 5120, "workspace": 2048}
    assert m.persistent == {"parameter": 1024, "temporary": 512}


def _linear_workload(optimizer=None):
    def make():
        model = nn.Linear(1024, 1024, bias=False)
        x = torch.randn(256, 1024)
        return gobrrr.Workload(
            model=model,
            batch=(x,),
            loss=lambda y, b: (y**2).mean(),
            optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)),
        )

    return make


def test_traced_linear_step_matches_hand_count():
    g = capture(_linear_workload(), precision="fp32")
    m = simulate(g)
    kinds = {}
    for s in g.storages:
        kinds[s.kind] = kinds.get(s.kind, 0) + round_alloc(s.nbytes)
    assert kinds["parameter"] == 4 * MiB  # 1024 x 1024 fp32
    assert kinds["gradient"] == 4 * MiB
    assert kinds["input"] == 1 * MiB  # 256 x 1024 fp32
    # pow saves its input y = x @ W.T (1 MiB); mm saves x and W, which already exist; the
    # loss scalar (one 512-byte block) is also alive when backward starts
    assert kinds["activation"] == 1 * MiB + 512
    assert "optimizer_state" not in kinds  # plain SGD keeps none
    # persistent: W and x; the step's peak is at least W + x + y + y**2 + dW
    assert m.persistent == {"parameter": 4 * MiB, "input": 1 * MiB}
    assert m.peak >= 4 * MiB + 1 * MiB + 1 * MiB + 1 * MiB


def test_adamw_states_are_two_param_copies_and_step_counters_live_on_host():
    g = capture(_linear_workload(lambda p: torch.optim.AdamW(p, lr=1e-3)), precision="fp32")
    states = [s for s in g.storages if s.kind == "optimizer_state"]
    assert sum(s.nbytes for s in states) == 2 * 4 * MiB  # exp_avg, exp_avg_sq; step on the host
    assert any(s.label.endswith(".step") and s.nbytes == 0 for s in states)


def test_checkpointing_saves_only_block_inputs():
    from gobrrr.evaluate import saved_activations
    from gobrrr.models.registry import get_workload

    wl = lambda: get_workload("gpt2", batch_size=2, seq_len=64, n_layer=4, vocab_size=128)
    plain = capture(wl, precision="fp32")
    ckpt = capture(wl, precision="fp32", checkpoint="full")
    block_input = 2 * 64 * 768 * 4  # (B, T, d) fp32 per block
    assert ckpt.meta.checkpointed_blocks == 4
    assert saved_activations(ckpt) < saved_activations(plain) / 4
    assert saved_activations(ckpt) >= 4 * block_input
    assert any(n.phase == "recompute" for n in ckpt.nodes)


def test_module_rollup_sums_by_prefix():
    assert module_rollup({"h.0.attn": 3, "h.0.mlp": 4, "h.1.attn": 5, "lm_head": 1}) == {
        "h.0": 7,
        "h.1": 5,
        "lm_head": 1,
    }


def test_gpt2_block_activations_match_a_hand_count_and_where_megatron_differs():
    """Bytes saved for backward by one GPT-2 block under bf16 autocast, tensor by tensor,
    against Megatron's 16-bit 34·s·b·h per layer (flash attention, so no s² term)."""
    from gobrrr.formulas import megatron_activation_bytes
    from gobrrr.models.registry import get_workload

    b, s, d, a = 4, 1024, 768, 12
    g = capture(lambda: get_workload("gpt2", b, s), precision="bf16-mixed")
    traced = sum(
        x.nbytes
        for x in g.storages
        if x.kind == "activation" and x.module.startswith("transformer.h.3")
    )
    sbh, bs = s * b * d, b * s
    hand = (
        2 * (2 * bs * 4)  # ln_1, ln_2: fp32 mean and rstd per token
        + 2 * sbh
        + 6 * sbh  # c_attn: bf16 cast of its input; q, k, v (bf16)
        + 2 * 3 * d * d  # c_attn: bf16 copy of the weight (autocast's cache)
        + 2 * sbh
        + 4 * b * a * s  # attention output (bf16) and its fp32 log-sum-exp
        + 2 * 8  # cuDNN attention's RNG seed and offset (int64 scalars)
        + 2 * d * d  # attn.c_proj weight copy
        + 4 * sbh
        + 4 * sbh  # the two residual sums, fp32 (the stream stays fp32)
        + 2 * sbh
        + 8 * sbh  # c_fc: input cast; output 4d wide (gelu's input)
        + 2 * 4 * d * d  # c_fc weight copy
        + 8 * sbh  # gelu output (mlp.c_proj's input)
        + 2 * 4 * d * d  # mlp.c_proj weight copy
    )
    assert traced == hand
    # Megatron assumes a 16-bit residual stream and dropout masks, and no weight copies: the
    # traced block is larger by the fp32 stream (+4·sbh) and the copies, smaller by the masks
    megatron = megatron_activation_bytes(s, b, d, a, recompute="flash")
    assert megatron == 34 * sbh
    fp32_stream = 2 * (4 - 2) * sbh  # two residual sums kept in fp32, not 16-bit
    weight_copies = 2 * 12 * d * d  # bf16 copies of the block's 12·d² weights
    # norm statistics, attention log-sum-exp, cuDNN attention's RNG seed and offset
    fp32_stats = 2 * (2 * bs * 4) + 4 * b * a * s + 2 * 8
    dropout_masks = 2 * sbh  # Megatron's two 1-byte masks (attention output, MLP output)
    assert traced - megatron == fp32_stream + weight_copies + fp32_stats - dropout_masks


# ------------------------------------------------------------------ reserved: the allocator replay
def test_hand_built_graph_reserves_one_small_segment():
    # every request is under 1 MiB: all of them share one 2 MiB small-pool segment
    m = simulate(_hand_built(), workspace=2048)
    assert m.reserved == 2 * MiB and m.allocator.segments_peak == 1
    assert m.fits() and m.headroom is None


def _lazy_state_graph():
    # a 12 MiB parameter and its 12 MiB optimizer state; a 24 MiB activation made in forward
    # and freed in backward; one optimizer op
    storages = [
        StorageInfo(0, 12 * MiB, "parameter", -1, None),
        StorageInfo(1, 12 * MiB, "optimizer_state", -1, None),
        StorageInfo(2, 24 * MiB, "activation", 0, 1),
    ]
    nodes = [_node(0, [2]), _node(1, [], [2], phase="backward"), _node(2, phase="optimizer")]
    return _graph(storages, nodes)


def test_optimizer_state_created_in_step_one_fragments_the_cache():
    # step 1: parameter (12 MiB segment), activation (24 MiB segment), freed; the optimizer
    # state is created by the first optimizer op and takes 12 MiB of the cached 24 MiB block.
    # Step 2's activation fits in neither the 12 MiB left nor elsewhere: a second 24 MiB
    # segment. Reserved 60 MiB, where state-first order (12 + 12 + 24) would say 48.
    m = simulate(_lazy_state_graph())
    assert m.peak == 48 * MiB
    assert m.reserved == 60 * MiB and m.allocator.segments_peak == 3


def test_budget_decides_fits_and_headroom():
    g = _lazy_state_graph()
    roomy = simulate(g, budget=64 * MiB)
    assert roomy.fits() and roomy.headroom == 4 * MiB
    assert roomy.headroom_share == pytest.approx(4 / 64)
    # 50 MiB: step 2's activation needs a third segment (60 MiB); the cached 24 MiB segment
    # holds the optimizer state, so nothing can be released: out of memory at op 0
    tight = simulate(g, budget=50 * MiB)
    assert not tight.fits() and tight.oom_index == 0
    assert tight.reserved == 60 * MiB and tight.headroom == -10 * MiB


SUITE = ROOT / "tests" / "fixtures" / "estimate_suite_h100.json"


@pytest.mark.parametrize(
    "model,batch,precision,checkpoint",
    [("gpt2", 8, "fp32", "none"), ("gpt2-medium", 4, "fp32", "full")],
)
def test_reserved_peak_matches_the_recorded_suite(model, batch, precision, checkpoint):
    """max_memory_reserved measured on an H100 by bench_estimate_suite.py (after three
    warm-up steps) against the replay, within 2%."""
    import json

    from gobrrr.estimate import estimate
    from gobrrr.hardware import Calibration
    from gobrrr.memory.replay import CUDA_CONTEXT_BYTES

    case = next(
        c
        for c in json.loads(SUITE.read_text())["cases"]
        if (c["model"], c["batch"], c["precision"], c["checkpoint"], c["compile"])
        == (model, batch, precision, checkpoint, False)
    )
    cal = Calibration.load(ROOT / "src" / "gobrrr" / "data" / "calibration" / "h100-sxm.json")
    est = estimate(
        model,
        "h100",
        batch=batch,
        seq=case["seq"],
        precision=precision,
        checkpoint=checkpoint,
        calibration=cal,
        loop="drops-output",  # measured with gobrrr's TrainStep
    )
    measured = case["measured"]["reserved_peak"]
    assert abs(est.memory.reserved / measured - 1) <= 0.02
    mem = estimate_dict(est)["memory"]
    assert mem["reserved_bytes"] == est.memory.reserved
    assert mem["budget_bytes"] == cal.meta["memory"] - CUDA_CONTEXT_BYTES
    assert mem["headroom_bytes"] == mem["budget_bytes"] - mem["reserved_bytes"] > 0
    assert est.fits
    # the same estimate with a memory whose allocated peak fits but whose reserved peak
    # does not (see the next test): it does not fit
    import dataclasses

    tight = simulate(_lazy_state_graph(), budget=50 * MiB)
    assert not dataclasses.replace(est, memory=tight).fits


def test_scratch_allocations_take_segments_while_the_op_runs():
    # op 0 allocates and frees a 5 MiB buffer (a 20 MiB segment) and a 600 KiB one (beside the
    # 1 KiB parameter in a 2 MiB small segment); the segments stay cached
    storages = [StorageInfo(0, 1000, "parameter", -1, None)]
    m = simulate(_graph(storages, [_node(0), _node(1)]), scratch={0: (5 * MiB, 600 * 1024)})
    assert m.peak == 1024 + 5 * MiB + 600 * 1024 and m.peak_index == 0
    assert m.at_peak["workspace"] == 5 * MiB + 600 * 1024
    assert m.reserved == 22 * MiB and m.allocator.segments_peak == 2


def test_a_step_whose_allocated_peak_fits_can_still_run_out_of_reserved_memory():
    import dataclasses

    from gobrrr.hardware import get_gpu
    from gobrrr.memory.replay import CUDA_CONTEXT_BYTES, process_budget, step_memory

    # a GPU leaving 50 MiB to the allocator: the 48 MiB allocated peak would fit, the 60 MiB
    # the allocator reserves does not
    gpu = dataclasses.replace(get_gpu("h100"), memory_bytes=CUDA_CONTEXT_BYTES + 50 * MiB)
    assert process_budget(gpu) == 50 * MiB
    m = step_memory(_lazy_state_graph(), gpu, None)
    assert m.peak == 48 * MiB and m.budget == 50 * MiB
    assert m.peak <= m.budget and not m.fits() and m.oom_index == 0
    assert m.fits(60 * MiB)  # what the allocator would need


def test_allocated_peak_counts_the_remainder_a_block_keeps():
    # an 11 MiB activation gets a 12 MiB segment whose 1 MiB remainder is not split off
    # (the large pool splits only above 1 MiB): max_memory_allocated counts 12 MiB
    storages = [
        StorageInfo(0, 1000, "parameter", -1, None),
        StorageInfo(1, 11 * MiB, "activation", 0, 1),
    ]
    m = simulate(_graph(storages, [_node(0, [1]), _node(1, [], [1])]))
    assert m.peak_rounded == 1024 + 11 * MiB
    assert m.peak == 1024 + 12 * MiB and m.peak_index == 0
    assert m.at_peak == {"parameter": 1024, "activation": 12 * MiB, "workspace": 0}
