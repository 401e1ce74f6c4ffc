"""The model as flat lists of op-pair calls over the planned buffers: one block function per family, called by the
training forward, the inference step (prefill) and the decode step; and the training backward.

A block (`gpt2_block`, `modern_block`: BLOCKS by model.block) is the same list of calls wherever it runs; what differs
between the three uses is only where its activations live (`Layer`: a training layer's own saved buffers, or the
inference plan's one layer that every layer reuses) and how it attends (`attend`: the training forward's attention
over the window from position 0; the inference step's KV-cache writes and cached attention per position group; the
decode step's per-row cache writes and attention). The modern block's rotary positions are applied inside attend,
where the positions are known, and so is its narrower mask (model.attn_window, model.doc_mask: `_mask`): the plan's
window buffer and the queries' document starts, made once a forward from its tokens (doc_starts), at inference from
the tokens the cache holds (`_infer_doc_starts`, decode_doc_starts).

`gpt_backward` calls the backward of every op of `gpt_forward` in exactly the reverse order, so the two
read side by side, with two exceptions. The loss head: the backward of the whole model starts at the loss,
whose upstream gradient (dlosses: 1/count on every scored token) is known before the forward runs, so in
training `gpt_forward(..., G)` calls crossentropy_forward_backward, which adds the head's gradients
(d lnf into A["dln"], the head's matrix's into G["head"]: wte's when tied) while each logits chunk is still in the
scratch: no second LM-head matmul in backward. `gpt_backward` starts from there. And the residual adds: their
backward sends dout unchanged to both inputs (dx += dout; dy += dout), so instead of copying the residual
stream's gradient into two zeroed buffers, the branch reads `dresid` as its output gradient and the
norm under it adds its input gradient into `dresid` in place (as llm.c's CUDA trainer does): one
buffer, updated from the top of the model down, with the same sums in the same order, so the result is bit
for bit what the explicit residual backward gives.
Nothing here computes: every line is one op pair's forward or backward (or a zeroing of an
activation-gradient buffer that a backward adds into, or a copy of a stream or gradient a skip connection keeps for
later: model.skips, `modern_block` and `_modern_backward`). Weight gradients are always added (+=: they accumulate
over micro-batches); an activation gradient is written by its one writer where it has one (the linear and MLP
input gradients, attention's dq, dk, dv, which in the modern block are the gradients w.r.t. the QK-norm and
rotary op's input: that op's backward runs inside attention's) and added where several ops contribute (dresid) and
by the loss head's pair, whose backward adds d lnf (one zeroing of an (N, C) buffer a micro-batch).
The attention's input projection is one linear of three weights: P[h + "w_qkv"] is the (3, C, C) view of w_q, w_k,
w_v (adjacent in the canonical order: engine/params.py), so the three projections share one call, and in fp8 one
cast of their input and one input-gradient GEMM. `K` is the backend (engine/backend.py): the NumPy reference or
the Triton kernels, with the same names and arguments.

`gpt_infer` is the inference step over the same pairs (memory.inference_plan's buffers): a window of t new
positions of b sequences, whose keys and values go into the plan's KV cache; prefill is a window from position 0
(attention then is the training forward's over the window), decoding a window of one position at pos (attention over
the cache). Its per-token losses are the training forward's, bit for bit, for the same window at position 0.
The b sequences share one position (sampling's batch, in cache rows 0 .. b-1), or each row has its own position and
cache row (serving's continuous batching: a request joins a batch whose other rows are further on): then the
position-free ops (the linears, norms, MLP, head) still run once over the b rows, and those that read the position
(the position embedding or the rotary one, the cache write, attention) once per position group (`windows`): rows
next to each other that start at position 0 are one group whatever their cache rows (their attention is the
window's own, which reads no cache; their keys and values go to their cache rows in one decode_kv_write), and every
other row is a group of its own.
`gpt_decode` is the decode step of b rows at per-row positions and cache rows, one token a row, which it reads from
planned buffers (device memory on the GPU) rather than from the host, so that one CUDA graph of it serves every step
of a batch size (infer.InferState.decode): the position-free ops are gpt_infer's at N = b rows, those that read a
row's position or cache row are the decode ops (ops/decode.py), one launch each for all rows.
Evaluation, sampling, chat and serving all run them (use/evaluate.py, sample.py, chat.py, scheduler.py).

P: parameter views, G: gradient views (engine/params.py names; "head" is the LM head's matrix), A: the arena
(activations, scratch), tokens and targets: one micro-batch's (B,T) inputs. Shapes: B micro-batch, T seq_len, C
d_model, L n_layer, H n_head, N = B*T.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from microgpt.config import ModelConfig
from microgpt.engine import params
from microgpt.engine.backend import Backend
from microgpt.engine.memory import Arena

Attend = Callable[[Any, Any], None]  # attend(att, qkv): att (n, C) from qkv (3, n, C), wherever the positions are


@dataclass
class Layer:
    """One layer's buffers as its block reads and writes them: the residual stream x (n, C) and its first norm ln1
    (written by the block below, or after the embedding), what the block writes on the way, and where it leaves the
    next layer's x and first norm (the final norm after the last layer). mean (GPT-2's LayerNorm) is None in the
    modern block, whose RMSNorm keeps rstd alone."""

    x: Any
    ln1: Any
    qkv: Any  # (3, n, C)
    att: Any
    proj: Any  # W_O's output, then the MLP's
    x2: Any  # between attention and MLP
    ln2: Any
    mean2: Any
    rstd2: Any
    h: Any  # (n, 4C) the MLP's pre-activation (None where W_1 writes a alone: memory.pre_activation_kept)
    a: Any  # (n, 4C) its activation (None where the fp8 cast computes it)
    x_out: Any
    ln_out: Any
    mean_out: Any
    rstd_out: Any
    tokens: Any  # the n rows' token ids (B,T) or (n,): which rows of a value-embedding table the values get
    rstd1: Any = None  # the modern block's: ln1's rstd, which a layer receiving a skip writes again
    skip: Any = None  # a layer receiving a skip (params.skip_into): the kept stream it adds to its input
    keep: Any = None  # a layer whose output a later skip adds, where a copy of it must be kept (None: it lies saved)


def gpt2_block(K: Backend, m: ModelConfig, P: dict[str, Any], layer: int, io: Layer, attend: Attend) -> None:
    """ANDREA's block: LayerNorm, attention, GELU MLP; each residual add runs with the LayerNorm that reads its sum,
    in one call, the last one with the next layer's LN1 (lnf after the last layer)."""
    h = f"h{layer}."
    K.linear_forward(io.qkv, io.ln1, P[h + "w_qkv"])
    attend(io.att, io.qkv)
    K.linear_forward(io.proj, io.att, P[h + "w_o"])
    K.residual_layernorm_forward(io.x2, io.ln2, io.mean2, io.rstd2, io.x, io.proj, P[h + "ln2_w"], P[h + "ln2_b"])
    K.mlp_forward(io.proj, io.h, io.a, io.ln2, P[h + "w_1"], P[h + "w_2"])
    nxt = f"h{layer + 1}.ln1" if layer + 1 < m.n_layer else "lnf"
    K.residual_layernorm_forward(
        io.x_out, io.ln_out, io.mean_out, io.rstd_out, io.x2, io.proj, P[nxt + "_w"], P[nxt + "_b"]
    )


