"""GPT forward and backward as flat lists of op-pair calls over the planned buffers, and the inference step.

`gpt_backward` calls the backward of every op of `gpt_forward` in exactly the reverse order, so the two
read side by side, with two exceptions. The loss head: the backward of the whole model starts at the loss,
whose upstream gradient (dlosses: 1/count on every scored token) is known before the forward runs, so in
training `gpt_forward(..., G)` calls crossentropy_forward_backward, which adds the head's gradients
(d lnf into A["dln"], the tied head's part into G["wte"]) while each logits chunk is still in the scratch:
no second LM-head matmul in backward. `gpt_backward` starts from there. And the residual adds: their
backward sends dout unchanged to both inputs (dx += dout; dy += dout), so instead of copying the residual
stream's gradient into two zeroed buffers, the branch reads `dresid` as its output gradient and the
LayerNorm under it adds its input gradient into `dresid` in place (as llm.c's CUDA trainer does): one
buffer, updated from the top of the model down, with the same sums in the same order, so the result is bit
for bit what the explicit residual backward gives.
Nothing here computes: every line is one op pair's forward or backward (or a zeroing of an
activation-gradient buffer that a backward adds into). Weight gradients are always added (+=: they accumulate
over micro-batches); an activation gradient is written by its one writer where it has one (the linear and MLP
input gradients, attention's dq, dk, dv) and added where several ops contribute (dresid) and by the loss head's
pair, whose backward adds d lnf (one zeroing of an (N, C) buffer a micro-batch).
The attention's input projection is one linear of three weights: P[h + "w_qkv"] is the (3, C, C) view of w_q, w_k,
w_v (adjacent in the canonical order: microgpt/engine/params.py), so the three projections share one
call, and in fp8 one cast of their input and one input-gradient GEMM. `K` is the backend (engine/backend.py): the
NumPy reference or the Triton kernels, with the same names and arguments.

`gpt_infer` is the inference step over the same pairs (memory.inference_plan's buffers): a window of t new
positions of b sequences, whose keys and values go into the plan's KV cache; prefill is a window from position 0
(attention then is the training forward's over the window), decoding a window of one position at pos (attention over
the cache). Its per-token losses are the training forward's, bit for bit, for the same window at position 0.
The b sequences share one position (sampling's batch, in cache rows 0 .. b-1), or each row has its own position and
cache row (serving's continuous batching: a request joins a batch whose other rows are further on): then the
position-free ops (the linears, LayerNorms, MLP, head) still run once over the b rows, and the three that read the
position (the position embedding, the cache write, attention) run once per row.
`gpt_decode` is the decode step of b rows at per-row positions and cache rows, one token a row, which it reads from
planned buffers (device memory on the GPU) rather than from the host, so that one CUDA graph of it serves every step
of a batch size (infer.InferState.decode): the position-free ops are gpt_infer's at N = b rows, the three that read a
row's position or cache row are the decode ops (ops/decode.py), one launch each for all rows.
Evaluation, sampling, chat and serving all run them (microgpt/use/evaluate.py, sample.py, chat.py, scheduler.py).

P: parameter views, G: gradient views (microgpt/engine/params.py names), A: the arena (activations, scratch), tokens and
targets: one micro-batch's (B,T) inputs. Shapes: B micro-batch, T seq_len, C d_model, L n_layer, N = B*T.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from microgpt.config import ModelConfig
from microgpt.engine.backend import Backend
from microgpt.engine.memory import Arena


def gpt_forward(K: Backend, m: ModelConfig, P: dict[str, Any], A: Arena, tokens: Any, targets: Any,
                G: dict[str, Any] | None = None) -> None:  # fmt: skip
    """tokens, targets (B,T) -> per-token losses (A["losses"]); with G (training), also the loss head's backward:
    d lnf in A["dln"] and the head's share of G["wte"], which gpt_backward then continues from."""
    B, T = tokens.shape
    N, H = B * T, m.n_head
    resid, proj = A["resid"], A["proj"]
    a, _ = _gelu_outputs(A, m.n_layer)
    K.embedding_forward(resid[0].reshape(B, T, -1), tokens, P["wte"], P["wpe"])
    out, mean, rstd, w, b = _norm(m, P, A, "ln1", 0)
    K.layernorm_forward(out, mean, rstd, resid[0], w, b)
    for layer in range(m.n_layer):  # each residual add runs with the LayerNorm that reads its sum, in one call
        h, x, resid2 = f"h{layer}.", resid[layer], A["resid2"][layer]
        ln1, q, k, v = A["ln1"][layer], *A["qkv"][layer]
        K.linear_forward(A["qkv"][layer], ln1, P[h + "w_qkv"])
        att = A["att"][layer]
        K.attention_forward(_btc(att, B, T), A["att_lse"][layer], _btc(q, B, T), _btc(k, B, T), _btc(v, B, T), H)
        K.linear_forward(proj, att, P[h + "w_o"])
        ln2, mean, rstd, w, b = _norm(m, P, A, "ln2", layer)
        K.residual_layernorm_forward(resid2, ln2, mean, rstd, x, proj, w, b)  # resid2 = x + proj; ln2 of it
        K.mlp_forward(proj, A["h"][layer], a[layer], ln2, P[h + "w_1"], P[h + "w_2"])
        out, mean, rstd, w, b = _norm(m, P, A, "ln1", layer + 1)  # the next layer's LN1; lnf after the last layer
        K.residual_layernorm_forward(resid[layer + 1], out, mean, rstd, resid2, proj, w, b)
    targets = targets.reshape(N)
    if G is None:
        K.crossentropy_forward(A["losses"], A["ce_lse"], A["lnf"], P["wte"], targets, A["logits"])
        return
    K.loss_weights(A["dlosses"], targets, A["loss_scale"])
    K.zero_(A["dln"])
    K.crossentropy_forward_backward(A["losses"], A["ce_lse"], A["dln"], G["wte"], A["dlosses"], A["lnf"], P["wte"],
                                    targets, A["logits"])  # fmt: skip


