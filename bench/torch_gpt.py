"""The PyTorch baseline: exactly microgpt's architecture as an nn.Module (benchmark only, never the engine).

Pre-LN GPT: token + position embedding; per block LN -> separate q, k, v projections (no bias) -> causal
F.scaled_dot_product_attention -> output projection -> residual; LN -> Linear(C,4C) -> GELU(tanh) ->
Linear(4C,C) -> residual; final LN; LM head tied to wte; mean cross-entropy. The weights start as microgpt's do
(microgpt/engine/params.py: the same init from the same seed, loaded by name; nn.Linear stores [out, in],
microgpt [in, out]).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from microgpt.config import ModelConfig
from microgpt.engine import params

# microgpt's block leaf -> this module's parameter (per block); embeddings and the final LayerNorm by TOP
BLOCK_NAMES = {
    "ln1_w": "ln1.weight",
    "ln1_b": "ln1.bias",
    "w_q": "q.weight",
    "w_k": "k.weight",
    "w_v": "v.weight",
    "w_o": "o.weight",
    "ln2_w": "ln2.weight",
    "ln2_b": "ln2.bias",
    "w_1": "fc.weight",
    "w_2": "proj.weight",
}
TOP_NAMES = {"wte": "wte.weight", "wpe": "wpe.weight", "lnf_w": "lnf.weight", "lnf_b": "lnf.bias"}


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
    def __init__(self, m: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        C = m.d_model
        self.wte, self.wpe = nn.Embedding(m.vocab_size, C), nn.Embedding(m.seq_len, C)
        self.blocks = nn.ModuleList(Block(C, m.n_head) for _ in range(m.n_layer))
        self.lnf = nn.LayerNorm(C)
        self.load_flat(params.init_weights(m, seed), m)

    @torch.no_grad()
    def load_flat(self, flat: np.ndarray, m: ModelConfig) -> None:
        """Weights from microgpt's flat (n_params,) fp32 array in the canonical order."""
        mine = dict(self.named_parameters())
        offsets = params.param_offsets(m)
        for name, shape in params.param_shapes(m):
            block, _, leaf = name.rpartition(".")
            target = mine[f"blocks.{block[1:]}.{BLOCK_NAMES[leaf]}" if block else TOP_NAMES[name]]
            w = torch.from_numpy(flat[offsets[name] : offsets[name] + int(np.prod(shape))].reshape(shape))
            target.copy_(w.t() if len(shape) == 2 and block else w)

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
