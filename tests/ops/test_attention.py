"""attention pair against an explicit causal masked softmax in torch autograd."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.attention import attention_backward, attention_forward, attention_forward_cached

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

# (B, T, C, NH): hs = 4, 1, 5, 6; T = 1 has a single unmasked key per row.
SHAPES = [(3, 7, 12, 3), (1, 1, 4, 1), (2, 13, 10, 2), (2, 16, 24, 4), (1, 5, 3, 3)]


def make_inputs(rng: np.random.Generator, B: int, T: int, C: int) -> dict:
    return {k: rng.standard_normal((B, T, C)) for k in ("q", "k", "v", "dout")}


def torch_reference(inp: dict, n_head: int) -> dict:
    q, k, v = tt(inp["q"]), tt(inp["k"]), tt(inp["v"])
    B, T, C = q.shape
    hs = C // n_head
    qh, kh, vh = (z.view(B, T, n_head, hs).transpose(1, 2) for z in (q, k, v))  # (B,NH,T,hs)
    scores = qh @ kh.transpose(-2, -1) / math.sqrt(hs)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B,NH,T)
    att = torch.softmax(scores, dim=-1)
    out = (att @ vh).transpose(1, 2).reshape(B, T, C)
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"out": out, "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_numpy(inp: dict, n_head: int, dtype, grads: dict) -> dict:
    q, k, v, dout = (inp[n].astype(dtype) for n in ("q", "k", "v", "dout"))
    B, T, C = q.shape
    out, lse = np.empty((B, T, C), dtype), np.empty((B, n_head, T), dtype)
    attention_forward(out, lse, q, k, v, n_head)
    attention_backward(grads["dq"], grads["dk"], grads["dv"], dout, q, k, v, out, lse, n_head)
    return {"out": out, "lse": lse, **grads}


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
