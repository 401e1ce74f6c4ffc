"""embedding pair against torch autograd (indexing wte and wpe, or wte alone: no position table)."""

import numpy as np
import pytest
import torch

from microgpt.ops.embedding import embedding_add_forward, embedding_backward, embedding_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

# (B, T, C, V, Tmax): odd and prime sizes; V < B*T forces repeated tokens (the scatter-add must sum them);
# Tmax > T leaves wpe rows that must get no gradient.
SHAPES = [(3, 7, 12, 37, 11), (1, 1, 5, 3, 1), (2, 13, 8, 5, 16), (4, 16, 3, 1, 16)]


def make_inputs(rng: np.random.Generator, B: int, T: int, C: int, V: int, Tmax: int) -> dict:
    return {
        "tokens": rng.integers(0, V, size=(B, T)).astype(np.int32),
        "wte": rng.standard_normal((V, C)),
        "wpe": rng.standard_normal((Tmax, C)),
        "dout": rng.standard_normal((B, T, C)),
    }


def torch_reference(inp: dict) -> dict:
    wte, wpe = tt(inp["wte"]), tt(inp["wpe"])
    tokens = torch.from_numpy(inp["tokens"]).long()
    out = wte[tokens] + wpe[: tokens.shape[1]]
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"out": out, "dwte": wte.grad, "dwpe": wpe.grad}


def run_numpy(inp: dict, dtype, grads: dict) -> dict:
    tokens = inp["tokens"]
    wte, wpe, dout = (inp[k].astype(dtype) for k in ("wte", "wpe", "dout"))
    out = np.empty(dout.shape, dtype)
    embedding_forward(out, tokens, wte, wpe)
    embedding_backward(grads["dwte"], grads["dwpe"], dout, tokens)
    return {"out": out, **grads}


def grad_shapes(inp: dict) -> dict:
    return {"dwte": inp["wte"].shape, "dwpe": inp["wpe"].shape}


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_without_positions(B: int, T: int, C: int, V: int, Tmax: int, dtype, tol: float) -> None:
    """wpe None (the modern block): out = wte[tokens], dwte += the scatter of dout, nothing else."""
    rng = np.random.default_rng(400 + B * T * C + V)
    inp = make_inputs(rng, B, T, C, V, Tmax)
    inp = {k: (v.astype(dtype).astype(np.float64) if v.dtype == np.float64 else v) for k, v in inp.items()}
    wte, tokens = tt(inp["wte"]), torch.from_numpy(inp["tokens"]).long()
    ref = wte[tokens]
    (ref * torch.from_numpy(inp["dout"])).sum().backward()
    noise = noise_like(rng, inp["wte"].shape, dtype)
    out, dwte = noise_like(rng, inp["dout"].shape, dtype), noise.copy()
    embedding_forward(out, inp["tokens"], inp["wte"].astype(dtype))
    embedding_backward(dwte, None, inp["dout"].astype(dtype), inp["tokens"])
    check("out", out, ref, tol)
    check("dwte", dwte - noise, wte.grad, tol)


@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_float64(B: int, T: int, C: int, V: int, Tmax: int) -> None:
    rng = np.random.default_rng(100 + B * T * C + V)
    inp = make_inputs(rng, B, T, C, V, Tmax)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()})
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("out",), F64_TOL)
    np.testing.assert_array_equal(got["dwpe"][T:], noise["dwpe"][T:])  # rows past T untouched


@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_float32(B: int, T: int, C: int, V: int, Tmax: int) -> None:
    rng = np.random.default_rng(200 + B * T * C + V)
    inp = make_inputs(rng, B, T, C, V, Tmax)
    inp = {k: (v.astype(np.float32).astype(np.float64) if v.dtype == np.float64 else v) for k, v in inp.items()}
    got = run_numpy(inp, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()})
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


def test_embedding_backward_is_deterministic() -> None:
    """Many repeats of each token (V = 3, 512 positions): two runs give bitwise-equal dwte."""
    rng = np.random.default_rng(300)
    inp = make_inputs(rng, 8, 64, 16, 3, 64)
    runs = [
        run_numpy(inp, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()}) for _ in range(2)
    ]
    np.testing.assert_array_equal(runs[0]["dwte"], runs[1]["dwte"])


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
@pytest.mark.parametrize("B,T,C,V,Tmax", SHAPES)
def test_embedding_add(B: int, T: int, C: int, V: int, Tmax: int, dtype, tol: float) -> None:
    """The value embeddings' pair: out += table[tokens] over (N, C) rows, and its backward, embedding_backward without
    wpe, against autograd of v + table[tokens] (the upstream gradient reaches v unchanged and the table by scatter)."""
    rng = np.random.default_rng(500 + B * T * C + V)
    inp = make_inputs(rng, B, T, C, V, Tmax)
    inp = {k: (v.astype(dtype).astype(np.float64) if v.dtype == np.float64 else v) for k, v in inp.items()}
    v0 = rng.standard_normal((B * T, C)).astype(dtype)
    table, tokens = tt(inp["wte"]), torch.from_numpy(inp["tokens"]).long()
    v = tt(v0.astype(np.float64))
    ref = v + table[tokens.reshape(-1)]
    (ref * torch.from_numpy(inp["dout"]).reshape(B * T, C)).sum().backward()
    noise = noise_like(rng, inp["wte"].shape, dtype)
    out, dtable = v0.copy(), noise.copy()
    embedding_add_forward(out, inp["tokens"], inp["wte"].astype(dtype))
    embedding_backward(dtable, None, inp["dout"].astype(dtype), inp["tokens"])
    check("out", out, ref, tol)
    check("dtable", dtable - noise, table.grad, tol)
    check("dv", inp["dout"].reshape(B * T, C), v.grad, tol)  # what the caller's dv keeps: the add passes it through
