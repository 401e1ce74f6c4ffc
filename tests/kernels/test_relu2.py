"""relu2 kernels (k_relu2_fwd, k_relu2_bwd in place) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import relu2 as kr
from microgpt.ops import relu2 as ref

from ._kutil import DTYPES, compare, rounded, t

SHAPES = [(7, 37), (33, 64), (1, 5), (3, 1500)]  # (N, 4C): 4500 elements span three programs, the last one short


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,F", SHAPES)
def test_relu2(N: int, F: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * F + 3)
    h, da = rounded(rng.standard_normal((N, F)) * 2 - 0.3, dtype), rounded(rng.standard_normal((N, F)), dtype)
    h.flat[::11] = 0.0
    a, dh = np.empty((N, F)), da.copy()
    ref.relu2_forward(a, h)
    ref.relu2_backward(dh, h)

    ga, gdh = t(rng.standard_normal((N, F)), dtype), t(da, dtype)  # ga: noise the forward overwrites
    kr.relu2_forward(ga, t(h, dtype))
    kr.relu2_backward(gdh, t(h, dtype))
    compare("a", ga, a, dtype)
    compare("dh", gdh, dh, dtype)
