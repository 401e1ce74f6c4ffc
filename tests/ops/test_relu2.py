"""relu2 pair against torch autograd (torch.relu(h) ** 2), the backward in place from the output a (2 sqrt(a)), and
fp8's backward from h (relu2_backward_h) with it; the forward also in place (a over h), as the modern MLP runs it."""

import numpy as np
import pytest
import torch

from microgpt.ops.relu2 import relu2_backward, relu2_backward_h, relu2_forward

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
    relu2_backward(dh, a)  # from a
    dh_h = inp["da"].astype(dtype)
    relu2_backward_h(dh_h, h)  # from h
    over = h.copy()
    relu2_forward(over, over)  # in place
    return {"a": a, "dh": dh, "dh from h": dh_h, "a in place": over}


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
@pytest.mark.parametrize("N,F", SHAPES)
def test_relu2(N: int, F: int, dtype, tol: float) -> None:
    rng = np.random.default_rng(8000 + N * F)
    inp = make_inputs(rng, N, F)
    if dtype == np.float32:
        inp = {k: v.astype(np.float32).astype(np.float64) for k, v in inp.items()}
    got = run_numpy(inp, dtype, rng)
    ref = torch_reference(inp)
    ref |= {"dh from h": ref["dh"], "a in place": ref["a"]}
    for k in ref:
        check(k, got[k], ref[k], tol)
    # sqrt(a) rounded to the dtype is max(h, 0) again: the two backwards agree bit for bit (ops/relu2.py)
    np.testing.assert_array_equal(got["dh"], got["dh from h"])
    np.testing.assert_array_equal(got["a"], got["a in place"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_slope_from_a_is_max_h_0_exactly(dtype) -> None:
    """2 sqrt(relu2(h)) = 2 max(h, 0) bit for bit where h^2 is a normal number of the dtype, across its exponents
    (ops/relu2.py's rounding argument; the GPU's bf16 and fp16 are checked over every value: tests/kernels)."""
    rng = np.random.default_rng(11)
    tiny, huge = np.finfo(dtype).tiny, np.finfo(dtype).max
    h = (rng.standard_normal(20000) * np.exp2(rng.uniform(-60, 60, 20000))).astype(dtype)
    h = h[(h * h >= tiny) & (h * h <= huge)]
    a = np.empty_like(h)
    relu2_forward(a, h)
    ones, ones_h = np.ones_like(h), np.ones_like(h)
    relu2_backward(ones, a)
    relu2_backward_h(ones_h, h)
    np.testing.assert_array_equal(ones, ones_h)
