"""The model's parameters, in one place: their names, shapes, the canonical order, the init and the GEMM sites, for
each block family.

The memory plan, the model, the checkpoint, the optimizers, export and the PyTorch baselines (bench/torch_gpt.py,
bench/torch_modern.py) all read the architecture from here; nothing else lists the parameters again.

The canonical order (docs/ANDREA.md), by model.block:

    gpt2 (ANDREA's):  wte (V,C)  wpe (T,C)
                      h{l}.ln1_w (C,)  h{l}.ln1_b (C,)  h{l}.w_q (C,C)  h{l}.w_k (C,C)  h{l}.w_v (C,C)  h{l}.w_o (C,C)
                      h{l}.ln2_w (C,)  h{l}.ln2_b (C,)  h{l}.w_1 (C,4C)  h{l}.w_2 (4C,C)
                      lnf_w (C,)  lnf_b (C,)                              the LM head is tied to wte
    modern:           wte (V,C)  ve{j} (V,C) for j < model.value_embeds  skip_w (k,) where k = model.skips > 0
                      h{l}.w_q (C,C)  h{l}.w_k (C,C)  h{l}.w_v (C,C)  h{l}.w_o (C,C)  h{l}.w_1 (C,4C)  h{l}.w_2 (4C,C)
                      lm_head (V,C)                                       untied; no norm weights (RMSNorm has none)

The value embeddings (model.value_embeds = k, 0 by default) are token tables like wte whose rows are added to a
layer's attention values: table j to layer j's and to layer L - k + j's (`value_embed`), the first and last layers
sharing, as the speedrun's U-shaped tables do.

The skip connections (model.skips = k, 0 by default) are U-net fashion: the residual stream after layer j (j < k) is
kept, and layer L - 1 - j adds skip_w[j] times it to its input before its block (`skip_into`), the last layer pairing
with the first. skip_w is one vector of k scalars before the blocks, so AdamW keeps it (engine/optim.py) and data
parallel sums it with the embedding's bucket, after every layer's backward (engine/collectives.py). It starts at ones
(the rule of a vector named *_w, drawing nothing from the generator, so every other parameter's init is the model's
without skips).

Linears are stored [in, out], so a linear's forward is x @ w; no linear has a bias. A block's GEMM sites (SITES,
the same in both families) name the weights each of its four linear calls reads: the attention's input projection
is one linear of the three weights w_q, w_k, w_v, which lie one after another in the order, so "h{l}.w_qkv" is the
(3, C, C) view of them (`views`). Shapes: V vocab_size, T seq_len, C d_model, L n_layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt.config import ModelConfig

Units = tuple[int, ...]  # a shape in units of C (a 1-tuple: a vector of C)


@dataclass(frozen=True)
class Family:
    """One block family's parameter table: what comes before the blocks, a block, what comes after, as (name,
    shape) with shapes in units ("V", "T" or a multiple of C)."""

    name: str
    before: tuple[tuple[str, tuple[str | int, ...]], ...]  # before the blocks (the embeddings)
    block: tuple[tuple[str, Units], ...]
    after: tuple[tuple[str, tuple[str | int, ...]], ...]  # after the blocks
    head_weight: str  # the matrix the LM head multiplies by: wte (tied) or lm_head
    zero_init: tuple[str, ...]  # matrices that start at zero (the modern block's output projections and head)


GPT2 = Family(
    "gpt2",
    before=(("wte", ("V", 1)), ("wpe", ("T", 1))),
    block=(("ln1_w", (1,)), ("ln1_b", (1,)), ("w_q", (1, 1)), ("w_k", (1, 1)), ("w_v", (1, 1)), ("w_o", (1, 1)),
           ("ln2_w", (1,)), ("ln2_b", (1,)), ("w_1", (1, 4)), ("w_2", (4, 1))),
    after=(("lnf_w", (1,)), ("lnf_b", (1,))),
    head_weight="wte",
    zero_init=(),
)  # fmt: skip
MODERN = Family(
    "modern",
    before=(("wte", ("V", 1)),),
    block=(("w_q", (1, 1)), ("w_k", (1, 1)), ("w_v", (1, 1)), ("w_o", (1, 1)), ("w_1", (1, 4)), ("w_2", (4, 1))),
    after=(("lm_head", ("V", 1)),),
    head_weight="lm_head",
    zero_init=("w_o", "w_2", "lm_head"),
)
FAMILIES = {f.name: f for f in (GPT2, MODERN)}
BLOCK = GPT2.block  # ANDREA's block (the default family)
# a block's GEMM sites: the model's name for the weight a linear call reads -> the parameters it holds
SITES = {"w_qkv": ("w_q", "w_k", "w_v"), "w_o": ("w_o",), "w_1": ("w_1",), "w_2": ("w_2",)}
RESIDUAL_PROJECTIONS = ("w_o", "w_2")  # GPT-2: init std scaled by 1/sqrt(2L)
INIT_STD = 0.02


def family(m: ModelConfig) -> Family:
    return FAMILIES[m.block]


def value_embed(m: ModelConfig, layer: int) -> str | None:
    """The value-embedding table layer adds to its values: "ve{j}" for layer j and layer L - k + j (j < k =
    model.value_embeds), None for the layers between (and every layer when k is 0)."""
    k, L = m.value_embeds, m.n_layer
    j = layer if layer < k else layer - (L - k) if layer >= L - k else -1
    return f"ve{j}" if 0 <= j < k else None


def skip_into(m: ModelConfig, layer: int) -> int | None:
    """The skip connection layer receives: j for layer L - 1 - j (j < k = model.skips), which adds skip_w[j] times the
    residual stream after layer j to its input; None for the other layers (every layer when k is 0)."""
    j = m.n_layer - 1 - layer
    return j if 0 <= j < m.skips else None


def _before(m: ModelConfig) -> tuple[tuple[str, tuple[str | int, ...]], ...]:
    """The family's parameters before the blocks, then the value-embedding tables, then the skips' scalars."""
    skips = (("skip_w", ("S",)),) if m.skips else ()
    return (*family(m).before, *((f"ve{j}", ("V", 1)) for j in range(m.value_embeds)), *skips)


def _shape(units: tuple[str | int, ...], m: ModelConfig) -> tuple[int, ...]:
    sizes = {"V": m.vocab_size, "T": m.seq_len, "S": m.skips}
    return tuple(sizes[u] if isinstance(u, str) else u * m.d_model for u in units)


def param_shapes(m: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every parameter as (name, shape), in the canonical order."""
    f = family(m)
    shapes = [(name, _shape(units, m)) for name, units in _before(m)]
    for layer in range(m.n_layer):
        shapes += [(f"h{layer}.{leaf}", _shape(units, m)) for leaf, units in f.block]
    return shapes + [(name, _shape(units, m)) for name, units in f.after]