def gpt_backward(K: Backend, m: ModelConfig, P: dict[str, Any], G: dict[str, Any], A: Arena, tokens: Any,
                 layer_done: Callable[[int], None] | None = None) -> None:  # fmt: skip
    """Adds this micro-batch's gradients into G (weights) using what gpt_forward(..., G) saved, starting from
    d lnf, which that call left in A["dln"] (the module docstring says why). layer_done(l), if given, is called
    once layer l's gradients are complete (data parallel starts their all-reduce there): layer 0's at the end,
    layer l's (l > 0) just before layer l-1's attention backward. An all-reduce takes some SMs for its time; beside
    the attention kernel's many short blocks that costs the attention its share of those SMs, while beside a GEMM
    of one wave of persistent blocks (cuBLAS's at these shapes) the GEMM's last blocks wait for the all-reduce to
    end, which slowed the 2-GPU step when the sums started as each layer ended (bench/RESULTS.md)."""
    B, T = tokens.shape
    H = m.n_head
    dresid, dln, datt, dqkv = A["dresid"], A["dln"], A["datt"], A["dqkv"]
    a, recompute = _gelu_outputs(A, m.n_layer)
    K.zero_(dresid)
    x = A["resid"][m.n_layer]
    K.layernorm_backward(dresid, G["lnf_w"], G["lnf_b"], dln, x, P["lnf_w"], A["lnf_mean"], A["lnf_rstd"])
    for layer in reversed(range(m.n_layer)):
        h, x = f"h{layer}.", A["resid"][layer]
        # resid[l+1] = resid2 + mlp(ln2(resid2)): the MLP reads dresid; LN2 adds into it, which makes it dresid2
        ln2 = A["ln2"][layer]
        K.mlp_backward(dln, G[h + "w_1"], G[h + "w_2"], dresid, ln2, A["h"][layer], P[h + "w_1"], P[h + "w_2"],
                       a[layer], A["dh"], recompute=recompute)  # fmt: skip
        K.layernorm_backward(dresid, G[h + "ln2_w"], G[h + "ln2_b"], dln, A["resid2"][layer], P[h + "ln2_w"],
                             A["ln2_mean"][layer], A["ln2_rstd"][layer])  # fmt: skip
        # resid2 = resid[l] + attn(ln1(resid[l])): W_O reads dresid (= dresid2); LN1 adds into it (-> dresid[l])
        att = A["att"][layer]
        K.linear_backward(datt, G[h + "w_o"], dresid, att, P[h + "w_o"])
        q, k, v = A["qkv"][layer]
        dq, dk, dv = dqkv
        if layer_done is not None and layer + 1 < m.n_layer:
            layer_done(layer + 1)
        K.attention_backward(_btc(dq, B, T), _btc(dk, B, T), _btc(dv, B, T), _btc(datt, B, T), _btc(q, B, T),
                             _btc(k, B, T), _btc(v, B, T), _btc(att, B, T), A["att_lse"][layer], H)  # fmt: skip
        K.linear_backward(dln, G[h + "w_qkv"], dqkv, A["ln1"][layer], P[h + "w_qkv"])
        K.layernorm_backward(dresid, G[h + "ln1_w"], G[h + "ln1_b"], dln, x, P[h + "ln1_w"],
                             A["ln1_mean"][layer], A["ln1_rstd"][layer])  # fmt: skip
    if layer_done is not None:
        layer_done(0)
    K.embedding_backward(G["wte"], G["wpe"], dresid.reshape(B, T, -1), tokens)


