"""attention pair against an explicit causal masked softmax in torch autograd (and with a window and document
starts: the mask narrowed as ops/attention.py says)."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.attention import attention_backward, attention_forward, attention_forward_cached, doc_starts

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt
from .test_qkrope import torch_qkrope

# (B, T, C, NH): hs = 4, 1, 5, 6; T = 1 has a single unmasked key per row.
SHAPES = [(3, 7, 12, 3), (1, 1, 4, 1), (2, 13, 10, 2), (2, 16, 24, 4), (1, 5, 3, 3)]


def make_inputs(rng: np.random.Generator, B: int, T: int, C: int) -> dict:
    return {k: rng.standard_normal((B, T, C)) for k in ("q", "k", "v", "dout")}


def torch_mask(T: int, window: int | None = None, doc: np.ndarray | None = None) -> torch.Tensor:
    """(B or 1, 1, T, T) bool, True where query i must not see key j: j > i, i - j >= window, j < doc[b, i]."""
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    hidden = (j > i)[None]
    if window is not None:
        hidden = hidden | (i - j >= window)[None]
    if doc is not None:
        hidden = hidden | (j < torch.from_numpy(doc.astype(np.int64))[:, :, None])
    return hidden[:, None]


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_head: int, window: int | None, doc: np.ndarray | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B,T,C), lse (B,NH,T)) of an explicit masked softmax over q, k, v (B,T,C)."""
    B, T, C = q.shape
    hs = C // n_head
    qh, kh, vh = (z.reshape(B, T, n_head, hs).transpose(1, 2) for z in (q, k, v))  # (B,NH,T,hs)
    scores = qh @ kh.transpose(-2, -1) / math.sqrt(hs)
    scores = scores.masked_fill(torch_mask(T, window, doc), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B,NH,T)
    att = torch.softmax(scores, dim=-1)
    return (att @ vh).transpose(1, 2).reshape(B, T, C), lse


def torch_reference(inp: dict, n_head: int, window: int | None = None, doc: np.ndarray | None = None) -> dict:
    q, k, v = tt(inp["q"]), tt(inp["k"]), tt(inp["v"])
    out, lse = torch_attention(q, k, v, n_head, window, doc)
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def torch_qkrope_reference(
    inp: dict, n_head: int, rope: np.ndarray, window: int | None = None, doc: np.ndarray | None = None
) -> dict:
    """Attention over qkrope's outputs (inp's q, k its inputs), by autograd: the gradients w.r.t. qkrope's input in
    dq, dk; its outputs y_q, y_k and statistics rstd (2, B*T, NH) for the op under test."""
    xq, xk, v = tt(inp["q"]), tt(inp["k"]), tt(inp["v"])
    (q, rq), (k, rk) = (torch_qkrope(x, rope, 0, n_head) for x in (xq, xk))
    out, lse = torch_attention(q, k, v, n_head, window, doc)
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"y_q": q, "y_k": k, "rstd": torch.stack([rq, rk]), "out": out, "lse": lse, "dq": xq.grad, "dk": xk.grad,
            "dv": v.grad}  # fmt: skip


def run_numpy(inp: dict, n_head: int, dtype, grads: dict, **mask) -> dict:
    q, k, v, dout = (inp[n].astype(dtype) for n in ("q", "k", "v", "dout"))
    B, T, C = q.shape
    out, lse = np.empty((B, T, C), dtype), np.empty((B, n_head, T), dtype)
    attention_forward(out, lse, q, k, v, n_head, **mask)
    attention_backward(grads["dq"], grads["dk"], grads["dv"], dout, q, k, v, out, lse, n_head, **mask)
    return {"out": out, "lse": lse, **grads}


def doc_tokens(rng: np.random.Generator, B: int, T: int, docs: int, eot: int = 0) -> np.ndarray:
    """(B, T) int32 tokens in 1 .. 9 with `docs` <|endoftext|> (eot) at random positions of each row (one of them
    at 0 in row 0, so that a row starting on a document and rows starting mid-document both occur)."""
    tokens = rng.integers(1, 10, (B, T)).astype(np.int32)
    for b in range(B):
        tokens[b, rng.choice(T, size=min(docs, T), replace=False)] = eot
    tokens[0, 0] = eot
    return tokens


def doc_start_of(tokens: np.ndarray, eot: int = 0) -> np.ndarray:
    out = np.empty(tokens.shape, np.int32)
    doc_starts(out, tokens, eot)
    return out


