"""linear pair (no bias, weight stored [in, out]) against torch autograd."""

import numpy as np
import pytest

from microgpt.ops.linear import Matmul, linear_backward, linear_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(21, 12, 36), (1, 1, 1), (7, 13, 5), (3, 12, 12)]  # (N, C, OC)


def make_inputs(rng: np.random.Generator, N: int, C: int, OC: int) -> dict:
    return {
        "x": rng.standard_normal((N, C)),
        "w": rng.standard_normal((C, OC)) * 0.5,
        "dout": rng.standard_normal((N, OC)),
    }


def torch_reference(inp: dict) -> dict:
    x, w = tt(inp["x"]), tt(inp["w"])
    out = x @ w
    (out * tt(inp["dout"]).detach()).sum().backward()
    return {"out": out, "dx": x.grad, "dw": w.grad}


def run_numpy(inp: dict, dtype, grads: dict) -> dict:
    x, w, dout = (inp[k].astype(dtype) for k in ("x", "w", "dout"))
    out = np.empty(dout.shape, dtype)
    linear_forward(out, x, w, mm=Matmul())
    linear_backward(grads["dx"], grads["dw"], dout, x, w, mm=Matmul())
    return {"out": out, **grads}


def grad_shapes(inp: dict) -> dict:
    return {"dx": inp["x"].shape, "dw": inp["w"].shape}


@pytest.mark.parametrize("N,C,OC", SHAPES)
def test_linear_float64(N: int, C: int, OC: int) -> None:
    rng = np.random.default_rng(400 + N * C * OC)
    inp = make_inputs(rng, N, C, OC)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()})
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("out",), F64_TOL, written=("dx",))


@pytest.mark.parametrize("N,C,OC", SHAPES)
def test_linear_float32(N: int, C: int, OC: int) -> None:
    rng = np.random.default_rng(500 + N * C * OC)
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, N, C, OC).items()}
    got = run_numpy(inp, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()})
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)
