"""The op registry: every transformer op as a forward/backward pair, one row each, naming both halves.

    name          forward writes              forward saves for backward
    embedding     out = wte[tokens] + wpe     nothing (tokens are the caller's)
    layernorm     out = xhat * w + b          mean, rstd (N,)
    linear        out = x @ w                 nothing (x is the caller's)
    attention     out = causal softmax(qk^T) v  lse (B,NH,T); probabilities are recomputed (a window and
                  (doc_starts) document starts may narrow the mask: model.attn_window, model.doc_mask)
    mlp           out = gelu(x @ w1) @ w2     h = x @ w1 and a = gelu(h) (N,4C) (train.recompute_gelu: h only)
    crossentropy  losses of x @ wte.T         lse (N,); logits are recomputed R rows at a time
    rmsnorm       out = x * rstd              rstd (N,)
    relu2         a = max(h, 0)^2             nothing (a is the caller's: the backward reads a, 2 sqrt(a))
    qkrope        q, k = rope(rmsnorm_head(.))  rstd (2,N,H); q, k in place, xhat recomputed by the inverse rotation
    skip          y = x + w * s               nothing (s, the kept stream, is the caller's)

Why the GPT-2 block runs six pairs where the seed counts eight: the seed's "final layernorm path" is the layernorm
pair applied to the last residual stream, and the residual add runs inside the layernorm pair (below), so neither
needs a pair of its own.
The tied LM head is fused into crossentropy, so the (N,V) logits never exist at once. Training runs
crossentropy as one call, crossentropy_forward_backward (the pair's two halves over each logits chunk
while it lies in the scratch), since the loss's upstream gradient is known before its forward; the loss
head's small helpers (loss_weights, loss_sum, and head_logits: the inference step's next-token logits) live in the
same modules. GELU lives inside the mlp pair,
which saves the pre-GELU activation and GELU's output (or, train.recompute_gelu, recomputes the output in
backward). The residual add and the LayerNorm that reads its sum run as one call, residual_layernorm_forward in the
layernorm modules (one pass over the rows on the GPU); the add's backward sends its gradient unchanged to both
inputs, which the model folds into the residual stream's one gradient buffer (microgpt/engine/model.py).

The modern block (model.block "modern", issue 46) adds three pairs: rmsnorm, its norm without a weight (with
residual_rmsnorm_forward, the residual add fused in as layernorm's is), relu2, its MLP's activation, a pair of its
own for now (relu2_backward turns the gradient in place, as GELU's backward does, from the output a: the modern MLP
keeps a alone), and qkrope, the QK-norm and rotary
embedding of q and k, in place between the QKV linear and attention (the model runs its backward inside attention's,
attention_backward's keyword `qkrope`, so that the GPU may fuse the two; qkrope_backward is the pair's own half, which
that op calls or matches). Its embedding is the embedding pair
without a position table (wpe None, and decode_embedding's likewise), and its loss head the crossentropy pair over its
untied head with a logit soft-cap (keyword `softcap`, 0 for GPT-2's). Its value embeddings (model.value_embeds)
are the embedding pair once more: embedding_add_forward adds a table's rows to a layer's values, and
embedding_backward without wpe is its backward. Its U-net skip connections (model.skips) are the skip pair: a late
layer's input plus a learned scalar times an early layer's output, whose backward adds the kept stream's gradient and
sums the scalar's in a fixed order.

Helpers without a backward, over the flat gradient / parameter arrays: gradclip (grad_norm_partial,
grad_norm_final), adamw (adamw_step, which also scales and clips the gradients: engine/step.py) and muon (muon_step,
Muon's step over the hidden matrices it owns, scaling and clipping as AdamW does, with muon_scratch listing the
planned buffers it takes for a set of MuonGroups, which differ by backend: ops/muon.py). And the decode step's
position-dependent ops, forward only (model.gpt_decode: rows at per-row positions of per-row cache rows, held in
device memory so that one CUDA graph serves every step): decode (decode_embedding, decode_kv_write,
decode_attention, and the modern block's decode_qkrope and decode_doc_starts; ops/decode.py specifies them). And the
greedy pick the decode step ends with: argmax (argmax_rows: each row's largest logit's index, so that a greedy row's
token leaves the device as one int, not V logits).

The linear, mlp and crossentropy pairs are GEMM sites: they take the precision's Matmul as the keyword `mm`
(microgpt/engine/precision.py says what it does; MATMUL_TAKERS names the functions), which the backend binds to them
with the arena, so the model calls every pair alike in every precision.

Each row names the NumPy module (the reference, imported by the CPU path without torch) and the Triton module
(microgpt/kernels/, imported only when the triton backend is asked for), as strings so that reading the
registry imports neither. microgpt/engine/backend.py builds both backends from these rows with one loop, and the
tests iterate them. Every function writes into the arrays it is given; every backward adds (+=) into its
parameter gradients.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class OpPair:
    """One op: the modules holding its two halves, `<name>_forward` and `<name>_backward` (argument order:
    outputs, saved, inputs, sizes), plus any further entry points of the same modules the model calls."""

    name: str
    numpy: str
    triton: str
    extra: tuple[str, ...] = ()

    @property
    def functions(self) -> tuple[str, ...]:
        return (f"{self.name}_forward", f"{self.name}_backward", *self.extra)


@dataclass(frozen=True)
class Helpers:
    """Functions without a backward (the step's), in a NumPy module and a Triton module of the same stem."""

    name: str
    numpy: str
    triton: str
    functions: tuple[str, ...]


def _pair(name: str, extra: tuple[str, ...] = ()) -> OpPair:
    return OpPair(name, f"microgpt.ops.{name}", f"microgpt.kernels.{name}", extra)


def _helpers(name: str, functions: tuple[str, ...]) -> Helpers:
    return Helpers(name, f"microgpt.ops.{name}", f"microgpt.kernels.{name}", functions)


OPS: dict[str, OpPair] = {
    "embedding": _pair("embedding", ("embedding_add_forward",)),
    "layernorm": _pair("layernorm", ("residual_layernorm_forward",)),
    "linear": _pair("linear"),
    "attention": _pair("attention", ("attention_forward_cached", "doc_starts")),
    "mlp": _pair("mlp"),
    "crossentropy": _pair("crossentropy", ("crossentropy_forward_backward", "head_logits", "loss_weights", "loss_sum")),
    "rmsnorm": _pair("rmsnorm", ("residual_rmsnorm_forward",)),
    "relu2": _pair("relu2"),
    "qkrope": _pair("qkrope"),
    "skip": _pair("skip"),
}

HELPERS: dict[str, Helpers] = {
    "gradclip": _helpers("gradclip", ("grad_norm_partial", "grad_norm_final")),
    "adamw": _helpers("adamw", ("adamw_step",)),
    "muon": _helpers("muon", ("muon_step", "muon_scratch")),
    "decode": _helpers(
        "decode", ("decode_embedding", "decode_kv_write", "decode_attention", "decode_qkrope", "decode_doc_starts")
    ),
    "argmax": _helpers("argmax", ("argmax_rows",)),
}

# the NumPy functions that take the backend's Rows (keyword `rows`, ops/rows.py): their passes run over ranges of
# rows, on the backend's threads (the Matmul carries its own, for GELU)
ROWS_TAKERS = ("layernorm_forward", "residual_layernorm_forward", "layernorm_backward", "attention_forward",
               "attention_backward", "mlp_backward", "crossentropy_forward", "crossentropy_backward",
               "crossentropy_forward_backward", "adamw_step", "rmsnorm_forward", "residual_rmsnorm_forward",
               "rmsnorm_backward", "relu2_forward", "relu2_backward", "qkrope_forward", "qkrope_backward")  # fmt: skip

# the functions that take the precision's Matmul (keyword `mm`): every GEMM site's
MATMUL_TAKERS = ("linear_forward", "linear_backward", "mlp_forward", "mlp_backward", "crossentropy_forward",
                 "crossentropy_backward", "crossentropy_forward_backward", "head_logits")  # fmt: skip