def modern_block(K: Backend, m: ModelConfig, P: dict[str, Any], layer: int, io: Layer, attend: Attend) -> None:
    """The modern block: RMSNorm (no weights), attention over QK-normed rotary q and k (inside attend), ReLU^2 MLP of
    two linears; each residual add runs with the RMSNorm that reads its sum, the last with the next layer's. A layer
    with a value embedding (params.value_embed) adds its table's rows for the tokens to the values first. A layer
    receiving a skip (params.skip_into: j) first adds skip_w[j] times the kept stream to its input, in place, and
    normalizes the sum again (the norm the layer below wrote is of the stream before the add); a layer whose output a
    skip keeps copies it where io.keep says."""
    h = f"h{layer}."
    if (j := params.skip_into(m, layer)) is not None:
        K.skip_forward(io.x, io.x, io.skip, P["skip_w"][j : j + 1])
        K.rmsnorm_forward(io.ln1, io.rstd1, io.x)
    K.linear_forward(io.qkv, io.ln1, P[h + "w_qkv"])
    if (ve := params.value_embed(m, layer)) is not None:
        K.embedding_add_forward(io.qkv[2], io.tokens, P[ve])
    attend(io.att, io.qkv)
    K.linear_forward(io.proj, io.att, P[h + "w_o"])
    K.residual_rmsnorm_forward(io.x2, io.ln2, io.rstd2, io.x, io.proj)
    K.mlp_forward(io.proj, io.h, io.a, io.ln2, P[h + "w_1"], P[h + "w_2"], act="relu2")
    K.residual_rmsnorm_forward(io.x_out, io.ln_out, io.rstd_out, io.x2, io.proj)
    if io.keep is not None:
        K.copy_(io.keep, io.x_out)


BLOCKS = {"gpt2": gpt2_block, "modern": modern_block}


def head_args(m: ModelConfig) -> dict[str, Any]:
    """The loss head's keywords beyond its arguments: the modern block's logit soft-cap."""
    return {"softcap": m.softcap} if m.block == "modern" else {}


