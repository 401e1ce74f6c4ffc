"""gradclip (k_grad_norm_partial/final) and k_adamw against the NumPy helpers, with the same arguments."""

import math

import numpy as np
import pytest
import torch

from microgpt.kernels import adamw as ka
from microgpt.kernels import gradclip as kg
from microgpt.ops import adamw as ref_adamw
from microgpt.ops import gradclip as ref_clip

from ._kutil import DEVICE, compare, h, t

F32 = torch.float32
B1, B2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


@pytest.mark.parametrize("n,block", [(5000, 1024), (3001, 777), (10, 4096)])
def test_grad_norm(n: int, block: int) -> None:
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


def _state(rng, n):
    p, g = rng.standard_normal(n), rng.standard_normal(n) * 0.1
    m, v = rng.standard_normal(n) * 0.01, rng.random(n) * 1e-3
    mask = (rng.random(n) < 0.7).astype(np.uint8)
    return [a.astype(np.float32) if a.dtype != np.uint8 else a for a in (p, g, m, v)] + [mask]


@pytest.mark.parametrize("norm,max_norm", [(4.0, 1.0), (0.3, 1.0), (4.0, math.inf)])
def test_adamw_matches_numpy(norm: float, max_norm: float) -> None:
    """Both halves on fp32 arrays with the same hyper, norm and clip: clipped, unclipped, no clip."""
    rng = np.random.default_rng(1)
    n, step, gscale = 3001, 7, 0.5
    p, g, m, v, mask = _state(rng, n)
    hyper = np.array([2e-3, 1 - B1**step, 1 - B2**step, gscale], np.float32)
    rp, rg, rm, rv, rpc = p.copy(), g.copy(), m.copy(), v.copy(), np.zeros(n, np.float32)
    ref_adamw.adamw_step(rp, rg, rm, rv, mask, rpc, hyper, np.array([norm], np.float32), B1, B2, EPS, WD, max_norm)
    gp, gg, gm, gv = t(p, F32), t(g, F32), t(m, F32), t(v, F32)
    pc = torch.empty(n, dtype=torch.float16, device=DEVICE)
    ka.adamw_step(gp, gg, gm, gv, t(mask), pc, t(hyper, F32), t(np.array([norm]), F32), B1, B2, EPS, WD, max_norm)
    compare("p", gp, rp.astype(np.float64), F32)
    compare("m", gm, rm.astype(np.float64), F32)
    compare("v", gv, rv.astype(np.float64), F32)
    compare("p_compute", pc, rp.astype(np.float64), torch.float16)
    assert not h(gg).any(), "the step leaves the gradients zeroed"


def test_adamw_non_finite_norm_skips() -> None:
    rng = np.random.default_rng(2)
    n = 2000
    p, g, m, v, mask = _state(rng, n)
    hyper = t(np.array([2e-3, 0.1, 0.05, 0.5]), F32)
    gp, gg = t(p, F32), t(g, F32)
    ka.adamw_step(gp, gg, t(m, F32), t(v, F32), t(mask), None, hyper, t(np.array([np.inf]), F32), B1, B2, EPS, WD, 1.0)
    np.testing.assert_array_equal(h(gp), p)
    assert not h(gg).any()


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's inf * 0 on the inf master
@pytest.mark.parametrize("norm", [4.0, math.inf], ids=["update", "skip"])
def test_adamw_records_each_segments_max(norm: float) -> None:
    """With a segment table (ops/adamw.segment_table_of), k_adamw leaves in segment_max[j] the finite max |p| of
    segment j as it stored it (updated, or as it was when the norm skips the step), for segments that start and end
    inside blocks, lie next to each other or leave a gap (LayerNorm's parameters between fp8's weights); everything
    else it writes is what it writes without the table. An inf and a NaN among p are left out. The NumPy half
    records the same from the same p."""
    rng = np.random.default_rng(3)
    n = 9000  # blocks of SEGMENT_BLOCK (2,048): every segment starts or ends inside one
    segments = [(0, 2500), (2600, 4800), (4800, 7100), (7300, 9000)]
    p, g, m, v, mask = _state(rng, n)
    for (start, end), f in zip(segments, rng.uniform(0.1, 5, len(segments))):
        p[start:end] *= f  # amaxes far apart: one weight's elements counted in another's would show
    p[100], p[5000] = np.inf, np.nan
    table = ref_adamw.segment_table_of(segments, n)
    hyper = t(np.array([2e-3, 0.1, 0.05, 0.5]), F32)
    runs = []
    for fused in (False, True):
        bufs = [t(a.copy(), F32) for a in (p, g, m, v)] + [torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)]
        seg_max = torch.zeros(len(segments), dtype=F32, device=DEVICE)
        extra = {"segment_table": t(table), "segment_max": seg_max} if fused else {}
        ka.adamw_step(*bufs[:4], t(mask), bufs[4], hyper, t(np.array([norm]), F32), B1, B2, EPS, WD, 1.0, **extra)
        runs.append([h(b.float()) for b in bufs] + [h(seg_max)])
    for name, a, b in zip(("p", "g", "m", "v", "p_compute"), runs[0], runs[1]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    stored = np.abs(runs[1][0])
    want = [np.max(np.where(np.isfinite(stored[s:e]), stored[s:e], 0)) for s, e in segments]
    assert runs[1][5].tolist() == np.float32(want).tolist()
    numpy_max = np.zeros(len(segments), np.float32)
    ref_adamw.record_segment_max(numpy_max, table, runs[1][0])
    assert numpy_max.tolist() == runs[1][5].tolist()