def test_doc_starts_is_the_last_endoftext_at_or_before_each_position() -> None:
    tokens = np.array([[5, 0, 3, 3, 0, 0, 7], [0, 2, 2, 2, 2, 2, 2], [4, 4, 4, 4, 4, 4, 0]], np.int32)
    out = np.full(tokens.shape, -1, np.int32)
    doc_starts(out, tokens, 0)
    assert out.tolist() == [[0, 1, 1, 1, 4, 5, 5], [0] * 7, [0, 0, 0, 0, 0, 0, 6]]
    doc_starts(out, tokens, 2)  # another eot id: the tokenizer's
    assert out.tolist()[1] == [0, 1, 2, 3, 4, 5, 6]


# (B, T, C, NH, window, documents a row): windows of 1, inside the row, at and past its length; with and without
# several documents a row
BOUNDED = [(2, 13, 12, 3, 4, 0), (2, 13, 12, 3, 1, 3), (1, 16, 8, 2, 16, 4), (3, 9, 6, 1, 40, 2),
           (2, 20, 16, 2, None, 5), (1, 7, 4, 1, 3, 7)]  # fmt: skip


@pytest.mark.parametrize("B,T,C,NH,window,docs", BOUNDED)
@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
def test_attention_window_and_documents(B, T, C, NH, window, docs, dtype, tol) -> None:
    """The pair with the mask narrowed by a window and document starts, both directions, against torch's explicit
    mask; dq, dk, dv written over noise."""
    rng = np.random.default_rng(70 + T * 3 + (window or 0) + docs)
    inp = {k: v.astype(dtype).astype(np.float64) for k, v in make_inputs(rng, B, T, C).items()}
    doc = doc_start_of(doc_tokens(rng, B, T, docs)) if docs else None
    mask = {"window": None if window is None else np.array([window], np.int32), "doc_start": doc}
    noise = {k: noise_like(rng, (B, T, C), dtype) for k in ("dq", "dk", "dv")}
    got = run_numpy(inp, NH, dtype, {k: v.copy() for k, v in noise.items()}, **mask)
    ref = torch_reference(inp, NH, window, doc)
    check_outputs_and_added_grads(got, ref, noise, ("out", "lse"), tol, written=("dq", "dk", "dv"))
    if window is not None and window < T:  # the mask did narrow: the causal attention differs
        causal = torch_reference(inp, NH)["out"].detach().numpy()
        assert np.abs(got["out"] - causal).max() > 1e-3


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_attention_float64(B: int, T: int, C: int, NH: int) -> None:
    rng = np.random.default_rng(800 + B * T * C + NH)
    inp = make_inputs(rng, B, T, C)
    noise = {k: noise_like(rng, (B, T, C), np.float64) for k in ("dq", "dk", "dv")}
    got = run_numpy(inp, NH, np.float64, {k: v.copy() for k, v in noise.items()})
    ref = torch_reference(inp, NH)
    check_outputs_and_added_grads(got, ref, noise, ("out", "lse"), F64_TOL, written=("dq", "dk", "dv"))


@pytest.mark.parametrize("B,T,C,NH", SHAPES)
def test_attention_float32(B: int, T: int, C: int, NH: int) -> None:
    rng = np.random.default_rng(900 + B * T * C + NH)
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, B, T, C).items()}
    got = run_numpy(inp, NH, np.float32, {k: noise_like(rng, (B, T, C), np.float32) for k in ("dq", "dk", "dv")})
    ref = torch_reference(inp, NH)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


# (B, Tmax, C, NH, pos, t): one query at a time (decode), a window inside the sequence (chat's new turn), a window
# from position 0 (prefill) and one filling the cache to its end
CACHED = [(2, 9, 12, 3, 5, 1), (1, 16, 8, 2, 7, 6), (3, 7, 10, 2, 0, 4), (2, 11, 6, 3, 3, 8)]


