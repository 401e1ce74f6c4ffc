"""residual pair against torch autograd."""

import numpy as np
import pytest

from microgpt.ops.residual import residual_backward, residual_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(3, 7, 12), (1, 1, 1), (2, 13, 37)]  # (B, T, C)


def make_inputs(rng: np.random.Generator, shape: tuple) -> dict:
    return {k: rng.standard_normal(shape) for k in ("x", "y", "dout")}


def torch_reference(inp: dict) -> dict:
    x, y = tt(inp["x"]), tt(inp["y"])
    out = x + y
    (out * tt(inp["dout"]).detach()).sum().backward()
    return {"out": out, "dx": x.grad, "dy": y.grad}


def run_numpy(inp: dict, dtype, grads: dict) -> dict:
    x, y, dout = (inp[k].astype(dtype) for k in ("x", "y", "dout"))
    out = np.empty(x.shape, dtype)
    residual_forward(out, x, y)
    residual_backward(grads["dx"], grads["dy"], dout)
    return {"out": out, **grads}


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_float64(shape: tuple) -> None:
    rng = np.random.default_rng(600 + int(np.prod(shape)))
    inp = make_inputs(rng, shape)
    noise = {k: noise_like(rng, shape, np.float64) for k in ("dx", "dy")}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()})
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("out",), F64_TOL)


@pytest.mark.parametrize("shape", SHAPES)
def test_residual_float32(shape: tuple) -> None:
    rng = np.random.default_rng(700 + int(np.prod(shape)))
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, shape).items()}
    got = run_numpy(inp, np.float32, {k: np.zeros(shape, np.float32) for k in ("dx", "dy")})
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)
