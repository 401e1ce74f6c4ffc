"""residual kernels against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import residual as kr
from microgpt.ops import residual as ref

from ._kutil import DEVICE, DTYPES, compare, rounded, t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3), (64, 97)])
def test_residual(shape: tuple, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(sum(shape))
    x, y, dout, dx0, dy0 = (rounded(rng.standard_normal(shape), dtype) for _ in range(5))
    out = np.empty(shape)
    ref.residual_forward(out, x, y)
    dx, dy = dx0.copy(), dy0.copy()
    ref.residual_backward(dx, dy, dout)
    gout = torch.empty(shape, dtype=dtype, device=DEVICE)
    kr.residual_forward(gout, t(x, dtype), t(y, dtype))
    compare("out", gout, out, dtype)
    gdx, gdy = t(dx0, dtype), t(dy0, dtype)
    kr.residual_backward(gdx, gdy, t(dout, dtype))
    compare("dx", gdx, dx, dtype)
    compare("dy", gdy, dy, dtype)
