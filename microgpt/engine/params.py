"""ANDREA's parameters, in one place: their names, shapes, the canonical order, the init and the GEMM sites.

The memory plan, the model, the checkpoint, the optimizer, export and the PyTorch baseline (bench/torch_gpt.py) all
read the architecture from here; nothing else lists the parameters again.

The canonical order (docs/ANDREA.md): token and position embeddings, then per block (h0, h1, ...) its two
LayerNorms and four linears, then the final LayerNorm. The LM head is tied to wte; linears have no bias.

    wte (V,C)  wpe (T,C)
    h{l}.ln1_w (C,)  h{l}.ln1_b (C,)  h{l}.w_q (C,C)  h{l}.w_k (C,C)  h{l}.w_v (C,C)  h{l}.w_o (C,C)
    h{l}.ln2_w (C,)  h{l}.ln2_b (C,)  h{l}.w_1 (C,4C)  h{l}.w_2 (4C,C)
    lnf_w (C,)  lnf_b (C,)

Linears are stored [in, out], so a linear's forward is x @ w. A block's GEMM sites (SITES) name the weights each
of its four linear calls reads: the attention's input projection is one linear of the three weights w_q, w_k,
w_v, which lie one after another in the order, so "h{l}.w_qkv" is the (3, C, C) view of them (`views`).
Shapes: V vocab_size, T seq_len, C d_model, L n_layer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from microgpt.config import ModelConfig

# a block's parameters in order: leaf name -> shape in units of C (a 1-tuple: a vector of C)
BLOCK = (("ln1_w", (1,)), ("ln1_b", (1,)), ("w_q", (1, 1)), ("w_k", (1, 1)), ("w_v", (1, 1)), ("w_o", (1, 1)),
         ("ln2_w", (1,)), ("ln2_b", (1,)), ("w_1", (1, 4)), ("w_2", (4, 1)))  # fmt: skip
# a block's GEMM sites: the model's name for the weight a linear call reads -> the parameters it holds
SITES = {"w_qkv": ("w_q", "w_k", "w_v"), "w_o": ("w_o",), "w_1": ("w_1",), "w_2": ("w_2",)}
RESIDUAL_PROJECTIONS = ("w_o", "w_2")  # init std scaled by 1/sqrt(2L) (GPT-2)
INIT_STD = 0.02


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter as (name, shape), in the canonical order."""
    C = m.d_model
    shapes: list[tuple[str, tuple[int, ...]]] = [("wte", (m.vocab_size, C)), ("wpe", (m.seq_len, C))]
    for layer in range(m.n_layer):
        shapes += [(f"h{layer}.{leaf}", tuple(k * C for k in units)) for leaf, units in BLOCK]
    return shapes + [("lnf_w", (C,)), ("lnf_b", (C,))]


def n_params(m: ModelConfig) -> int:
    """The sum over param_shapes, in closed form: a hostile n_layer must not build a billion-row table first."""
    C = m.d_model
    squares = sum(math.prod(units) for _, units in BLOCK if len(units) == 2)  # a block: 12 C^2 + 4 C
    vectors = sum(units[0] for _, units in BLOCK if len(units) == 1)
    return (m.vocab_size + m.seq_len) * C + m.n_layer * (squares * C * C + vectors * C) + 2 * C


def param_offsets(m: ModelConfig) -> dict[str, int]:
    """Each parameter's element offset in the flat arrays (the canonical order)."""
    offsets, off = {}, 0
    for name, shape in param_shapes(m):
        offsets[name] = off
        off += math.prod(shape)
    return offsets


def site_shapes(C: int) -> dict[str, tuple[int, int, int]]:
    """Each GEMM site's weight as (G, C_in, C_out): G weights of (C_in, C_out) side by side in the flat arrays."""
    out = {}
    for site, leaves in SITES.items():
        units = dict(BLOCK)[leaves[0]]
        out[site] = (len(leaves), units[0] * C, units[1] * C)
    return out


def named(flat: Any, m: ModelConfig) -> dict[str, Any]:
    """name -> parameter-shaped view of a flat (n_params,) array (weights, grads, a compute copy), canonical order."""
    offsets = param_offsets(m)
    return {name: flat[offsets[name] : offsets[name] + math.prod(shape)].reshape(shape) for name, shape in
            param_shapes(m)}  # fmt: skip


def views(flat: Any, m: ModelConfig) -> dict[str, Any]:
    """What the model reads of a flat array: `named`, plus each block's GEMM sites of several weights
    ("h{l}.w_qkv": the (3, C, C) view of w_q, w_k, w_v). Iterate `named` to visit each parameter once."""
    out, offsets = named(flat, m), param_offsets(m)
    for layer in range(m.n_layer):
        for site, (G, C, OC) in site_shapes(m.d_model).items():
            if G > 1:
                o = offsets[f"h{layer}.{SITES[site][0]}"]
                out[f"h{layer}.{site}"] = flat[o : o + G * C * OC].reshape(G, C, OC)
    return out


def init_std(leaf: str, n_layer: int) -> float:
    """GPT-2's init for a matrix: N(0, 0.02), the residual projections scaled by 1/sqrt(2L)."""
    return INIT_STD / (2 * n_layer) ** 0.5 if leaf in RESIDUAL_PROJECTIONS else INIT_STD


def init_weights(m: ModelConfig, seed: int) -> np.ndarray:
    """The flat fp32 weights of a fresh model from the run's seed: matrices and embeddings from init_std, drawn in the
    canonical order from one generator; LayerNorm weights 1, biases 0."""
    rng = np.random.default_rng(seed)
    parts = []
    for name, shape in param_shapes(m):
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("_w"):
            parts.append(np.ones(shape, np.float32))
        elif leaf.endswith("_b"):
            parts.append(np.zeros(shape, np.float32))
        else:
            parts.append(rng.normal(0.0, init_std(leaf, m.n_layer), size=shape).astype(np.float32))
    return np.concatenate([p.reshape(-1) for p in parts])


def decay_mask(m: ModelConfig) -> np.ndarray:
    """(n_params,) uint8: 1 where AdamW decays the weights (the matrices and embeddings), 0 for LayerNorm's."""
    return np.concatenate([np.full(math.prod(s), len(s) == 2, np.uint8) for _, s in param_shapes(m)])