def n_params(m: ModelConfig) -> int:
    """The sum over param_shapes, in closed form: a hostile n_layer must not build a billion-row table first."""
    f = family(m)
    ends = sum(math.prod(_shape(units, m)) for _, units in (*_before(m), *f.after))
    block = sum(math.prod(_shape(units, m)) for _, units in f.block)
    return ends + m.n_layer * block


def flops_params(m: ModelConfig) -> tuple[int, str]:
    """(N, what it counts) for FLOPs per token = 6N + 12 L T d (PaLM's count): the parameters a token's forward
    multiplies by. Every parameter where the head is tied (the embedding once, as the head; the position table
    too), else all but the embedding and the value embeddings, whose rows a token only looks up."""
    if family(m).head_weight == "wte":
        return n_params(m), "every parameter (the tied embedding once, the position table included)"
    lookups = (1 + m.value_embeds) * m.vocab_size * m.d_model
    return n_params(m) - lookups, "every parameter but the untied embedding and value embeddings (lookups)"


def flops_per_token(m: ModelConfig) -> int:
    """Training FLOPs per token: 6N (forward and backward of each weight a token meets, flops_params) + 12 L T d
    (attention's scores and mixing)."""
    return 6 * flops_params(m)[0] + 12 * m.n_layer * m.seq_len * m.d_model


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
    return {
        name: flat[offsets[name] : offsets[name] + math.prod(shape)].reshape(shape) for name, shape in param_shapes(m)
    }


