"""adamw_step on a flat vector with a decay mask against torch.optim.AdamW (two param groups) and
torch.nn.utils.clip_grad_norm_: the scale, the clip and the update in one call, as the step runs it."""

import math

import numpy as np
import pytest
import torch

from microgpt.ops.adamw import adamw_step, segment_table_of

from ._util import F32_TOL, F64_TOL, check

SHAPES = [(5, 7), (13,), (3, 4), (7,), (2, 9)]  # 2-D weights decay, 1-D ones (LN w, b) do not
LRS = [1e-3, 3e-3, 6e-3, 6e-3, 4e-3, 2e-3, 1e-3]  # a warmup-then-decay schedule, one lr per step
GRAD_SIZES = [0.02, 3.0, 0.1, 8.0, 0.3, 1.5, 0.05]  # norms on both sides of the clip
BETA1, BETA2, EPS, WD, MAX_NORM = 0.9, 0.95, 1e-8, 0.1, 1.0
GSCALE = 0.25  # as if the gradients were summed over 4 micro-batches


def make_inputs(rng: np.random.Generator) -> tuple[list, list]:
    params = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) * size for s in SHAPES] for size in GRAD_SIZES]
    return params, grads


def flat(arrays: list) -> np.ndarray:
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def decay_mask() -> np.ndarray:
    return flat([np.full(s, 1 if len(s) == 2 else 0, np.uint8) for s in SHAPES])


def hyper_at(t: int, lr: float, dtype, gscale: float = GSCALE) -> np.ndarray:
    return np.array([lr, 1 - BETA1**t, 1 - BETA2**t, gscale], dtype)


