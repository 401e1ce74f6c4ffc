"""The op registry: every transformer op as a forward/backward pair, one line each.

    name          forward writes              forward saves for backward
    embedding     out = wte[tokens] + wpe     nothing (tokens are the caller's)
    layernorm     out = xhat * w + b          mean, rstd (N,)
    linear        out = x @ w                 nothing (x is the caller's)
    attention     out = causal softmax(qk^T) v  lse (B,NH,T); probabilities are recomputed
    mlp           out = gelu(x @ w1) @ w2     h = x @ w1 (N,4C), the pre-GELU activation
    residual      out = x + y                 nothing
    crossentropy  losses of x @ wte.T         lse (N,); logits are recomputed R rows at a time

Why seven pairs where the seed counts eight: the seed's "final layernorm path" is the layernorm pair
applied to the last residual stream, so it needs no pair of its own.
The tied LM head is fused into crossentropy, so the (N,V) logits never exist at once. Training runs
crossentropy as one call, crossentropy_forward_backward (the pair's two halves over each logits chunk
while it lies in the scratch), since the loss's upstream gradient is known before its forward. GELU lives
inside the mlp pair, which saves the pre-GELU activation and recomputes GELU in backward.

Helpers without a backward: gradclip (grad_norm_partial, grad_norm_final, clip_coef, grad_scale)
and adamw (adamw_step), both over the flat gradient / parameter arrays.

Every function writes into the arrays it is given; every backward adds (+=) into its gradients.
This package imports NumPy only: the Triton kernels live in microgpt.kernels.
"""

from collections.abc import Callable
from dataclasses import dataclass

from microgpt.ops.adamw import adamw_step
from microgpt.ops.attention import attention_backward, attention_forward
from microgpt.ops.crossentropy import crossentropy_backward, crossentropy_forward, crossentropy_forward_backward
from microgpt.ops.embedding import embedding_backward, embedding_forward
from microgpt.ops.gradclip import clip_coef, grad_norm_final, grad_norm_partial, grad_scale
from microgpt.ops.layernorm import layernorm_backward, layernorm_forward
from microgpt.ops.linear import linear_backward, linear_forward
from microgpt.ops.mlp import mlp_backward, mlp_forward
from microgpt.ops.residual import residual_backward, residual_forward


@dataclass(frozen=True)
class OpPair:
    """One op: its NumPy reference forward and backward (argument order: outputs, saved, inputs, sizes),
    and, for the loss, both in one call (forward's outputs, backward's gradients, inputs, scratch)."""

    name: str
    forward: Callable[..., None]
    backward: Callable[..., None]
    forward_backward: Callable[..., None] | None = None


OPS: dict[str, OpPair] = {
    "embedding": OpPair("embedding", embedding_forward, embedding_backward),
    "layernorm": OpPair("layernorm", layernorm_forward, layernorm_backward),
    "linear": OpPair("linear", linear_forward, linear_backward),
    "attention": OpPair("attention", attention_forward, attention_backward),
    "mlp": OpPair("mlp", mlp_forward, mlp_backward),
    "residual": OpPair("residual", residual_forward, residual_backward),
    "crossentropy": OpPair("crossentropy", crossentropy_forward, crossentropy_backward, crossentropy_forward_backward),
}

__all__ = [
    "OPS",
    "OpPair",
    "adamw_step",
    "clip_coef",
    "grad_norm_final",
    "grad_norm_partial",
    "grad_scale",
]