# --- training ------------------------------------------------------------------------------------------------------
def _train_layer(m: ModelConfig, A: Arena, layer: int, a: Any, tokens: Any) -> Layer:
    """Training layer l's own buffers (saved for backward); its output is layer l+1's input (lnf after the last). A
    skip's kept stream is the saved resid[j+1] (`_kept`), copied only where its receiving layer adds into it."""
    if layer + 1 < m.n_layer:
        out = A["ln1"][layer + 1], _at(A, "ln1_mean", layer + 1), A["ln1_rstd"][layer + 1]
    else:
        out = A["lnf"], A.get("lnf_mean"), A["lnf_rstd"]
    j = params.skip_into(m, layer)
    keep = A["skip_kept"] if layer == m.skips - 1 and "skip_kept" in A else None
    return Layer(
        A["resid"][layer],
        A["ln1"][layer],
        A["qkv"][layer],
        A["att"][layer],
        A["proj"],
        A["resid2"][layer],
        A["ln2"][layer],
        _at(A, "ln2_mean", layer),
        A["ln2_rstd"][layer],
        _at(A, "h", layer),
        a,
        A["resid"][layer + 1],
        *out,
        tokens,
        A["ln1_rstd"][layer],
        None if j is None else _kept(m, A, j),
        keep,
    )


def _kept(m: ModelConfig, A: Arena, j: int) -> Any:
    """Skip j's kept stream in training: the residual stream after layer j as saved (resid[j+1]), or its copy
    skip_kept where layer j+1 receives a skip and adds into resid[j+1] (skip k-1 where 2k = L: memory.skip_rows)."""
    return A["skip_kept"] if j == m.skips - 1 and "skip_kept" in A else A["resid"][j + 1]


def _at(A: Arena, name: str, layer: int) -> Any:
    """A per-layer buffer's layer, or None where the plan has no such buffer (the modern block's norm means, and its
    MLP's h where ReLU^2's output is saved: memory.pre_activation_kept)."""
    buf = A.get(name)
    return None if buf is None else buf[layer]


def _embed(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    x: Any,
    ln: Any,
    mean: Any,
    rstd: Any,
    tokens: Any,
    groups: list[Group],
    emb: Any,
    emb_rstd: Any,
) -> None:
    """The stream entering layer 0 into x (b*t, C) and its first norm into ln: GPT-2 x = wte[tokens] + wpe (each
    position group's rows of the position table from its position: `windows`), then LN1 of layer 0; modern x =
    rmsnorm(wte[tokens]) with wte[tokens] in emb (its rstd in emb_rstd), then layer 0's RMSNorm."""
    b, t = tokens.shape
    if m.block == "modern":
        K.embedding_forward(_btc(emb, b, t), tokens, P["wte"], None)
        K.rmsnorm_forward(x, emb_rstd, emb)
        K.rmsnorm_forward(ln, rstd, x)
        return
    x3 = _btc(x, b, t)
    for rows, p, _ in groups:
        K.embedding_forward(x3[rows], tokens[rows], P["wte"], P["wpe"][p:])
    K.layernorm_forward(ln, mean, rstd, x, P["h0.ln1_w"], P["h0.ln1_b"])


def gpt_forward(
    K: Backend, m: ModelConfig, P: dict[str, Any], A: Arena, tokens: Any, targets: Any, G: dict[str, Any] | None = None
) -> None:
    """tokens, targets (B,T) -> per-token losses (A["losses"]); with G (training), also the loss head's backward:
    d lnf in A["dln"] and the head's share of G["head"], which gpt_backward then continues from."""
    B, T = tokens.shape
    a, _ = _mlp_outputs(A, m.n_layer)
    if m.doc_mask >= 0:  # where each query's document starts, from this micro-batch's tokens (its backward reads it)
        K.doc_starts(A["doc_start"], tokens, m.doc_mask)
    _embed(
        K,
        m,
        P,
        A["resid"][0],
        A["ln1"][0],
        _at(A, "ln1_mean", 0),
        A["ln1_rstd"][0],
        tokens,
        windows(B, 0),
        A.get("emb"),
        A.get("emb_rstd"),
    )
    block = BLOCKS[m.block]
    for layer in range(m.n_layer):
        block(K, m, P, layer, _train_layer(m, A, layer, a[layer], tokens), _train_attend(K, m, A, layer, B, T))
    targets = targets.reshape(B * T)
    if G is None:
        K.crossentropy_forward(A["losses"], A["ce_lse"], A["lnf"], P["head"], targets, A["logits"], **head_args(m))
        return
    K.loss_weights(A["dlosses"], targets, A["loss_scale"])
    K.zero_(A["dln"])
    K.crossentropy_forward_backward(
        A["losses"],
        A["ce_lse"],
        A["dln"],
        G["head"],
        A["dlosses"],
        A["lnf"],
        P["head"],
        targets,
        A["logits"],
        **head_args(m),
    )


