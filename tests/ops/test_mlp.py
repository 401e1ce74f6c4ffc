"""mlp pair (x @ w1 -> act -> @ w2) against torch autograd, act GELU tanh (gelu(approximate="tanh")) or ReLU^2."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from microgpt.ops.linear import Matmul
from microgpt.ops.mlp import mlp_backward, mlp_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(21, 12), (1, 1), (7, 5), (3, 16)]  # (N, C); the hidden width is 4C
ACTS = {"gelu": lambda h: F.gelu(h, approximate="tanh"), "relu2": lambda h: F.relu(h).square()}


def make_inputs(rng: np.random.Generator, N: int, C: int) -> dict:
    return {
        "x": rng.standard_normal((N, C)),
        "w1": rng.standard_normal((C, 4 * C)),  # unit scale puts h across GELU's curved region
        "w2": rng.standard_normal((4 * C, C)) * 0.5,
        "dout": rng.standard_normal((N, C)),
    }


def torch_reference(inp: dict, act: str) -> dict:
    x, w1, w2 = tt(inp["x"]), tt(inp["w1"]), tt(inp["w2"])
    h = x @ w1
    out = ACTS[act](h) @ w2
    (out * torch.from_numpy(inp["dout"])).sum().backward()
    return {"out": out, "h": h, "dx": x.grad, "dw1": w1.grad, "dw2": w2.grad}


def run_numpy(inp: dict, dtype, grads: dict, rng: np.random.Generator, recompute: bool, act: str) -> dict:
    """The pair as the model runs it: with recompute, a is a scratch whose contents between the calls must not
    matter (backward recomputes a); without, a is kept from forward to backward (memory.act_output_saved)."""
    x, w1, w2, dout = (inp[k].astype(dtype) for k in ("x", "w1", "w2", "dout"))
    N, C = x.shape
    out, h = np.empty((N, C), dtype), np.empty((N, 4 * C), dtype)
    a = noise_like(rng, (N, 4 * C), dtype)  # forward writes a: its contents before must not matter
    mlp_forward(out, h, a, x, w1, w2, mm=Matmul(), act=act)
    if recompute:
        a[...] = noise_like(rng, (N, 4 * C), dtype)  # backward must recompute a, not trust forward's
    dh = noise_like(rng, (N, 4 * C), dtype)
    mm = Matmul()
    mlp_backward(
        grads["dx"], grads["dw1"], grads["dw2"], dout, x, h, w1, w2, a, dh, mm=mm, recompute=recompute, act=act
    )
    return {"out": out, "h": h, **grads}


def grad_shapes(inp: dict) -> dict:
    return {"dx": inp["x"].shape, "dw1": inp["w1"].shape, "dw2": inp["w2"].shape}


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("N,C", SHAPES)
def test_mlp_float64(N: int, C: int, recompute: bool, act: str) -> None:
    rng = np.random.default_rng(1100 + N * C)
    inp = make_inputs(rng, N, C)
    noise = {k: noise_like(rng, s, np.float64) for k, s in grad_shapes(inp).items()}
    got = run_numpy(inp, np.float64, {k: v.copy() for k, v in noise.items()}, rng, recompute, act)
    ref = torch_reference(inp, act)
    check_outputs_and_added_grads(got, ref, noise, ("out", "h"), F64_TOL, written=("dx",))


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("recompute", [False, True], ids=["a-kept", "a-recomputed"])
@pytest.mark.parametrize("N,C", SHAPES)
def test_mlp_float32(N: int, C: int, recompute: bool, act: str) -> None:
    rng = np.random.default_rng(1200 + N * C)
    inp = {k: v.astype(np.float32).astype(np.float64) for k, v in make_inputs(rng, N, C).items()}
    got = run_numpy(
        inp, np.float32, {k: np.zeros(s, np.float32) for k, s in grad_shapes(inp).items()}, rng, recompute, act
    )
    ref = torch_reference(inp, act)
    for k in ref:
        check(k, got[k], ref[k], F32_TOL)
