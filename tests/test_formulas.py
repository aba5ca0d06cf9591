"""The closed forms against counts done by hand, term by term."""

import math

import pytest

from gobrrr.formulas import (
    activation_bytes_per_sequence,
    megatron_activation_bytes,
    mfu,
    model_flops_per_token,
    textbook_params,
    transformer_params,
)


def test_gpt2_params_by_hand():
    d, V, L = 768, 50257, 12
    wte, wpe = V * d, 1024 * d
    ln = 2 * d  # weight + bias
    c_attn = d * 3 * d + 3 * d
    attn_proj = d * d + d
    c_fc = d * 4 * d + 4 * d
    mlp_proj = 4 * d * d + d
    layer = 2 * ln + c_attn + attn_proj + c_fc + mlp_proj
    expected = wte + wpe + L * layer + ln
    assert expected == 124_439_808  # Hugging Face's count for "gpt2"
    assert transformer_params(L, d, V, bias=True, tied=True, positions=1024) == expected


def test_llama_params_by_hand():
    # a toy Llama: d=8, 4 heads of 2, 2 kv heads, ffn 12, vocab 10, 3 layers, untied
    L, d, V, ffn = 3, 8, 10, 12
    q, k, v, o = d * d, d * 4, d * 4, d * d
    mlp = 3 * d * ffn
    layer = q + k + v + o + mlp + 2 * d
    untied = V * d + L * layer + d + V * d
    got = transformer_params(L, d, V, ffn=ffn, kv_heads=2, heads=4, gated=True, tied=False)
    assert got == untied == 2 * 80 + 3 * (64 + 32 + 32 + 64 + 288 + 16) + 8
    tied = transformer_params(L, d, V, ffn=ffn, kv_heads=2, heads=4, gated=True, tied=True)
    assert tied == untied - V * d


def test_textbook_params():
    assert textbook_params(12, 768, 50257) == 84_934_656 + 77_194_752
    # textbook: a second V*d for the head (tied in gpt2), no positions, no biases/norms
    # (9984 per layer: 4 norm vectors of d, qkv 3d, proj d, fc 4d, proj d), no ln_f (2d)
    exact = transformer_params(12, 768, 50257, bias=True, positions=1024)
    assert (
        textbook_params(12, 768, 50257) - exact
        == 77_194_752 - 38_597_376 - 786_432 - 119_808 - 1536
    )


def test_activation_bytes_per_sequence():
    # 12*L*d*T = 12*2*4*3 = 288; L*heads*T^2 = 2*2*9 = 36; V*T = 15 -> 339 elements
    assert activation_bytes_per_sequence(2, 4, 3, 2, 5, bytes_per_elem=2) == 678
    assert activation_bytes_per_sequence(2, 4, 3, 2, 5, bytes_per_elem=4) == 1356


def test_megatron_activation_bytes():
    s, b, h, a = 2048, 1, 4096, 32
    # 5*a*s/h = 5*32*2048/4096 = 80, so 114 bytes per s*b*h element
    assert megatron_activation_bytes(s, b, h, a) == 2048 * 4096 * 114
    assert megatron_activation_bytes(s, b, h, a, L=3) == 3 * 2048 * 4096 * 114
    assert megatron_activation_bytes(s, b, h, a, recompute="selective") == 34 * 2048 * 4096
    assert megatron_activation_bytes(s, b, h, a, recompute="flash") == 34 * 2048 * 4096
    assert megatron_activation_bytes(s, b, h, a, recompute="full") == 2 * 2048 * 4096
    with pytest.raises(ValueError, match="recompute='some'"):
        megatron_activation_bytes(s, b, h, a, recompute="some")


def test_model_flops_per_token():
    # 6*100 = 600; 12*L*d*S = 12*2*4*8 = 768, halved when causal
    assert model_flops_per_token(100, 2, 4, 8, causal=False) == 600 + 768
    assert model_flops_per_token(100, 2, 4, 8, causal=True) == 600 + 384