def _gelu_outputs(A: Arena, n_layer: int) -> tuple[list[Any], bool]:
    """Each layer's buffer for a = gelu(h), and whether backward recomputes a from h: a layer's own (N, 4C) plane
    where the plan saves a (memory.gelu_output_saved), else the one (N, 4C) scratch all layers share, or None where
    the precision's cast computes GELU (Precision.gelu_planned)."""
    a = A.get("a")
    if a is None or a.ndim == 2:
        return [a] * n_layer, True
    return list(a), False


def _norm(m: ModelConfig, P: dict[str, Any], A: Arena, name: str, layer: int) -> tuple[Any, ...]:
    """LayerNorm `name` ("ln1" or "ln2") of `layer` as (out, mean, rstd, w, b); ("ln1", n_layer) is lnf, the one
    after the last layer, so the LayerNorm reading resid[l] is always ("ln1", l)."""
    if layer == m.n_layer:
        return A["lnf"], A["lnf_mean"], A["lnf_rstd"], P["lnf_w"], P["lnf_b"]
    h = f"h{layer}.{name}"
    return A[name][layer], A[f"{name}_mean"][layer], A[f"{name}_rstd"][layer], P[h + "_w"], P[h + "_b"]


def _btc(x: Any, B: int, T: int) -> Any:
    """(N, C) view -> (B, T, C) view."""
    return x.reshape(B, T, -1)


def windows(b: int, pos: int | Sequence[int], slots: Sequence[int] | None = None) -> list[tuple[slice, int, slice]]:
    """The inference step's position groups as (rows of the batch, their first position, their rows of the KV cache):
    one group when the b rows share position pos and sit in cache rows 0 .. b-1, else one group per row, row i at
    position pos[i] (or pos) in cache row slots[i] (or i)."""
    if isinstance(pos, int) and slots is None:
        return [(slice(0, b), pos, slice(0, b))]
    at = [pos] * b if isinstance(pos, int) else list(pos)
    rows = range(b) if slots is None else slots
    if len(at) != b or len(rows) != b:
        raise ValueError(f"gpt_infer: {b} rows need {b} positions and cache rows, got {len(at)} and {len(rows)}")
    return [(slice(i, i + 1), p, slice(s, s + 1)) for i, (p, s) in enumerate(zip(at, rows))]


def gpt_infer(K: Backend, m: ModelConfig, P: dict[str, Any], A: Arena, tokens: Any, pos: int | Sequence[int],
              targets: Any = None, slots: Sequence[int] | None = None) -> None:  # fmt: skip
    """tokens (b, t), contiguous: positions pos .. pos + t - 1 of b sequences (b <= the plan's B, pos + t <=
    seq_len), whose keys and values are written into the KV cache A["kv"] (L, 2, B, T, C) beside those of the
    positions before them: cache rows 0 .. b-1, or with pos a list of b positions and slots a list of b cache rows,
    row i at positions pos[i] .. pos[i] + t - 1 of cache row slots[i] (`windows`). A plan without a cache scores
    windows from position 0 alone, b x t of them up to its N rows.
    With targets (b, t): the per-token losses in A["losses"][:b*t]; without, each sequence's next-token logits (from
    its last position) in A["next_logits"][:b]."""
    b, t = tokens.shape
    N, H = b * t, m.n_head
    x, x2, ln, att, proj = (A[name][:N] for name in ("x", "x2", "ln", "att", "proj"))
    qkv, h, mean, rstd = A["qkv"][:, :N], A["h"][:N], A["ln_mean"][:N], A["ln_rstd"][:N]
    a, cache = A.get("a"), A.get("kv")
    a = None if a is None else a[:N]
    groups = windows(b, pos, slots)
    if cache is None and any(p > 0 for _, p, _ in groups):
        raise ValueError("gpt_infer: a window after position 0 needs the plan's KV cache")
    x3 = _btc(x, b, t)
    for rows, p, _ in groups:
        K.embedding_forward(x3[rows], tokens[rows], P["wte"], P["wpe"][p:])
    K.layernorm_forward(ln, mean, rstd, x, P["h0.ln1_w"], P["h0.ln1_b"])
    for layer in range(m.n_layer):
        hl = f"h{layer}."
        K.linear_forward(qkv, ln, P[hl + "w_qkv"])
        q, k, v = (_btc(z, b, t) for z in qkv)
        for rows, p, cached in groups:
            _attend(K, A, _btc(att, b, t)[rows], q[rows], k[rows], v[rows], p, layer, cached, H)
        K.linear_forward(proj, att, P[hl + "w_o"])
        K.residual_layernorm_forward(x2, ln, mean, rstd, x, proj, P[hl + "ln2_w"], P[hl + "ln2_b"])
        K.mlp_forward(proj, h, a, ln, P[hl + "w_1"], P[hl + "w_2"])
        nxt = f"h{layer + 1}.ln1" if layer + 1 < m.n_layer else "lnf"  # the next layer's LN1; lnf after the last
        K.residual_layernorm_forward(x, ln, mean, rstd, x2, proj, P[nxt + "_w"], P[nxt + "_b"])
    if targets is not None:
        K.crossentropy_forward(A["losses"][:N], A["ce_lse"][:N], ln, P["wte"], targets.reshape(N), A["logits"])
    else:
        K.head_logits(A["next_logits"][:b], _btc(ln, b, t)[:, -1], P["wte"])


