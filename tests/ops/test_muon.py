"""muon_step on a flat array that holds Muon's matrices (wide, tall, square; several groups) among parameters it
does not own, against a PyTorch float64 Muon written here from the math (microgpt/ops/muon.py's docstring) with
torch.nn.utils.clip_grad_norm_ for the clip: several steps in a row, clipped and not; the orthogonalisation's singular
values; the non-finite skip; the groups and their scratch."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.muon import NS_COEFFS, MuonGroup, muon_groups, muon_scratch, muon_step

from ._util import F32_TOL, F64_TOL, check

# the flat layout: (shape, owned by Muon); 1-D and the embedding-like first matrix are AdamW's
LAYOUT = [((7, 5), False), ((6, 11), True), ((8, 8), True), ((9,), False), ((13, 4), True), ((8, 8), True),
          ((6, 11), True), ((13, 4), True), ((8, 8), True), ((5, 7), False)]  # fmt: skip
LRS = [0.02, 0.05, 0.05, 0.03]  # one per step
MUS = [0.85, 0.9, 0.95, 0.95]  # a momentum warm-up, one per step
GRAD_SIZES = [0.05, 4.0, 0.3, 2.0]  # norms on both sides of the clip
WD, MAX_NORM = 0.1, 1.0
GSCALE = 0.25  # as if the gradients were summed over 4 micro-batches


def offsets() -> list[int]:
    return list(np.cumsum([0] + [math.prod(s) for s, _ in LAYOUT])[:-1])


def groups() -> tuple[MuonGroup, ...]:
    return muon_groups((off, *s) for off, (s, own) in zip(offsets(), LAYOUT) if own)


def owned_mask() -> np.ndarray:
    return np.concatenate([np.full(math.prod(s), own) for s, own in LAYOUT])


def scratch(grps: tuple[MuonGroup, ...], dtype) -> dict[str, np.ndarray]:
    """muon_scratch's buffers, filled with noise: the step must write before it reads."""
    rng = np.random.default_rng(7)
    return {s.keyword: rng.standard_normal(s.numel).astype(dtype) for s in muon_scratch(grps)}


def hyper(lr: float, mu: float, dtype, gscale: float = GSCALE, wd: float = WD) -> np.ndarray:
    return np.array([lr, mu, gscale, wd], dtype)


def make_inputs(rng: np.random.Generator) -> tuple[np.ndarray, list[np.ndarray]]:
    """Weights, and per step the raw summed gradients (the mean times 1 / GSCALE), flat."""
    n = sum(math.prod(s) for s, _ in LAYOUT)
    p = rng.standard_normal(n) * 0.3
    grads = [rng.standard_normal(n) * size / math.sqrt(n) / GSCALE for size in GRAD_SIZES]
    return p, grads


def run_numpy(p0: np.ndarray, grads: list[np.ndarray], dtype, p_compute=None) -> tuple[np.ndarray, np.ndarray]:
    """The step's sequence: the raw gradients' norm, then muon_step; returns p and m."""
    p, m = p0.astype(dtype), np.zeros(len(p0), dtype)
    grps, bufs = groups(), scratch(groups(), dtype)
    own = owned_mask()
    for lr, mu, raw in zip(LRS, MUS, grads):
        g = raw.astype(dtype)
        norm = np.array([np.sqrt(np.sum(g.astype(np.float64) ** 2))], dtype)
        rest = g[~own].copy()
        muon_step(p, g, m, p_compute, hyper(lr, mu, dtype), norm, groups=grps, max_norm=MAX_NORM, **bufs)
        assert not g[own].any(), "muon_step leaves its matrices' gradients zeroed"
        np.testing.assert_array_equal(g[~own], rest)  # the others' are AdamW's to read
    return p, m


