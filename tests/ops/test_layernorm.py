"""layernorm pair against torch autograd (F.layer_norm, eps 1e-5)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.ops.layernorm import EPS, layernorm_backward, layernorm_forward

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
