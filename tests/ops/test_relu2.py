"""relu2 pair against torch autograd (torch.relu(h) ** 2), the backward in place."""

import numpy as np
import pytest
import torch

from microgpt.ops.relu2 import relu2_backward, relu2_forward

from ._util import F32_TOL, F64_TOL, check, noise_like, tt

SHAPES = [(21, 48), (1, 5), (7, 37), (3, 130), (1, 1)]  # (N, 4C)


def make_inputs(rng: np.random.Generator, N: int, F: int) -> dict:
    h = rng.standard_normal((N, F)) * 2.0 - 0.3  # both signs, more negatives than positives
    h.flat[::11] = 0.0  # the kink: the gradient there is 0 on both sides
    return {"h": h, "da": rng.standard_normal((N, F))}


def torch_reference(inp: dict) -> dict:
    h = tt(inp["h"])
    a = torch.relu(h) ** 2
    (a * torch.from_numpy(inp["da"])).sum().backward()
    return {"a": a, "dh": h.grad}


def run_numpy(inp: dict, dtype, rng: np.random.Generator) -> dict:
    h, dh = inp["h"].astype(dtype), inp["da"].astype(dtype)  # dh holds the gradient reaching a, turned in place
    a = noise_like(rng, h.shape, dtype)  # forward writes with =
    relu2_forward(a, h)
    relu2_backward(dh, h)
    return {"a": a, "dh": dh}


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
@pytest.mark.parametrize("N,F", SHAPES)
def test_relu2(N: int, F: int, dtype, tol: float) -> None:
    rng = np.random.default_rng(8000 + N * F)
    inp = make_inputs(rng, N, F)
    if dtype == np.float32:
        inp = {k: v.astype(np.float32).astype(np.float64) for k, v in inp.items()}
    got = run_numpy(inp, dtype, rng)
    ref = torch_reference(inp)
    for k in ref:
        check(k, got[k], ref[k], tol)