def views(flat: Any, m: ModelConfig) -> dict[str, Any]:
    """What the model reads of a flat array: `named`, plus each block's GEMM sites of several weights
    ("h{l}.w_qkv": the (3, C, C) view of w_q, w_k, w_v), plus "head": the LM head's matrix (wte when tied).
    Iterate `named` to visit each parameter once."""
    out, offsets = named(flat, m), param_offsets(m)
    for layer in range(m.n_layer):
        for site, (G, C, OC) in site_shapes(m.d_model).items():
            if G > 1:
                o = offsets[f"h{layer}.{SITES[site][0]}"]
                out[f"h{layer}.{site}"] = flat[o : o + G * C * OC].reshape(G, C, OC)
    out["head"] = out[family(m).head_weight]
    return out


def init_std(leaf: str, n_layer: int) -> float:
    """GPT-2's init for a matrix: N(0, 0.02), the residual projections scaled by 1/sqrt(2L)."""
    return INIT_STD / (2 * n_layer) ** 0.5 if leaf in RESIDUAL_PROJECTIONS else INIT_STD


def modern_init_std(leaf: str, shape: tuple[int, ...]) -> float:
    """The modern block's init for a matrix stored [in, out]: the embeddings N(0, 1) (RMSNorm follows wte; a value
    embedding's row then has the scale of the value it is added to, rmsnorm(x) @ w_v), a linear
    N(0, 1/sqrt(in)) shrunk by sqrt(out/in) where it narrows (the variance of x @ w then stays that of x), and the
    output projections and head at zero (`Family.zero_init`: each residual branch starts as the identity)."""
    if leaf == "wte" or leaf.startswith("ve"):
        return 1.0
    fan_in, fan_out = shape
    return min(1.0, (fan_out / fan_in) ** 0.5) / fan_in**0.5


def init_weights(m: ModelConfig, seed: int) -> np.ndarray:
    """The flat fp32 weights of a fresh model from the run's seed: matrices and embeddings drawn in the canonical order
    from one generator (GPT-2: init_std; modern: modern_init_std, zero_init ones left at zero and drawing nothing);
    LayerNorm weights 1, biases 0."""
    rng, f = np.random.default_rng(seed), family(m)
    parts = []
    for name, shape in param_shapes(m):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in f.zero_init:
            parts.append(np.zeros(shape, np.float32))
        elif len(shape) == 1:
            parts.append((np.ones if leaf.endswith("_w") else np.zeros)(shape, np.float32))
        else:
            std = modern_init_std(leaf, shape) if f is MODERN else init_std(leaf, m.n_layer)
            parts.append(rng.normal(0.0, std, size=shape).astype(np.float32))
    return np.concatenate([p.reshape(-1) for p in parts])


def decay_mask(m: ModelConfig) -> np.ndarray:
    """(n_params,) uint8: 1 where AdamW decays the weights (the matrices and embeddings), 0 for LayerNorm's."""
    return np.concatenate([np.full(math.prod(s), len(s) == 2, np.uint8) for _, s in param_shapes(m)])


def matrices(m: ModelConfig) -> list[tuple[str, int, tuple[int, int]]]:
    """Every block matrix as (name, offset, shape) in the canonical order: what Muon owns (train.optimizer "muon")."""
    offsets = param_offsets(m)
    return [(name, offsets[name], shape) for name, shape in param_shapes(m) if name.startswith("h") and len(shape) == 2]