def torch_muon(p0: np.ndarray, grads: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, int]:
    """Muon from the math, in float64: every parameter a tensor, the mean gradient clipped by clip_grad_norm_ over
    all of them, then momentum, Nesterov, normalisation, five Newton-Schulz steps, decay and the scaled update on the
    owned matrices. Returns p, m and how many steps clipped."""
    a, b, c = NS_COEFFS
    params = [
        torch.tensor(p0[o : o + math.prod(s)].reshape(s), requires_grad=True) for o, (s, _) in zip(offsets(), LAYOUT)
    ]
    moms = [torch.zeros(s, dtype=torch.float64) for s, _ in LAYOUT]
    clipped = 0
    for lr, mu, raw in zip(LRS, MUS, grads):
        for w, o, (s, _) in zip(params, offsets(), LAYOUT):
            w.grad = torch.tensor(raw[o : o + math.prod(s)].reshape(s) * GSCALE)
        clipped += float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM)) > MAX_NORM
        with torch.no_grad():
            for w, mom, (s, own) in zip(params, moms, LAYOUT):
                if not own:
                    continue
                mom.lerp_(w.grad, 1 - mu)
                u = w.grad.lerp(mom, mu)
                tall = s[0] > s[1]
                x = u.mT if tall else u
                x = x / (torch.linalg.matrix_norm(x) + 1e-7)
                for _ in range(5):
                    gram = x @ x.mT
                    x = a * x + (b * gram + c * gram @ gram) @ x
                w.mul_(1 - lr * WD).add_(x.mT if tall else x, alpha=-lr * max(1, s[1] / s[0]) ** 0.5)
    flat = [np.concatenate([t.detach().numpy().reshape(-1) for t in ts]) for ts in (params, moms)]
    return flat[0], flat[1], clipped


def test_muon_matches_torch_over_several_steps() -> None:
    rng = np.random.default_rng(4600)
    p0, grads = make_inputs(rng)
    p, m = run_numpy(p0, grads, np.float64)
    ref_p, ref_m, clipped = torch_muon(p0, grads)
    assert 0 < clipped < len(LRS), "the gradients should be clipped on some steps and not others"
    own = owned_mask()
    check("p (owned)", p[own], ref_p[own], F64_TOL)
    check("m (owned)", m[own], ref_m[own], F64_TOL)
    np.testing.assert_array_equal(p[~own], p0[~own])  # AdamW's parameters untouched
    assert not m[~own].any()


def test_muon_float32_and_compute_copy() -> None:
    """In float32 (the NumPy backend's) against the float64 reference: the Newton-Schulz products in float32 add
    a few 1e-7 of relative error per step, well within F32_TOL; the compute copy is p, for the owned matrices."""
    rng = np.random.default_rng(4601)
    p0, grads = make_inputs(rng)
    p0 = p0.astype(np.float32).astype(np.float64)
    grads = [g.astype(np.float32).astype(np.float64) for g in grads]
    ref_p, ref_m = run_numpy(p0, grads, np.float64)
    pc = np.full(len(p0), 7.0, np.float32)
    p, m = run_numpy(p0, grads, np.float32, p_compute=pc)
    assert p.dtype == m.dtype == np.float32
    own = owned_mask()
    check("p", p, ref_p, F32_TOL)
    check("m", m, ref_m, F32_TOL)
    np.testing.assert_array_equal(pc[own], p[own])
    assert (pc[~own] == 7.0).all(), "the compute copy of AdamW's parameters is AdamW's to write"


