"""gradclip (k_grad_norm_partial/final, k_grad_scale) and k_adamw against the NumPy helpers."""

import numpy as np
import pytest
import torch

from microgpt.kernels import adamw as ka
from microgpt.kernels import gradclip as kg
from microgpt.ops import adamw as ref_adamw
from microgpt.ops import gradclip as ref_clip

from ._kutil import DEVICE, compare, h, t

F32 = torch.float32


@pytest.mark.parametrize("n,block", [(5000, 1024), (3001, 777), (10, 4096)])
def test_grad_norm_and_scale(n: int, block: int) -> None:
    rng = np.random.default_rng(n)
    g = rng.standard_normal(n).astype(np.float32).astype(np.float64)
    P = -(-n // block)
    part, norm = np.empty(P), np.empty(1)
    ref_clip.grad_norm_partial(part, g, block)
    ref_clip.grad_norm_final(norm, part)
    gg, gpart, gnorm = t(g, F32), torch.empty(P, dtype=F32, device=DEVICE), torch.empty(1, dtype=F32, device=DEVICE)
    kg.grad_norm_partial(gpart, gg, block)
    compare("partials", gpart, part, F32)
    kg.grad_norm_final(gnorm, gpart)
    compare("norm", gnorm, norm, F32)
    assert abs(kg.clip_coef(gnorm, 1.0) - ref_clip.clip_coef(norm, 1.0)) < 1e-6
    kg.grad_scale(gg, 0.25)
    compare("scaled", gg, g * 0.25, F32)
    # on-device clip (graph path): scale 0.5 then clip to max_norm 1.0 from the unscaled norm
    gg2 = t(g, F32)
    kg.grad_scale(gg2, 0.5, norm=gnorm, max_norm=1.0)
    compare("clipped", gg2, g * 0.5 * min(1.0, 1.0 / (norm[0] * 0.5 + 1e-6)), F32)


def _state(rng, n):
    p, g = rng.standard_normal(n), rng.standard_normal(n) * 0.1
    m, v = rng.standard_normal(n) * 0.01, rng.random(n) * 1e-3
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    return p, g, m, v, mask


def test_adamw() -> None:
    rng = np.random.default_rng(1)
    n = 3001
    p, g, m, v, mask = (
        a.astype(np.float32).astype(a.dtype if a.dtype == np.uint8 else np.float64) for a in _state(rng, n)
    )
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    ref_adamw.adamw_step(rp, g, rm, rv, mask, 1e-3, 0.9, 0.95, 1e-8, 0.1, 7)
    gp, gm, gv, lp = t(p, F32), t(m, F32), t(v, F32), torch.empty(n, dtype=torch.float16, device=DEVICE)
    gg = t(g, F32)
    ka.adamw_step(gp, gg, gm, gv, t(mask), 1e-3, 0.9, 0.95, 1e-8, 0.1, 7, p_lp=lp, zero_grad=True)
    compare("p", gp, rp, F32)
    compare("m", gm, rm, F32)
    compare("v", gv, rv, F32)
    compare("p_lp", lp, rp, torch.float16)
    assert not h(gg).any(), "zero_grad leaves g zero"


def test_adamw_device_hyper_and_clip() -> None:
    """lr, bias corrections and grad factor from a device array; clip from the device norm; inf norm skips."""
    rng = np.random.default_rng(2)
    n = 2000
    p, g, m, v, mask = _state(rng, n)
    b1, b2, step, gscale, max_norm, norm = 0.9, 0.95, 3, 0.5, 1.0, 4.0
    rp, rm, rv = p.copy(), m.copy(), v.copy()
    coef = gscale * min(1.0, max_norm / (norm * gscale + 1e-6))
    ref_adamw.adamw_step(rp, g * coef, rm, rv, mask, 2e-3, b1, b2, 1e-8, 0.1, step)
    hyper = t(np.array([2e-3, 1 - b1**step, 1 - b2**step, gscale]), F32)
    gp, gm, gv = t(p, F32), t(m, F32), t(v, F32)
    gnorm = t(np.array([norm]), F32)
    ka.adamw_step(gp, t(g, F32), gm, gv, t(mask), 0.0, b1, b2, 1e-8, 0.1, 1, hyper=hyper, norm=gnorm, max_norm=max_norm)
    compare("p", gp, rp, F32)
    compare("m", gm, rm, F32)
    compare("v", gv, rv, F32)
    gp2 = t(p, F32)
    ka.adamw_step(gp2, t(g, F32), t(m, F32), t(v, F32), t(mask), 0.0, b1, b2, 1e-8, 0.1, 1, hyper=hyper,
                  norm=t(np.array([np.inf]), F32), max_norm=max_norm)  # fmt: skip
    np.testing.assert_array_equal(h(gp2), p.astype(np.float32))
