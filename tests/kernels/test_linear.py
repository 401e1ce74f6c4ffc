"""linear kernels (the GEMM sites of fp32/bf16/fp16 over the router: the Triton tile in the interpreter) against the
NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import linear as kl
from microgpt.kernels.gemm import cublas_mm
from microgpt.ops import linear as ref

from ._kutil import DEVICE, DTYPES, GEMM, MM, REF_MM, compare, rounded, t

SHAPES = [(37, 24, 40), (5, 3, 7), (64, 64, 96)]  # (N, C, OC): partial tiles in every dimension


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,OC", SHAPES)
def test_linear(N: int, C: int, OC: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N + C + OC)
    x, w, dout = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((C, OC)), dtype), None
    dout = rounded(rng.standard_normal((N, OC)), dtype)
    dx0, dw0 = rounded(rng.standard_normal((N, C)), dtype), rng.standard_normal((C, OC))
    out = np.empty((N, OC))
    ref.linear_forward(out, x, w, mm=REF_MM)
    dx, dw = dx0.copy(), dw0.copy()
    ref.linear_backward(dx, dw, dout, x, w, mm=REF_MM)
    gout = torch.empty(N, OC, dtype=dtype, device=DEVICE)
    kl.linear_forward(gout, t(x, dtype), t(w, dtype), mm=MM)
    compare("out", gout, out, dtype)
    gdx, gdw = t(dx0, dtype), t(dw0, torch.float32)  # weight grads are fp32 in every precision
    kl.linear_backward(gdx, gdw, t(dout, dtype), t(x, dtype), t(w, dtype), mm=MM)
    compare("dx", gdx, dx, dtype)
    compare("dw", gdw, dw, dtype)


def test_mm_transposed_accumulate() -> None:
    """mm takes strided (transposed) operands and adds into out when asked."""
    rng = np.random.default_rng(3)
    a, b, c0 = rng.standard_normal((19, 33)), rng.standard_normal((41, 19)), rng.standard_normal((33, 41))
    a, b, c0 = (rounded(z, torch.float32) for z in (a, b, c0))
    c = t(c0, torch.float32)
    GEMM.mm(c, t(a, torch.float32).t(), t(b, torch.float32).t(), accumulate=True)
    compare("c", c, c0 + a.T @ b.T, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_three_weights(dtype: torch.dtype) -> None:
    """The attention's input projection: w (3,C,OC), out (3,N,OC); dx written (the sum over the three), dw added."""
    rng = np.random.default_rng(11)
    N, C, OC = 37, 24, 24
    x, w = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((3, C, OC)), dtype)
    dout = rounded(rng.standard_normal((3, N, OC)), dtype)
    dx0, dw0 = rounded(rng.standard_normal((N, C)), dtype), rng.standard_normal((3, C, OC))
    out = np.empty((3, N, OC))
    ref.linear_forward(out, x, w, mm=REF_MM)
    dx, dw = dx0.copy(), dw0.copy()
    ref.linear_backward(dx, dw, dout, x, w, mm=REF_MM)
    gout = torch.empty(3, N, OC, dtype=dtype, device=DEVICE)
    kl.linear_forward(gout, t(x, dtype), t(w, dtype), mm=MM)
    compare("out", gout, out, dtype)
    gdx, gdw = t(dx0, dtype), t(dw0, torch.float32)
    kl.linear_backward(gdx, gdw, t(dout, dtype), t(x, dtype), t(w, dtype), mm=MM)
    compare("dx", gdx, dx, dtype)
    compare("dw", gdw, dw, dtype)


@pytest.mark.parametrize("batched", [False, True])
def test_torch_way_writes_and_adds_in_2d_and_batched(batched: bool) -> None:
    """gemm.cublas_mm (the "cublas" way: torch's mm/addmm, or bmm/baddbmm for a batch) writes a @ b, and adds it
    to what out held, against NumPy in float64 (on the CPU here; the GPU test runs it beside every other way)."""
    rng = np.random.default_rng(11)
    lead = (3,) if batched else ()
    a, b, start = (rng.standard_normal(lead + s) for s in ((5, 4), (4, 6), (5, 6)))
    out = torch.tensor(start, dtype=torch.float32)
    cublas_mm(out, torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), False)
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-5, atol=1e-5)
    out = torch.tensor(start, dtype=torch.float32)
    cublas_mm(out, torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), True)
    np.testing.assert_allclose(out.numpy(), start + a @ b, rtol=1e-5, atol=1e-5)