def _train_attend(K: Backend, m: ModelConfig, A: Arena, layer: int, B: int, T: int) -> Attend:
    """The training forward's attention of one layer over the window from position 0 (the modern block's q and k
    QK-normed and rotated in place first, their per-head rstd saved)."""

    def attend(att: Any, qkv: Any) -> None:
        q, k, v = (_btc(z, B, T) for z in qkv)
        if m.block == "modern":
            K.qkrope_forward(q, k, A["qk_rstd"][layer], A["rope"], n_head=m.n_head)
        K.attention_forward(_btc(att, B, T), A["att_lse"][layer], q, k, v, m.n_head, **_mask(A, A.get("doc_start")))

    return attend


def _mask(A: Arena, doc_start: Any) -> dict[str, Any]:
    """Attention's narrower mask (ops/attention.py) as its keywords: the plan's window (model.attn_window, or the
    training schedule's: optim.attn_window_at) and these queries' document starts (model.doc_mask), each None where
    the model has none: the causal mask."""
    return {"window": A.get("attn_window"), "doc_start": doc_start}


def gpt_backward(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    G: dict[str, Any],
    A: Arena,
    tokens: Any,
    layer_done: Callable[[int], None] | None = None,
) -> None:
    """Adds this micro-batch's gradients into G (weights) using what gpt_forward(..., G) saved, starting from
    d lnf, which that call left in A["dln"] (the module docstring says why). layer_done(l), if given, is called
    once layer l's gradients are complete (data parallel starts their all-reduce there): layer 0's at the end,
    layer l's (l > 0) just before layer l-1's attention backward. An all-reduce takes some SMs for its time; beside
    the attention kernel's many short blocks that costs the attention its share of those SMs, while beside a GEMM
    of one wave of persistent blocks (cuBLAS's at these shapes) the GEMM's last blocks wait for the all-reduce to
    end, which slowed the 2-GPU step when the sums started as each layer ended (bench/RESULTS.md)."""
    (_modern_backward if m.block == "modern" else _gpt2_backward)(K, m, P, G, A, tokens, layer_done)


def _gpt2_backward(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    G: dict[str, Any],
    A: Arena,
    tokens: Any,
    layer_done: Callable[[int], None] | None,
) -> None:
    B, T = tokens.shape
    dresid, dln = A["dresid"], A["dln"]
    a, recompute = _mlp_outputs(A, m.n_layer)
    K.zero_(dresid)
    x = A["resid"][m.n_layer]
    K.layernorm_backward(dresid, G["lnf_w"], G["lnf_b"], dln, x, P["lnf_w"], A["lnf_mean"], A["lnf_rstd"])
    for layer in reversed(range(m.n_layer)):
        h, x = f"h{layer}.", A["resid"][layer]
        # resid[l+1] = resid2 + mlp(ln2(resid2)): the MLP reads dresid; LN2 adds into it, which makes it dresid2
        ln2 = A["ln2"][layer]
        K.mlp_backward(
            dln,
            G[h + "w_1"],
            G[h + "w_2"],
            dresid,
            ln2,
            _at(A, "h", layer),
            P[h + "w_1"],
            P[h + "w_2"],
            a[layer],
            A["dh"],
            recompute=recompute,
        )
        K.layernorm_backward(
            dresid,
            G[h + "ln2_w"],
            G[h + "ln2_b"],
            dln,
            A["resid2"][layer],
            P[h + "ln2_w"],
            A["ln2_mean"][layer],
            A["ln2_rstd"][layer],
        )
        # resid2 = resid[l] + attn(ln1(resid[l])): W_O reads dresid (= dresid2); LN1 adds into it (-> dresid[l])
        _attention_backward(K, m, P, G, A, layer, tokens, layer_done)
        K.layernorm_backward(
            dresid, G[h + "ln1_w"], G[h + "ln1_b"], dln, x, P[h + "ln1_w"], A["ln1_mean"][layer], A["ln1_rstd"][layer]
        )
    if layer_done is not None:
        layer_done(0)
    K.embedding_backward(G["wte"], G["wpe"], dresid.reshape(B, T, -1), tokens)


