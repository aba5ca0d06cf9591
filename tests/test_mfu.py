"""MFU and HFU by one definition for every model, checked against PyTorch's FlopCounterMode on
real tensors; throughput in the workload's unit; checkpointing seen in the graph."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost.roofline import model_flops, model_flops_6n
from gobrrr.evaluate import checkpointing, predict, throughput_unit
from gobrrr.hardware import get_gpu
from gobrrr.models.registry import get_workload

H100 = get_gpu("h100")
CASES = [
    ("gpt2", 2, 64, dict(n_layer=2, vocab_size=96)),
    ("convnet", 2, None, {}),
    ("mlp", 16, None, {}),
]


def real_flops(name, batch, seq, **kw) -> int:
    """FLOPs of one forward and backward on real tensors, as PyTorch counts them (matmuls,
    convolutions, attention)."""
    torch.manual_seed(0)
    w = get_workload(name, batch, seq, **kw)
    with FlopCounterMode(display=False) as counter:
        w.compute_loss(w.batch).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name,batch,seq,kw", CASES, ids=[c[0] for c in CASES])
def test_model_flops_are_the_traced_forward_and_backward(name, batch, seq, kw):
    g = capture(lambda: get_workload(name, batch, seq, **kw), precision="fp32")
    reference = real_flops(name, batch, seq, **kw)
    # PyTorch counts the matmul-class ops; gobrrr adds the pointwise ops' few FLOPs
    assert reference <= model_flops(g) <= 1.02 * reference
    p = predict(g, H100)
    assert p.model_flops == model_flops(g)
    assert p.mfu == pytest.approx(p.model_flops / p.step_s / H100.peak("fp32"))
    assert 0 < p.mfu <= p.hfu


@pytest.mark.parametrize("name,batch,seq,kw", CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_recomputation_counts_in_hfu_only(name, batch, seq, kw):
    plain = capture(lambda: get_workload(name, batch, seq, **kw), precision="fp32")
    ckpt = capture(
        lambda: get_workload(name, batch, seq, **kw), precision="fp32", checkpoint="full"
    )
    assert model_flops(ckpt) == pytest.approx(model_flops(plain), rel=1e-3)
    p = predict(ckpt, H100)
    # about one more forward: at least a fifth more FLOPs run than the model's
    assert p.flops > 1.2 * p.model_flops and p.mfu < p.hfu


def test_a_cnn_gets_a_real_mfu_where_6n_counts_images_as_tokens():
    g = capture(lambda: get_workload("convnet", 8), precision="bf16-mixed")
    p = predict(g, H100)
    assert p.mfu > 0.05 * p.hfu
    # 6·N per "token" with one token per image misses the convolutions' reuse of weights
    assert model_flops_6n(g) < 0.1 * model_flops(g)


def test_throughput_unit():
    lm = capture(lambda: get_workload("gpt2", 1, 32, n_layer=1, vocab_size=64))
    cnn = capture(lambda: get_workload("convnet", 2))
    assert throughput_unit(lm) == "tokens" and throughput_unit(cnn) == "samples"

    def lm_without_seq_len():  # a (batch, sequence) integer input still counts tokens
        ids = torch.randint(0, 32, (2, 16))
        model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 1))
        return gobrrr.Workload(model=model, batch=(ids,), loss=lambda y, b: y.mean())

    g = capture(lm_without_seq_len)
    assert g.meta.tokens == 32 and throughput_unit(g) == "tokens"


class SelfCheckpointing(nn.Module):
    """Checkpoints its own blocks, as a model with gradient checkpointing enabled does."""

    def __init__(self, use: bool):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))
        self.use = use

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.use else b(x)
        return x.square().mean()


@pytest.mark.parametrize("use", [True, False])
def test_a_model_that_checkpoints_itself_is_seen_in_the_graph(use):
    g = capture(lambda: gobrrr.Workload(model=SelfCheckpointing(use), batch=torch.randn(4, 16)))
    how, recomputed = checkpointing(g)
    assert g.meta.checkpoint == "none"  # the flag knows nothing of it
    assert (how, recomputed > 0) == (("model", True) if use else ("none", False))
    # each block's forward runs again in backward: its linear and GELU at least
    assert not use or recomputed >= 2 * 3
