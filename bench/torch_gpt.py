"""The PyTorch baseline: exactly microgpt's architecture as an nn.Module (benchmark only, never the engine).

Pre-LN GPT: token + position embedding; per block LN -> separate q, k, v projections (no bias) -> causal
F.scaled_dot_product_attention -> output projection -> residual; LN -> Linear(C,4C) -> GELU(tanh) ->
Linear(4C,C) -> residual; final LN; LM head tied to wte; mean cross-entropy. Init as microgpt.model.init_params.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, C: int, NH: int) -> None:
        super().__init__()
        self.n_head = NH
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.q, self.k, self.v, self.o = (nn.Linear(C, C, bias=False) for _ in range(4))
        self.fc, self.proj = nn.Linear(C, 4 * C, bias=False), nn.Linear(4 * C, C, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, V: int, C: int, L: int, NH: int, T: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, NH) for _ in range(L))
        self.lnf = nn.LayerNorm(C)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * L) if name.endswith(("o.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.lnf(x), self.wte.weight)  # tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)


def make_optimizer(model: nn.Module, lr: float = 6e-4, weight_decay: float = 0.1) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
