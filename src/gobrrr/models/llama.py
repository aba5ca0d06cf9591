"""Llama 3 (Grattafiori et al. 2024): RMSNorm, RoPE, grouped-query attention, SwiGLU.

Names follow the Hugging Face checkpoints (q_proj, gate_proj, input_layernorm, ...), so a
module path in a report reads the same as in `transformers`. Llama 3.1+ rescales RoPE
frequencies for long contexts; that changes no shape, FLOP or byte, so it is left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# `enable_gqa` arrived in torch 2.5; before it, K and V are expanded to all query heads.
_HAS_ENABLE_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class LlamaConfig:
    """Shape of a Llama-3 model.

    Fields:
        n_layer: transformer blocks.
        dim: hidden size d.
        n_head: query heads (head dim = dim // n_head).
        n_kv_head: key/value heads (grouped-query attention when < n_head).
        ffn_dim: SwiGLU inner size.
        vocab_size: token vocabulary (128256 for Llama 3).
        tied: lm_head shares the token embedding (the 1B and 3B models).
        max_seq_len: longest sequence (RoPE has no table, so this is a policy limit).
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
    """

    n_layer: int = 32
    dim: int = 4096
    n_head: int = 32
    n_kv_head: int = 8
    ffn_dim: int = 14336
    vocab_size: int = 128256
    tied: bool = False
    max_seq_len: int = 131072
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


LLAMA_CONFIGS = {
    "llama3-1b": LlamaConfig(n_layer=16, dim=2048, n_head=32, ffn_dim=8192, tied=True),
    "llama3-3b": LlamaConfig(n_layer=28, dim=3072, n_head=24, ffn_dim=8192, tied=True),
    "llama3-8b": LlamaConfig(n_layer=32, dim=4096, n_head=32, ffn_dim=14336),
    "llama3-70b": LlamaConfig(n_layer=80, dim=8192, n_head=64, ffn_dim=28672),
    "llama3-405b": LlamaConfig(n_layer=126, dim=16384, n_head=128, ffn_dim=53248),
}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back, as Hugging Face's LlamaRMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        var = h.pow(2).mean(-1, keepdim=True)  # (B, T, 1)
        h = h * torch.rsqrt(var + self.eps)
        return self.weight * h.to(dtype)


def rope_cos_sin(
    T: int, head_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each (T, head_dim), halves repeated (HF layout)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )  # (hd/2,)
    t = torch.arange(T, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, hd) by the angles; pairs are (i, i + hd/2) as in HF."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        assert cfg.dim % cfg.n_head == 0 and cfg.n_head % cfg.n_kv_head == 0
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        self.head_dim = cfg.dim // cfg.n_head
        kv_dim = cfg.n_kv_head * self.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, self.n_head, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv_head, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = self._sdpa(q, k, v)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C))

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.n_kv_head == self.n_head:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if _HAS_ENABLE_GQA:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rep = self.n_head // self.n_kv_head
        B, KV, T, hd = k.shape
        k = k[:, :, None].expand(B, KV, rep, T, hd).reshape(B, KV * rep, T, hd)  # (B, H, T, hd)
        v = v[:, :, None].expand(B, KV, rep, T, hd).reshape(B, KV * rep, T, hd)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class FeedForward(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """Llama-3 language model; forward(idx, targets) returns the mean cross-entropy loss."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.embed_tokens.weight
        for m in self.modules():  # N(0, 0.02) as HF's initializer_range; first loss near ln V
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.embed_tokens(idx)  # (B, T, C)
        hd = self.config.dim // self.config.n_head
        cos, sin = rope_cos_sin(T, hd, self.config.rope_theta, idx.device, x.dtype)  # (T, hd)
        for layer in self.layers:
            x = layer(x, cos, sin)
        if targets is None:
            return self.lm_head(self.norm(x))  # (B, T, V), all positions as in training
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and mean cross-entropy over all positions, from the last
        block's output x (B, T, C). gobrrr.apply's fused loss replaces it on the instance:
        the same loss without the (B, T, V) logits."""
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
