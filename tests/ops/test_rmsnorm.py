"""rmsnorm pair against torch autograd (F.rms_norm without a weight, eps 1e-6), and its fused residual entry point."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.ops.rmsnorm import EPS, residual_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(21, 12), (1, 5), (7, 37), (3, 130)]  # (N, C); C = 1 is left out: there dx is eps-sized noise


def make_inputs(rng: np.random.Generator, N: int, C: int) -> dict:
    return {
        "x": rng.standard_normal((N, C)) * 2.0 + 0.5,  # offset and scale so the mean square matters
        "dout": rng.standard_normal((N, C)),
    }


def torch_reference(inp: dict) -> dict:
    x = tt(inp["x"])
    out = F.rms_norm(x, (x.shape[1],), eps=EPS)
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"out": out, "rstd": torch.rsqrt(x.detach().square().mean(1) + EPS), "dx": x.grad}


def run_numpy(inp: dict, dtype, grads: dict, rng: np.random.Generator) -> dict:
    x, dout = (inp[k].astype(dtype) for k in ("x", "dout"))
    N, C = x.shape
    out, rstd = noise_like(rng, (N, C), dtype), noise_like(rng, N, dtype)  # forward writes with =
    rmsnorm_forward(out, rstd, x)
    rmsnorm_backward(grads["dx"], dout, x, rstd)
    return {"out": out, "rstd": rstd, **grads}


@pytest.mark.parametrize("N,C", SHAPES)
def test_rmsnorm_float64(N: int, C: int) -> None:
    rng = np.random.default_rng(4000 + N * C)
    inp = make_inputs(rng, N, C)
    noise = {"dx": noise_like(rng, (N, C), np.float64)}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()}, rng)
    ref = torch_reference(inp)
    check_outputs_and_added_grads(got, ref, noise, ("out", "rstd"), F64_TOL)


@pytest.mark.parametrize("N,C", SHAPES)
def test_rmsnorm_float32(N: int, C: int) -> None:
    rng = np.random.default_rng(5000 + N * C)
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, N, C).items()}
    got = run_numpy(inp, np.float32, {"dx": np.zeros((N, C), np.float32)}, rng)
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,C", SHAPES)
def test_residual_rmsnorm_forward(N: int, C: int, dtype) -> None:
    """The residual add fused with the RMSNorm of its sum: s = x + y and out = rmsnorm(s) against torch, and bit for
    bit the two steps it replaces (the add, then rmsnorm_forward on the sum)."""
    rng = np.random.default_rng(6000 + N * C)
    x, y = rng.standard_normal((N, C)) * 2.0 + 0.5, rng.standard_normal((N, C)) * 0.7 - 0.2
    got = {k: noise_like(rng, shape, dtype) for k, shape in (("s", (N, C)), ("out", (N, C)), ("rstd", N))}
    residual_rmsnorm_forward(got["s"], got["out"], got["rstd"], x.astype(dtype), y.astype(dtype))
    s = tt(x) + tt(y)
    ref = {"s": s, "out": F.rms_norm(s, (C,), eps=EPS)}
    for k in ref:
        check(k, got[k], ref[k], F64_TOL if dtype == np.float64 else F32_TOL)
    two = {k: np.empty_like(v) for k, v in got.items()}
    np.add(x.astype(dtype), y.astype(dtype), out=two["s"])
    rmsnorm_forward(two["out"], two["rstd"], two["s"])
    for k in got:
        np.testing.assert_array_equal(got[k], two[k], err_msg=k)
