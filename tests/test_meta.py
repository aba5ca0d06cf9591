"""StepMeta (the step graph's typed meta) and Precision: JSON round trips, the index
bookkeeping of passes that insert ops, and precision parsing."""

from __future__ import annotations

import json

import pytest
import torch

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo
from gobrrr.graph.meta import (
    Autograd,
    NodeSpan,
    OptimizerInfo,
    Region,
    Repeat,
    SavedRow,
    StepMeta,
    Tf32,
    Unreferenced,
)
from gobrrr.precision import PRECISIONS, Precision

#: A meta as a file holds it: every key capture and the passes write.
FILE_META = {
    "name": "gpt2",
    "precision": "bf16-mixed",
    "tokens": 2048,
    "seq_len": 1024,
    "params": 124,
    "trainable_params": 120,
    "embedding_params": 40,
    "info": {"layers": 12, "hidden": 768},
    "traced_on": "cpu-fake",
    "torch": "2.14",
    "tf32": {"matmul": False, "conv": True},
    "syncs": [3, 9],
    "autograd": {
        "version": 1,
        "hooked": False,
        "saved": [[0, 5, True, False, [2, 4], [4, 1], "float32", 0]],
        "node_spans": [[0, 7, 8]],
        "unreferenced": [[5, 1]],
        "block_inputs": {"h.0": [1, 2]},
    },
    "gradient_sums_in_place": 1,
    "optimizer": {"key": "AdamW:foreach", "tensors": 28, "large": 10},
    "checkpoint": {"h.0": "selective"},
    "checkpointed_blocks": 1,
    "blocks": ["h.0", "h.1"],
    "sdpa_backends": {"flash": 2},
    "assumptions": [{"kind": "count", "value": "6 of 6"}],
    "compiled": True,
    "compiled_regions": [["forward", 0, 4], ["backward", 5, 8]],
    "compiled_graphs": {"forward": 1, "backward": 1},
    "inductor": {"unallocated": 3, "unallocated_bytes": 96, "in_place": 1},
    "accumulation": 2,
    "repeat": {"start": 9, "end": 18, "times": 1},
    "micro_batch": 2,
    "passes": [{"pass": "accumulate", "n": 2}],
}


def test_a_file_meta_is_typed_and_written_back_as_it_was():
    m = StepMeta.from_dict(FILE_META)
    assert m.precision == Precision.parse("bf16-mixed") and str(m.precision) == "bf16-mixed"
    assert m.tf32 == Tf32(matmul=False, conv=True)
    assert m.syncs == (3, 9) and m.blocks == ("h.0", "h.1")
    assert m.autograd.saved == (SavedRow(0, 5, True, False, (2, 4), (4, 1), "float32", 0),)
    assert m.autograd.node_spans == (NodeSpan(0, 7, 8),)
    assert m.autograd.unreferenced == (Unreferenced(5, 1),)
    assert m.optimizer == OptimizerInfo("AdamW:foreach", 28, 10)
    assert m.compiled_regions == (Region("forward", 0, 4), Region("backward", 5, 8))
    assert m.repeat == Repeat(9, 18, 1) and m.extra == {}
    assert m.to_dict() == FILE_META
    assert list(m.to_dict()) == list(FILE_META)  # the keys in the order capture writes them
    assert StepMeta.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_absent_keys_stay_absent_and_unknown_ones_are_kept():
    d = {
        "name": "mlp",
        "precision": "fp32",
        "tokens": 8,
        "seq_len": None,
        "params": 5,
        "trainable_params": 5,
        "embedding_params": 0,
        "info": {},
        "future_key": [1, 2],
    }
    m = StepMeta.from_dict(d)
    assert m.extra == {"future_key": [1, 2]} and m.autograd is None and m.syncs is None
    assert m.to_dict() == d  # seq_len null is written; no key the file lacked is added


def test_a_step_graph_round_trips_through_json(tmp_path):
    meta = StepMeta.from_dict(FILE_META)
    g = StepGraph(
        nodes=(OpNode(0, "aten.mm.default", "forward", "", (), ()),),
        storages=(StorageInfo(0, 64, "activation", 0, None),),
        meta=meta,
    )
    g.save(tmp_path / "g.json")
    back = StepGraph.load(tmp_path / "g.json")
    assert back.meta == meta and back.repeat == (9, 18, 1)
    assert json.loads(back.to_json())["meta"] == FILE_META


