"""Built-in models: sizes against published counts, numerics against plain PyTorch, the registry."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from gobrrr.errors import GobrrrError
from gobrrr.models import describe, get_workload, load_workload, model_names
from gobrrr.models.gpt2 import CausalSelfAttention, GPT2Config
from gobrrr.models.llama import Attention, LlamaConfig, RMSNorm, apply_rope, rope_cos_sin
from gobrrr.workload import Workload

# Published sizes: Hugging Face model cards / config counts, Meta's Llama 3 releases,
# torchvision's resnet18 (the ConvNet's layout), and L * width^2 for the MLP.
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    "llama3-1b": 1_235_814_400,
    "llama3-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mlp": 8 * 4096 * 4096,
    "convnet": 11_689_512,
}

LLAMA_ARCH = {  # L, d, heads, kv_heads, ffn, tied (Meta's params.json)
    "llama3-1b": (16, 2048, 32, 8, 8192, True),
    "llama3-3b": (28, 3072, 24, 8, 8192, True),
    "llama3-8b": (32, 4096, 32, 8, 14336, False),
    "llama3-70b": (80, 8192, 64, 8, 28672, False),
    "llama3-405b": (126, 16384, 128, 8, 53248, False),
}


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights


def llama_params_from_arch(L, d, heads, kv_heads, ffn, tied, V=128256) -> int:
    hd = d // heads
    attn = d * heads * hd + 2 * d * kv_heads * hd + heads * hd * d
    layer = attn + 3 * d * ffn + 2 * d  # q k v o, gate up down, two RMSNorm weights
    return V * d + L * layer + d + (0 if tied else V * d)


def test_names_cover_published():
    assert sorted(model_names()) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_param_counts(name):
    with torch.device("meta"):
        wl = get_workload(name)
    assert next(wl.model.parameters()).device.type == "meta"
    assert count_params(wl.model) == PUBLISHED[name] == describe(name)["params"]


@pytest.mark.parametrize("name", list(LLAMA_ARCH))
def test_llama_published_sizes_follow_architecture(name):
    assert llama_params_from_arch(*LLAMA_ARCH[name]) == PUBLISHED[name]
    info = describe(name)
    assert (info["layers"], info["hidden"], info["heads"]) == LLAMA_ARCH[name][:3]
    assert (info["kv_heads"], info["ffn"], info["tied"]) == LLAMA_ARCH[name][3:]


def test_params_nonembed():
    # gpt2: everything but wte and wpe, plus the (tied) head matmul: nanoGPT's 123.65M + wte - wte
    assert describe("gpt2")["params_nonembed"] == 124_439_808 - 1024 * 768
    assert describe("llama3-8b")["params_nonembed"] == 8_030_261_248 - 128256 * 4096


def test_tied_heads():
    with torch.device("meta"):
        g, small, big = (get_workload(n).model for n in ("gpt2", "llama3-1b", "llama3-8b"))
    assert g.lm_head.weight is g.transformer.wte.weight
    assert small.lm_head.weight is small.embed_tokens.weight
    assert big.lm_head.weight is not big.embed_tokens.weight


TINY = {
    "gpt2": dict(n_layer=2, n_embd=32, n_head=4, vocab_size=97, block_size=16),
    "llama3-8b": dict(n_layer=2, dim=32, n_head=4, n_kv_head=2, ffn_dim=48, vocab_size=97),
    "mlp": dict(layers=3, width=16),
    "convnet": dict(width=8, num_classes=10, image_size=32),
}


@pytest.mark.parametrize("name", list(TINY))
def test_forward_backward_tiny(name):
    torch.manual_seed(0)
    wl = get_workload(name, batch_size=2, seq_len=8, **TINY[name])
    loss = wl.compute_loss(wl.batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    if name in ("gpt2", "llama3-8b"):  # N(0, 0.02) init: logits near 0, loss near ln V
        assert abs(loss.item() - math.log(97)) < 0.3
    loss.backward()
    for pname, p in wl.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    opt = wl.make_optimizer()
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.param_groups[0]["lr"] == 3e-4 and opt.param_groups[0]["fused"] is None
    opt.step()


def causal_attention_reference(q, k, v):
    """softmax(q k^T / sqrt(hd) + causal mask) v, (B, H, T, hd), K/V heads repeated for GQA."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    T = q.shape[2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def test_gpt2_attention_matches_reference():
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=24, n_head=3)
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 5, 24)
    q, k, v = attn.c_attn(x).split(24, dim=2)
    q, k, v = (t.view(2, 5, 3, 8).transpose(1, 2) for t in (q, k, v))
    y = causal_attention_reference(q, k, v).transpose(1, 2).reshape(2, 5, 24)
    torch.testing.assert_close(attn(x), attn.c_proj(y))