def test_model_flops_matches_nanogpt_estimate():
    # nanoGPT's estimate_mfu: 6*N + 12*L*H*Q*T per token, non-causal, with H*Q = d
    N, L, H, Q, T = 123_653_376, 12, 12, 64, 1024
    nano = 6 * N + 12 * L * H * Q * T
    assert model_flops_per_token(N, L, H * Q, T, causal=False) == nano


def test_mfu():
    assert math.isclose(mfu(50_000, 1e9, 100e12), 0.5)
    with pytest.raises(ValueError, match="peak=0"):
        mfu(1.0, 1.0, 0)


def _gpt2_shapes(L, d, V, P):
    """GPT-2's parameters as nanoGPT names and shapes them (head tied to wte)."""
    out = [
        ("transformer.wte.weight", (V, d)),
        ("transformer.wpe.weight", (P, d)),
        ("transformer.ln_f.weight", (d,)),
        ("transformer.ln_f.bias", (d,)),
    ]
    for i in range(L):
        h = f"transformer.h.{i}"
        out += [
            (f"{h}.ln_1.weight", (d,)),
            (f"{h}.ln_1.bias", (d,)),
            (f"{h}.attn.c_attn.weight", (3 * d, d)),
            (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)),
            (f"{h}.attn.c_proj.bias", (d,)),
            (f"{h}.ln_2.weight", (d,)),
            (f"{h}.ln_2.bias", (d,)),
            (f"{h}.mlp.c_fc.weight", (4 * d, d)),
            (f"{h}.mlp.c_fc.bias", (4 * d,)),
            (f"{h}.mlp.c_proj.weight", (d, 4 * d)),
            (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    return out


def test_textbook_param_gap_explains_gpt2():
    from gobrrr.formulas import textbook_param_gap

    L, d, V, P = 12, 768, 50257, 1024
    gap = dict(textbook_param_gap(L, d, V, _gpt2_shapes(L, d, V, P)))
    assert gap == {
        "head tied to the embedding (one V×d table, not two)": -V * d,
        "matrices outside the layers (e.g. a position table)": P * d,
        "biases and norm weights (1-D), left out of 12·d²·L": 13 * d * L + 2 * d,
    }
    # 162.1M textbook, 124.4M real: the deltas close the gap exactly
    real = transformer_params(L, d, V, bias=True, positions=P)
    assert textbook_params(L, d, V) + sum(gap.values()) == real == 124_439_808


def test_textbook_param_gap_explains_an_untied_gqa_llama():
    from gobrrr.formulas import textbook_param_gap

    L, d, V, ffn, kv = 2, 64, 100, 224, 16  # kv_dim = d * kv_heads / heads
    shapes = [("tok.weight", (V, d)), ("out.weight", (V, d)), ("norm.weight", (d,))]
    for i in range(L):
        shapes += [
            (f"layers.{i}.wq", (d, d)),
            (f"layers.{i}.wk", (kv, d)),
            (f"layers.{i}.wv", (kv, d)),
            (f"layers.{i}.wo", (d, d)),
            (f"layers.{i}.w1", (ffn, d)),
            (f"layers.{i}.w2", (d, ffn)),
            (f"layers.{i}.w3", (ffn, d)),
            (f"layers.{i}.n1", (d,)),
            (f"layers.{i}.n2", (d,)),
        ]
    gap = dict(textbook_param_gap(L, d, V, shapes))
    layer = L * (2 * d * d + 2 * kv * d + 3 * ffn * d) - 12 * d * d * L
    assert gap == {
        "layer matrices beyond 12·d² per layer (grouped K/V, gated or resized MLP)": layer,
        "biases and norm weights (1-D), left out of 12·d²·L": (2 * L + 1) * d,
    }
    assert textbook_params(L, d, V) + sum(gap.values()) == transformer_params(
        L, d, V, ffn=ffn, kv_heads=1, heads=4, tied=False, gated=True
    )
