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
