"""skip pair (the modern block's U-net skip connections) against torch autograd: y = x + w s, and its backward's
ds += w dy, dw += sum(dy s), dx = dy itself; in place (y is x) and with ds the very dy (s = x, nothing between)."""

import numpy as np
import pytest
import torch

from microgpt.ops.skip import skip_backward, skip_forward

from ._util import F32_TOL, F64_TOL, check, check_outputs_and_added_grads, noise_like, tt

SHAPES = [(21, 12), (1, 5), (7, 37), (3, 130)]  # (N, C)


def torch_reference(x0: np.ndarray, s0: np.ndarray, w0: np.ndarray, dout: np.ndarray) -> dict:
    x, s, w = tt(x0), tt(s0), tt(w0)
    y = x + w * s
    (y * torch.from_numpy(dout)).sum().backward()
    return {"y": y, "dx": x.grad, "ds": s.grad, "dw": w.grad}


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
@pytest.mark.parametrize("N,C", SHAPES)
def test_skip(N: int, C: int, dtype, tol: float) -> None:
    """Forward in place on x (the model's way) and backward adding into noise-filled ds and dw."""
    rng = np.random.default_rng(7000 + N * C)
    x, s, dout = (rng.standard_normal((N, C)).astype(dtype) for _ in range(3))
    w = np.array([rng.uniform(0.3, 1.7)], dtype)
    ref = torch_reference(x, s, w, dout)
    noise = {"ds": noise_like(rng, (N, C), dtype), "dw": noise_like(rng, (1,), dtype)}
    got = {k: v.copy() for k, v in noise.items()}
    y = x.copy()
    skip_forward(y, y, s, w)
    skip_backward(got["ds"], got["dw"], dout, s, w)
    check_outputs_and_added_grads({**got, "y": y}, ref, noise, ("y",), tol)
    check("dx", dout, ref["dx"], tol)  # the caller's dy is dx: the add passes it through


@pytest.mark.parametrize("dtype, tol", [(np.float64, F64_TOL), (np.float32, F32_TOL)])
def test_skip_of_its_own_input(dtype, tol: float) -> None:
    """s = x (a layer adding the stream it is fed: 2k = L), y = (1 + w) x: the backward with ds the very dy buffer
    leaves the whole input gradient dy + w dy there, and dw reads dy before it is added to."""
    rng = np.random.default_rng(7100)
    x, dout = (rng.standard_normal((9, 14)).astype(dtype) for _ in range(2))
    w = np.array([0.8], dtype)
    xt, wt = tt(x), tt(w)
    y_ref = xt + wt * xt
    (y_ref * torch.from_numpy(dout)).sum().backward()
    y, d, dw = np.empty_like(x), dout.copy(), np.zeros(1, dtype)
    skip_forward(y, x, x, w)
    skip_backward(d, dw, d, x, w)
    check("y", y, y_ref, tol)
    check("dx", d, xt.grad, tol)
    check("dw", dw, wt.grad, tol)


def test_skip_backward_is_the_same_bits_every_time() -> None:
    """dw's reduction order is fixed: two runs on the same inputs give bitwise-equal dw and ds."""
    rng = np.random.default_rng(7200)
    dy, s = (rng.standard_normal((513, 65)).astype(np.float32) for _ in range(2))
    w = np.array([1.25], np.float32)
    runs = []
    for _ in range(2):
        ds, dw = np.zeros_like(dy), np.zeros(1, np.float32)
        skip_backward(ds, dw, dy, s, w)
        runs.append((ds, dw))
    np.testing.assert_array_equal(runs[0][0], runs[1][0])
    np.testing.assert_array_equal(runs[0][1], runs[1][1])
