"""skip kernels (k_skip_fwd, k_skip_bwd and its dw sum) against the NumPy pair, in place as the model calls them."""

import numpy as np
import pytest
import torch

from microgpt.kernels import skip as ks
from microgpt.ops import skip as ref

from ._kutil import DTYPES, SMS, compare, rounded, t

# (N, C): odd widths and a size past one tile, and one large enough that every program of the backward sums several
# tiles (per_prog > BLOCK) while the last program's run is short
SHAPES = [(7, 37), (1, 5), (33, 64), (40, 130), (3 * SMS * ks.PARTS_PER_SM + 5, 1000)]


def partials() -> torch.Tensor:
    return torch.full((ks.scratch_numel(SMS),), float("nan"), device=t(np.zeros(1)).device)  # overwritten first


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C", SHAPES)
def test_skip(N: int, C: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * C + 3)
    x, s, dy, ds0 = (rounded(rng.standard_normal((N, C)), dtype) for _ in range(4))
    w = rounded(np.array([rng.uniform(0.3, 1.7)]), dtype)
    y, ds, dw = x.copy(), ds0.copy(), np.array([0.7])
    ref.skip_forward(y, y, s, w)
    ref.skip_backward(ds, dw, dy, s, w)

    gy, gw = t(x, dtype), t(w, dtype)
    ks.skip_forward(gy, gy, t(s, dtype), gw)
    compare("y", gy, y, dtype)
    gds, gdw = t(ds0, dtype), t(np.array([0.7], np.float32))
    ks.skip_backward(gds, gdw, t(dy, dtype), t(s, dtype), gw, partials=partials())
    compare("ds", gds, ds, dtype)
    compare("dw", gdw, dw, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skip_of_its_own_input(dtype: torch.dtype) -> None:
    """ds the very dy buffer (the stream a layer adds is its own input): dw from dy as it was, then dy + w dy."""
    rng = np.random.default_rng(8)
    x, dy = (rounded(rng.standard_normal((9, 70)), dtype) for _ in range(2))
    w = rounded(np.array([0.8]), dtype)
    d, dw = dy.copy(), np.zeros(1)
    ref.skip_backward(d, dw, d, x, w)
    gd, gdw = t(dy, dtype), t(np.zeros(1, np.float32))
    ks.skip_backward(gd, gdw, gd, t(x, dtype), t(w, dtype), partials=partials())
    compare("dx", gd, d, dtype)
    compare("dw", gdw, dw, torch.float32)


def test_skip_backward_is_deterministic() -> None:
    """Two runs on the same inputs: bitwise-equal ds and dw (no atomics; the partial sums added in a fixed order)."""
    rng = np.random.default_rng(9)
    N, C = 2 * SMS * ks.PARTS_PER_SM + 3, 512
    dy, s = (t(rng.standard_normal((N, C)), torch.float32) for _ in range(2))
    w = t(np.array([1.25], np.float32))
    runs = []
    for _ in range(2):
        ds, dw = torch.zeros_like(dy), t(np.zeros(1, np.float32))
        ks.skip_backward(ds, dw, dy, s, w, partials=partials())
        runs.append((ds, dw))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
