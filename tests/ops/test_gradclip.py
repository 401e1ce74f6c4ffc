"""Gradient clipping helpers on one flat vector against torch.nn.utils.clip_grad_norm_ over several tensors."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.gradclip import clip_coef, grad_norm_final, grad_norm_partial, grad_scale

from ._util import F32_TOL, F64_TOL, check

SHAPES = [(5, 7), (13,), (3, 4, 2), (1,)]  # n = 73 elements in all: prime, so no block size > 1 divides it
BLOCK = 16


def clip_flat(g: np.ndarray, max_norm: float, block: int) -> tuple[float, float]:
    """The engine's sequence: partial sums, final norm, coefficient, scale. Returns (norm, coef)."""
    partials = np.empty(math.ceil(g.shape[0] / block), g.dtype)
    norm = np.empty(1, g.dtype)
    grad_norm_partial(partials, g, block)
    grad_norm_final(norm, partials)
    coef = clip_coef(norm, max_norm)
    grad_scale(g, coef)
    return float(norm[0]), coef


@pytest.mark.parametrize("block", [1, 7, 16, 73, 100])
def test_grad_norm_partial(block: int) -> None:
    rng = np.random.default_rng(1600 + block)
    g = rng.standard_normal(73)
    partials = np.full(math.ceil(73 / block), np.nan)  # every slot must be written
    grad_norm_partial(partials, g, block)
    expected = [np.sum(g[i : i + block] ** 2) for i in range(0, 73, block)]
    check("partials", partials, np.array(expected), F64_TOL)


def test_clip_matches_torch_over_steps() -> None:
    """Several steps, alternating a norm under max_norm (coef exactly 1) and one over it (coef < 1)."""
    rng = np.random.default_rng(1700)
    params = [torch.zeros(s, dtype=torch.float64, requires_grad=True) for s in SHAPES]
    max_norm = 1.0
    for step, scale in enumerate([0.01, 3.0, 0.05, 10.0, 0.2, 1.7]):
        grads = [rng.standard_normal(s) * scale / 4 for s in SHAPES]
        flat = np.concatenate([g.reshape(-1) for g in grads])
        for p, g in zip(params, grads):
            p.grad = torch.from_numpy(g.copy())
        ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        norm, coef = clip_flat(flat, max_norm, BLOCK)
        check(f"norm step {step}", norm, ref_norm, F64_TOL)
        assert (coef == 1.0) == (float(ref_norm) < max_norm), f"step {step}: coef {coef}, norm {float(ref_norm)}"
        check(f"grads step {step}", flat, torch.cat([p.grad.reshape(-1) for p in params]), F64_TOL)


@pytest.mark.parametrize("scale", [0.05, 5.0])
def test_clip_float32(scale: float) -> None:
    rng = np.random.default_rng(1800)
    g64 = (rng.standard_normal(73) * scale).astype(np.float32).astype(np.float64)
    g32 = g64.astype(np.float32)
    norm64, coef64 = clip_flat(g64, 1.0, BLOCK)
    norm32, coef32 = clip_flat(g32, 1.0, BLOCK)
    check("norm", norm32, norm64, F32_TOL)
    check("coef", coef32, coef64, F32_TOL)
    check("grads", g32, g64, F32_TOL)
    assert g32.dtype == np.float32
