"""crossentropy kernels (fused LM head: k_crossentropy_fwd/bwd around the GEMMs) against the NumPy pair."""

import numpy as np
import pytest
import torch

from microgpt.kernels import crossentropy as kc
from microgpt.ops import crossentropy as ref

from ._kutil import DEVICE, DTYPES, MM, REF_MM, TUNER, compare, rounded, t

# (N, C, V, R): several chunks with a short last one; V above the interpreter's 1024-wide block; R >= N
SHAPES = [(21, 16, 100, 8), (5, 8, 1100, 4), (6, 12, 33, 16)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy(N: int, C: int, V: int, R: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(N * C + V)
    x, wte = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((V, C)) * 0.5, dtype)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[::5] = -1  # ignored rows: loss 0, no gradient
    dlosses = rng.random(N) / N
    dx0, dwte0 = rounded(rng.standard_normal((N, C)), dtype), rng.standard_normal((V, C))
    losses, lse = np.empty(N), np.empty(N)
    ref.crossentropy_forward(losses, lse, x, wte, targets, np.empty((R, V)), mm=REF_MM)
    dx, dwte = dx0.copy(), dwte0.copy()
    ref.crossentropy_backward(dx, dwte, dlosses, x, wte, targets, lse, np.empty((R, V)), mm=REF_MM)

    f32 = dict(dtype=torch.float32, device=DEVICE)
    glosses, glse, logits = torch.empty(N, **f32), torch.empty(N, **f32), torch.empty(R, V, dtype=dtype, device=DEVICE)
    gx, gwte, gt = t(x, dtype), t(wte, dtype), t(targets)
    kc.crossentropy_forward(glosses, glse, gx, gwte, gt, logits, mm=MM, tuner=TUNER)
    compare("losses", glosses, losses, dtype)
    compare("lse", glse, lse, dtype)
    gdx, gdwte = t(dx0, dtype), t(dwte0, torch.float32)
    kc.crossentropy_backward(gdx, gdwte, t(dlosses, torch.float32), gx, gwte, gt, glse, logits, mm=MM, tuner=TUNER)
    compare("dx", gdx, dx, dtype)
    compare("dwte", gdwte, dwte, dtype)


@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_forward_backward(N: int, C: int, V: int, R: int) -> None:
    """The training call against the NumPy one, and bit for bit against the kernel pair's two calls."""
    dtype = torch.float32
    rng = np.random.default_rng(N * C + V + 7)
    x, wte = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((V, C)) * 0.5, dtype)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[1::4] = -1
    dlosses = rng.random(N) / N
    dx0, dwte0 = rng.standard_normal((N, C)), rng.standard_normal((V, C))
    losses, lse, dx, dwte = np.empty(N), np.empty(N), dx0.copy(), dwte0.copy()
    ref.crossentropy_forward_backward(losses, lse, dx, dwte, dlosses, x, wte, targets, np.empty((R, V)), mm=REF_MM)

    f32 = dict(dtype=dtype, device=DEVICE)
    gx, gwte, gt, gdl = t(x, dtype), t(wte, dtype), t(targets), t(dlosses, dtype)
    fused = [torch.empty(N, **f32), torch.empty(N, **f32), t(dx0, dtype), t(dwte0, dtype)]
    kc.crossentropy_forward_backward(*fused, gdl, gx, gwte, gt, torch.randn(R, V, **f32), mm=MM, tuner=TUNER)
    for name, got, want in zip(("losses", "lse", "dx", "dwte"), fused, (losses, lse, dx, dwte)):
        compare(name, got, want, dtype)
    pair = [torch.empty(N, **f32), torch.empty(N, **f32), t(dx0, dtype), t(dwte0, dtype)]
    logits = torch.empty(R, V, **f32)
    kc.crossentropy_forward(pair[0], pair[1], gx, gwte, gt, logits, mm=MM, tuner=TUNER)
    kc.crossentropy_backward(pair[2], pair[3], gdl, gx, gwte, gt, pair[1], logits, mm=MM, tuner=TUNER)
    for name, a, b in zip(("losses", "lse", "dx", "dwte"), fused, pair):
        assert torch.equal(a, b), f"{name}: forward_backward differs from forward + backward"


