"""adamw_step on a flat vector with a decay mask against torch.optim.AdamW with two param groups."""

import numpy as np
import torch

from microgpt.ops.adamw import adamw_step

from ._util import F32_TOL, F64_TOL, check

SHAPES = [(5, 7), (13,), (3, 4), (7,), (2, 9)]  # 2-D weights decay, 1-D ones (LN w, b) do not
LRS = [1e-3, 3e-3, 6e-3, 6e-3, 4e-3, 2e-3, 1e-3]  # a warmup-then-decay schedule, one lr per step
BETA1, BETA2, EPS, WD = 0.9, 0.95, 1e-8, 0.1


def make_inputs(rng: np.random.Generator) -> tuple[list, list]:
    params = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) for s in SHAPES] for _ in LRS]
    return params, grads


def flat(arrays: list) -> np.ndarray:
    return np.concatenate([np.asarray(a).reshape(-1) for a in arrays])


def decay_mask() -> np.ndarray:
    return flat([np.full(s, 1.0 if len(s) == 2 else 0.0) for s in SHAPES])


def run_numpy(params: list, grads: list, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p = flat(params).astype(dtype)
    m, v = np.zeros_like(p), np.zeros_like(p)
    mask = decay_mask().astype(dtype)
    for t, (lr, g) in enumerate(zip(LRS, grads), start=1):
        adamw_step(p, flat(g).astype(dtype), m, v, mask, lr, BETA1, BETA2, EPS, WD, t)
    return p, m, v


def test_adamw_matches_torch() -> None:
    rng = np.random.default_rng(1900)
    params, grads = make_inputs(rng)
    tparams = [torch.tensor(p, requires_grad=True) for p in params]
    groups = [
        {"params": [p for p in tparams if p.dim() == 2], "weight_decay": WD},
        {"params": [p for p in tparams if p.dim() != 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=LRS[0], betas=(BETA1, BETA2), eps=EPS, foreach=False)
    p, m, v = run_numpy(params, grads, np.float64)
    for lr, g in zip(LRS, grads):
        for tp, gi in zip(tparams, g):
            tp.grad = torch.from_numpy(gi)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
    check("p", p, flat([tp.detach() for tp in tparams]), F64_TOL)
    check("m", m, flat([opt.state[tp]["exp_avg"] for tp in tparams]), F64_TOL)
    check("v", v, flat([opt.state[tp]["exp_avg_sq"] for tp in tparams]), F64_TOL)


def test_adamw_decay_only_where_masked() -> None:
    """With zero gradients, masked entries shrink by exactly (1 - lr*wd) and the others stay put."""
    rng = np.random.default_rng(2000)
    p = rng.standard_normal(20)
    mask = (np.arange(20) % 3 == 0).astype(np.float64)
    before = p.copy()
    adamw_step(p, np.zeros(20), np.zeros(20), np.zeros(20), mask, 0.5, BETA1, BETA2, EPS, WD, 1)
    check("decayed", p[mask == 1], before[mask == 1] * (1 - 0.5 * WD), F64_TOL)
    np.testing.assert_array_equal(p[mask == 0], before[mask == 0])


def test_adamw_float32() -> None:
    rng = np.random.default_rng(2100)
    params, grads = make_inputs(rng)
    params = [a.astype(np.float32).astype(np.float64) for a in params]
    grads = [[a.astype(np.float32).astype(np.float64) for a in g] for g in grads]
    ref = run_numpy(params, grads, np.float64)
    got = run_numpy(params, grads, np.float32)
    for name, a, b in zip("pmv", got, ref):
        assert a.dtype == np.float32, f"{name} left float32"
        check(name, a, b, F32_TOL)