def _modern_backward(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    G: dict[str, Any],
    A: Arena,
    tokens: Any,
    layer_done: Callable[[int], None] | None,
) -> None:
    """modern_block's calls reversed: the MLP's pair (ReLU^2 between its linears), attention's q and k through
    the QK-norm and rotary backward (inside attention's) before the QKV linear's, and the embedding's RMSNorm before
    the embedding's. A skip's add passes its gradient through to the receiving layer's input (dresid goes on down
    unchanged); that gradient waits (`_skip_grad`) until dresid is the gradient of the kept stream, after layer j,
    where the skip pair's backward adds skip_w[j] times it into dresid and sums skip_w[j]'s gradient."""
    B, T = tokens.shape
    dresid, dln, dh = A["dresid"], A["dln"], A["dh"]
    a, recompute = _mlp_outputs(A, m.n_layer)
    K.zero_(dresid)
    K.rmsnorm_backward(dresid, dln, A["resid"][m.n_layer], A["lnf_rstd"])
    for layer in reversed(range(m.n_layer)):
        h = f"h{layer}."
        if layer < m.skips:  # dresid: the gradient of the stream after this layer, which skip `layer` kept
            at = slice(layer, layer + 1)  # skip_w[layer], a (1,) view
            dy, kept = _skip_grad(m, A, layer), _kept(m, A, layer)
            K.skip_backward(dresid, G["skip_w"][at], dy, kept, P["skip_w"][at])
        # resid[l+1] = resid2 + w_2(relu(w_1(ln2(resid2)))^2): the MLP reads dresid; LN2 adds into it (-> dresid2)
        K.mlp_backward(
            dln,
            G[h + "w_1"],
            G[h + "w_2"],
            dresid,
            A["ln2"][layer],
            _at(A, "h", layer),
            P[h + "w_1"],
            P[h + "w_2"],
            a[layer],
            dh,
            recompute=recompute,
            act="relu2",
        )
        K.rmsnorm_backward(dresid, dln, A["resid2"][layer], A["ln2_rstd"][layer])
        # resid2 = resid[l] + attn(ln1(resid[l])): W_O reads dresid (= dresid2); LN1 adds into it (-> dresid[l])
        _attention_backward(K, m, P, G, A, layer, tokens, layer_done)
        K.rmsnorm_backward(dresid, dln, A["resid"][layer], A["ln1_rstd"][layer])
        j = params.skip_into(m, layer)
        if j is not None and layer > j + 1:  # dresid: the gradient of this layer's input, y of skip j's add
            K.copy_(_skip_grad(m, A, j), dresid)
    if layer_done is not None:
        layer_done(0)
    K.zero_(dln)  # the embedding's gradient, through its RMSNorm
    K.rmsnorm_backward(dln, dresid, A["emb"], A["emb_rstd"])
    K.embedding_backward(G["wte"], None, dln.reshape(B, T, -1), tokens, sorted_before=m.value_embeds > 0)


def _skip_grad(m: ModelConfig, A: Arena, j: int) -> Any:
    """Where the gradient of skip j's output (its receiving layer L-1-j's input) waits for backward to reach the
    stream after layer j: its plane of dskip, or dresid itself where that is the next layer down (L-1-j = j+1,
    nothing between: memory.skip_rows)."""
    return A["dresid"] if m.n_layer - 1 - j == j + 1 else A["dskip"][j]


def _attention_backward(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    G: dict[str, Any],
    A: Arena,
    layer: int,
    tokens: Any,
    layer_done: Callable[[int], None] | None,
) -> None:
    """The attention half of a layer's backward, both families': from dresid (the gradient reaching W_O's output) to
    the QKV projection's input gradient in dln, the block's calls from the QKV linear on reversed (the modern block's
    QK-norm and rotary backward with attention's, one op: ops/attention.py `qkrope`, whose GPU kernel may run it in
    its dq and dk epilogues; then a value embedding's, which dv reaches unchanged; the first of those, layer L-1's,
    sorts the tokens for every later one and for the embedding's). layer_done(layer + 1) just before the attention
    (gpt_backward says why)."""
    (B, T), h, H = tokens.shape, f"h{layer}.", m.n_head
    att = A["att"][layer]
    K.linear_backward(A["datt"], G[h + "w_o"], A["dresid"], att, P[h + "w_o"])
    q, k, v = (_btc(z, B, T) for z in A["qkv"][layer])
    dq, dk, dv = (_btc(z, B, T) for z in A["dqkv"])
    if layer_done is not None and layer + 1 < m.n_layer:
        layer_done(layer + 1)
    datt, mask = _btc(A["datt"], B, T), _mask(A, A.get("doc_start"))
    qkrope = {"qkrope": (A["qk_rstd"][layer], A["rope"])} if m.block == "modern" else {}  # dq, dk: w.r.t. its input
    K.attention_backward(dq, dk, dv, datt, q, k, v, _btc(att, B, T), A["att_lse"][layer], H, **mask, **qkrope)
    if (ve := params.value_embed(m, layer)) is not None:
        K.embedding_backward(G[ve], None, dv, tokens, sorted_before=layer < m.n_layer - 1)
    K.linear_backward(A["dln"], G[h + "w_qkv"], A["dqkv"], A["ln1"][layer], P[h + "w_qkv"])