def test_a_dict_meta_is_refused():
    with pytest.raises(TypeError, match="StepMeta"):
        StepGraph(nodes=(), storages=(), meta={"tokens": 1})


def test_inserting_an_op_moves_syncs_and_compiled_regions_together():
    # ops 0..6; one op inserted at 3 (a host wait of its own): old i >= 3 moves to i + 1
    m = StepMeta(syncs=(2, 5), compiled_regions=(Region("forward", 0, 3), Region("backward", 4, 6)))
    moved = m.with_ops_moved(lambda i: i if i < 3 else i + 1, new_syncs=[3])
    assert moved.syncs == (2, 3, 6)
    assert moved.compiled_regions == (Region("forward", 0, 4), Region("backward", 5, 7))
    assert m.syncs == (2, 5)  # frozen: the original is unchanged


def test_accumulating_repeats_the_first_micro_batch_bookkeeping():
    # ops 0..3 forward/backward, 4..5 optimizer; micro-batch 2's copies of 0..3 go to 4..7
    # (no gradient sums inserted: shift 4), the optimizer to 8..9; n = 3 micro-batches
    m = StepMeta(
        tokens=16,
        syncs=(1, 5),
        compiled_regions=(Region("forward", 0, 1), Region("backward", 2, 3)),
    )
    acc = m.with_repeated(split=4, shift=4, pos={i: 4 + i for i in range(4)}, n=3)
    assert acc.syncs == (1, 5, 9)  # 1 in micro-batch 1, its copy at 5, the optimizer's 5 at 9
    assert acc.compiled_regions == (
        Region("forward", 0, 1),
        Region("backward", 2, 3),
        Region("forward", 4, 5),
        Region("backward", 6, 7),
    )
    assert acc.repeat == Repeat(4, 8, 2) and acc.tokens == 48 and acc.accumulation == 3
    assert acc.passes == ({"pass": "accumulate", "n": 3},)
    assert acc.with_pass({"pass": "micro_batch", "micro_batch": 2}, micro_batch=2).passes == (
        {"pass": "accumulate", "n": 3},
        {"pass": "micro_batch", "micro_batch": 2},
    )


def test_tf32_mode():
    assert StepMeta(precision=Precision.parse("tf32")).tf32_mode == Tf32(True, True)
    assert StepMeta(precision=Precision.parse("fp32")).tf32_mode == Tf32(False, True)  # default
    assert StepMeta(tf32=Tf32(True, False)).tf32_mode == Tf32(True, False)


@pytest.mark.parametrize(
    ("text", "autocast", "params", "tf32", "peak", "size"),
    [
        ("fp32", None, torch.float32, False, "fp32", 4),
        ("tf32", None, torch.float32, True, "tf32", 4),
        ("bf16-mixed", torch.bfloat16, torch.float32, False, "bf16", 2),
        ("fp16-mixed", torch.float16, torch.float32, False, "fp16", 2),
        ("bf16", None, torch.bfloat16, False, "bf16", 2),
    ],
)
def test_precision_means(text, autocast, params, tf32, peak, size):
    p = Precision.parse(text)
    assert (p.autocast_dtype, p.param_dtype, p.tf32, p.peak_mode, p.element_size) == (
        autocast,
        params,
        tf32,
        peak,
        size,
    )
    assert p.is_mixed == (autocast is not None) and p.needs_scaler == (text == "fp16-mixed")
    assert p.casts_weights == (text == "bf16") and str(p) == text
    assert Precision.parse(p) is p


@pytest.mark.parametrize("bad", ["bf16_mixed", "FP32", "", "mixed"])
def test_an_unknown_precision_names_the_choices(bad):
    with pytest.raises(GobrrrError) as e:
        Precision.parse(bad)
    assert repr(bad) in str(e.value) and all(p in str(e.value) for p in PRECISIONS)


def test_an_unknown_precision_in_a_file_is_refused():
    with pytest.raises(GobrrrError, match="unknown precision 'int4'"):
        StepMeta.from_dict({"precision": "int4"})


def test_autograd_defaults_round_trip():
    a = Autograd()
    assert Autograd.from_dict(a.to_dict()) == a