def _attend(K: Backend, A: Arena, att: Any, q: Any, k: Any, v: Any, pos: int, layer: int, cached: slice,
            H: int) -> None:  # fmt: skip
    """One position group's attention, q, k, v, att (g, t, C) at positions pos .. pos + t - 1: its keys and values
    into cache rows `cached` of layer's KV cache (where the plan has one), then attention over the window (from
    position 0: the training forward's) or over the cache."""
    g, t, _ = q.shape
    cache = A.get("kv")
    if cache is not None:
        cache_k, cache_v = cache[layer, 0, cached], cache[layer, 1, cached]  # (g, T, C)
        K.copy_(cache_k[:, pos : pos + t], k)
        K.copy_(cache_v[:, pos : pos + t], v)
    if pos == 0:  # the window is the whole sequence so far: the training forward's attention over it
        K.attention_forward(att, A["att_lse"][: g * H * t].reshape(g, H, t), q, k, v, H)
    else:
        K.attention_forward_cached(att, q, cache_k, cache_v, pos, H)


def gpt_decode(K: Backend, m: ModelConfig, P: dict[str, Any], A: Arena, tokens: Any, positions: Any,
               slots: Any) -> None:  # fmt: skip
    """tokens, positions, slots (b,) int32 (b <= the plan's B): row i's token at position positions[i] (< seq_len)
    of KV-cache row slots[i] (< B; no two rows at one slot and position), whose key and value go into the cache
    A["kv"] beside those of positions 0 .. positions[i] - 1 of that row (written before, or by this step's other rows
    of that cache row: every write precedes every attention), which its attention reads; each row's next-token logits
    in A["next_logits"][:b]. For rows 0 .. b-1 all at position pos, the same step as gpt_infer's decode window of one
    token at pos."""
    b = tokens.shape[0]
    x, x2, ln, att, proj = (A[name][:b] for name in ("x", "x2", "ln", "att", "proj"))
    qkv, h, mean, rstd = A["qkv"][:, :b], A["h"][:b], A["ln_mean"][:b], A["ln_rstd"][:b]
    a, cache = A.get("a"), A["kv"]
    a = None if a is None else a[:b]
    K.decode_embedding(x, tokens, positions, P["wte"], P["wpe"])
    K.layernorm_forward(ln, mean, rstd, x, P["h0.ln1_w"], P["h0.ln1_b"])
    for layer in range(m.n_layer):
        hl = f"h{layer}."
        K.linear_forward(qkv, ln, P[hl + "w_qkv"])
        q, k, v = qkv
        cache_k, cache_v = cache[layer, 0], cache[layer, 1]  # (B, T, C)
        K.decode_kv_write(cache_k, cache_v, k, v, positions, slots)
        K.decode_attention(att, q, cache_k, cache_v, positions, slots, m.n_head)
        K.linear_forward(proj, att, P[hl + "w_o"])
        K.residual_layernorm_forward(x2, ln, mean, rstd, x, proj, P[hl + "ln2_w"], P[hl + "ln2_b"])
        K.mlp_forward(proj, h, a, ln, P[hl + "w_1"], P[hl + "w_2"])
        nxt = f"h{layer + 1}.ln1" if layer + 1 < m.n_layer else "lnf"  # the next layer's LN1; lnf after the last
        K.residual_layernorm_forward(x, ln, mean, rstd, x2, proj, P[nxt + "_w"], P[nxt + "_b"])
    K.head_logits(A["next_logits"][:b], ln, P["wte"])
