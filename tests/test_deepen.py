"""A deep model's step graph made from traces with five and six blocks (`capture.deepen`)
is the graph a trace of the whole model makes, byte for byte in its JSON."""

from __future__ import annotations

import pytest
import torch

from gobrrr.capture import capture
from gobrrr.capture.deepen import NotRepeated, capture_deep, deepen
from gobrrr.models.registry import get_workload
from gobrrr.training.fused_loss import use_fused_loss

TINY_LLAMA = dict(dim=64, n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=256)


def _maker(name, batch, seq, fused=False, adam=False, **cfg):
    def make(blocks):
        def build():
            w = get_workload(name, batch, seq, n_layer=blocks, **cfg)
            if fused:
                use_fused_loss(w.model)
            if adam:
                w.optimizer = lambda ps: torch.optim.Adam(ps, lr=1e-3)
            return w

        return build

    return make


CASES = [
    # name, micro-batch, seq, blocks, precision, fused loss, Adam (else AdamW), config
    ("gpt2", 1, 64, 12, "bf16-mixed", False, False, {}),
    ("gpt2", 2, 32, 12, "fp32", True, True, dict(n_embd=64, n_head=4, vocab_size=256)),
    ("llama3-1b", 2, 32, 16, "bf16-mixed", True, False, {}),
    ("llama3-8b", 1, 16, 13, "fp32", False, True, TINY_LLAMA),
    ("llama3-8b", 2, 16, 14, "bf16-mixed", True, False, TINY_LLAMA),
]


@pytest.mark.parametrize("name,m,seq,blocks,precision,fused,adam,cfg", CASES)
def test_deepened_graph_is_the_full_trace(name, m, seq, blocks, precision, fused, adam, cfg):
    make = _maker(name, m, seq, fused, adam, **cfg)
    shallow = capture(make(5), precision=precision)
    deeper = capture(make(6), precision=precision)
    full = capture(make(blocks), precision=precision)
    made = deepen(shallow, deeper, blocks)
    assert made.to_json() == full.to_json()
    assert made == full
    assert len(made.meta.blocks) == blocks and made.meta.info["layers"] == blocks


def test_blocks_that_differ_are_traced_whole():
    """A model whose third block differs from its neighbours is not made from copies of it:
    `deepen` refuses, and `capture_deep` traces the whole model."""
    plain = _maker("llama3-8b", 1, 16, **TINY_LLAMA)

    def make(blocks):
        def build():
            w = plain(blocks)()
            w.model.layers[2].mlp = torch.nn.Identity()
            return w

        return build

    shallow, deeper = capture(make(5), precision="fp32"), capture(make(6), precision="fp32")
    with pytest.raises(NotRepeated):
        deepen(shallow, deeper, 14)
    made = capture_deep(make, 16, precision="fp32")
    assert made == capture(make(16), precision="fp32")


def test_traces_of_other_models_are_refused():
    """Two traces that are not one model at two depths (here: two sequence lengths)."""
    a = capture(_maker("llama3-8b", 1, 16, **TINY_LLAMA)(5), precision="fp32")
    b = capture(_maker("llama3-8b", 1, 32, **TINY_LLAMA)(6), precision="fp32")
    with pytest.raises(NotRepeated):
        deepen(a, b, 14)


@pytest.mark.parametrize(
    "source,variant,blocks",
    [
        ("llama3-70b", {}, 80),
        ("llama3-70b", dict(fused_loss=True), 80),
        ("gpt2-medium", {}, 24),
        ("gpt2", {}, 12),  # capture_deep traces it whole (DEEP_FROM)
        ("llama3-70b", dict(compile="model"), None),  # traced through dynamo: whole
        ("llama3-70b", dict(optimizer_states="8bit"), None),
        ("llama3-70b", dict(offload=True), None),
        ("convnet", {}, None),
        (lambda batch_size, seq_len: None, {}, None),  # the user's own: whole
    ],
)
def test_the_planner_deepens_built_in_transformers_only(source, variant, blocks):
    """The planner's traces are made by `capture_deep` for the variants tests/test_deepen.py
    holds it to (a built-in transformer, eager, optimizer and weights as built), and traced
    whole otherwise."""
    from gobrrr.hardware import Target
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.trace import Tracer

    tracer = Tracer(
        source,
        seq=128,
        precision="bf16-mixed",
        target=Target.resolve("h100", calibration=False),
        variant=Knobs(micro_batch=1, **variant),
    )
    assert tracer._depth() == blocks