@pytest.mark.parametrize("per_block", [False, True], ids=["max-per-lane", "max-per-block"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_row_kernel_both_maxima(per_block: bool, dtype: torch.dtype) -> None:
    """k_crossentropy_fwd as ROW_CONFIGS runs it, its running max kept per lane or per block, on rows of several
    blocks (the last one short) whose logits spread over +-60 (so the max moves between blocks): loss, lse and the
    dlogits written in place against NumPy."""
    rng = np.random.default_rng(11 + per_block)
    r, V, block = 6, 300, 64
    logits = rounded(rng.standard_normal((r, V)) * 8 + np.linspace(-30, 30, V) * rng.choice([-1, 1], (r, 1)), dtype)
    targets = rng.integers(0, V, size=r).astype(np.int32)
    targets[2] = -1
    dloss = rng.random(r)
    # the NumPy pair on logits = I @ (logits^T)^T: its dwte (from zero) is then dlogits^T
    loss, lse, dwte = np.empty(r), np.empty(r), np.zeros((V, r))
    ref.crossentropy_forward_backward(
        loss, lse, np.zeros((r, r)), dwte, dloss, np.eye(r), logits.T.copy(), targets, np.empty((r, V)), mm=REF_MM
    )
    dlogits = dwte.T

    f32 = dict(dtype=torch.float32, device=DEVICE)
    glosses, glse, g = torch.empty(r, **f32), torch.empty(r, **f32), t(logits, dtype)
    kc.k_crossentropy_fwd[(r,)](
        glosses, glse, g, t(targets), t(dloss, torch.float32), V, GRAD=True, BLOCK_V=block, PER_BLOCK=per_block
    )
    compare("losses", glosses, loss, dtype)
    compare("lse", glse, lse, dtype)
    compare("dlogits", g, dlogits, dtype)


SOFTCAP = 2.5  # under the logits' spread here (x @ wte.T ~ N(0, C/4)): tanh saturates on many of them


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,C,V,R", SHAPES)
def test_crossentropy_softcap(N: int, C: int, V: int, R: int, dtype: torch.dtype) -> None:
    """The soft-capped pair against the NumPy one (the cap applied as the row kernels load each chunk, its slope in
    the gradient pass), and the training call bit for bit against the pair's two calls."""
    rng = np.random.default_rng(N * C + V + 11)
    x, wte = rounded(rng.standard_normal((N, C)), dtype), rounded(rng.standard_normal((V, C)) * 0.5, dtype)
    targets = rng.integers(0, V, size=N).astype(np.int32)
    targets[::5] = -1
    dlosses = rng.random(N) / N
    dx0, dwte0 = rounded(rng.standard_normal((N, C)), dtype), rng.standard_normal((V, C))
    losses, lse, dx, dwte = np.empty(N), np.empty(N), dx0.copy(), dwte0.copy()
    ref.crossentropy_forward(losses, lse, x, wte, targets, np.empty((R, V)), mm=REF_MM, softcap=SOFTCAP)
    ref.crossentropy_backward(dx, dwte, dlosses, x, wte, targets, lse, np.empty((R, V)), mm=REF_MM, softcap=SOFTCAP)

    f32 = dict(dtype=torch.float32, device=DEVICE)
    gx, gwte, gt, gdl = t(x, dtype), t(wte, dtype), t(targets), t(dlosses, torch.float32)
    logits = torch.empty(R, V, dtype=dtype, device=DEVICE)
    pair = [torch.empty(N, **f32), torch.empty(N, **f32), t(dx0, dtype), t(dwte0, torch.float32)]
    kc.crossentropy_forward(pair[0], pair[1], gx, gwte, gt, logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    kc.crossentropy_backward(pair[2], pair[3], gdl, gx, gwte, gt, pair[1], logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    for name, got, want in zip(("losses", "lse", "dx", "dwte"), pair, (losses, lse, dx, dwte)):
        compare(name, got, want, dtype)
    fused = [torch.empty(N, **f32), torch.empty(N, **f32), t(dx0, dtype), t(dwte0, torch.float32)]
    kc.crossentropy_forward_backward(*fused, gdl, gx, gwte, gt, logits, mm=MM, tuner=TUNER, softcap=SOFTCAP)
    for name, a, b in zip(("losses", "lse", "dx", "dwte"), fused, pair):
        assert torch.equal(a, b), f"{name}: forward_backward differs from forward + backward"


@pytest.mark.parametrize("per_block,cap_max", [(False, False), (True, False), (False, True)],
                         ids=["max-per-lane", "max-per-block", "cap-as-max"])  # fmt: skip
def test_row_kernel_softcap(per_block: bool, cap_max: bool) -> None:
    """k_crossentropy_fwd with SOFTCAP on rows of several blocks, the last one short (its padding must stay out of
    the sums: capped, -inf would become -softcap): loss, lse and the gradient of the uncapped logits in place, under
    each way of the row's sum (a running max per lane or per block; none, the cap as the bound: capped_sum)."""
    rng = np.random.default_rng(13 + per_block + 2 * cap_max)
    r, V, block = 5, 300, 64
    logits = rng.standard_normal((r, V)) * 8
    targets = rng.integers(0, V, size=r).astype(np.int32)
    targets[3] = -1
    dloss = rng.random(r)
    loss, lse, dwte = np.empty(r), np.empty(r), np.zeros((V, r))  # logits = I @ logits: dwte is dz^T (as above)
    ref.crossentropy_forward_backward(
        loss,
        lse,
        np.zeros((r, r)),
        dwte,
        dloss,
        np.eye(r),
        logits.T.copy(),
        targets,
        np.empty((r, V)),
        mm=REF_MM,
        softcap=SOFTCAP,
    )
    f32 = dict(dtype=torch.float32, device=DEVICE)
    glosses, glse, g = torch.empty(r, **f32), torch.empty(r, **f32), t(logits, torch.float32)
    kc.k_crossentropy_fwd[(r,)](
        glosses,
        glse,
        g,
        t(targets),
        t(dloss, torch.float32),
        V,
        GRAD=True,
        BLOCK_V=block,
        PER_BLOCK=per_block,
        SOFTCAP=SOFTCAP,
        CAP_MAX=cap_max,
    )
    compare("losses", glosses, loss, torch.float32)
    compare("lse", glse, lse, torch.float32)
    compare("dz", g, dwte.T, torch.float32)


@pytest.mark.parametrize("softcap", [kc.CAP_MAX_LIMIT, kc.CAP_MAX_LIMIT + 10])
def test_row_kernel_softcap_at_its_floor(softcap: float) -> None:
    """Rows whose every logit sits at the cap's floor (-softcap): at the limit the cap is the row's max
    (capped_sum), each term exp(-2 softcap) still a normal fp32; past it the running max takes over, where the cap
    as the max would sum terms that underflow to 0 (an lse of -inf)."""
    r, V = 3, 200
    logits = np.full((r, V), -1e4)
    logits[:, ::7] = -2e4
    targets = np.array([0, 5, -1], np.int32)
    loss, lse = np.empty(r), np.empty(r)
    ref.crossentropy_forward(
        loss, lse, np.eye(r), logits.T.copy(), targets, np.empty((r, V)), mm=REF_MM, softcap=softcap
    )
    glosses, glse = torch.empty(r, device=DEVICE), torch.empty(r, device=DEVICE)
    kc.row_launch(glosses, glse, t(logits, torch.float32), t(targets), None, V, *kc.ROW_CONFIGS["block2048w4"],
                  softcap=softcap)()  # fmt: skip
    compare("lse", glse, lse, torch.float32)
    compare("losses", glosses, loss, torch.float32)


@pytest.mark.parametrize("softcap", [0.0, SOFTCAP])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_logits(dtype: torch.dtype, softcap: float) -> None:
    """The inference step's next-token logits, capped in place where softcap, against the NumPy head (V over the
    cap pass's block: two programs, the last one short)."""
    rng = np.random.default_rng(17)
    b, C, V = 3, 16, 1100
    x, wte = rounded(rng.standard_normal((b, C)), dtype), rounded(rng.standard_normal((V, C)) * 0.5, dtype)
    want = np.empty((b, V))
    ref.head_logits(want, x, wte, mm=REF_MM, softcap=softcap)
    out = t(rng.standard_normal((b, V)), dtype)  # noise the head overwrites
    kc.head_logits(out, t(x, dtype), t(wte, dtype), mm=MM, softcap=softcap)
    compare("logits", out, want, dtype)