@pytest.mark.parametrize("shape", [(5, 13), (13, 5), (30, 70), (64, 24), (16, 16), (48, 48)])
def test_orthogonalised_update_has_singular_values_near_one(shape: tuple[int, int]) -> None:
    """With mu = 0, no decay and p = 0 the step leaves p = -lr * scale * X: X's singular values are those NS5
    gives, about [0.68, 1.14] for the normalised U's that are not tiny, so X lies about 0.2 (relative) from U's
    polar factor. A random non-square matrix's are not tiny; a random square one's smallest are (about 1 / n^1.5 of
    the largest), so square ones get singular values spread over [0.05, 1] instead."""
    rng = np.random.default_rng(sum(shape))
    rows, cols = shape
    g = rng.standard_normal(shape)
    if rows == cols:
        q1, _ = np.linalg.qr(rng.standard_normal(shape))
        q2, _ = np.linalg.qr(rng.standard_normal(shape))
        g = q1 @ np.diag(np.geomspace(0.05, 1.0, rows)) @ q2.T
    grp = muon_groups([(0, rows, cols)])
    p, m, lr = np.zeros(rows * cols), np.zeros(rows * cols), 0.05
    muon_step(
        p,
        g.reshape(-1).copy(),
        m,
        None,
        hyper(lr, 0.0, np.float64, 1.0, 0.0),
        np.array([1.0]),
        groups=grp,
        max_norm=math.inf,
        **scratch(grp, np.float64),
    )
    x = -p.reshape(shape) / (lr * math.sqrt(max(1, cols / rows)))
    s = np.linalg.svd(x, compute_uv=False)
    assert 0.65 < s.min() and s.max() < 1.2, f"singular values in [{s.min():.3f}, {s.max():.3f}]"
    u = np.linalg.svd(g, full_matrices=False)
    polar = u[0] @ u[2]
    assert np.linalg.norm(x - polar) / np.linalg.norm(polar) < 0.3, "X should lie near U's polar factor"


def test_non_finite_norm_skips_the_update_and_zeroes_the_grads() -> None:
    """An fp16 overflow (or the warm-up's inf gscale): p, m and the compute copy untouched, the owned g zeroed,
    the others' g left for AdamW."""
    rng = np.random.default_rng(4602)
    n, own, grps = len(owned_mask()), owned_mask(), groups()
    p, m, pc = rng.standard_normal(n), rng.standard_normal(n), rng.standard_normal(n)
    before = [a.copy() for a in (p, m, pc)]
    for norm, gscale in ((np.inf, GSCALE), (np.nan, GSCALE), (2.0, np.inf)):
        g = rng.standard_normal(n)
        rest = g[~own].copy()
        muon_step(
            p,
            g,
            m,
            pc,
            hyper(0.02, 0.95, np.float64, gscale),
            np.array([norm]),
            groups=grps,
            max_norm=MAX_NORM,
            **scratch(grps, np.float64),
        )
        assert not g[own].any()
        np.testing.assert_array_equal(g[~own], rest)
        for a, b in zip((p, m, pc), before):
            np.testing.assert_array_equal(a, b)


def test_groups_and_their_scratch() -> None:
    """One group per stored shape in the order of first appearance; the scratch is the largest group's."""
    grps = groups()
    sizes = {(7, 5): 35, (6, 11): 66, (8, 8): 64, (9,): 9, (13, 4): 52}
    o = offsets()
    assert [(g.rows, g.cols) for g in grps] == [(6, 11), (8, 8), (13, 4)]
    assert grps[0].offsets == (o[1], o[6]) and grps[1].offsets == (o[2], o[5], o[8]) and grps[2].offsets == (o[4], o[7])
    assert o[2] - o[1] == sizes[(6, 11)]
    assert [g.shape for g in grps] == [(6, 11), (8, 8), (4, 13)] and [g.transposed for g in grps] == [0, 0, 1]
    assert [g.scale for g in grps] == [math.sqrt(11 / 6), 1.0, 1.0]
    bufs = {s.keyword: (s.buffer, s.numel, s.kind, s.fill) for s in muon_scratch(grps)}
    xy, aa = max(2 * 66, 3 * 64, 2 * 52), max(2 * 36, 3 * 64, 2 * 16)
    assert bufs == {
        "x": ("muon_x", xy, "compute", None),
        "y": ("muon_y", xy, "compute", None),
        "gram": ("muon_gram", aa, "compute", None),
        "poly": ("muon_poly", aa, "compute", None),
    }
    with pytest.raises(ValueError, match="Muon group"):
        MuonGroup((), 3, 4)