def _mlp_outputs(A: Arena, n_layer: int) -> tuple[list[Any], bool]:
    """Each layer's buffer for the MLP's activation a, and whether backward recomputes a from h: a layer's own (N, 4C)
    plane where the plan saves a (memory.act_output_saved), else the one (N, 4C) scratch all layers share, or None
    where the precision's cast computes the activation (Precision.act_planned)."""
    a = A.get("a")
    if a is None or a.ndim == 2:
        return [a] * n_layer, True
    return list(a), False


def _btc(x: Any, B: int, T: int) -> Any:
    """(N, C) view -> (B, T, C) view."""
    return x.reshape(B, T, -1)


# --- inference ---------------------------------------------------------------------------------------------------
Group = tuple[slice, int, slice | tuple[int, ...]]  # rows of the batch, first position, cache rows


def windows(b: int, pos: int | Sequence[int], slots: Sequence[int] | None = None) -> list[Group]:
    """The inference step's position groups as (rows of the batch, their first position, their rows of the KV cache):
    one group when the b rows share position pos and sit in cache rows 0 .. b-1; else row i at position pos[i] (or
    pos) in cache row slots[i] (or i), each row a group of its own, except that rows next to each other at position 0
    are one group: its cache rows a slice where they follow each other, else a tuple of them (a window from position
    0 attends over itself and reads no cache, so its rows need not be neighbours there: `_infer_attend`)."""
    if isinstance(pos, int) and slots is None:
        return [(slice(0, b), pos, slice(0, b))]
    at = [pos] * b if isinstance(pos, int) else [int(p) for p in pos]
    rows = list(range(b)) if slots is None else [int(s) for s in slots]
    if len(at) != b or len(rows) != b:
        raise ValueError(f"gpt_infer: {b} rows need {b} positions and cache rows, got {len(at)} and {len(rows)}")
    groups: list[Group] = []
    i = 0
    while i < b:
        j = i + 1
        while at[i] == 0 and j < b and at[j] == 0:
            j += 1
        cached = rows[i:j]
        follow = cached == list(range(cached[0], cached[0] + len(cached)))
        groups.append((slice(i, j), at[i], slice(cached[0], cached[-1] + 1) if follow else tuple(cached)))
        i = j
    return groups


def _scattered(K: Backend, A: Arena, groups: list[Group], t: int) -> list[tuple[Any, Any] | None]:
    """Each group's per-token positions and cache rows on the device, for the groups whose cache rows are a tuple
    (`windows`), None for the others: the tokens of such a group, row by row, at positions 0 .. t-1 of its cache
    rows, staged in the plan's window_rows (positions, then cache rows) with one copy for the whole step. A plan
    without a KV cache has nothing to put there: None for every group."""
    if "kv" not in A:
        return [None] * len(groups)
    spans, host = [], []
    for rows, p, cached in groups:
        if isinstance(cached, slice):
            spans.append(None)
            continue
        n = len(cached) * t
        spans.append(n)
        host += [np.tile(np.arange(p, p + t, dtype=np.int32), len(cached)), np.repeat(np.int32(cached), t)]
    if not host:
        return [None] * len(groups)
    staged = A["window_rows"]
    K.copy_in_async(staged[: sum(h.size for h in host)], np.concatenate(host))
    out, at = [], 0
    for n in spans:
        out.append(None if n is None else (staged[at : at + n], staged[at + n : at + 2 * n]))
        at += 0 if n is None else 2 * n
    return out


def _infer_layer(A: Arena, n: int, a: Any, tokens: Any) -> Layer:
    """The inference plan's one layer of n rows, which every layer reuses: x in and out, ln every norm's output."""
    x, x2, ln, att, proj = (A[name][:n] for name in ("x", "x2", "ln", "att", "proj"))
    mean = A.get("ln_mean")
    mean = None if mean is None else mean[:n]
    rstd = A["ln_rstd"][:n]
    h = A.get("h")  # None where W_1 writes a alone (memory.pre_activation_kept)
    h = None if h is None else h[:n]
    return Layer(x, ln, A["qkv"][:, :n], att, proj, x2, ln, mean, rstd, h, a, x, ln, mean, rstd, tokens, rstd)


def _infer_skips(m: ModelConfig, A: Arena, io: Layer, layer: int) -> Layer:
    """The inference plan's one layer as `layer` uses it with model.skips: the kept stream skip j adds (the plan's
    skips[j]) where the layer receives one, and the plane where its output is kept (skips[layer]) where a later
    layer's skip adds it, since x is every layer's; io itself without skips."""
    if not m.skips:
        return io
    n, j = io.x.shape[0], params.skip_into(m, layer)
    kept = A["skips"]
    return dataclasses.replace(
        io, skip=None if j is None else kept[j][:n], keep=kept[layer][:n] if layer < m.skips else None
    )


