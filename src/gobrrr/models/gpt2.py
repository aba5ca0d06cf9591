"""GPT-2 (Radford et al. 2019), written the nanoGPT way: one block, one screen."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPT2Config:
    """Shape of a GPT-2 model.

    Fields:
        n_layer: transformer blocks.
        n_embd: hidden size d.
        n_head: attention heads (head dim = n_embd // n_head).
        vocab_size: token vocabulary (50257 for the released models).
        block_size: longest sequence (learned position embeddings).
        dropout: dropout probability (0 for benchmarking).
        bias: biases in Linear and LayerNorm, as the released models have.
    """

    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab_size: int = 50257
    block_size: int = 1024
    dropout: float = 0.0
    bias: bool = True


GPT2_CONFIGS = {
    "gpt2": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "gpt2-medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "gpt2-large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "gpt2-xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # fused q, k, v
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _init_weights(module: nn.Module) -> None:
    """GPT-2's init: N(0, 0.02) weights, zero biases (nanoGPT); keeps the first loss near ln V."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


class GPT2(nn.Module):
    """GPT-2 language model; forward(idx, targets) returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as released
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        if targets is None:
            return self.lm_head(self.transformer.ln_f(x))  # (B, T, V), all positions as in training
        return self.head_loss(x, targets)

    def head_loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Final norm, output head and mean cross-entropy over all positions, from the last
        block's output x (B, T, C). gobrrr.apply's fused loss replaces it on the instance:
        the same loss without the (B, T, V) logits."""
        logits = self.lm_head(self.transformer.ln_f(x))  # (B, T, V)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