@pytest.mark.parametrize("B,Tmax,C,NH,pos,t", CACHED)
@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
def test_attention_cached_is_the_causal_attention_of_its_rows(B, Tmax, C, NH, pos, t, dtype, tol) -> None:
    """The inference step's attention: queries at positions pos .. pos + t - 1 over a cache holding the keys and
    values of positions 0 .. pos + t - 1 (and noise past them, which it must not read) are the rows pos .. pos + t
    - 1 of the causal attention over the whole sequence so far, against torch."""
    rng = np.random.default_rng(40 + pos * 7 + t)
    n = pos + t
    q_all, k_all, v_all = (rng.standard_normal((B, n, C)) for _ in range(3))
    kc, vc = rng.standard_normal((B, Tmax, C)) * 1e3, rng.standard_normal((B, Tmax, C)) * 1e3  # noise past n
    kc[:, :n], vc[:, :n] = k_all, v_all
    out = noise_like(rng, (B, t, C), dtype)
    attention_forward_cached(out, q_all[:, pos:].astype(dtype), kc.astype(dtype), vc.astype(dtype), pos, NH)
    ref = torch_reference({"q": q_all, "k": k_all, "v": v_all, "dout": np.zeros((B, n, C))}, NH)["out"]
    check("out", out, ref[:, pos:], tol)


@pytest.mark.parametrize(
    "pos,t,window,docs", [(5, 1, 3, 0), (7, 6, 4, 3), (0, 9, 2, 2), (3, 8, None, 4), (10, 1, 20, 3)]
)
def test_attention_cached_with_window_and_documents(pos, t, window, docs) -> None:
    """The cached attention's rows pos .. pos + t - 1 under a window and document starts are those rows of the
    training pair's over the whole sequence so far, against torch."""
    rng = np.random.default_rng(90 + pos + t)
    B, C, NH, Tmax, n = 2, 8, 2, 24, pos + t
    q_all, k_all, v_all = (rng.standard_normal((B, n, C)) for _ in range(3))
    kc, vc = rng.standard_normal((B, Tmax, C)) * 1e3, rng.standard_normal((B, Tmax, C)) * 1e3
    kc[:, :n], vc[:, :n] = k_all, v_all
    doc = doc_start_of(doc_tokens(rng, B, n, docs)) if docs else None
    out = np.empty((B, t, C))
    w = None if window is None else np.array([window], np.int32)
    attention_forward_cached(
        out, q_all[:, pos:], kc, vc, pos, NH, window=w, doc_start=None if doc is None else doc[:, pos:]
    )
    ref = torch_reference({"q": q_all, "k": k_all, "v": v_all, "dout": np.zeros((B, n, C))}, NH, window, doc)["out"]
    check("out", out, ref[:, pos:], F64_TOL)


# (B, T, C, NH, window, documents a row): head sizes 4, 6 (odd halves: 3 lanes), 8; causal, a window, documents, both
QKROPE = [(2, 7, 12, 3, None, 0), (1, 9, 6, 1, 3, 0), (2, 11, 16, 2, None, 2), (3, 5, 24, 3, 2, 1)]


@pytest.mark.parametrize("B,T,C,NH,window,docs", QKROPE)
@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
def test_attention_backward_through_qkrope(B, T, C, NH, window, docs, dtype, tol) -> None:
    """attention_backward with qkrope=(rstd, rope): dq, dk are the gradients w.r.t. qkrope's input (autograd of
    attention over qkrope's outputs), dv attention's own."""
    rng = np.random.default_rng(B * T + C + (window or 0) + docs)
    inp = make_inputs(rng, B, T, C)
    # random tables, 2 positions past T: R is then no rotation, and the backward must invert it all the same
    rope = np.random.default_rng(0).standard_normal((2, T + 2, C // NH // 2)).astype(np.float32)
    win = None if window is None else np.array([window], np.int32)
    doc = doc_start_of(doc_tokens(rng, B, T, docs)) if docs else None
    want = torch_qkrope_reference(inp, NH, rope, window, doc)
    y_q, y_k = (want[n].detach().numpy().astype(dtype) for n in ("y_q", "y_k"))
    rstd = want["rstd"].detach().numpy().astype(dtype)
    v, dout = inp["v"].astype(dtype), inp["dout"].astype(dtype)
    out, lse = np.empty((B, T, C), dtype), np.empty((B, NH, T), dtype)
    attention_forward(out, lse, y_q, y_k, v, NH, window=win, doc_start=doc)
    got = {n: np.full((B, T, C), np.nan, dtype) for n in ("dq", "dk", "dv")}
    attention_backward(
        got["dq"], got["dk"], got["dv"], dout, y_q, y_k, v, out, lse, NH, window=win, doc_start=doc,
        qkrope=(rstd, rope),
    )  # fmt: skip
    for n in got:
        check(n, got[n], want[n].detach().numpy(), tol)
