"""layernorm pair against torch autograd (F.layer_norm, eps 1e-5), and its fused residual entry point."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.ops.layernorm import EPS, layernorm_backward, layernorm_forward, residual_layernorm_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(21, 12), (1, 5), (7, 37), (3, 64)]  # (N, C)


def make_inputs(rng: np.random.Generator, N: int, C: int) -> dict:
    return {
        "x": rng.standard_normal((N, C)) * 2.0 + 0.5,  # offset and scale so mean and rstd matter
        "w": rng.standard_normal(C),
        "b": rng.standard_normal(C),
        "dout": rng.standard_normal((N, C)),
    }


def torch_reference(inp: dict) -> dict:
    x, w, b = tt(inp["x"]), tt(inp["w"]), tt(inp["b"])
    out = F.layer_norm(x, (x.shape[1],), w, b, eps=EPS)
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    var, mean = torch.var_mean(x.detach(), dim=1, unbiased=False)
    return {"out": out, "mean": mean, "rstd": 1.0 / torch.sqrt(var + EPS), "dx": x.grad, "dw": w.grad, "db": b.grad}


def run_numpy(inp: dict, dtype, grads: dict) -> dict:
    x, w, b, dout = (inp[k].astype(dtype) for k in ("x", "w", "b", "dout"))
    N, C = x.shape
    out, mean, rstd = np.empty((N, C), dtype), np.empty(N, dtype), np.empty(N, dtype)
    layernorm_forward(out, mean, rstd, x, w, b)
    layernorm_backward(grads["dx"], grads["dw"], grads["db"], dout, x, w, mean, rstd)
    return {"out": out, "mean": mean, "rstd": rstd, **grads}


def grad_shapes(N: int, C: int) -> dict:
    return {"dx": (N, C), "dw": (C,), "db": (C,)}


@pytest.mark.parametrize("N,C", SHAPES)
def test_layernorm_float64(N: int, C: int) -> None:
    rng = np.random.default_rng(1000 + N * C)
    inp = make_inputs(rng, N, C)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(N, C).items()}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()})
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("out", "mean", "rstd"), F64_TOL)


@pytest.mark.parametrize("N,C", SHAPES)
def test_layernorm_float32(N: int, C: int) -> None:
    rng = np.random.default_rng(2000 + N * C)
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, N, C).items()}
    got = run_numpy(inp, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(N, C).items()})
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,C", SHAPES)
def test_residual_layernorm_forward(N: int, C: int, dtype) -> None:
    """The residual add fused with the LayerNorm of its sum: s = x + y and out = layernorm(s) against torch, and
    bit for bit the two steps it replaces (the add, then layernorm_forward on the sum)."""
    rng = np.random.default_rng(3000 + N * C)
    inp = make_inputs(rng, N, C)
    y = rng.standard_normal((N, C)) * 0.7 - 0.2
    x, w, b = (inp[k].astype(dtype) for k in ("x", "w", "b"))
    got = {k: noise_like(rng, shape, dtype) for k, shape in (("s", (N, C)), ("out", (N, C)), ("mean", N), ("rstd", N))}
    residual_layernorm_forward(got["s"], got["out"], got["mean"], got["rstd"], x, y.astype(dtype), w, b)
    s = tt(inp["x"]) + tt(y)
    ref = {"s": s, "out": F.layer_norm(s, (C,), tt(inp["w"]), tt(inp["b"]), eps=EPS)}
    for k in ref:
        check(k, got[k], ref[k], F64_TOL if dtype == np.float64 else F32_TOL)
    two = {k: np.empty_like(v) for k, v in got.items()}
    np.add(x, y.astype(dtype), out=two["s"])
    layernorm_forward(two["out"], two["mean"], two["rstd"], two["s"], w, b)
    for k in got:
        np.testing.assert_array_equal(got[k], two[k], err_msg=k)
