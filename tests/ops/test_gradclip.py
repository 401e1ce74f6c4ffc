"""The gradient norm on one flat vector against torch.nn.utils.clip_grad_norm_ over several tensors (the clip
factor itself is applied by AdamW: tests/ops/test_adamw.py)."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.gradclip import grad_norm_final, grad_norm_partial

from ._util import F32_TOL, F64_TOL, check

SHAPES = [(5, 7), (13,), (3, 4, 2), (1,)]  # n = 73 elements in all: prime, so no block size > 1 divides it
BLOCK = 16


def norm_flat(g: np.ndarray, block: int) -> float:
    """The step's sequence: partial sums, then the final norm."""
    partials = np.full(math.ceil(g.shape[0] / block), np.nan, g.dtype)
    norm = np.full(1, np.nan, g.dtype)
    grad_norm_partial(partials, g, block)
    grad_norm_final(norm, partials)
    return float(norm[0])


@pytest.mark.parametrize("block", [1, 7, 16, 73, 100])
def test_grad_norm_partial(block: int) -> None:
    rng = np.random.default_rng(1600 + block)
    g = rng.standard_normal(73)
    partials = np.full(math.ceil(73 / block), np.nan)  # every slot must be written
    grad_norm_partial(partials, g, block)
    expected = [np.sum(g[i : i + block] ** 2) for i in range(0, 73, block)]
    check("partials", partials, np.array(expected), F64_TOL)


def test_norm_matches_torch_over_steps() -> None:
    rng = np.random.default_rng(1700)
    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    for step, scale in enumerate([0.01, 3.0, 0.05, 10.0, 0.2, 1.7]):
        grads = [rng.standard_normal(s) * scale / 4 for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        ref_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        check(f"norm step {step}", norm_flat(np.concatenate([g.reshape(-1) for g in grads]), BLOCK), ref_norm, F64_TOL)


@pytest.mark.parametrize("scale", [0.05, 5.0])
def test_norm_float32(scale: float) -> None:
    rng = np.random.default_rng(1800)
    g64 = (rng.standard_normal(73) * scale).astype(np.float32).astype(np.float64)
    check("norm", norm_flat(g64.astype(np.float32), BLOCK), norm_flat(g64, BLOCK), F32_TOL)