def gpt_infer(
    K: Backend,
    m: ModelConfig,
    P: dict[str, Any],
    A: Arena,
    tokens: Any,
    pos: int | Sequence[int],
    targets: Any = None,
    slots: Sequence[int] | None = None,
) -> None:
    """tokens (b, t), contiguous: positions pos .. pos + t - 1 of b sequences (b <= the plan's B, pos + t <=
    seq_len), whose keys and values are written into the KV cache A["kv"] (L, 2, B, T, C) beside those of the
    positions before them: cache rows 0 .. b-1, or with pos a list of b positions and slots a list of b cache rows,
    row i at positions pos[i] .. pos[i] + t - 1 of cache row slots[i] (`windows`). A plan without a cache scores
    windows from position 0 alone, b x t of them up to its N rows.
    With targets (b, t): the per-token losses in A["losses"][:b*t]; without, each sequence's next-token logits (from
    its last position) in A["next_logits"][:b]."""
    b, t = tokens.shape
    N = b * t
    a = A.get("a")
    io = _infer_layer(A, N, None if a is None else a[:N], tokens)
    groups = windows(b, pos, slots)
    if "kv" not in A and any(p > 0 for _, p, _ in groups):
        raise ValueError("gpt_infer: a window after position 0 needs the plan's KV cache")
    scattered = _scattered(K, A, groups, t)
    docs = _infer_doc_starts(K, m, A, tokens, groups)
    _embed(K, m, P, io.x, io.ln1, io.mean2, io.rstd2, tokens, groups, io.x2, io.rstd2)
    block = BLOCKS[m.block]
    for layer in range(m.n_layer):
        attend = _infer_attend(K, m, A, layer, b, t, groups, docs, scattered)
        block(K, m, P, layer, _infer_skips(m, A, io, layer), attend)
    if targets is not None:
        K.crossentropy_forward(
            A["losses"][:N], A["ce_lse"][:N], io.ln1, P["head"], targets.reshape(N), A["logits"], **head_args(m)
        )
    else:
        K.head_logits(A["next_logits"][:b], _btc(io.ln1, b, t)[:, -1], P["head"], **head_args(m))


def _infer_doc_starts(K: Backend, m: ModelConfig, A: Arena, tokens: Any, groups: list[Group]) -> list[Any]:
    """Each position group's document starts (g, t) for its queries (model.doc_mask; None for each without): with a
    KV cache, its tokens go into the cache's token rows (kv_tokens) beside those before them and the starts are read
    from those rows, so a window after position 0 sees the documents its prefix began; without, or for a group whose
    cache rows are a tuple (from position 0: `windows`), from the window's own tokens. Made once, before the layers,
    in rows of the plan's doc_start that no other group of the step uses."""
    if m.doc_mask < 0:
        return [None] * len(groups)
    b, t = tokens.shape
    cached = A.get("kv_tokens")
    if cached is None:
        out = A["doc_start"].reshape(-1)[: b * t].reshape(b, t)
        K.doc_starts(out, tokens, m.doc_mask)
        return [out[rows] for rows, _, _ in groups]
    docs = []
    for rows, p, slots in groups:
        scan = A["doc_start"][rows, : p + t]
        if isinstance(slots, tuple):  # at position 0: each row's tokens into its cache row, the starts from the window
            for i, s in enumerate(slots):
                K.copy_(cached[s : s + 1, :t], tokens[rows.start + i : rows.start + i + 1])
            K.doc_starts(scan, tokens[rows], m.doc_mask)
        else:
            K.copy_(cached[slots, p : p + t], tokens[rows])
            K.doc_starts(scan, cached[slots, : p + t], m.doc_mask)
        docs.append(scan[:, p:])
    return docs


def _infer_attend(
    K: Backend,
    m: ModelConfig,
    A: Arena,
    layer: int,
    b: int,
    t: int,
    groups: list[Group],
    docs: list[Any],
    scattered: list[tuple[Any, Any] | None],
) -> Attend:
    """The inference step's attention of one layer, per position group: the modern block's q and k QK-normed and
    rotated at the group's positions, its keys and values into the group's cache rows (where the plan has a cache:
    a tuple of them by decode_kv_write at the positions and rows `_scattered` staged), then attention over the window
    (from position 0: the training forward's) or over the cache, each under the model's window and the group's
    document starts (docs: _infer_doc_starts)."""
    H = m.n_head

    def attend(att: Any, qkv: Any) -> None:
        q, k, v = (_btc(z, b, t) for z in qkv)
        att3 = _btc(att, b, t)
        for (rows, p, cached), doc, at in zip(groups, docs, scattered):
            g = rows.stop - rows.start
            if m.block == "modern":
                rstd = A["qk_rstd"][:, rows.start * t : rows.stop * t]
                K.qkrope_forward(q[rows], k[rows], rstd, A["rope"], n_head=H, pos=p)
            lse = A["att_lse"][: g * H * t].reshape(g, H, t)
            if at is not None:
                kv = A["kv"][layer]
                K.decode_kv_write(kv[0], kv[1], k[rows].reshape(g * t, -1), v[rows].reshape(g * t, -1), *at)
                K.attention_forward(att3[rows], lse, q[rows], k[rows], v[rows], H, **_mask(A, doc))
            else:
                _attend(K, A, att3[rows], lse, q[rows], k[rows], v[rows], p, layer, cached, H, _mask(A, doc))

    return attend


