"""rmsnorm kernels (k_rmsnorm_fwd/bwd, and the residual add fused into the forward) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import rmsnorm as kr
from microgpt.ops import rmsnorm as ref

from ._kutil import DTYPES, TUNER, compare, rounded, t

SHAPES = [(7, 37), (33, 64), (1, 5), (40, 130)]  # (N, C): odd widths exercise the column masks, 33 and 7 the rows'


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_rmsnorm(N: int, C: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * C + 1)
    x, dout = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(2))
    dx0 = rounded(rng.standard_normal((N, C)), dtype)  # noise the backward adds to
    out, rstd = np.empty((N, C)), np.empty(N)
    ref.rmsnorm_forward(out, rstd, x)
    dx = dx0.copy()
    ref.rmsnorm_backward(dx, dout, x, rstd)

    gout, grstd = t(rng.standard_normal((N, C)), dtype), t(rng.standard_normal(N).astype(np.float32))  # overwritten
    kr.rmsnorm_forward(gout, grstd, t(x, dtype), tuner=TUNER)
    compare("out", gout, out, dtype)
    compare("rstd", grstd, rstd, torch.float32)
    gdx = t(dx0, dtype)
    kr.rmsnorm_backward(gdx, t(dout, dtype), t(x, dtype), grstd, tuner=TUNER)
    compare("dx", gdx, dx, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_residual_rmsnorm_forward(N: int, C: int, dtype: torch.dtype) -> None:
    """The fused kernel against the NumPy RMSNorm of the rounded sum (tests/ops checks the NumPy entry point), and
    byte for byte against the add then k_rmsnorm_fwd reading the sum."""
    rng = np.random.default_rng(N * C + 2)
    x, y = (rounded(rng.standard_normal((N, C)) * 2 + 0.5, dtype) for _ in range(2))
    s = rounded(x + y, dtype)  # the kernel stores the sum in dtype and normalizes it as stored
    out, rstd = np.empty((N, C)), np.empty(N)
    ref.rmsnorm_forward(out, rstd, s)
    gx, gy = t(x, dtype), t(y, dtype)

    def run(fused: bool) -> list[torch.Tensor]:
        gs, gout = t(rng.standard_normal((N, C)), dtype), t(rng.standard_normal((N, C)), dtype)  # overwritten
        grstd = t(rng.standard_normal(N).astype(np.float32))
        if fused:
            kr.residual_rmsnorm_forward(gs, gout, grstd, gx, gy, tuner=TUNER)
        else:
            torch.add(gx, gy, out=gs)  # the add in the operands' dtype, as the fused kernel rounds it
            kr.rmsnorm_forward(gout, grstd, gs, tuner=TUNER)
        return [gs, gout, grstd]

    fused, two = run(True), run(False)
    for name, got, want in zip(("s", "out", "rstd"), fused, (s, out, rstd)):
        compare(name, got, want, dtype if name != "rstd" else torch.float32)
    for name, a, c in zip(("s", "out", "rstd"), fused, two):
        assert torch.equal(a, c), f"{name}: the fused kernel differs from the add + rmsnorm"