def run_numpy(params: list, grads: list, dtype, p_compute=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The step's sequence: raw summed gradients (the mean times 1/GSCALE), their norm, then adamw_step."""
    p = flat(params).astype(dtype)
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, (lr, g) in enumerate(zip(LRS, grads), start=1):
        raw = (flat(g) / GSCALE).astype(dtype)
        norm = np.array([np.sqrt(np.sum(raw * raw))], dtype)
        adamw_step(p, raw, m, v, decay_mask(), p_compute, hyper_at(t, lr, dtype), norm, BETA1, BETA2, EPS, WD, MAX_NORM)
        assert not raw.any(), "adamw_step leaves the gradients zeroed"
    return p, m, v


def test_adamw_with_clip_matches_torch() -> None:
    rng = np.random.default_rng(1900)
    params, grads = make_inputs(rng)
    tparams = [torch.tensor(p, requires_grad=True) for p in params]
    groups = [
        {"params": [p for p in tparams if p.dim() == 2], "weight_decay": WD},
        {"params": [p for p in tparams if p.dim() != 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LRS[0], betas=(BETA1, BETA2), eps=EPS, foreach=False)
    p, m, v = run_numpy(params, grads, np.float64)
    clipped = 0
    for lr, g in zip(LRS, grads):
        for tp, gi in zip(tparams, g):
            tp.grad = torch.from_numpy(gi.copy())
        clipped += float(torch.nn.utils.clip_grad_norm_(tparams, MAX_NORM)) > MAX_NORM
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    assert 0 < clipped < len(LRS), "the schedule should clip some steps and not others"
    check("p", p, flat([tp.detach() for tp in tparams]), F64_TOL)
    check("m", m, flat([opt.state[tp]["exp_avg"] for tp in tparams]), F64_TOL)
    check("v", v, flat([opt.state[tp]["exp_avg_sq"] for tp in tparams]), F64_TOL)


def test_adamw_decay_only_where_masked() -> None:
    """With zero gradients, masked entries shrink by exactly (1 - lr*wd) and the others stay put."""
    rng = np.random.default_rng(2000)
    p = rng.standard_normal(20)
    mask = (np.arange(20) % 3 == 0).astype(np.uint8)
    before = p.copy()
    adamw_step(
        p,
        np.zeros(20),
        np.zeros(20),
        np.zeros(20),
        mask,
        None,
        hyper_at(1, 0.5, np.float64),
        np.zeros(1),
        BETA1,
        BETA2,
        EPS,
        WD,
        math.inf,
    )
    check("decayed", p[mask == 1], before[mask == 1] * (1 - 0.5 * WD), F64_TOL)
    np.testing.assert_array_equal(p[mask == 0], before[mask == 0])


def test_non_finite_norm_skips_the_update_and_zeroes_the_grads() -> None:
    """An fp16 overflow (or the warm-up's inf gscale): p, m, v and the compute copy untouched, g zeroed."""
    rng = np.random.default_rng(2050)
    p, m, v = rng.standard_normal(30), rng.standard_normal(30), rng.random(30)
    pc = rng.standard_normal(30)
    before = [a.copy() for a in (p, m, v, pc)]
    for norm, gscale in ((np.inf, GSCALE), (np.nan, GSCALE), (2.0, np.inf)):
        g = rng.standard_normal(30)
        adamw_step(
            p,
            g,
            m,
            v,
            np.ones(30, np.uint8),
            pc,
            hyper_at(3, 1e-2, np.float64, gscale),
            np.array([norm]),
            BETA1,
            BETA2,
            EPS,
            WD,
            MAX_NORM,
        )
        assert not g.any()
        for a, b in zip((p, m, v, pc), before):
            np.testing.assert_array_equal(a, b)


def test_adamw_float32_and_compute_copy() -> None:
    rng = np.random.default_rng(2100)
    params, grads = make_inputs(rng)
    params = [a.astype(np.float32).astype(np.float64) for a in params]
    grads = [[a.astype(np.float32).astype(np.float64) for a in g] for g in grads]
    ref = run_numpy(params, grads, np.float64)
    pc = np.zeros(flat(params).size, np.float32)
    got = run_numpy(params, grads, np.float32, p_compute=pc)
    for name, a, b in zip("pmv", got, ref):
        assert a.dtype == np.float32, f"{name} left float32"
        check(name, a, b, F32_TOL)
    np.testing.assert_array_equal(pc, got[0])


@pytest.mark.parametrize("seed", range(6))
def test_the_segment_table_says_whose_each_element_is(seed: int) -> None:
    """segment_table_of on random layouts (segments next to each other, gaps between them, edges on and off block
    boundaries, the last block short): reading each block's row as AdamW does gives every element's segment (or
    none); a layout with a segment inside one block, touching neither edge, gets None."""
    rng = np.random.default_rng(seed)
    block = 16
    segments, at = [], int(rng.integers(0, 20))
    for _ in range(int(rng.integers(1, 8))):
        size = int(rng.integers(block, 5 * block))
        segments.append((at, at + size))
        at += size + int(rng.choice([0, 0, 1, 7, 16, 40]))
    n = at + int(rng.integers(0, 30))
    order = rng.permutation(len(segments))  # the table takes the segments in any order: j is the position given
    given = [segments[j] for j in order]
    owner = np.full(n, -1)
    for j, (start, end) in enumerate(given):
        owner[start:end] = j
    table = segment_table_of(given, n, block)
    assert table is not None and table.shape == (-(-n // block), 4) and table.dtype == np.int32
    read = np.full(n, -1)
    for b, (a, end_a, w, start_b) in enumerate(table):
        i = np.arange(b * block, min((b + 1) * block, n)) - b * block
        read[b * block + i] = np.where(i < end_a, a, np.where(i >= start_b, w, -1))
    np.testing.assert_array_equal(read, owner)
    assert segment_table_of([(0, 40), (41, 47), (50, 90)], 100, block) is None  # (41, 47) inside block 2
    assert segment_table_of([(0, 40), (48, 52), (64, 90)], 100, block) is not None  # (48, 52) starts a block


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the inf among p: inf - inf in its update
@pytest.mark.parametrize("norm", [4.0, np.inf], ids=["update", "skip"])
def test_segment_max_is_each_segments_finite_max_as_stored(norm: float) -> None:
    """With a segment table, adamw_step max-es into segment_max[j] the finite max |p| of segment j as it leaves p
    (updated, or untouched where the norm skips the step); everything else is what it is without the table. An inf
    and a NaN among p are left out; a value already larger in segment_max stays."""
    rng = np.random.default_rng(2200)
    n = 9000  # rows of SEGMENT_BLOCK (2,048): every segment starts or ends inside one
    segments = [(0, 2500), (2600, 4800), (4800, 7100), (7300, 9000)]
    p = rng.standard_normal(n).astype(np.float32)
    for (start, end), f in zip(segments, rng.uniform(0.1, 5, len(segments))):
        p[start:end] *= f  # maxima far apart: one segment's elements counted in another's would show
    p[100], p[5000] = np.inf, np.nan
    g, m, v = rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    mask, hyper = np.ones(n, np.uint8), hyper_at(1, 1e-2, np.float32)
    table = segment_table_of(segments, n)
    runs = []
    for with_table in (False, True):
        arrays = [a.copy() for a in (p, g, m, v)]
        seg_max = np.array([0, 0, 0, 1e9], np.float32)
        extra = {"segment_table": table, "segment_max": seg_max} if with_table else {}
        adamw_step(*arrays, mask, None, hyper, np.array([norm], np.float32), BETA1, BETA2, EPS, WD, MAX_NORM, **extra)
        runs.append((arrays, seg_max))
    for name, a, b in zip("pgmv", runs[0][0], runs[1][0]):
        np.testing.assert_array_equal(a, b, err_msg=name)
    stored = np.abs(runs[1][0][0])
    want = [np.max(np.where(np.isfinite(stored[s:e]), stored[s:e], 0)) for s, e in segments[:3]] + [1e9]
    assert runs[1][1].tolist() == np.float32(want).tolist()