def _attend(
    K: Backend,
    A: Arena,
    att: Any,
    lse: Any,
    q: Any,
    k: Any,
    v: Any,
    pos: int,
    layer: int,
    cached: slice,
    H: int,
    mask: dict[str, Any],
) -> None:
    """One position group's attention, q, k, v, att (g, t, C) at positions pos .. pos + t - 1: its keys and values
    into cache rows `cached` of layer's KV cache (where the plan has one), then attention over the window (from
    position 0: the training forward's) or over the cache, under `mask` (_mask)."""
    t = q.shape[1]
    cache = A.get("kv")
    if cache is not None:
        cache_k, cache_v = cache[layer, 0, cached], cache[layer, 1, cached]  # (g, T, C)
        K.copy_(cache_k[:, pos : pos + t], k)
        K.copy_(cache_v[:, pos : pos + t], v)
    if pos == 0:  # the window is the whole sequence so far: the training forward's attention over it
        K.attention_forward(att, lse, q, k, v, H, **mask)
    else:
        K.attention_forward_cached(att, q, cache_k, cache_v, pos, H, **mask)


def gpt_decode(
    K: Backend, m: ModelConfig, P: dict[str, Any], A: Arena, tokens: Any, positions: Any, slots: Any
) -> None:
    """tokens, positions, slots (b,) int32 (b <= the plan's B): row i's token at position positions[i] (< seq_len)
    of KV-cache row slots[i] (< B; no two rows at one slot and position), whose key and value go into the cache
    A["kv"] beside those of positions 0 .. positions[i] - 1 of that row (written before, or by this step's other rows
    of that cache row: every write precedes every attention), which its attention reads; each row's next-token logits
    in A["next_logits"][:b]. For rows 0 .. b-1 all at position pos, the same step as gpt_infer's decode window of one
    token at pos."""
    b = tokens.shape[0]
    a = A.get("a")
    io = _infer_layer(A, b, None if a is None else a[:b], tokens)
    if m.block == "modern":
        K.decode_embedding(io.x2, tokens, positions, P["wte"], None)
        K.rmsnorm_forward(io.x, io.rstd2, io.x2)
        K.rmsnorm_forward(io.ln1, io.rstd2, io.x)
    else:
        K.decode_embedding(io.x, tokens, positions, P["wte"], P["wpe"])
        K.layernorm_forward(io.ln1, io.mean2, io.rstd2, io.x, P["h0.ln1_w"], P["h0.ln1_b"])
    doc = None
    if m.doc_mask >= 0:  # each row's token into the cache's token rows, then where its document starts
        doc = A["doc_start"].reshape(-1)[:b]
        K.decode_doc_starts(doc, A["kv_tokens"], tokens, positions, slots, m.doc_mask)
    block = BLOCKS[m.block]
    for layer in range(m.n_layer):
        block(K, m, P, layer, _infer_skips(m, A, io, layer), _decode_attend(K, m, A, layer, positions, slots, doc))
    K.head_logits(A["next_logits"][:b], io.ln1, P["head"], **head_args(m))


def _decode_attend(K: Backend, m: ModelConfig, A: Arena, layer: int, positions: Any, slots: Any, doc: Any) -> Attend:
    """The decode step's attention of one layer: each row's q and k at its position (the modern block's QK-norm and
    rotation first), its key and value into its cache row, then its attention over that row's cache (under the
    model's window and the rows' document starts doc (b,), where the model has them)."""
    cache_k, cache_v = A["kv"][layer, 0], A["kv"][layer, 1]  # (B, T, C)

    def attend(att: Any, qkv: Any) -> None:
        q, k, v = qkv
        if m.block == "modern":
            K.decode_qkrope(q, k, positions, A["rope"], n_head=m.n_head)
        K.decode_kv_write(cache_k, cache_v, k, v, positions, slots)
        K.decode_attention(att, q, cache_k, cache_v, positions, slots, m.n_head, **_mask(A, doc))

    return attend
