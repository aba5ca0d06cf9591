"""A user's own training step for `gobrrr estimate examples/custom_workload.py:workload`.

gobrrr calls `workload()` under fake tensors: nothing is allocated, nothing computed, so the
model can be far larger than this machine could hold. `--batch` and `--seq` are passed in.
"""

import torch
from torch import nn

import gobrrr


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32000, d: int = 1024, layers: int = 8, heads: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(
                    d,
                    heads,
                    4 * d,
                    dropout=0.0,
                    batch_first=True,
                    norm_first=True,
                    activation="gelu",
                )
                for _ in range(layers)
            ]
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, d)
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        logits = self.head(self.norm(x))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def workload(batch_size: int = 8, seq_len: int = 512) -> gobrrr.Workload:
    idx = torch.randint(0, 32000, (batch_size, seq_len))
    return gobrrr.Workload(
        model=TinyLM(),
        batch=(idx, torch.roll(idx, -1, dims=1)),
        loss=None,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
        name="tiny-lm",
        seq_len=seq_len,
    )