@pytest.mark.parametrize("gqa", [True, False])
def test_llama_attention_matches_reference(gqa, monkeypatch):
    monkeypatch.setattr("gobrrr.models.llama._HAS_ENABLE_GQA", gqa)  # both code paths
    torch.manual_seed(0)
    cfg = LlamaConfig(dim=32, n_head=4, n_kv_head=2)
    attn = Attention(cfg)
    x = torch.randn(2, 6, 32)
    cos, sin = rope_cos_sin(6, 8, cfg.rope_theta, x.device, x.dtype)
    q = apply_rope(attn.q_proj(x).view(2, 6, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(2, 6, 2, 8).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(2, 6, 2, 8).transpose(1, 2)
    y = causal_attention_reference(q, k, v).transpose(1, 2).reshape(2, 6, 32)
    torch.testing.assert_close(attn(x, cos, sin), attn.o_proj(y))


def test_rope_is_relative_rotation():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    cos, sin = rope_cos_sin(12, 16, 500000.0, torch.device("cpu"), torch.float32)
    rq = apply_rope(q.expand(1, 1, 12, 16), cos, sin)[0, 0]  # (T, hd): q placed at every position
    rk = apply_rope(k.expand(1, 1, 12, 16), cos, sin)[0, 0]
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(12))  # a rotation
    dots = rq @ rk.T  # (T, T): depends on m - n only
    torch.testing.assert_close(dots[3, 1], dots[9, 7])
    torch.testing.assert_close(dots[0, 0], (q * k).sum())


def test_rmsnorm_matches_reference_in_bf16():
    torch.manual_seed(0)
    norm = RMSNorm(16)
    norm.weight.data = torch.randn(16)
    x = torch.randn(3, 16, dtype=torch.bfloat16) * 5
    xf = x.float()
    ref = norm.weight * (xf / xf.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()).bfloat16()
    out = norm(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(
        out.float(), F.rms_norm(xf, (16,), norm.weight, 1e-5), atol=0.05, rtol=0.02
    )


def test_workload_defaults():
    with torch.device("meta"):
        g, lm, mlp = get_workload("gpt2"), get_workload("llama3-1b"), get_workload("mlp")
    assert g.batch[0].shape == g.batch[1].shape == (8, 1024) and g.batch[0].dtype == torch.long
    assert (g.tokens, g.seq_len, g.max_seq_len, g.name) == (8192, 1024, 1024, "gpt2")
    assert g.info == dict(
        layers=12,
        hidden=768,
        heads=12,
        kv_heads=12,
        vocab=50257,
        ffn=3072,
        tied=True,
        family="gpt2",
    )
    assert (lm.tokens, lm.seq_len, lm.max_seq_len) == (2048, 2048, 131072)
    assert lm.info["family"] == "llama" and lm.info["kv_heads"] == 8
    assert mlp.batch[0].shape == (1024, 4096) and mlp.tokens == 1024 and mlp.seq_len is None


def test_mlp_ignores_seq_with_a_note():
    with torch.device("meta"):
        wl = get_workload("mlp", seq_len=512)
    assert wl.seq_len is None and "512" in wl.info["note"]


def test_405b_under_fake_mode():
    """How long the build takes: benchmarks/speed/bench_build_speed.py."""
    with FakeTensorMode():
        wl = get_workload("llama3-405b", seq_len=4096)
    assert count_params(wl.model) == PUBLISHED["llama3-405b"]
    assert wl.tokens == 4096


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name="gpt3"), "unknown model 'gpt3': choose one of gpt2, gpt2-medium"),
        (dict(name="gpt2", batch_size=0), "batch size 0"),
        (dict(name="gpt2", seq_len=-1), "sequence length -1"),
        (dict(name="gpt2", seq_len=1025), "1025 exceeds gpt2's maximum of 1024"),
        (dict(name="llama3-8b", seq_len=131073), "131073 exceeds llama3-8b's maximum of 131072"),
        (dict(name="gpt2", n_layers=2), "gpt2 has no setting n_layers: valid settings are"),
    ],
)
def test_get_workload_errors(kwargs, match):
    with torch.device("meta"), pytest.raises(GobrrrError, match=match):
        get_workload(**kwargs)


USER_FILE = """
import torch
from gobrrr.workload import Workload

def good(batch_size=4, seq_len=3):
    model = torch.nn.Linear(seq_len, 1)
    return Workload(model=model, batch=torch.randn(batch_size, seq_len),
                    loss=lambda out, batch: out.sum())

def no_args():
    return good(2, 2)

def boom(batch_size=1):
    raise ValueError("bad width 7")

def wrong():
    return 42
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my.py"
    path.write_text(USER_FILE)
    return path


def test_load_workload_good(user_file):
    wl = load_workload(f"{user_file}:good", batch_size=5, seq_len=6)
    assert isinstance(wl, Workload) and wl.batch.shape == (5, 6)
    assert load_workload(f"{user_file}:good").batch.shape == (4, 3)
    assert load_workload(f"{user_file}:no_args", batch_size=9).batch.shape == (2, 2)
    loss = wl.compute_loss(wl.batch)
    assert loss.dim() == 0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("{f}:missing", r"has no function 'missing' \(functions: good, no_args, boom, wrong\)"),
        ("{f}:boom", r"workload .*my.py:boom raised ValueError: bad width 7"),
        ("{f}:wrong", r"returned int, not a gobrrr.Workload"),
        ("{d}/nope.py:good", r"nope.py not found"),
        ("{f}", r"write it as path/to/file.py:function"),
    ],
)
def test_load_workload_errors(user_file, spec, match):
    spec = spec.format(f=user_file, d=user_file.parent)
    with pytest.raises(GobrrrError, match=match) as e:
        load_workload(spec, batch_size=2)
    assert "\n" not in str(e.value)
