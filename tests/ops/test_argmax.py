"""The greedy pick (ops/argmax.py) against torch.argmax: random rows, ties (the first index wins), a row of -inf, a
row of ties all along, NaN (the first NaN wins, as in torch and NumPy), a row of one value, ANDREA's vocabulary."""

import numpy as np
import pytest
import torch

from microgpt.ops.argmax import argmax_rows


def rows(b: int, V: int, seed: int) -> np.ndarray:
    """b random rows of V values, with the awkward cases in the first rows where there are enough."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, V))
    if b >= 5 and V >= 8:
        x[0, [2, 5, V - 1]] = 9.0  # a three-way tie for the largest: index 2
        x[1] = -np.inf  # nothing but -inf: index 0
        x[2] = 1.5  # all equal: index 0
        x[3, [V // 2, V - 2]] = np.nan  # the first NaN
        x[4, V - 1] = np.inf
    return x


@pytest.mark.parametrize("b,V", [(1, 1), (1, 7), (5, 8), (6, 1000), (3, 50304)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_argmax_rows_is_torchs(b: int, V: int, dtype: type) -> None:
    x = rows(b, V, b * V).astype(dtype)
    out = np.full(b, -7, np.int32)
    argmax_rows(out, x)
    np.testing.assert_array_equal(out, torch.argmax(torch.from_numpy(x), dim=1).numpy())
